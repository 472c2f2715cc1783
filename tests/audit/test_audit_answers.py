"""No silent wrong answer (issue 49): each input that used to give a wrong figure without a word is refused,
warned about or made right, and inputs that look risky but give the right answer keep giving it (image
modes, paths with spaces, accents or links, a subset of the classes). Grouped by what each test protects;
tiny data made in tmp."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
from vit3.engine.process import amp_dtype

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


def _gray_ramp() -> np.ndarray:
    return np.arange(0, 256, 4, dtype=np.uint8).reshape(8, 8)


def _mode_image(mode: str) -> tuple[Image.Image, np.ndarray]:
    """An image of ``mode`` whose pixels are a gray ramp (0/255 for bilevel), and that ramp."""
    gray = _gray_ramp()
    g, alpha = Image.fromarray(gray), Image.fromarray(np.full((8, 8), 7, np.uint8))
    if mode == "1":
        gray = np.where(gray >= 128, 255, 0).astype(np.uint8)
        return Image.fromarray(gray).convert("1"), gray
    images = {
        "RGBA": lambda: Image.merge("RGBA", (g, g, g, alpha)),
        "LA": lambda: Image.merge("LA", (g, alpha)),
        "P": lambda: g.convert("P"),
        "I;16": lambda: Image.fromarray(gray.astype(np.uint16) * 257),
        "CMYK": lambda: g.convert("CMYK"),
    }
    return images[mode](), gray


@pytest.mark.parametrize(
    ("mode", "suffix"),
    [("RGBA", "png"), ("LA", "png"), ("P", "png"), ("P-transparent", "png"), ("I;16", "png"), ("CMYK", "tif"),
     ("1", "png")],
)  # fmt: skip
def test_every_image_mode_loads_as_it_looks(mode, suffix, tmp_path):
    """Alpha dropped (not blended), palettes looked up, 16-bit scaled, CMYK converted: a gray ramp stays that
    ramp, in the grayscale and in the RGB models' input alike."""
    img, gray = _mode_image(mode.removesuffix("-transparent"))
    if mode == "P-transparent":
        img.info["transparency"] = 0
    path = tmp_path / f"img.{suffix}"
    img.save(path)
    np.testing.assert_array_equal(np.asarray(open_image(path, "L")), gray)
    np.testing.assert_array_equal(np.asarray(open_image(path, "RGB")), np.repeat(gray[..., None], 3, axis=-1))


