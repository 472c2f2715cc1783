"""train.py / vit3.engine.classification: learning on real images, exact resume, fine-tuning, DDP, bad
input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.train import (
    REPO,
    TINY_MODEL,
    assert_same_tensors,
    crash_then_bare_resume,
    kill_when_checkpoint,
    load_script,
    make_digit_folder,
    read_ckpt,
    tiny_cfg,
    torchrun_two_processes,
)

from vit3.engine import ConfigError, run
from vit3.engine.checkpoint import CheckpointMismatchError
from vit3.engine.classification import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    """One short run shared by the tests that need a checkpoint: 3 epochs x 12 steps, EMA on."""
    out = tmp_path_factory.mktemp("run")
    summary = run(tiny_cfg(digits, out, "train.epochs=3", "train.ema=true", "train.ema_decay=0.9"), "train")
    return out, summary


def test_short_run_on_real_digits_beats_chance(trained):
    out, summary = trained
    final = summary["final"]
    # 4 balanced classes: chance is 25%; a few steps of the tiny ViT³ clearly beat it.
    assert final["val_top1"] > 60.0, final
    history = json.loads((out / "metrics.json").read_text())
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert "ema_top1" in final
    csv_lines = (out / "metrics.csv").read_text().splitlines()
    assert len(csv_lines) == 4 and "val_top1" in csv_lines[0]
    assert (out / "curves.png").stat().st_size > 1000
    saved = (out / "config.yaml").read_text()
    assert "git_commit" in saved and "test_h_vit3" in saved


def _weights_and_state(path):
    ckpt = read_ckpt(path)
    return {
        k: ckpt[k] for k in ("model", "ema", "optimizer", "scaler", "global_step", "epoch", "batch_in_epoch")
    }


def test_kill_and_bare_resume_matches_uninterrupted_run(digits, tmp_path, monkeypatch):
    """Mixup, drop path, accumulation, EMA and MESA all draw on RNG/state that the resume must restore. The
    resume is a bare ``train.py --resume FILE``: the run's own config (not the default demo's) and folder,
    leaving the demo's output/demo alone."""
    monkeypatch.chdir(tmp_path)  # where the default demo config's output/demo is
    demo = tmp_path / "output" / "demo"
    demo.mkdir(parents=True)
    (demo / "last.pt").write_bytes(b"the finished demo's checkpoint")
    recipe = (
        "train.accum_steps=2",
        "train.save_every_steps=2",
        "train.ema=true",
        "train.ema_decay=0.9",
        "train.mesa=1.0",
        "train.mesa_start=0.5",
        "aug.mixup=0.8",
        "aug.cutmix=1.0",
        "model.drop_path_rate=0.1",
        "train.warmup_epochs=1",
    )
    full, killed, partial = crash_then_bare_resume(
        monkeypatch, lambda out: tiny_cfg(digits, out, *recipe), tmp_path, 8
    )
    # 6 updates per epoch: it died in epoch 2 after the step-8 checkpoint
    assert (partial["epoch"], partial["batch_in_epoch"], partial["global_step"]) == (1, 4, 8)
    assert_same_tensors(_weights_and_state(full / "last.pt"), _weights_and_state(killed / "last.pt"))
    assert (demo / "last.pt").read_bytes() == b"the finished demo's checkpoint" and len(
        list(demo.iterdir())
    ) == 1
    a = json.loads((full / "metrics.json").read_text())
    b = json.loads((killed / "metrics.json").read_text())
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a["val_top1"] == row_b["val_top1"] and row_a["train_loss"] == row_b["train_loss"]


def test_finetune_to_a_different_class_count(trained, tmp_path):
    """A 4-class checkpoint fine-tunes on a 3-class folder: backbone loaded, new 3-way head."""
    out, _ = trained
    three = make_digit_folder(tmp_path / "three", digits=(5, 6, 7), n_train=20, n_val=10)
    cfg = tiny_cfg(three, tmp_path / "ft", f"model.pretrained={out / 'last.pt'}", "train.epochs=1")
    model, fresh = build_model(cfg, 3, cfg.model.pretrained)
    assert sorted(fresh) == ["head.bias", "head.weight"]
    assert model.get_classifier().out_features == 3
    source = read_ckpt(out / "last.pt")["model"]
    for k, v in model.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(v, source[k]), k
    summary = run(cfg, "train")
    assert read_ckpt(tmp_path / "ft" / "last.pt")["num_classes"] == 3
    # measured 83.3% on the 30 val images; chance is 33.3% (a chance-level model's std: 8.6 points)
    assert summary["final"]["val_top1"] > 60.0


