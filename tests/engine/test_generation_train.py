"""train.py / eval.py for task generation (vit3.engine.generation): learning, exact resume, sampling files,
latent space, metrics and bad input."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest
import torch
from helpers import train as train_helpers
from helpers.generation import DEMO, tiny_gen_args, tiny_gen_cfg, write_tiny_vae

from vit3.engine import ConfigError, load_config, run
from vit3.engine.cli import USER_ERROR_EXIT
from vit3.engine.config import CONFIG_DIR
from vit3.engine.generation_metrics import classifier_metrics, inception_metrics
from vit3.errors import DataError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    """One short pixel-space run shared by the sampling tests: 3 epochs x 12 steps, EMA on."""
    out = tmp_path_factory.mktemp("gen")
    summary = run(tiny_gen_cfg(digits, out, "train.epochs=3"), "train")
    return out, summary


def test_short_run_on_real_digits_lowers_the_loss(trained):
    out, _ = trained
    curve = train_helpers.read_ckpt(out / "last.pt")["curve"]
    assert [c["step"] for c in curve] == list(range(2, 37, 2))
    first, last = curve[0], curve[-1]
    assert last["loss"] < 0.5 * first["loss"], (first, last)  # starts at ~1: the output layer is zero at init
    assert last["mse"] < first["mse"] and all(c["vb"] > 0 for c in curve)
    history = json.loads((out / "metrics.json").read_text())
    assert [r["epoch"] for r in history] == [1, 2, 3] and history[-1]["train_loss"] < history[0]["train_loss"]
    assert (out / "curves.png").stat().st_size > 1000
    ckpt = train_helpers.read_ckpt(out / "last.pt")
    assert ckpt["task"] == "generation" and ckpt["global_step"] == 36 and ckpt["ema"] is not None
    assert ckpt["model_kwargs"]["in_channels"] == 1 and ckpt["model_kwargs"]["num_classes"] == 4
    assert "git_commit" in (out / "config.yaml").read_text()


def _resumable(ckpt_path):
    ckpt = train_helpers.read_ckpt(ckpt_path)
    return {k: ckpt[k] for k in ("model", "ema", "optimizer", "scaler", "global_step", "epoch", "curve")}


def test_kill_and_bare_resume_matches_uninterrupted_run(digits, tmp_path, monkeypatch):
    """Timesteps, noise, label dropout and accumulation all draw on state that the resume must restore. The
    resume is a bare ``train.py --resume FILE``: the generation task and config come from the checkpoint."""
    recipe = (
        "train.accum_steps=2",
        "train.save_every_steps=2",
        "train.clip_grad=0.5",
        "model.class_dropout_prob=0.3",
    )
    full, killed, partial = train_helpers.crash_then_bare_resume(
        monkeypatch, lambda out: tiny_gen_cfg(digits, out, *recipe), tmp_path, 8
    )
    # 6 updates per epoch: it died in epoch 2 after the step-8 checkpoint
    assert (partial["epoch"], partial["batch_in_epoch"], partial["global_step"]) == (1, 4, 8)
    train_helpers.assert_same_tensors(_resumable(full / "last.pt"), _resumable(killed / "last.pt"))
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (full, killed))
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]


@pytest.mark.slow
def test_real_process_kill_then_bare_resume(digits, tmp_path):
    """train.py killed with SIGKILL (kill -9) inside epoch 2, then a bare ``train.py --resume FILE``: the
    generation task, config and folder come from the checkpoint, and the weights, EMA, optimizer state and
    loss curve equal an uninterrupted run's bit for bit."""
    args = tiny_gen_args(
        digits, tmp_path / "full", "train.save_every_steps=4", "model.class_dropout_prob=0.3"
    )
    run(load_config(DEMO, args), "train")  # uninterrupted (this process runs one thread, as the child does)
    killed = tmp_path / "killed"
    cmd = [sys.executable, "train.py", "--config", str(DEMO), *args, f"output={killed}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # 12 steps per epoch, a checkpoint every 4: killed once one inside epoch 2 (step 16 or 20) is on disk
    left = train_helpers.kill_when_checkpoint(
        cmd,
        killed / "last.pt",
        lambda c: c["epoch"] == 1 and c["batch_in_epoch"] > 0,
        cwd=train_helpers.REPO,
        env=env,
    )
    assert left["epoch"] == 1 and 0 < left["batch_in_epoch"] < 12, (left["epoch"], left["batch_in_epoch"])
    train_helpers.bare_resume(killed / "last.pt")
    train_helpers.assert_same_tensors(
        _resumable(tmp_path / "full" / "last.pt"), _resumable(killed / "last.pt")
    )


def test_resuming_from_a_classification_checkpoint_is_refused(digits, tmp_path):
    cls = tmp_path / "cls"
    run(train_helpers.tiny_cfg(digits, cls, "train.epochs=1"), "train")
    with pytest.raises(ConfigError, match=r"cannot resume a generation run from .*classification checkpoint"):
        run(tiny_gen_cfg(digits, tmp_path / "gen", f"train.resume={cls / 'last.pt'}"), "train")


# ----------------------------------------------------------------------------------------------- sampling
def _eval(checkpoint, out, *args: str) -> dict:
    eval_script = train_helpers.load_script("eval")
    assert eval_script.main(["--checkpoint", str(checkpoint), *args, f"sample.out={out}"]) == 0
    return json.loads((out / "eval.json").read_text())


def test_eval_samples_write_the_reference_suite_layout(trained, tmp_path):
    out, _ = trained
    args = [
        "--sampler",
        "ddim",
        "--steps",
        "3",
        "--cfg-scale",
        "2",
        "--num-samples",
        "6",
        "sample.batch_size=4",
    ]
    report = _eval(out / "last.pt", tmp_path / "a", *args)
    assert (report["sampler"], report["steps"], report["cfg_scale"], report["num_samples"]) == (
        "ddim",
        3,
        2.0,
        6,
    )
    npz = np.load(tmp_path / "a" / "samples.npz")
    assert npz["arr_0"].dtype == np.uint8 and npz["arr_0"].shape == (
        6,
        28,
        28,
        3,
    )  # grayscale repeated to RGB
    assert npz["labels"].tolist() == [0, 1, 2, 3, 0, 1]
    assert (tmp_path / "a" / "grid.png").stat().st_size > 200
    # same seed -> same images, whatever the batch size; another seed -> other images
    _eval(out / "last.pt", tmp_path / "b", *args, "sample.batch_size=6")
    assert np.array_equal(np.load(tmp_path / "b" / "samples.npz")["arr_0"], npz["arr_0"])
    _eval(out / "last.pt", tmp_path / "c", *args, "sample.seed=5")
    assert not np.array_equal(np.load(tmp_path / "c" / "samples.npz")["arr_0"], npz["arr_0"])


@pytest.mark.parametrize("use_ema", [True, False])
def test_the_final_samples_of_a_run_use_the_weights_sample_use_ema_names(digits, tmp_path, use_ema):
    """``train.final_eval`` samples the EMA or the raw weights as ``sample.use_ema`` says (the EMA always,
    before): the same images as ``eval.py`` sampling the run's last.pt with that setting."""
    out = tmp_path / "run"
    setting = f"sample.use_ema={str(use_ema).lower()}"
    sampling = ["sample.num_samples=3", "sample.sampler=ddim", "sample.steps=2", "metrics.classifier=null"]
    cfg = tiny_gen_cfg(digits, out, "train.epochs=1", "train.final_eval=true", setting, *sampling)
    final = np.load(run(cfg, "train")["eval"]["npz"])["arr_0"]
    args = [
        "--sampler",
        "ddim",
        "--steps",
        "2",
        "--num-samples",
        "3",
        "--cfg-scale",
        str(cfg.sample.cfg_scale),
    ]
    for weights in (True, False):
        _eval(out / "last.pt", tmp_path / str(weights), *args, f"sample.use_ema={str(weights).lower()}")
        again = np.load(tmp_path / str(weights) / "samples.npz")["arr_0"]
        assert np.array_equal(again, final) == (weights == use_ema)


def test_eval_default_folder_names_the_settings(trained):
    out, _ = trained
    eval_script = train_helpers.load_script("eval")
    assert (
        eval_script.main(
            ["--checkpoint", str(out / "last.pt"), "--sampler", "dpm++", "--steps", "2", "--num-samples", "2"]
        )
        == 0
    )
    report = json.loads((out / "samples_dpm++2_cfg2_n2_seed0" / "eval.json").read_text())
    assert report["sampler"] == "dpm++" and report["checkpoint"] == str(out / "last.pt")
    assert report["use_ema"] and report["sampled_classes"] is None
    # other weights or classes: another folder (they replaced the first's samples before), named in the report
    args = ["--checkpoint", str(out / "last.pt"), "--sampler", "dpm++", "--steps", "2", "--num-samples", "2"]
    assert eval_script.main([*args, "sample.use_ema=false", "sample.classes=[3]"]) == 0
    other = json.loads((out / "samples_dpm++2_cfg2_n2_seed0_classes3_raw" / "eval.json").read_text())
    assert not other["use_ema"] and other["sampled_classes"] == [3]
    assert json.loads((out / "samples_dpm++2_cfg2_n2_seed0" / "eval.json").read_text()) == report


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["sample.classes=[1, 7]"], r"sample.classes must be class indices in \[0, 3\]"),
        (["--sampler", "euler"], r"invalid choice: 'euler'"),
        (["vae.path=/nowhere/vae"], r"vae.path must be an existing folder .*, got '/nowhere/vae': not found"),
        (["data.channels=3"], r"trained on 1-channel inputs; this config gives 3"),
    ],
    ids=["classes-out-of-range", "unknown-sampler", "missing-vae", "wrong-channels"],
)
def test_bad_sampling_requests_are_named(trained, args, match, capsys):
    """Each mistake ends eval.py with one message naming it and the user-error exit code, no traceback."""
    out, _ = trained
    eval_script = train_helpers.load_script("eval")
    try:
        code = eval_script.main(["--checkpoint", str(out / "last.pt"), "--num-samples", "2", *args])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == USER_ERROR_EXIT
    assert re.search(match, err), err
    assert "Traceback" not in err


