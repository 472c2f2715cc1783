"""Fine-tuning on a small image folder out of the box (configs/finetune.yaml, vit3.engine.recipe): the batch
fitted to the data (the lrs follow it: ``test_optim.py``), enough optimizer steps for a tiny folder,
layer-wise lr decay groups, the linear probe (frozen backbone), and the README's fine-tune command run as
written on a folder of real photographs."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import timm
import torch
import yaml
from helpers.common import load_benchmark
from helpers.train import DEMO, Crashed, crash_after_checkpoint, load_script, read_ckpt, tiny_cfg
from PIL import Image

import vit3.models  # noqa: F401  (registers the models)
from vit3.data.samples import main as sample_folder_main
from vit3.data.samples import make_photo_folder
from vit3.engine import Config, ConfigError, load_config, run
from vit3.engine.config import CONFIG_DIR, WRITTEN_KEY, config_from_dict, written_keys
from vit3.engine.optim import build_optimizer
from vit3.engine.recipe import fit_batch_size, fit_epochs, freeze_for_training
from vit3.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

FINETUNE = CONFIG_DIR / "finetune.yaml"
# The demo's architecture (configs/demo_mnist.yaml): what the README fine-tunes.
DEMO_MODEL = load_config(DEMO).model


def _recipe(*defaults: str, written: tuple[str, ...] = ()) -> Config:
    """configs/finetune.yaml with ``defaults`` (``key=value``) as its own values, left to the recipe to fit,
    and ``written`` as what the user wrote on the command line."""
    data = load_config(FINETUNE, defaults).to_dict()
    data.pop(WRITTEN_KEY, None)
    return config_from_dict(data, written)


@pytest.fixture(scope="module")
def pretrained(digits, tmp_path_factory):
    """A tiny one-channel H-ViT³ trained briefly on real digits (`python train.py`'s output, in miniature)."""
    out = tmp_path_factory.mktemp("pretrained")
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        run(tiny_cfg(digits, out, "train.epochs=2"), "train")
    return out / "best.pt"


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Three classes of real photographs (one per sample photo), 16 training / 6 val crops each."""
    return make_photo_folder(tmp_path_factory.mktemp("photos"), n_train=16, n_val=6, classes=3)


# ------------------------------------------------------------------------------------ the sample folder
@pytest.mark.parametrize(
    ("classes", "names"),
    [
        pytest.param(3, ["china", "flower", "hopper"], id="one-class-per-photograph"),
        pytest.param(
            6, [f"{p}_{h}" for p in ("china", "flower", "hopper") for h in ("left", "right")], id="halves"
        ),
    ],
)
def test_the_sample_folder_holds_crops_of_the_shipped_photographs(classes, names, tmp_path):
    assert sample_folder_main([str(tmp_path), "--classes", str(classes), "--train", "3", "--val", "2"]) == 0
    for split, n in (("train", 3), ("val", 2)):
        assert sorted(d.name for d in (tmp_path / split).iterdir()) == names
        files = sorted((tmp_path / split / names[0]).iterdir())
        assert len(files) == n and Image.open(files[0]).size == (64, 64)
    with pytest.raises(UserError, match="3 or 6 classes, not 4"):
        make_photo_folder(tmp_path, classes=4)


# ------------------------------------------------------------------------------------------ batch fitting
@pytest.mark.parametrize(
    ("images", "fit", "mixup", "expected"),
    [
        pytest.param(48, 8, True, 6, id="48-images-6-per-batch"),
        pytest.param(40, 8, True, 4, id="mixup-rounds-5-down-to-even-4"),
        pytest.param(40, 8, False, 5, id="no-mixup-keeps-5"),
        pytest.param(5, 8, True, 2, id="too-few-images-for-8-batches-mixup-pairs-2"),
        pytest.param(5, 8, False, 2, id="too-few-images-for-8-batches-2-for-batchnorm"),
        pytest.param(1, 8, False, 1, id="one-image-one-batch"),
        pytest.param(512, 8, True, 64, id="enough-images-keep-the-batch"),
        pytest.param(1_281_167, 8, True, 64, id="imagenet-keeps-the-batch"),
        pytest.param(48, 0, True, 64, id="fit-off-keeps-the-batch"),
    ],
)
def test_fit_batch_gives_a_small_folder_enough_batches_per_epoch(images, fit, mixup, expected):
    cfg = _recipe("data.batch_size=64", f"data.fit_batch={fit}")
    note = fit_batch_size(cfg, images, even=mixup)
    assert cfg.data.batch_size == expected
    if expected == 64:
        assert note is None
    else:
        assert note.startswith(
            f"data.batch_size: 64 -> {expected} (fitted, data.fit_batch={fit}: {images} training images"
        )
        fit_batch_size(cfg, images, even=mixup)  # a fitted config fits to itself (resuming changes nothing)
        assert cfg.data.batch_size == expected


@pytest.mark.parametrize("key", ["data.fit_batch", "train.min_steps"])
def test_a_negative_fit_target_is_refused_naming_the_key(key):
    with pytest.raises(ConfigError, match=rf"config key {key} must be >= 0, got -1"):
        load_config(None, [f"{key}=-1"])


def test_without_fit_batch_a_batch_above_the_images_names_the_fix(photos, tmp_path):
    cfg = load_config(FINETUNE, [f"data.path={photos}", "data.fit_batch=0", "model.name=test_h_vit3"])
    cfg.output = str(tmp_path / "out")
    with pytest.raises(
        Exception, match=r"data.batch_size=64 exceeds the 48 training images .*data.fit_batch"
    ):
        run(cfg, "train")


# ----------------------------------------------------------------------------------------------- epochs
@pytest.mark.parametrize(
    ("updates_per_epoch", "epochs", "warmup"),
    [
        pytest.param(8, 75, 5.0, id="tiny-folder-stretched-to-600-steps"),
        pytest.param(7, 86, 86 * 2 / 30, id="rounded-up"),
        pytest.param(20, 30, 2.0, id="600-steps-in-30-epochs-stay"),
        pytest.param(20_000, 30, 2.0, id="imagenet-stays"),
    ],
)
def test_min_steps_gives_a_tiny_folder_more_epochs_with_the_warmup_share_kept(
    updates_per_epoch, epochs, warmup
):
    cfg = _recipe("train.epochs=30", "train.warmup_epochs=2", "train.min_steps=600")
    note = fit_epochs(cfg, updates_per_epoch)
    assert cfg.train.epochs == epochs and cfg.train.warmup_epochs == pytest.approx(warmup)
    assert cfg.train.epochs * updates_per_epoch >= 600
    assert (note is None) == (epochs == 30)
    fit_epochs(cfg, updates_per_epoch)
    assert cfg.train.epochs == epochs  # idempotent


# ------------------------------------------------------------------------------------ what the user wrote
def test_written_epochs_and_batch_are_kept_and_logged_as_written():
    """`train.epochs=4 data.batch_size=30` on 144 training images (the recipe would fit 18 and 150): both
    kept, each logged as written (before: 150 epochs of batch 18, logged as fitted values)."""
    cfg = load_config(FINETUNE, ["train.epochs=4", "data.batch_size=30"])
    assert fit_batch_size(cfg, 144, even=True) == (
        "data.batch_size=30 as written (4 batches per epoch; not fitted to data.fit_batch)"
    )
    assert (
        fit_epochs(cfg, 144 // 30)
        == "train.epochs=4 as written (16 optimizer steps; not fitted to train.min_steps)"
    )
    assert (cfg.data.batch_size, cfg.train.epochs, cfg.train.warmup_epochs) == (30, 4, 2)


def test_a_written_warmup_is_kept_while_the_epochs_are_fitted():
    cfg = _recipe("train.epochs=30", "train.min_steps=600", written=("train.warmup_epochs=1",))
    assert fit_epochs(cfg, 8) == (
        "train.epochs: 30 -> 75, train.warmup_epochs=1 as written (fitted, train.min_steps=600 at 8 steps "
        "per "
        "epoch)"
    )
    assert (cfg.train.epochs, cfg.train.warmup_epochs) == (75, 1)


def test_values_in_the_users_own_config_file_are_written_too(tmp_path):
    """A file of the user's (over configs/finetune.yaml, through a base: chain of the user's files): its
    values are the user's; the shipped recipe's stay the recipe's to fit."""
    (tmp_path / "mine.yaml").write_text(f"base: {FINETUNE}\ntrain: {{epochs: 10}}\n")
    (tmp_path / "run.yaml").write_text("base: mine.yaml\ndata: {batch_size: 12}\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert {"train.epochs", "data.batch_size"} <= written_keys(cfg)
    assert not {"train.min_steps", "data.fit_batch", "train.warmup_epochs"} & written_keys(cfg)
    fit_batch_size(cfg, 48, even=True)
    fit_epochs(cfg, 48 // 12)
    assert (cfg.data.batch_size, cfg.train.epochs) == (12, 10)


@pytest.mark.parametrize(
    ("written", "fit", "message"),
    [
        pytest.param(
            ("data.batch_size=30",), "batch",
            r"^data.batch_size=30 exceeds the 24 training images per process: write at most 24, or leave "
            r"data.batch_size to the recipe \(data.fit_batch=8 fits 2\)$",
            id="batch-above-the-images",
        ),
        pytest.param(
            ("data.batch_size=12", "data.fit_batch=8"), "batch",
            r"^data.batch_size=12 and data.fit_batch=8 are both written, but 24 training images per process "
            r"make "
            r"2 batches of 12 per epoch: drop one of them$",
            id="batch-and-fit-batch",
        ),
        pytest.param(
            ("train.epochs=4", "train.min_steps=600"), "epochs",
            r"^train.epochs=4 and train.min_steps=600 are both written, but 4 epochs of 3 optimizer steps "
            r"make "
            r"12: drop one of them$",
            id="epochs-and-min-steps",
        ),
    ],
)  # fmt: skip
def test_a_written_value_the_recipe_cannot_honour_is_refused_in_one_line(written, fit, message):
    cfg = load_config(FINETUNE, written)
    with pytest.raises(ConfigError, match=message):
        fit_batch_size(cfg, 24, even=True) if fit == "batch" else fit_epochs(cfg, 3)


def test_a_fine_tune_runs_the_written_epochs_at_the_written_batch(pretrained, photos, tmp_path, capsys):
    """`train.epochs=2 data.batch_size=12` on the 48 photos: 2 epochs of 4 batches (8 optimizer steps), as
    the checkpoint's config and metrics say; the log says both were kept as written (before: 75 epochs of
    batch 6, the command's values replaced)."""
    overrides = [
        f"data.path={photos}", f"model.pretrained={pretrained}", f"output={tmp_path / 'ft'}",
        "train.epochs=2",
        "data.batch_size=12", "train.warmup_epochs=0", "train.progress=false", "data.num_workers=0",
    ]  # fmt: skip
    run(load_config(FINETUNE, overrides), "train")
    out = capsys.readouterr().out
    assert "data.batch_size=12 as written (4 batches per epoch; not fitted to data.fit_batch)" in out
    assert "train.epochs=2 as written (8 optimizer steps; not fitted to train.min_steps)" in out
    history = json.loads((tmp_path / "ft" / "metrics.json").read_text())
    assert [row["step"] for row in history] == [4, 8]
    saved = read_ckpt(tmp_path / "ft" / "last.pt")["config"]
    assert (saved["data"]["batch_size"], saved["train"]["epochs"]) == (12, 2)
    assert {"train.epochs", "data.batch_size"} <= set(saved[WRITTEN_KEY])


def test_a_fitted_run_resumes_with_the_command_that_started_it(pretrained, photos, tmp_path, monkeypatch):
    """The checkpoint holds the fitted batch and epochs; the same command fits them alike, so resuming is not
    refused as a change of the data stream (batch 64 -> 6) and continues to the fitted end. (The recipe's
    epochs and steps cut to 2 and 24 to keep it short.)"""
    recipe = ("train.epochs=2", "train.min_steps=24")
    overrides = [
        f"data.path={photos}", f"model.pretrained={pretrained}", f"output={tmp_path / 'ft'}",
        "train.progress=false", "data.num_workers=0",
    ]  # fmt: skip
    with monkeypatch.context() as m:
        crash_after_checkpoint(m, global_step=8)  # the end of the first of the three fitted epochs
        with pytest.raises(Crashed):
            run(_recipe(*recipe, written=tuple(overrides)), "train")
    resume = f"train.resume={tmp_path / 'ft' / 'last.pt'}"
    run(_recipe(*recipe, written=(*overrides, resume)), "train")
    history = json.loads((tmp_path / "ft" / "metrics.json").read_text())
    assert [row["step"] for row in history] == [8, 16, 24]


# ----------------------------------------------------------------------------- layer decay, linear probe
def _lr_scales(opt) -> dict[int, float]:
    return {id(p): g["lr_scale"] for g in opt.param_groups for p in g["params"]}


def test_layer_decay_groups_of_the_demo_model_follow_its_depth():
    """H-ViT³'s group_matcher through timm's param_groups_layer_decay: one layer per block (a stage's
    downsampling with its first block), the stem lowest, the new classifier at the full lr, each layer
    decay x the next one's."""
    model = timm.create_model(DEMO_MODEL.name, num_classes=3, **DEMO_MODEL.kwargs)
    opt = build_optimizer(model, load_config(FINETUNE).train, 1e-3)
    scale = _lr_scales(opt)
    named = dict(model.named_parameters())
    assert len(scale) == len(named)  # every parameter once
    by_name = {n: scale[id(p)] for n, p in named.items()}
    layers = [*dict.fromkeys(by_name.values())]  # distinct scales in parameter (= depth) order
    depth = 1 + sum(DEMO_MODEL.kwargs["depths"]) + 1  # the stem, each block, the classifier
    assert layers == sorted(layers) and len(layers) == depth
    for low, high in itertools.pairwise(layers):
        assert low == pytest.approx(0.75 * high)
    assert by_name["head.weight"] == 1.0 and by_name["stem.0.conv.weight"] == layers[0]
    assert by_name["stages.1.downsample.0.conv.weight"] == by_name["stages.1.blocks.0.norm1.weight"]
    assert by_name["stages.2.blocks.0.norm1.weight"] < by_name["stages.2.blocks.1.norm1.weight"]


def test_a_frozen_backbone_leaves_only_the_classifier_to_the_optimizer():
    model = timm.create_model(DEMO_MODEL.name, num_classes=3, **DEMO_MODEL.kwargs)
    assert freeze_for_training(model, "backbone") == ["head.weight", "head.bias"]
    opt = build_optimizer(model, load_config(FINETUNE).train, 1e-3)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(model.head.weight), id(model.head.bias)}
    assert set(_lr_scales(opt).values()) == {1.0}  # the classifier keeps the full lr under layer decay
    assert all(not p.requires_grad for n, p in model.named_parameters() if not n.startswith("head."))
    with pytest.raises(ConfigError, match=r"train.freeze must be one of none, backbone, got 'stem'"):
        freeze_for_training(model, "stem")


def test_the_linear_probe_trains_the_classifier_alone(pretrained, photos, tmp_path):
    """train.freeze=backbone: every backbone weight and BatchNorm statistic ends as loaded, and the classifier
    trains (the optimizer holds state for its weight and bias alone)."""
    overrides = [
        f"data.path={photos}", f"model.pretrained={pretrained}", f"output={tmp_path / 'lp'}",
        "train.freeze=backbone",
        "train.progress=false", "data.num_workers=0",
    ]  # fmt: skip
    run(_recipe("train.min_steps=16", "train.epochs=1", written=tuple(overrides)), "train")
    ckpt, source = read_ckpt(tmp_path / "lp" / "last.pt"), read_ckpt(pretrained)["model"]
    for k, v in ckpt["model"].items():
        if not k.startswith("head."):
            assert torch.equal(v, source[k]), k
    assert ckpt["model"]["head.weight"].shape == (3, source["head.weight"].shape[1])
    assert len(ckpt["optimizer"]["state"]) == 2
    assert ckpt["config"]["train"]["epochs"] > 1  # fitted: 16 steps of 8 batches per epoch


# --------------------------------------------------------------------------------- the README's example
@pytest.mark.slow
def test_the_readme_finetune_example_runs_as_written_on_a_small_photo_folder(
    pretrained, tmp_path, monkeypatch, capsys
):
    """The README's sample-folder and fine-tune commands, as written, in a folder holding the demo's
    `output/demo/best.pt` (here a tiny stand-in): the batch is fitted to the 48 training images, logged and
    saved in the resolved config, and the run learns. (Before: `error: data.batch_size=64 exceeds the 48
    training images per process`.) Only the epochs are cut (written: kept as written, not fitted to the
    recipe's 600 steps) to keep the test short; benchmarks/finetune.py runs the whole recipe."""
    bench = load_benchmark("finetune")
    samples = next(a for a in bench.readme_commands() if a[:3] == ["python", "-m", "vit3.data.samples"])
    finetune = bench.readme_finetune_command()
    assert "data.path=photos" in finetune and "model.pretrained=output/demo/best.pt" in finetune
    monkeypatch.chdir(tmp_path)
    (tmp_path / "output" / "demo").mkdir(parents=True)
    shutil.copy(pretrained, "output/demo/best.pt")
    assert sample_folder_main(samples[3:]) == 0
    assert load_script("train").main([*finetune[2:], "train.epochs=12", "train.warmup_epochs=3"]) == 0
    out = capsys.readouterr().out
    assert (
        "data.batch_size: 64 -> 6 (fitted, data.fit_batch=8: 48 training images per process, 8 batches per "
        "epoch)" in out
    )
    assert "train.epochs=12 as written (96 optimizer steps; not fitted to train.min_steps)" in out
    assert "total batch 6, lr 0.000433 (train.base_lr 0.004 x 0.1083, sqrt in the batch)" in out
    run_dir = tmp_path / "output" / "finetune"
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (cfg["data"]["batch_size"], cfg["train"]["epochs"], cfg["train"]["warmup_epochs"]) == (6, 12, 3.0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"]["val_top1"] > 100 / 3
