"""The validation layer seen from the command line (issue 29): every user mistake over ``train.py``,
``eval.py``, ``export.py`` and torchrun ends in one ``error:`` line naming the key or flag, the value and what
is allowed, exit code 2, nothing written; a legitimate value that may not mean what the user expects runs with
a warning saying what it means. One table per script; each row is a mistake a new user made."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.train import TINY_MODEL, load_script, make_digit_folder, one_error_line
from PIL import Image

from vit3.engine.cli import USER_ERROR_EXIT

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1), n_train=12, n_val=4)


@pytest.fixture(scope="module")
def checkpoint(digits, tmp_path_factory) -> Path:
    """The best.pt of a one-epoch run of the tiny one-channel model on the digits."""
    out = tmp_path_factory.mktemp("run")
    assert load_script("train").main(_train_args(digits, out)) == 0
    return out / "best.pt"


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


def _train_args(digits: Path, out: Path, *extra: str) -> list[str]:
    return [
        "data.dataset=folder", f"data.path={digits}", f"output={out}", "data.batch_size=8", "train.epochs=1",
        "train.warmup_epochs=0", "train.progress=false", *TINY_MODEL, *extra,
    ]  # fmt: skip


def _fill(text: str, **paths: Path) -> str:
    """``text`` with each ``<name>`` replaced by the path ``paths[name]``."""
    for name, path in paths.items():
        text = text.replace(f"<{name}>", str(path))
    return text


# ---------------------------------------------------------------------------------------------- train.py
# (overrides, what the one line says): each was a traceback or trained silently
TRAIN_MISTAKES = {
    "negative-lr": (["train.base_lr=-1e-3"], "config key train.base_lr must be > 0, got -0.001"),
    "device-vit3-does-not-run-on": (["device=mps"], "got 'mps': vit3 runs on cpu or cuda, not mps"),
    "negative-clip-grad": (
        ["train.clip_grad=-1"],
        "train.clip_grad must be > 0 (or null: no clipping), got -1",
    ),
    "negative-img-size": (["data.img_size=-32"], "config key data.img_size must be >= 1, got -32"),
    "img-size-below-the-stride": (
        ["data.img_size=16"],
        "config key data.img_size must be image sizes test_h_vit3 takes, got 16",
    ),
    "garbage-auto-augment": (
        ["aug.auto_augment=rand-garbage"],
        "config key aug.auto_augment must be a timm auto-augment policy",
    ),
    "unknown-model": (["model.name=h_vit3_tinyy"], "got 'h_vit3_tinyy': did you mean h_vit3_tiny"),
    "model-kwarg-typo": (
        ["model.kwargs={img_size: 32, in_chans: 1, dimz: 8}"],
        "model.kwargs.dimz is not an argument of test_h_vit3",
    ),
    "output-under-a-file": (
        ["output=<a_file>/run"],
        "config key output (train.py --output) must be a folder this run can write, got '<a_file>/run': "
        "<a_file> is a file, so nothing can be made under it",
    ),
    "unknown-interpolation": (["data.interpolation=bicubik"], "config key data.interpolation must be a timm"),
    "unknown-dist-backend": (["dist.backend=ncl"], "config key dist.backend must be one of auto, "),
    "unparsable-flag-value": (["--output"], "error: argument --output: expected one argument (see "),
}


@pytest.mark.parametrize(("overrides", "message"), TRAIN_MISTAKES.values(), ids=TRAIN_MISTAKES.keys())
def test_a_train_mistake_is_one_line_and_nothing_is_written(
    overrides, message, digits, tmp_path, a_file, capsys
):
    out = tmp_path / "out"
    args = _train_args(digits, out, *(_fill(o, a_file=a_file) for o in overrides))
    assert load_script("train").main(args) == USER_ERROR_EXIT
    assert _fill(message, a_file=a_file) in one_error_line(capsys, last=True)
    assert not out.exists()


def test_a_read_only_output_folder_is_refused_before_anything_is_written(
    digits, tmp_path, monkeypatch, capsys
):
    """os.access stands in for the permission bits (they do not bind root, whom CI may run as)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and access(p, mode))
    assert load_script("train").main(_train_args(digits, locked / "run")) == USER_ERROR_EXIT
    assert f"{locked} is not writable here" in one_error_line(capsys, last=True)
    assert list(locked.iterdir()) == []