def test_a_glued_colon_in_an_override_is_refused(tmp_path, capsys):
    """``model.kwargs={img_size:32}`` (no space after the colon) is, to YAML, one key ``img_size:32`` without
    a value: the run trained at the model's default size without a word. Refused, saying how to write it."""
    data = make_digit_folder(tmp_path / "d", digits=(0, 1), n_train=4, n_val=2)
    code = load_script("train").main(
        [*tiny_args(data, tmp_path / "out"), "model.kwargs={img_size:32, in_chans: 1}"]
    )
    assert code == 2
    assert one_error_line(capsys) == (
        "error: bad override 'model.kwargs={img_size:32, in_chans: 1}': YAML reads 'img_size:32' as one key "
        "without a value: write a space after the colon (img_size: 32), as YAML mappings need"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("units", [False, True], ids=["without-bf16-units", "with-bf16-units"])
def test_bf16_autocast_on_cpu_is_warned_about_where_it_is_slow(units, monkeypatch):
    """``train.amp=bf16`` on a CPU without bfloat16 matrix instructions ran many times slower than float32
    with no note (as fp16 did); where the CPU has them (AVX512-BF16, AMX) it is the fast path, unwarned."""
    import warnings

    import vit3.engine.process as process

    monkeypatch.setattr(process, "cpu_has_bf16_units", lambda: units)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert amp_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    messages = [str(w.message) for w in caught]
    assert messages == ([] if units else [
        "train.amp=bf16 on the CPU: this CPU has no bfloat16 matrix instructions (AVX512-BF16 or AMX), where "
        "bfloat16 autocast runs many times slower than float32; train.amp=none runs float32"
    ])  # fmt: skip


def test_a_batch_of_one_where_batchnorm_sees_a_map_trains(tmp_path):
    """The refusal of a batch of one (a BatchNorm layer with one value per channel) is for 1x1 maps only: at
    64 pixels test_h_vit3's last map is 2x2, and a batch of one trains as written."""
    data = make_digit_folder(tmp_path / "d", digits=(0, 1), n_train=2, n_val=1)
    args = [*tiny_args(data, tmp_path / "out"), "data.batch_size=1", "train.lr_batch=1", "data.img_size=64",
            "model.kwargs={in_chans: 1}", "train.epochs=1"]  # fmt: skip
    assert load_script("train").main(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final"]["step"] == 4


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A one-epoch run on a plain digit folder: its data and the SHA-1 of the weights it ended with."""
    root = tmp_path_factory.mktemp("plain")
    data = make_digit_folder(root / "data", digits=(0, 1), n_train=10, n_val=4)
    with torch.random.fork_rng():
        assert load_script("train").main(tiny_args(data, root / "out", "train.epochs=1")) == 0
    return data, json.loads((root / "out" / "summary.json").read_text())["weights_sha1"]


def _linked(data: Path, root: Path) -> Path:
    """``data`` with every class folder a symbolic link to the original."""
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        for folder in (data / split).iterdir():
            (root / split / folder.name).symlink_to(folder, target_is_directory=True)
    return root


def _with_extras(data: Path, root: Path) -> Path:
    """A copy of ``data`` with a hidden file, a hidden folder and a note among the images."""
    shutil.copytree(data, root)
    (root / "train" / "digit_0" / ".DS_Store").write_bytes(b"\0\1")
    (root / "train" / ".thumbnails").mkdir()
    (root / "train" / "digit_1" / "notes.txt").write_text("where the images come from")
    return root


@pytest.mark.parametrize(
    ("where", "make"),
    [
        ("spaces and accents", lambda data, tmp: shutil.copytree(data, tmp / "mes données" / "0 à 1")),
        ("symlinked classes", lambda data, tmp: _linked(data, tmp / "linked")),
        ("hidden files and a note", lambda data, tmp: _with_extras(data, tmp / "extras")),
    ],
)
@pytest.mark.filterwarnings("ignore:skipping 1 file")
def test_the_same_images_give_the_same_weights_wherever_they_are(where, make, plain_run, tmp_path):
    """The run on a copy of the data under spaces and accents, through symbolic links, or beside files that
    are no images ends with the weights of the run on the plain folder, bit for bit."""
    data, sha1 = plain_run
    moved = make(data, tmp_path)
    out = tmp_path / "run out"
    with torch.random.fork_rng():
        assert load_script("train").main(tiny_args(moved, out, "train.epochs=1")) == 0
    assert json.loads((out / "summary.json").read_text())["weights_sha1"] == sha1


def test_eval_on_a_subset_of_the_classes_matches_them_by_name(resumed, tmp_path):
    """A folder with only one of the model's classes (``digit_1``, the model's second) is labelled by name:
    with a classifier that always answers ``digit_0`` its top-1 is 0 %, where labels by the folder's position
    (0) would make it 100 %."""
    out, _, data = resumed
    ckpt = read_ckpt(out / "last.pt")
    ckpt["model"]["head.weight"].zero_()
    ckpt["model"]["head.bias"].copy_(torch.tensor([10.0, -10.0]))
    always_0 = tmp_path / "always_0.pt"
    torch.save(ckpt, always_0)
    results = {}
    for name, classes in (("only", ("digit_1",)), ("both", ("digit_0", "digit_1"))):
        for c in classes:
            shutil.copytree(data / "val" / c, tmp_path / name / "val" / c)
        report = tmp_path / f"{name}.json"
        args = ["--checkpoint", str(always_0), "--data", str(tmp_path / name), "--json", str(report)]
        assert load_script("eval").main([*args, "eval.flops=false"]) == 0
        results[name] = json.loads(report.read_text())["results"][0]
    assert (results["only"]["images"], results["only"]["top1"]) == (6, 0.0)
    assert (results["both"]["images"], results["both"]["top1"]) == (12, 50.0)


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
