"""The README's classification chain through the scripts, in miniature: a demo-like one-channel model on the
digits -> fine-tuning with configs/finetune.yaml on six classes of real photographs (RandAugment and all) ->
eval.py at two sizes -> feature export -> ONNX, every step taking the model from the checkpoint."""

from __future__ import annotations

import json

import pytest
from helpers.train import load_script, make_digit_folder, tiny_cfg

from vit3.data.samples import make_photo_folder
from vit3.engine import run
from vit3.engine.config import CONFIG_DIR

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_demo_finetune_eval_features_onnx(tmp_path, capsys):
    digits = make_digit_folder(tmp_path / "digits", n_train=40, n_val=10)
    demo = tmp_path / "demo"
    run(tiny_cfg(digits, demo, "train.epochs=2", "model.kwargs.dims=[16, 32, 48, 80]"), "train")

    photos = make_photo_folder(tmp_path / "photos", n_train=20, n_val=6)
    train = load_script("train")
    args = [
        "--config",
        str(CONFIG_DIR / "finetune.yaml"),
        f"data.path={photos}",
        f"model.pretrained={demo / 'best.pt'}",
    ]
    quick = [
        "--output",
        str(tmp_path / "ft"),
        "train.epochs=3",
        "train.min_steps=0",  # three epochs, not the recipe's 600 steps
        "train.warmup_epochs=0",
    ]
    assert train.main([*args, *quick, "data.num_workers=0", "train.progress=false"]) == 0
    best = tmp_path / "ft" / "best.pt"
    record = json.loads((tmp_path / "ft" / "summary.json").read_text())

    report = tmp_path / "eval.json"
    assert (
        load_script("eval").main(["--checkpoint", str(best), "--img-size", "32", "48", "--json", str(report)])
        == 0
    )
    results = json.loads(report.read_text())["results"]
    assert [r["img_size"] for r in results] == [32, 48] and all(r["images"] == 36 for r in results)
    # six photo classes: better than chance after three epochs (after two, float32 rounding of one backend or
    # another decided whether one of the 36 images tipped it over chance)
    assert results[0]["top1"] > 100 / 6
    assert results[0]["top1"] == pytest.approx(record["best_top1"])  # eval.py reproduces the run's best epoch

    export = load_script("export")
    images = photos / "val"  # the class subfolders' images, written as <out>/<class>/<image>.safetensors
    assert (
        export.main(
            ["features", "--checkpoint", str(best), "--images", str(images), "--out", str(tmp_path / "f")]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert manifest["model"] == "test_h_vit3" and manifest["preprocessing"]["input_size"] == [1, 32, 32]
    assert len(manifest["files"]) == 36 and manifest["files"][0]["file"] == "china_left/000.safetensors"
    assert (tmp_path / "f" / "hopper_right" / "005.safetensors").is_file()
    capsys.readouterr()
    assert export.main(["onnx", "--checkpoint", str(best), "--out", str(tmp_path / "f.onnx")]) == 0
    text = capsys.readouterr().out
    info = json.loads(text[text.rindex("\n{") + 1 :])
    assert info["dynamic_size"] and info["max_abs_err"] < 1e-4