def test_guidance_needs_a_model_trained_with_label_dropout(digits, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"sample.cfg_scale=2.0 needs the null class"):
        run(tiny_gen_cfg(digits, tmp_path, "model.class_dropout_prob=0", "train.final_eval=true"), "train")
    out = tmp_path / "nocfg"
    run(
        tiny_gen_cfg(digits, out, "model.class_dropout_prob=0", "sample.cfg_scale=1", "train.epochs=1"),
        "train",
    )
    eval_script = train_helpers.load_script("eval")
    code = eval_script.main(
        ["--checkpoint", str(out / "last.pt"), "--cfg-scale", "3", "model.class_dropout_prob=0.1"]
    )
    assert code == USER_ERROR_EXIT
    assert "needs the null class" in capsys.readouterr().err


def test_contradicting_latent_channels_and_missing_vae_are_named(digits, tmp_path):
    with pytest.raises(
        ConfigError, match=r"model.kwargs.in_channels=4 contradicts the data \(in_channels=1\)"
    ):
        run(tiny_gen_cfg(digits, tmp_path, "model.kwargs.in_channels=4"), "train")
    with pytest.raises(
        ConfigError, match=r"vae.path must be an existing folder .*nothing is downloaded.*missing': not found"
    ):
        run(tiny_gen_cfg(digits, tmp_path, f"vae.path={tmp_path / 'missing'}"), "train")