def test_a_full_disk_mid_training_keeps_the_checkpoint_on_disk(digits, tmp_path, monkeypatch, capsys):
    """The second epoch's checkpoint meets a full disk halfway: one line naming the file and the reason, and
    the first epoch's checkpoint is still there, whole."""
    from vit3.engine import checkpoint as ckpt_module

    save, kept = torch.save, {}

    def fill_the_disk(obj, f, *args, **kwargs):
        target = Path(f.name).with_name(Path(f.name).name.removeprefix(".").rsplit(".tmp", 1)[0])
        if target.name == "last.pt" and target.exists():  # the second epoch's
            kept[target] = target.read_bytes()
            f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt_module.torch, "save", fill_the_disk)
    out = tmp_path / "run"
    assert load_script("train").main(_train_args(digits, out, "train.epochs=2")) == USER_ERROR_EXIT
    line = one_error_line(capsys, last=True)
    assert line == (
        f"error: cannot write checkpoint {out / 'last.pt'}: No space left on device (the checkpoint already "
        f"there is left as it was)"
    )
    assert (out / "last.pt").read_bytes() == kept[out / "last.pt"]
    monkeypatch.setattr(ckpt_module.torch, "save", save)
    assert ckpt_module.load_checkpoint(out / "last.pt")["epoch"] == 1
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


def test_values_that_run_but_may_surprise_are_warned_about(digits, tmp_path):
    """A warmup longer than the run, a file that is no image and a 1x1 image in a class folder: the run goes
    on and says what happens to each."""
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    (data / "train" / "digit_0" / "notes.txt").write_text("not an image")
    (data / "train" / "digit_0" / ".DS_Store").write_bytes(b"\0")  # hidden: skipped without a word
    Image.new("L", (1, 1)).save(data / "train" / "digit_1" / "dot.png")
    args = _train_args(data, tmp_path / "out", "train.warmup_epochs=3")
    with pytest.warns(UserWarning) as caught:
        assert load_script("train").main(args) == 0
    messages = [str(w.message) for w in caught]
    assert any(
        "train.warmup_epochs=3 is not below train.epochs=1: the whole run is warmup" in m
        and "ends one update short of 33% of the way" in m
        for m in messages
    )
    skipped = [m for m in messages if m.startswith("skipping 1 file(s)")]
    assert len(skipped) == 1 and skipped[0].endswith("digit_0/notes.txt"), messages
    assert any("dot.png is only 1x1 pixels: it is resized to the input size" in m for m in messages)


# ----------------------------------------------------------------------------------------------- eval.py
EVAL_MISTAKES = {
    "model-of-another-family": (
        ["--model", "vit3_tiny"],
        "model 'vit3_tiny' (--model / model.name) does not fit <checkpoint>: it holds a 'test_h_vit3'",
    ),
    "img-size-below-the-stride": (
        ["--img-size", "16"],
        "config key eval.img_sizes (eval.py --img-size) must be image sizes test_h_vit3 takes, got 16",
    ),
    "img-size-zero": (
        ["--img-size", "0"],
        "eval.img_sizes (eval.py --img-size) must be a list of values >= 1",
    ),
    "batch-size-zero": (
        ["--batch-size", "0"],
        "config key eval.batch_size (eval.py --batch-size) must be >= 1",
    ),
    "report-under-a-file": (
        ["--json", "<a_file>/r.json"],
        "<a_file> is a file, so nothing can be made under it",
    ),
    "report-not-json": (["--json", "<checkpoint>"], "the file name must end in .json"),
    "unparsable-flag-value": (["--batch-size", "lots"], "error: argument --batch-size: invalid int value"),
}


@pytest.mark.parametrize(("flags", "message"), EVAL_MISTAKES.values(), ids=EVAL_MISTAKES.keys())
def test_an_eval_mistake_is_one_line(flags, message, checkpoint, a_file, capsys):
    paths = {"checkpoint": checkpoint, "a_file": a_file}
    before = sorted(checkpoint.parent.iterdir())
    args = ["--checkpoint", str(checkpoint), *(_fill(f, **paths) for f in flags)]
    assert load_script("eval").main(args) == USER_ERROR_EXIT
    assert _fill(message, **paths) in one_error_line(capsys, last=True)
    assert sorted(checkpoint.parent.iterdir()) == before


# --------------------------------------------------------------------------------------------- export.py
EXPORT_MISTAKES = {
    "feature-index-out-of-range": (
        ["features", "--out-indices", "7"],
        "--out-indices [7] do not fit test_h_vit3: its 4 feature levels are 0 to 3 (or -4 to -1 from the "
        "last)",
    ),
    "onnx-index-out-of-range": (["onnx", "--out-indices", "9"], "--out-indices [9] do not fit test_h_vit3"),
    "unknown-model": (
        ["features", "--model", "h_vit3_tinyy", "--random-init"],
        "--model must be a timm model name (e.g. vit3_tiny, h_vit3_small; import vit3 registers them), got "
        "'h_vit3_tinyy': did you mean h_vit3_tiny",
    ),
    "no-weights": (
        ["features", "--model", "test_h_vit3"],
        "export.py features needs the weights to export: pass --checkpoint FILE",
    ),
    "onnx-no-weights": (["onnx", "--model", "test_h_vit3"], "pass --checkpoint FILE"),
    "out-is-a-file": (
        ["features", "--out", "<a_file>"],
        "--out must be a folder this run can write, got '<a_file>': <a_file> is a file",
    ),
    "onnx-out-not-onnx": (["onnx", "--out", "<checkpoint>"], "--out must be a .onnx file this run can write"),
    "img-size-below-the-stride": (
        ["features", "--img-size", "16"],
        "--img-size must be image sizes test_h_vit3 takes, got 16",
    ),
    "ema-without-checkpoint": (
        ["features", "--model", "test_h_vit3", "--random-init", "--ema"],
        "--ema takes",
    ),
    "missing-images": (
        ["features", "--images", "<tmp>/nowhere"],
        "--images must be an existing folder, got '<tmp>/nowhere': not found",
    ),
}


