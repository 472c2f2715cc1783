"""No silent wrong answer (issue 49): each input that used to give a wrong figure without a word is refused,
warned about or made right. Grouped by what each test protects; tiny data made in tmp."""

from __future__ import annotations

import json

import numpy as np
import pytest
import timm
import torch
from helpers.train import (
    load_script,
    make_digit_folder,
    one_error_line,
    read_ckpt,
    run_until_crash,
    tiny_args,
    tiny_cfg,
)
from PIL import Image

import vit3.models  # noqa: F401  (registers the models)
from vit3.data.image import open_image
from vit3.engine.common import amp_dtype

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A tiny run (2 classes, 2 epochs of 2 steps) killed after epoch 1 and resumed by ``train.py --resume``:
    its folder, the checkpoint the kill left and the data folder."""
    data = make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1), n_train=20, n_val=6)
    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as m, torch.random.fork_rng():
        left = run_until_crash(m, tiny_cfg(data, out), global_step=2)
    assert load_script("train").main(["--resume", str(out / "last.pt")]) == 0
    return out, left, data


# --- an accuracy that means nothing is refused -------------------------------------------------------------


def test_one_class_classification_is_refused(tmp_path, capsys):
    """One class folder: every prediction is right ("val top-1 100%"); refused naming the folder."""
    data = make_digit_folder(tmp_path / "d", digits=(3,), n_train=20, n_val=5)
    code = load_script("train").main(tiny_args(data, tmp_path / "out"))
    line = one_error_line(capsys)
    assert code == 2 and str(data / "train") in line and "at least 2 classes" in line, line
    assert not (tmp_path / "out" / "last.pt").exists()


# --- images load as they look ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pixels", "want"),
    [
        (
            np.linspace(0.0, 1.0, 64, dtype=np.float32),
            np.rint(np.linspace(0.0, 255.0, 64)),
        ),  # float in [0, 1]
        (np.arange(0, 256, 4, dtype=np.int32), np.arange(0, 256, 4)),  # int32 holding 8-bit values
        (
            np.arange(64, dtype=np.int32) * (2**31 // 64),
            np.rint(np.arange(64) * (2**31 // 64) * 255 / (2**31 - 1)),
        ),
    ],
    ids=["float-0-1", "int32-8-bit", "int32-32-bit"],
)
def test_float_and_int32_tiffs_keep_their_range(tmp_path, pixels, want):
    """A float TIFF in [0, 1] or an int32 TIFF of 8-bit values loaded black (clipped or / 257); an int32 one
    beyond 16 bits white (clipped at 65535). Each is scaled by its type's convention."""
    path = tmp_path / "img.tif"
    Image.fromarray(pixels.reshape(8, 8)).save(path)
    gray = np.asarray(open_image(path, "L")).reshape(-1)
    np.testing.assert_array_equal(gray, want.astype(np.uint8))
    sixteen = tmp_path / "sixteen.tif"  # an int32 image in the 16-bit range keeps the 16-bit rule (/ 257)
    Image.fromarray(np.arange(64, dtype=np.int32).reshape(8, 8) * 1000).save(sixteen)
    np.testing.assert_array_equal(
        np.asarray(open_image(sixteen, "L")).reshape(-1), np.rint(np.arange(64) * 1000 / 257).astype(np.uint8)
    )


# --- results go where the user said ------------------------------------------------------------------------


def test_empty_output_is_refused(tmp_path, monkeypatch, capsys):
    """``output=`` ran with the working folder as the run folder, writing checkpoints there."""
    data = make_digit_folder(tmp_path / "d", digits=(0, 1), n_train=20, n_val=5)
    monkeypatch.chdir(tmp_path)
    code = load_script("train").main([*tiny_args(data, tmp_path / "out"), "output="])
    line = one_error_line(capsys)
    assert code == 2 and "config key output" in line and "empty" in line, line
    assert not (tmp_path / "last.pt").exists()


def test_output_flag_and_override_that_disagree_are_refused(tmp_path, capsys):
    """``--output A output=B`` ran into A without a word about B."""
    data = make_digit_folder(tmp_path / "d", digits=(0, 1), n_train=20, n_val=5)
    flag, written = tmp_path / "a", tmp_path / "b"
    code = load_script("train").main(["--output", str(flag), *tiny_args(data, written)])
    line = one_error_line(capsys)
    assert code == 2 and "--output" in line and f"output={written}" in line and "disagree" in line, line
    assert not flag.exists() and not written.exists()


# --- what is counted is what was evaluated -----------------------------------------------------------------


def test_eval_skipping_a_corrupt_image_counts_the_images_read(resumed, tmp_path):
    """``data.corrupt_images=skip`` put the next image in the corrupt one's place: 13 images counted where 12
    were read (one twice). Now 12, and the report says one was skipped."""
    out, _, _ = resumed
    other = make_digit_folder(tmp_path / "e", digits=(0, 1), n_train=1, n_val=6)
    (other / "val" / "digit_0" / "0002_bad.png").write_bytes(b"\x89PNG truncated")
    report = tmp_path / "r.json"
    args = ["--checkpoint", str(out / "last.pt"), "--data", str(other), "--json", str(report)]
    with pytest.warns(UserWarning, match="0002_bad.png"):
        assert load_script("eval").main([*args, "data.corrupt_images=skip", "eval.flops=false"]) == 0
    result = json.loads(report.read_text())["results"][0]
    assert (result["images"], result["skipped"]) == (12, 1)


# --- the model refuses what it cannot compute --------------------------------------------------------------


def test_finite_images_too_large_for_the_float_type_are_refused():
    """Finite images of 1e30 (or 1e5 under float16 autocast) gave NaN logits without a word."""
    model = timm.create_model("vit3_tiny", img_size=32, num_classes=4).eval()
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.isfinite(model(x * 255)).all()
        with pytest.raises(ValueError, match=r"beyond ±1\.84e\+19"):
            model(x * 1e30)
        with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="beyond ±256"):
            model(x * 1e5)


# --- what a run reports covers what it did -----------------------------------------------------------------


def test_resumed_run_reports_the_whole_runs_time(resumed):
    """A resumed run's summary gave the resumed part's time as the run's."""
    out, left, _ = resumed
    summary = json.loads((out / "summary.json").read_text())
    assert left["run_seconds"] > 0  # the time before the kill, kept in the checkpoint
    assert summary["wall_time_s"] == pytest.approx(
        left["run_seconds"] + summary["wall_time_this_process_s"], abs=0.2
    )
    assert (
        summary["wall_time_covers"].startswith("the whole run")
        and str(out / "last.pt") in summary["wall_time_covers"]
    )
    assert read_ckpt(out / "last.pt")["run_seconds"] > left["run_seconds"]


def test_fp16_autocast_on_cpu_is_warned_about():
    """``train.amp=fp16`` on a CPU ran several times slower than float32 with no note."""
    with pytest.warns(UserWarning, match="train.amp=fp16 on the CPU"):
        assert amp_dtype("fp16", torch.device("cpu")) is torch.float16