def test_latent_training_and_sampling_through_a_local_vae(digits, tmp_path):
    vae = write_tiny_vae(tmp_path / "vae")
    out = tmp_path / "latent"
    cfg = tiny_gen_cfg(
        digits, out, f"vae.path={vae}", "data.channels=3", "train.epochs=1", "train.final_eval=true",
        "sample.num_samples=3", "sample.sampler=ddpm", "sample.steps=2",
    )  # fmt: skip
    summary = run(cfg, "train")
    kwargs = train_helpers.read_ckpt(out / "last.pt")["model_kwargs"]
    assert (kwargs["in_channels"], kwargs["input_size"]) == (4, 14)  # 28 px / 2, 4 latent channels
    assert np.load(summary["eval"]["npz"])["arr_0"].shape == (3, 28, 28, 3)
    assert summary["eval"]["checkpoint"] == str(out / "last.pt")  # the weights it sampled: the run's last
    with pytest.raises(ConfigError, match=r"multiple of the VAE's downsampling 2"):
        run(
            tiny_gen_cfg(digits, tmp_path / "odd", f"vae.path={vae}", "data.channels=3", "data.img_size=27"),
            "train",
        )


# ------------------------------------------------------------------------------------------------ metrics
@pytest.fixture(scope="module")
def classifier(digits, tmp_path_factory):
    """A tiny H-ViT³ digit classifier (the classification engine, 4 classes)."""
    out = tmp_path_factory.mktemp("clf")
    run(train_helpers.tiny_cfg(digits, out, "train.epochs=3"), "train")
    return out / "best.pt"