@pytest.mark.parametrize(("flags", "message"), EXPORT_MISTAKES.values(), ids=EXPORT_MISTAKES.keys())
def test_an_export_mistake_is_one_line_and_nothing_is_written(
    flags, message, checkpoint, digits, tmp_path, a_file, capsys
):
    paths = {"checkpoint": checkpoint, "a_file": a_file, "tmp": tmp_path}
    args = [_fill(f, **paths) for f in flags]
    # the flags it needs, where the row is not about them
    out = tmp_path / ("feats" if args[0] == "features" else "m.onnx")
    args += [] if "--model" in args else ["--checkpoint", str(checkpoint)]
    args += [] if "--out" in args else ["--out", str(out)]
    if args[0] == "features":
        args += [] if "--images" in args else ["--images", str(digits / "val")]
    assert load_script("export").main(args) == USER_ERROR_EXIT
    assert _fill(message, **paths) in one_error_line(capsys, last=True)
    assert not (tmp_path / "feats").exists() and not (tmp_path / "m.onnx").exists()


def test_dense_feature_indices_are_checked_against_the_backbone():
    from vit3.errors import ConfigError
    from vit3.tasks.backbone import FeatureBackbone

    with pytest.raises(
        ConfigError, match=r"^dense.out_indices \[1, 4\] do not fit test_h_vit3: its 4 feature"
    ):
        FeatureBackbone("test_h_vit3", [1, 4], indices_from="dense.out_indices")
    assert FeatureBackbone("test_h_vit3", [1, -1]).strides == [8, 32]


def test_random_init_is_asked_for_and_recorded(digits, tmp_path):
    out = tmp_path / "feats"
    args = [
        "features",
        "--model",
        "test_h_vit3",
        "--random-init",
        "--images",
        str(digits / "val"),
        "--out",
        str(out),
    ]
    with pytest.warns(UserWarning, match="--random-init: exporting a randomly initialised test_h_vit3"):
        assert load_script("export").main(args) == 0
    assert '"weights": "random init"' in (out / "manifest.json").read_text()


# --------------------------------------------------------------------------------------------- torchrun
def test_nccl_on_a_cpu_machine_is_one_line_before_the_process_group(digits, tmp_path, monkeypatch, capsys):
    """Rank 0 of a two-process launch: refused before the rendezvous (which would wait for the other rank)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = _train_args(digits, tmp_path / "out", "dist.backend=nccl", "device=cpu")
    assert load_script("train").main(args) == USER_ERROR_EXIT
    assert "dist.backend=nccl needs CUDA devices, but this run is on cpu: use dist.backend=gloo" in (
        one_error_line(capsys, last=True)
    )


def test_another_rank_reports_only_what_rank_0_did_not(digits, tmp_path, monkeypatch, capsys):
    from vit3.engine import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli, "RANK_REPORT_DELAY_S", 0.0)  # torchrun ends it first when rank 0 reports too
    assert (
        load_script("train").main(_train_args(digits, tmp_path / "out", "train.base_lr=-1"))
        == USER_ERROR_EXIT
    )
    assert one_error_line(capsys, last=True).startswith(
        "error: (rank 1) config key train.base_lr must be > 0"
    )


@pytest.mark.slow
def test_torchrun_with_a_batch_larger_than_a_ranks_share_says_so_once(digits, tmp_path):
    args = _train_args(digits, tmp_path / "out", "data.batch_size=16")  # 24 images, 12 per rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(REPO / "train.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: data.batch_size=16 exceeds the 12 training images per process (24 images over 2 "
        "process(es)): "
        "lower data.batch_size, or let data.fit_batch=8 fit it (configs/finetune.yaml does)"
    ], done.stderr
    assert "exitcode  : 2" in done.stderr  # rank 0's own exit code, in torchrun's summary


@pytest.mark.parametrize(
    "name", ["run #3", "2024-01-02", "null", "[a]"], ids=["hash", "date", "null", "brackets"]
)
def test_a_path_flag_is_taken_as_written(name, tmp_path, monkeypatch):
    """``--output`` (and eval.py's path flags) become config overrides, which read YAML: the value is quoted,
    so a ``#`` no longer cut the folder name short and a date-like name is no date."""
    import vit3.scripts.train as train_script

    seen = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_script, "run", lambda cfg, task: seen.append(cfg.output))
    assert train_script.main(["--output", name, "train.epochs=1"]) == 0
    assert seen == [name]
