"""eval.py: top-1/top-5 of a checkpoint at several resolutions, EMA weights, speed/memory/FLOPs, JSON."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.train import load_script, make_digit_folder, read_ckpt, tiny_cfg

from vit3.engine import run
from vit3.engine.checkpoint import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data = make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1, 2), n_train=40, n_val=20)
    out = tmp_path_factory.mktemp("run")
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        summary = run(tiny_cfg(data, out, "train.ema=true", "train.ema_decay=0.8"), "train")
    return data, out, summary


def test_eval_reproduces_training_accuracy_at_several_resolutions(trained, tmp_path):
    _, out, summary = trained
    report_path = tmp_path / "eval.json"
    evaluate = load_script("eval")
    assert (
        evaluate.main(
            ["--checkpoint", str(out / "last.pt"), "--img-size", "32", "48", "--json", str(report_path)]
        )
        == 0
    )
    report = json.loads(report_path.read_text())
    at32, at48 = report["results"]
    assert (at32["img_size"], at48["img_size"]) == (32, 48)
    final = summary["final"]  # last.pt holds the final epoch's weights, evaluated with the same preprocessing
    assert at32["top1"] == pytest.approx(final["val_top1"]) and at32["top5"] == pytest.approx(
        final["val_top5"]
    )
    assert at32["images"] == 60 and at32["top5"] == 100.0  # 3 classes: top-5 is trivially everything
    assert at48["gflops_per_image"] > at32["gflops_per_image"] > 0
    assert at32["throughput_img_s"] > 0 and at32["peak_memory_mb"] > 0
    params = sum(v.numel() for k, v in read_ckpt(out / "last.pt")["model"].items() if "running" not in k)
    assert report["params_m"] * 1e6 == pytest.approx(params, rel=0.01)


def test_eval_of_ema_weights_matches_training_ema_accuracy(trained, tmp_path):
    _, out, summary = trained
    evaluate = load_script("eval")
    assert (
        evaluate.main(["--checkpoint", str(out / "last.pt"), "--ema", "--json", str(tmp_path / "e.json")])
        == 0
    )
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["weights"] == "ema"
    assert report["results"][0]["top1"] == pytest.approx(summary["final"]["ema_top1"])


def test_eval_on_another_folder_with_fewer_classes(trained, tmp_path):
    _, out, _ = trained
    other = make_digit_folder(tmp_path / "d", digits=(0, 1), n_train=1, n_val=5)
    evaluate = load_script("eval")
    code = evaluate.main(
        ["--checkpoint", str(out / "last.pt"), "--data", str(other), "--json", str(tmp_path / "o.json")]
    )
    assert code == 0 and json.loads((tmp_path / "o.json").read_text())["results"][0]["images"] == 10


def test_a_report_on_another_folder_keeps_the_first(trained, tmp_path):
    """Without --json a report goes beside the checkpoint: on the run's own data as ``last.eval.json``, on
    another folder as ``last.<folder>.eval.json`` (it replaced the first); each report names its data."""
    data, out, _ = trained
    other = make_digit_folder(tmp_path / "other", digits=(0, 1), n_train=1, n_val=5)
    evaluate = load_script("eval")
    args = ["--checkpoint", str(out / "last.pt"), "eval.flops=false", "eval.throughput_batches=1"]
    assert evaluate.main(args) == 0
    assert evaluate.main([*args, "--data", str(other)]) == 0
    own, theirs = out / "last.eval.json", out / "last.other.eval.json"
    assert json.loads(own.read_text())["data"]["path"] == str(data)
    assert json.loads(theirs.read_text())["data"]["path"] == str(other)
    assert json.loads(own.read_text())["results"][0]["images"] == 60


def test_eval_rejects_a_checkpoint_of_another_model(trained, tmp_path, capsys):
    _, out, _ = trained
    ckpt = read_ckpt(out / "last.pt")
    ckpt["model"] = {k.replace("stages.", "layers."): v for k, v in ckpt["model"].items()}
    forged = save_checkpoint(
        tmp_path / "other.pt", {k: v for k, v in ckpt.items() if k not in ("format", "version")}
    )
    evaluate = load_script("eval")
    assert evaluate.main(["--checkpoint", str(forged), "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"(?s)^error: .*mismatched keys:.*missing in checkpoint: stages\.", err)
    assert "Traceback" not in err


def test_eval_missing_checkpoint_and_non_vit3_file(tmp_path, capsys):
    evaluate = load_script("eval")
    assert evaluate.main(["--checkpoint", str(tmp_path / "nope.pt")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    torch.save({"model": {}}, tmp_path / "foreign.pth")
    assert evaluate.main(["--checkpoint", str(tmp_path / "foreign.pth")]) == 2
    assert "--model" in capsys.readouterr().err