def test_finetune_from_an_official_format_file(digits, tmp_path):
    """An official ViTTT-style file ({"model": weights with the official mixer names}) goes through the
    vit3 models' own loader; the classifier is replaced for the folder's 4 classes."""
    import timm

    kwargs = {"img_size": 32, "patch_size": 4, "in_chans": 1}
    source = timm.create_model("test_vit3_ttt", num_classes=1000, **kwargs)
    official_names = {
        "attn.inner.0.w1": "attn.w1",
        "attn.inner.0.w2": "attn.w2",
        "attn.inner.1.weight": "attn.w3",
    }
    weights = {}
    for k, v in source.state_dict().items():
        for ours, theirs in official_names.items():
            k = k.replace(ours, theirs)
        weights[k] = v
    torch.save({"model": weights, "epoch": 299}, tmp_path / "official.pth")
    cfg = tiny_cfg(
        digits, tmp_path / "ft", "model.name=test_vit3_ttt", f"model.kwargs={kwargs}", "train.epochs=8",
        "train.base_lr=4e-3",
        f"model.pretrained={tmp_path / 'official.pth'}",
    )  # fmt: skip
    model, _ = build_model(cfg, 4, cfg.model.pretrained)
    assert model.get_classifier().out_features == 4
    assert torch.equal(model.blocks[1].attn.inner[0].w1, source.blocks[1].attn.inner[0].w1)
    # measured 57% on the 100 val images after 8 epochs; chance is 25% (std of a chance-level model: 4.3)
    assert run(cfg, "train")["final"]["val_top1"] > 40.0


def test_finetune_from_another_model_names_the_mismatched_keys(trained, tmp_path):
    out, _ = trained
    wider = tiny_cfg(
        tmp_path, tmp_path, f"model.pretrained={out / 'last.pt'}", "model.kwargs.dims=[16, 32, 48, 72]"
    )
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatch: .*stages\.3"):
        build_model(wider, 4, wider.model.pretrained)
    other = tiny_cfg(tmp_path, tmp_path, f"model.pretrained={out / 'last.pt'}", "model.name=test_vit3_ttt")
    with pytest.raises(CheckpointMismatchError, match=r"test_h_vit3.*mismatched keys"):
        build_model(other, 4, other.model.pretrained)


def test_missing_data_dir_is_named(tmp_path):
    with pytest.raises(
        ConfigError, match=r"data.path .*must be an existing folder, got '.*nowhere': not found"
    ):
        run(tiny_cfg(tmp_path / "nowhere", tmp_path / "out"), "train")