def _folder_digits(root, split: str, per_class: int):
    from PIL import Image

    real, labels = [], []
    for d in range(4):
        for f in sorted((root / split / f"digit_{d}").glob("*.png"))[:per_class]:
            real.append(np.asarray(Image.open(f))[..., None])
            labels.append(d)
    return np.stack(real), np.asarray(labels)


def test_classifier_metrics_tell_real_digits_from_noise(digits, classifier):
    real, labels = _folder_digits(digits, "train", 5)
    good = classifier_metrics(real, labels, classifier, batch_size=16, draws=4)
    noise = np.random.default_rng(0).integers(0, 256, real.shape, dtype=np.uint8)
    bad = classifier_metrics(noise, labels, classifier, batch_size=16, draws=4)
    assert good["class_accuracy"] > 60 and bad["class_accuracy"] < 50, (good, bad)
    assert set(good["per_class_accuracy"]) == {0, 1, 2, 3}
    assert good["frechet_distance"] < bad["frechet_distance"]
    assert good["real_images"] == {"train": 240, "val": 100} and good["floor_draws"] == 4


def test_real_floor_is_measured_at_the_sample_count(digits, classifier):
    """The floor and the ceiling come from as many real images as were generated, with their spread over
    the draws: smaller samples have a higher Fréchet floor (estimation bias)."""
    few = classifier_metrics(*_folder_digits(digits, "train", 4), classifier, batch_size=16, draws=6)
    many = classifier_metrics(*_folder_digits(digits, "train", 16), classifier, batch_size=16, draws=6)
    for r in (few, many):
        assert r["frechet_real_floor_min"] <= r["frechet_real_floor"] <= r["frechet_real_floor_max"]
        assert r["frechet_real_floor_std"] > 0 and 0 <= r["real_accuracy"] <= 100
    assert few["frechet_real_floor"] > many["frechet_real_floor"]
    assert few["real_val_accuracy"] == many["real_val_accuracy"]  # all the real images: independent of N
    with pytest.raises(ValueError, match=r"needs more real images than generated ones"):
        classifier_metrics(*_folder_digits(digits, "train", 25), classifier, batch_size=16)


def test_demo_scorer_trains_on_the_digits_the_generator_never_sees():
    from vit3.data import build_datasets
    from vit3.engine import load_config
    from vit3.engine.generation_metrics import DEMO_CLASSIFIER_CONFIG

    scorer = build_datasets(load_config(DEMO_CLASSIFIER_CONFIG), 1)
    generator = build_datasets(load_config(CONFIG_DIR / "generation" / "demo_mnist.yaml"), 1)
    assert len(scorer["train"]) == 1000 and set(scorer["train"].rows).isdisjoint(generator["train"].rows)
    assert set(scorer["val"].rows) == set(generator["train"].rows)  # real digits the scorer never sees
    bad = load_config(DEMO_CLASSIFIER_CONFIG, ["data.train_split=test"])
    with pytest.raises(DataError, match=r"data.train_split='test': data.dataset=mnist5k has the splits"):
        build_datasets(bad, 1)


