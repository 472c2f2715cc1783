"""The command-line boundary: user errors end with one clean ``error:`` line and exit code 2 wherever they are
raised (config values of the wrong type, engine checks, truncated checkpoints, DataLoader workers);
``--debug`` / ``VIT3_DEBUG=1`` show the traceback; overrides may come anywhere on the command line."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from helpers.train import TINY_MODEL, Terminal, load_script, make_digit_folder, one_error_line

from vit3.engine.bars import progress_bar
from vit3.engine.checkpoint import CheckpointError, save_checkpoint
from vit3.engine.cli import DEBUG_ENV, INTERRUPTED_EXIT, USER_ERROR_EXIT, ArgumentParser, run_cli
from vit3.engine.config import ConfigError, load_config
from vit3.layers import backends
from vit3.models.record import load_checkpoint, peek_vit3_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1), n_train=12, n_val=4)


def _folder_run(digits, out, *extra: str) -> list[str]:
    return [
        "data.dataset=folder", f"data.path={digits}", f"output={out}", "data.batch_size=8",
        "train.epochs=1", "train.progress=false", *TINY_MODEL, *extra,
    ]  # fmt: skip


# --------------------------------------------------------------------------------------- typed config
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.epochs=abc", "train.epochs must be an integer, got 'abc'"),
        ("data.batch_size=12x", "data.batch_size must be an integer, got '12x'"),
        ("train.base_lr=abc", "train.base_lr must be a number, got 'abc'"),
        ("train.epochs=1.5", "train.epochs must be an integer, got 1.5"),
        ("train.ema=yes please", "train.ema must be true or false"),
        ("aug.scale=[small, 1]", "aug.scale must be a list of numbers"),
        ("eval.img_sizes=[224, 25.5]", "eval.img_sizes must be a list of integers"),
        ("model.kwargs=3", "model.kwargs must be a mapping"),
    ],
    ids=[
        "epochs-word",
        "batch-size-suffix",
        "lr-word",
        "fractional-epochs",
        "bool",
        "list",
        "int-list",
        "map",
    ],
)
def test_a_value_of_the_wrong_type_names_the_key_and_the_type(override, message, capsys):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])
    assert load_script("train").main([override]) == USER_ERROR_EXIT
    assert message in one_error_line(capsys)


def test_values_of_the_right_type_are_normalised():
    cfg = load_config(None, ["train.epochs=2.0", "train.base_lr=1", "output=2026", "train.warmup_epochs=0.5"])
    assert cfg.train.epochs == 2 and isinstance(cfg.train.epochs, int)
    assert cfg.train.base_lr == 1 and cfg.output == "2026" and cfg.train.warmup_epochs == 0.5
    assert load_config(None, ["aug.mixup=null", "train.progress=run"]).aug.mixup is None


def test_a_config_file_value_is_typed_too(tmp_path):
    (tmp_path / "bad.yaml").write_text(
        "base: " + str(load_config(None)["_config_file"]) + "\ntrain:\n  epochs: many\n"
    )
    with pytest.raises(ConfigError, match=r"train\.epochs must be an integer, got 'many'"):
        load_config(tmp_path / "bad.yaml")


# ------------------------------------------------------------------------------- one clean error line
def test_engine_errors_are_as_clean_as_config_errors(digits, tmp_path, capsys):
    train = load_script("train")
    # Raised deep in the engine (after the data is read), not while loading the config:
    assert train.main(_folder_run(digits, tmp_path, "model.num_classes=1")) == USER_ERROR_EXIT
    assert "model.num_classes=1 is below the 2 classes" in one_error_line(capsys)
    assert (
        train.main(_folder_run(digits, tmp_path, "data.mean=[0.5, 0.5, 0.5]", "data.std=[0.2, 0.2, 0.2]"))
        == 2
    )
    line = one_error_line(capsys)
    assert "data.mean must hold one value per input channel of the model (1)" in line
    assert train.main(_folder_run(digits, tmp_path, "data.mean=[0.5]")) == 2
    assert "data.mean is set but not its partner" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("VIT3_TTT_BACKEND", "gpu"), ("VIT3_TTT_RECOMPUTE", "sometimes"), ("VIT3_TTT_STRICT", "2")],
)
def test_a_bad_environment_variable_is_one_error_line(digits, tmp_path, capsys, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    backends.refresh_env()  # read once per process: the run must see this one
    try:
        assert load_script("train").main(_folder_run(digits, tmp_path)) == USER_ERROR_EXIT
    finally:
        monkeypatch.delenv(variable)
        backends.refresh_env()
    assert f"${variable} must be " in one_error_line(capsys)


@pytest.mark.parametrize("failure", [ConfigError("bad value"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_the_error_line_starts_a_line_of_its_own_after_a_progress_bar(failure, capsys):
    """A mistake met mid-epoch (a corrupt image) or Ctrl-C: the epoch's progress bar is ended before the
    error line, not left open for the line to be written after it on the terminal both go to."""
    out = Terminal()

    def body(args):
        bar = progress_bar(10, "epoch 1/2", True, file=out)
        bar.update(3)
        raise failure

    assert run_cli(ArgumentParser(), body, []) in (USER_ERROR_EXIT, INTERRUPTED_EXIT)
    assert out.getvalue().endswith("\r") and "epoch 1/2" in out.getvalue()  # the bar's line, cleared
    assert capsys.readouterr().err.startswith("error: ")


def test_debug_flag_and_environment_show_the_traceback(monkeypatch):
    train = load_script("train")
    with pytest.raises(ConfigError, match=r"train\.epochs must be an integer"):
        train.main(["--debug", "train.epochs=abc"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ConfigError, match=r"train\.epochs must be an integer"):
        load_script("train").main(["train.epochs=abc"])


def test_an_error_in_a_dataloader_worker_is_one_line_naming_the_file(digits, tmp_path, capsys):
    root = tmp_path / "data"
    shutil.copytree(digits, root)
    (root / "train" / "digit_1" / "0003.png").write_bytes(b"not a png")
    code = load_script("train").main(_folder_run(root, tmp_path / "out", "data.num_workers=1"))
    assert code == USER_ERROR_EXIT
    line = one_error_line(capsys)
    assert re.search(r"^error: cannot read image file \S+digit_1/0003\.png", line), line
    assert "DataLoader worker" not in line


# ------------------------------------------------------------------------------------------- overrides
def test_overrides_may_come_anywhere_on_the_command_line(digits, tmp_path, capsys):
    train = load_script("train")
    args = [f"data.path={digits}", "--output", str(tmp_path / "x"), "train.epochs=abc", "data.batch_size=8"]
    assert train.main(args) == USER_ERROR_EXIT  # parsed: the config error, not "unrecognized arguments"
    assert "train.epochs must be an integer" in one_error_line(capsys)
    evaluate = load_script("eval")
    args = ["--img-size", "32", "48", "eval.batch_size=lots", "--checkpoint", str(tmp_path / "none.pt")]
    assert evaluate.main(args) == USER_ERROR_EXIT
    assert "checkpoint not found" in one_error_line(capsys)  # 'eval.batch_size=lots' was no image size


# ----------------------------------------------------------------------------------------- checkpoints
def test_a_truncated_checkpoint_is_called_truncated(tmp_path, capsys):
    path = save_checkpoint(tmp_path / "last.pt", {"model": {"w": torch.randn(256, 256)}, "config": {}})
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for read in (load_checkpoint, peek_vit3_checkpoint):
        with pytest.raises(CheckpointError, match=r"cut\.pt is truncated"):
            read(cut)
    assert load_script("eval").main(["--checkpoint", str(cut)]) == USER_ERROR_EXIT
    assert "is truncated" in one_error_line(capsys)
    assert peek_vit3_checkpoint(tmp_path / "last.pt") is not None
    foreign = tmp_path / "foreign.txt"
    foreign.write_text("not a checkpoint")
    # not truncated: a file no checkpoint loader reads, named for what it is
    with pytest.raises(CheckpointError, match=r"foreign\.txt is a text file \(16 bytes"):
        peek_vit3_checkpoint(foreign)