def test_empty_class_folder_is_named(digits, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(digits, root)
    (root / "train" / "digit_9").mkdir()
    with pytest.raises(ValueError, match=r"digit_9 holds no image files"):
        run(tiny_cfg(root, tmp_path / "out"), "train")


def test_corrupt_image_error_names_file_and_skip_warns(digits, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(digits, root)
    bad = root / "train" / "digit_1" / "0003.png"
    bad.write_bytes(b"not a png")
    from vit3.data.folder import CorruptImageError

    with pytest.raises(CorruptImageError, match=r"0003\.png"):
        run(tiny_cfg(root, tmp_path / "out", "train.epochs=1"), "train")
    with pytest.warns(UserWarning, match=r"skipping corrupt image file .*0003\.png"):
        summary = run(
            tiny_cfg(root, tmp_path / "out2", "train.epochs=3", "data.corrupt_images=skip"), "train"
        )
    assert summary["final"]["val_top1"] > 60.0  # learns without the skipped image: measured 92%, chance 25%


def test_unknown_config_key_exits_with_close_matches(capsys):
    train = load_script("train")
    assert train.main(["train.epoch=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.epoch'" in err and "train.epochs" in err


@pytest.mark.slow
def test_torchrun_two_processes_agree(digits, tmp_path):
    out = tmp_path / "ddp"
    args = [
        "data.dataset=folder", f"data.path={digits}", f"output={out}", "data.batch_size=10", "train.epochs=3",
        "train.progress=false", *TINY_MODEL, "train.base_lr=2e-3", "train.lr_batch=20",
        "train.warmup_epochs=0",
        "train.ema=true", "aug.mixup=0.8",
    ]  # fmt: skip
    _, ckpt = torchrun_two_processes(args, out, timeout=600)
    assert len(ckpt["rng"]) == 2  # one RNG state per rank
    # 240 images / (2 ranks x 10) = 12 optimizer steps per epoch, and every val image counted once
    assert ckpt["global_step"] == 36
    # both ranks learnt together: measured 82% on the 100 val images (each counted once); chance is 25%
    assert json.loads((out / "metrics.json").read_text())[-1]["val_top1"] > 50.0


@pytest.mark.slow
def test_real_process_kill_then_bare_resume(digits, tmp_path):
    """The same resume check through train.py subprocesses, the first killed with SIGKILL (kill -9) mid-epoch,
    the second a bare ``train.py --resume FILE``."""
    args = [
        "data.dataset=folder", f"data.path={digits}", "data.batch_size=20", "train.epochs=2",
        "train.progress=false", "train.save_every_steps=4", "aug.mixup=0.8", "model.drop_path_rate=0.1",
        *TINY_MODEL,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def cmd(out, *extra):
        return [sys.executable, "train.py", f"output={out}", *args, *extra]

    def train(out, *extra):
        return subprocess.run(
            cmd(out, *extra), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )

    assert train(tmp_path / "a").returncode == 0
    # 12 steps per epoch, a checkpoint every 4: killed once one inside epoch 2 (step 16 or 20) is on disk
    left = kill_when_checkpoint(
        cmd(tmp_path / "b"), tmp_path / "b" / "last.pt",
        lambda c: c["epoch"] == 1 and c["batch_in_epoch"] > 0,
        cwd=REPO, env=env,
    )  # fmt: skip
    assert left["epoch"] == 1 and 0 < left["batch_in_epoch"] < 12, (left["epoch"], left["batch_in_epoch"])
    proc = subprocess.run(  # a bare resume: the run's own config and folder
        [sys.executable, "train.py", "--resume", str(tmp_path / "b" / "last.pt")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_tensors(
        _weights_and_state(tmp_path / "a" / "last.pt"), _weights_and_state(tmp_path / "b" / "last.pt")
    )


@pytest.mark.parametrize(("setting", "mode"), [("auto", None), ("default", "default")])
def test_train_compile_compiles_the_step_and_saves_the_plain_model(
    setting, mode, digits, tmp_path, monkeypatch
):
    """``train.compile`` runs the training step through ``torch.compile`` in the mode it names, while
    checkpoints keep the plain model's keys; ``auto`` on a CPU keeps the step eager (compiled, it is slower
    than the C++ kernels)."""
    calls = []
    real = torch.compile

    def compile_on_aot_eager(net, mode=None, **kwargs):
        calls.append(mode)
        return real(net, backend="aot_eager", **kwargs)  # Inductor's C++ build is minutes on this machine

    monkeypatch.setattr(torch, "compile", compile_on_aot_eager)
    run(tiny_cfg(digits, tmp_path / "run", "train.epochs=1", f"train.compile={setting}"), "train")
    assert calls == ([] if mode is None else [mode])
    keys = read_ckpt(tmp_path / "run" / "last.pt")["model"]
    assert keys and not any(k.startswith("_orig_mod") for k in keys)


def test_train_compile_mode_on_each_device():
    from vit3.engine.process import compile_mode

    assert compile_mode("auto", torch.device("cuda")) == "reduce-overhead"
    assert compile_mode("auto", torch.device("cpu")) is None
    assert compile_mode("max-autotune", torch.device("cpu")) == "max-autotune"
    assert compile_mode("none", torch.device("cuda")) is None