def test_fid_without_inception_weights_says_why(tmp_path):
    report = inception_metrics(np.zeros((2, 8, 8, 3), np.uint8), [], str(tmp_path / "inception.pth"))
    assert report["fid"] is None and "does not exist" in report["fid_note"]
    assert "nothing is downloaded" in inception_metrics(np.zeros((2, 8, 8, 3), np.uint8), [], "")["fid_note"]


@pytest.mark.slow
def test_fid_and_inception_score_with_local_weights(tmp_path, monkeypatch):
    """torchmetrics' FID / IS read a local Inception file (random weights here: the plumbing, not the
    number)."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe

    with monkeypatch.context() as m:  # build the network once without weights to write a weights file
        m.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        m.setattr(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None)
        net = fe.FeatureExtractorInceptionV3("probe", ["2048"])
    torch.save(net.state_dict(), tmp_path / "inception.pth")
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (6, 32, 32, 1), dtype=np.uint8)
    same = inception_metrics(a, [a], str(tmp_path / "inception.pth"), batch_size=3)
    other = inception_metrics(a, [255 - a], str(tmp_path / "inception.pth"), batch_size=3)
    assert abs(same["fid"]) < 1e-2 and other["fid"] > same["fid"]
    assert same["is_mean"] >= 1.0 and same["fid_reference_images"] == 6


@pytest.mark.slow
def test_torchrun_two_processes_train_and_sample(digits, tmp_path):
    out = tmp_path / "ddp"
    args = [
        "--config", "configs/generation/demo_mnist.yaml", "data.dataset=folder", f"data.path={digits}",
        f"output={out}", "data.batch_size=10", "train.epochs=1", "train.progress=false",
        "metrics.classifier=",
        "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "sample.num_samples=5", "sample.steps=2",
    ]  # fmt: skip
    _, ckpt = train_helpers.torchrun_two_processes(args, out, timeout=900)
    assert ckpt["global_step"] == 12  # 240 images / (2 ranks x 10)
    npz = np.load(out / "samples" / "samples.npz")
    assert npz["labels"].tolist() == [0, 1, 2, 3, 0]  # both ranks' shards, back in sample order


def test_eval_samples_from_an_official_file_named_by_model_and_config(trained, tmp_path, capsys):
    """A bare official-format state dict (official mixer names, its pos_embed table) samples through
    eval.py."""
    from helpers.generation import TINY_DIT

    from vit3.models.dit3 import sincos_pos_embed_2d

    out, _ = trained
    state = {}
    for k, v in train_helpers.read_ckpt(out / "last.pt")["ema"].items():
        for ours, theirs in (("inner.0.w1", "w1"), ("inner.0.w2", "w2"), ("inner.1.weight", "w3")):
            k = k.replace(f"attn.{ours}", f"attn.{theirs}")
        state[k] = v
    state["pos_embed"] = sincos_pos_embed_2d(32, (7, 7))[None]
    torch.save(state, tmp_path / "official.pt")
    eval_script = train_helpers.load_script("eval")
    options = ["--checkpoint", str(tmp_path / "official.pt"), "--config", str(DEMO), "--num-samples", "4"]
    overrides = [*TINY_DIT, "model.num_classes=4", "metrics.classifier=", f"sample.out={tmp_path / 's'}"]
    args = [*options, "--steps", "2", *overrides]
    assert eval_script.main(args) == 0
    assert np.load(tmp_path / "s" / "samples.npz")["arr_0"].shape == (4, 28, 28, 3)
    assert eval_script.main([*args, "model.num_classes=null"]) == USER_ERROR_EXIT  # later overrides win
    assert "set model.num_classes" in capsys.readouterr().err
