"""End to end: train a detector and a segmenter on real-digit canvases for a few steps (the loss falls), then
evaluate the checkpoints with eval.py through pycocotools and mIoU; config errors are named."""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from helpers.dense import det_args, seg_args
from helpers.train import REPO, assert_same_tensors, bare_resume, kill_when_checkpoint, load_script, read_ckpt

from vit3.engine import ConfigError, load_config
from vit3.engine.config import CONFIG_DIR
from vit3.engine.dense import train
from vit3.engine.dense_metrics import nan_free_json

DET = CONFIG_DIR / "dense" / "demo_detection.yaml"
SEG = CONFIG_DIR / "dense" / "demo_segmentation.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_mask_rcnn_trains_and_evaluates_through_pycocotools(coco_root, tmp_path):
    cfg = load_config(DET, det_args(coco_root, tmp_path / "run"))
    result = train(cfg)
    losses = result["losses"]
    assert len(losses) == 4 * 4  # 7 annotated images (one empty skipped) in batches of 2, four epochs
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    ckpt = tmp_path / "run" / "last.pt"
    assert ckpt.exists() and (tmp_path / "run" / "best.pt").exists()
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())[-1]["step"] == 16
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # as every task writes one
    assert summary == json.loads(nan_free_json(result["summary"]))
    assert summary["last"] == str(ckpt) and summary["best"] == str(tmp_path / "run" / "best.pt")
    assert summary["steps"] == 16 and summary["final"]["step"] == 16
    assert summary["best_bbox_AP"] == max(
        h["bbox_AP"] for h in json.loads((tmp_path / "run" / "metrics.json").read_text())
    )
    out = tmp_path / "eval.json"
    assert load_script("eval").main(["--checkpoint", str(ckpt), "--json", str(out), "device=cpu"]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    for key in ("bbox_AP", "bbox_AP50", "segm_AP", "segm_AP50"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["bbox_AP"] == pytest.approx(
        result["final"]["bbox_AP"]
    )  # eval.py reproduces the run's eval
    # --data names the COCO root: the checkpoint's dataset stays (it was made an image folder, refused)
    args = ["--checkpoint", str(ckpt), "--data", str(coco_root), "--json", str(out), "device=cpu"]
    assert load_script("eval").main(args) == 0
    assert json.loads(out.read_text())["metrics"]["bbox_AP"] == pytest.approx(metrics["bbox_AP"])


def test_a_resume_into_another_folder_names_the_best_checkpoint_that_exists(coco_root, tmp_path):
    """A finished detection run resumed into another folder trains nothing more and writes no ``best.pt``:
    its summary names the resumed run's, as a classification run's does (``loop.best_checkpoint``)."""
    source, again = tmp_path / "source", tmp_path / "again"
    train(load_config(DET, det_args(coco_root, source)))
    train(load_config(DET, [*det_args(coco_root, again), f"train.resume={source / 'last.pt'}"]))
    assert (source / "best.pt").is_file() and not (again / "best.pt").exists()
    assert json.loads((again / "summary.json").read_text())["best"] == str(source / "best.pt")


def _resumable(path):
    ckpt = read_ckpt(path)
    return {k: ckpt[k] for k in ("model", "optimizer", "scaler", "global_step", "epoch", "losses", "history")}


# Per task: the config, its short run, and when to kill it (a checkpoint inside a later epoch).
KILLS = {
    "detection": (DET, det_args, "coco_root", ["train.save_every_steps=2"], 2),  # 4 steps per epoch
    "segmentation": (SEG, seg_args, "ade_root", ["train.epochs=3", "train.save_every_steps=1"], 1),  # 2
}


@pytest.mark.slow
@pytest.mark.parametrize("task", list(KILLS))
def test_killed_mid_epoch_then_bare_resume_gives_the_uninterrupted_weights(task, request, tmp_path):
    """train.py killed with SIGKILL (kill -9) inside a later epoch, then a bare ``train.py --resume FILE``
    (the run's own config, task and folder): its weights, optimizer state, losses and metrics equal an
    uninterrupted run's bit for bit (the RPN's sampling, drop path, crops and flips all draw on RNG states the
    resume restores; the data stream continues at the saved batch)."""
    config, args, data, extra, batch = KILLS[task]
    overrides = [*args(request.getfixturevalue(data), tmp_path / "full"), *extra, "model.drop_path_rate=0.1"]
    full = train(load_config(config, overrides))  # uninterrupted (this process runs one thread, as the child)
    killed = tmp_path / "killed"
    cmd = [sys.executable, "train.py", "--config", str(config), *overrides, f"output={killed}", "threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    left = kill_when_checkpoint(
        cmd, killed / "last.pt", lambda c: c["epoch"] >= 1 and c["batch_in_epoch"] == batch, cwd=REPO, env=env
    )
    assert left["epoch"] >= 1 and left["batch_in_epoch"] == batch, (left["epoch"], left["batch_in_epoch"])
    assert len(left["losses"]) == left["global_step"] < len(full["losses"])
    bare_resume(killed / "last.pt")
    assert_same_tensors(_resumable(tmp_path / "full" / "last.pt"), _resumable(killed / "last.pt"))


def test_a_detection_run_checkpoints_every_epoch_and_keeps_best_only_when_asked(
    coco_root, tmp_path, monkeypatch
):
    """``last.pt`` at every epoch's end, not only at an evaluation (a kill between evaluations lost whole
    epochs), and no ``best.pt`` under ``train.keep_best=false``."""
    import vit3.engine.dense as dense

    saved, real = [], dense.save_state

    def spy(state, path, info, also=()):
        saved.append((state()["global_step"], path.name, [p.name for p in also]))
        return real(state, path, info, also)

    monkeypatch.setattr(dense, "save_state", spy)
    train(load_config(DET, [*det_args(coco_root, tmp_path), "train.keep_best=false"]))
    assert saved == [(4, "last.pt", []), (8, "last.pt", []), (12, "last.pt", []), (16, "last.pt", [])]
    assert not (tmp_path / "best.pt").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["best"] is None


def test_upernet_on_a_plain_backbone_trains_and_evaluates_miou(ade_root, tmp_path):
    overrides = [
        *seg_args(ade_root, tmp_path / "run"),
        "model.name=test_vit3_ttt",
        "train.epochs=6",
        "train.eval_every=6",
    ]
    assert load_script("train").main(["--config", str(SEG), *overrides]) == 0
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert history[-1]["step"] == 12
    first = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert first["num_classes"] == 3
    out = tmp_path / "eval.json"
    args = ["--checkpoint", str(tmp_path / "run" / "best.pt"), "--json", str(out), "dense.inference=slide"]
    assert load_script("eval").main([*args, "dense.slide_crop=[48,48]", "dense.slide_stride=[32,32]"]) == 0
    report = json.loads(out.read_text())
    metrics = report["metrics"]
    assert report["settings"]["dense.inference"] == "slide"  # two evaluations of one checkpoint tell apart
    assert report["settings"]["dense.slide_crop"] == [48, 48]
    assert set(metrics["per_class_IoU"]) == {"background", "three", "seven"}
    ious = list(metrics["per_class_IoU"].values())
    assert metrics["mIoU"] == pytest.approx(np.nanmean(ious)) and 0.0 <= metrics["aAcc"] <= 1.0
    # without --json: beside the checkpoint, and a report on another folder keeps the one on the run's own
    other = shutil.copytree(ade_root, tmp_path / "other")
    assert load_script("eval").main(args[:2]) == 0
    assert load_script("eval").main([*args[:2], f"data.path={other}"]) == 0
    own, theirs = (json.loads((tmp_path / "run" / f"best{s}.eval.json").read_text()) for s in ("", ".other"))
    assert own["settings"]["data.path"] == str(ade_root) and theirs["settings"]["data.path"] == str(other)


def test_segmentation_loss_falls_in_a_few_steps(ade_root, tmp_path):
    overrides = [
        "data.dataset=ade20k",
        f"data.path={ade_root}",
        f"output={tmp_path}",
        "device=cpu",
        "train.epochs=5",
        "train.eval_every=100",
        "train.log_every=0",
        "data.batch_size=4",
        "dense.warmup_iters=1",
        "dense.head_channels=16",
        "dense.aux_weight=0",
        "dense.arch=semantic_fpn",
        "dense.scale=[64,64]",
        "dense.crop_size=[64,64]",
        "dense.num_classes=3",
        "dense.class_names=null",
        "train.base_lr=3.0e-3",
        "dense.lr_schedule=step",  # constant after the warmup
        "dense.ratio_range=[1,1]",  # crops are whole images: less noise between steps
    ]
    result = train(load_config(SEG, overrides))
    losses = result["losses"]
    assert len(losses) == 10 and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    assert 0.0 <= result["final"]["mIoU"] <= 1.0


SEG_ARGS = ["task=segmentation", "dense.arch=upernet", "data.dataset=ade20k", "dense.num_classes=3"]


def test_a_detector_normalises_with_the_configs_mean_and_std(coco_root, tmp_path):
    """``data.mean`` / ``data.std`` reach the detector's transform, as the segmenter's data (they were left
    at the backbone's while the checkpoint recorded them); unset, the backbone's."""
    from vit3.engine.dense import model_and_data

    stats = ["data.mean=[0.5, 0.5, 0.5]", "data.std=[0.25, 0.25, 0.25]"]
    model, _, _ = model_and_data(load_config(DET, [*det_args(coco_root, tmp_path), *stats]), False)
    assert model.transform.image_mean == [0.5] * 3 and model.transform.image_std == [0.25] * 3
    model, _, _ = model_and_data(load_config(DET, det_args(coco_root, tmp_path)), False)
    assert model.transform.image_mean == list(model.backbone.backbone.data_config["mean"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["dense.arch=upernet"], r"dense.arch must be one of mask_rcnn, faster_rcnn, got 'upernet'"),
        (["data.dataset=ade20k"], r"data.dataset must be one of coco, digits, got 'ade20k'"),
        (SEG_ARGS[:3], "dense.num_classes"),
        (["train.amp=fp8"], r"train.amp must be one of auto, none, bf16, fp16, got .fp8."),
        (
            [*SEG_ARGS, "data.mean=[0.5]", "data.std=[0.2]"],
            r"data.mean must hold one value per RGB channel \(3\), got \[0.5\]",
        ),
    ],
    ids=[
        "arch-of-other-task",
        "dataset-of-other-task",
        "segmentation-without-classes",
        "bad-amp",
        "mean-length",
    ],
)
def test_config_errors_are_named(coco_root, tmp_path, overrides, match):
    """When the config loads (the validation layer) or else when the run starts: one error naming the key."""
    with pytest.raises(ConfigError, match=match):
        train(load_config(DET, [*det_args(coco_root, tmp_path), *overrides]))
