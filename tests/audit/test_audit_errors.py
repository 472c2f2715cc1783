"""No crash, one line for every mistake (issue 49): a mistake in what a user gives is one ``error:`` line
naming the key, flag or file and what is allowed (exit code 2; in the Python API a clear exception of one
line), never a traceback, a crash (SIGFPE) or a line that misnames the problem; an empty batch gives the
empty result timm's models give. The cases that ended so before are here, and the mistakes a new user makes
that already got their one line (kept so). Grouped by what each protects: the command line and configs of
every command (train.py, eval.py, export.py, vit3-explain, python -m vit3.ablate, python -m
vit3.data.samples), checkpoints, data (image folders, COCO, ADE20K), the Python API, signals and the disk.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from helpers.common import REPO
from helpers.dense import det_args, seg_args
from helpers.generation import DEMO as GEN_DEMO
from helpers.generation import tiny_gen_args
from helpers.train import TINY_MODEL, load_script, make_digit_folder, one_error_line
from PIL import Image

import vit3
from vit3 import ablate
from vit3.ablate import ABLATIONS_DIR
from vit3.engine.cli import INTERRUPTED_EXIT, TERMINATED_EXIT, USER_ERROR_EXIT, ArgumentParser, run_cli
from vit3.engine.config import CONFIG_DIR
from vit3.errors import ConfigError
from vit3.layers.ttt import TTTMixer
from vit3.scripts import explain as explain_script

pytestmark = pytest.mark.usefixtures("one_thread")

FINETUNE = CONFIG_DIR / "finetune.yaml"


def _onnx(out: str, *extra: str) -> list[str]:
    """``export.py onnx`` of the classifier fixture into ``out``, then ``extra``."""
    return ["onnx", "--checkpoint", "<classifier>", "--out", out, *extra]


def _features(images: str, out: str, *extra: str) -> list[str]:
    """``export.py features`` of the classifier fixture on ``images`` into ``out``, then ``extra``."""
    return ["features", "--checkpoint", "<classifier>", "--images", images, "--out", out, *extra]


# export.py features of the classifier fixture on the digits' val split, into a new folder
FEATURES = _features("<digits>/val", "<tmp>/f")
# timm's own test ViT cut to two blocks: fewer than the three its features take by default.
TWO_BLOCK_VIT = [
    "model.name=test_vit3",
    "model.kwargs={img_size: 32, in_chans: 1, depth: 2}",
    "data.img_size=32",
]


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1), n_train=12, n_val=4)


def _run(digits: Path, out: Path, *extra: str, model: list[str] = TINY_MODEL) -> list[str]:
    """``train.py`` arguments of a one-epoch run on the digits (a few CPU seconds)."""
    return [
        "data.dataset=folder", f"data.path={digits}", f"output={out}", "data.batch_size=8", "train.epochs=1",
        "train.warmup_epochs=0", "train.progress=false", *model, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def classifier(digits, tmp_path_factory) -> Path:
    """The best.pt of a one-epoch classification run of a two-block ViT."""
    out = tmp_path_factory.mktemp("classifier") / "run"
    with torch.random.fork_rng():
        assert load_script("train").main(_run(digits, out, model=TWO_BLOCK_VIT)) == 0
    return out / "best.pt"


@pytest.fixture(scope="module")
def generator(digits, tmp_path_factory) -> Path:
    """The last.pt of a one-epoch generation run (a tiny DiT³ on the digits)."""
    out = tmp_path_factory.mktemp("generator") / "run"
    args = ["--config", str(GEN_DEMO), *tiny_gen_args(digits, out, "train.epochs=1")]
    with torch.random.fork_rng():
        assert load_script("train").main(args) == 0
    return out / "last.pt"


@pytest.fixture(scope="module")
def detector(coco_root, tmp_path_factory) -> Path:
    """The last.pt of a one-epoch detection run on the COCO digits."""
    out = tmp_path_factory.mktemp("detector") / "run"
    args = ["--config", str(CONFIG_DIR / "dense" / "demo_detection.yaml"), *det_args(coco_root, out)]
    with torch.random.fork_rng():
        assert load_script("train").main([*args, "train.epochs=1", "train.eval_every=1"]) == 0
    return out / "last.pt"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Files that are no vit3 checkpoint: empty, random bytes, a config, a bare state dict, a folder."""
    root = tmp_path_factory.mktemp("files")
    (root / "empty.pt").write_bytes(b"")
    (root / "random.pt").write_bytes(bytes(range(256)) * 4)
    (root / "config.yaml").write_text("train:\n  epochs: 1\n")
    torch.save({"a": torch.ones(2)}, root / "foreign.pt")
    (root / "folder").mkdir()
    return {p.stem: p for p in root.iterdir()}


def _fill(args: list[str], **paths: Path) -> list[str]:
    """``args`` with each ``<name>`` replaced by ``paths[name]``."""
    for name, path in paths.items():
        args = [a.replace(f"<{name}>", str(path)) for a in args]
    return args


# ----------------------------------------------------------------------------------- command line, configs
# (script, arguments, what the one line says)
CLI_MISTAKES = {
    "config-without-base": (
        "train", ["--config", "<tmp>/mine.yaml", "output=<tmp>/out"],
        "config file <tmp>/mine.yaml lacks task, seed, output, device, threads, deterministic, ... (11 "
        "keys): a run "
        f"config builds on a shipped one; begin it with 'base: {CONFIG_DIR / 'default.yaml'}'",
    ),
    "config-without-base-no-overrides": (
        "train", ["--config", "<tmp>/mine.yaml"], "config file <tmp>/mine.yaml lacks task, seed, output",
    ),
    "empty-config": ("train", ["--config", "<tmp>/empty.yaml", "output=<tmp>/out"], "config file "
        "<tmp>/empty.yaml is empty"),
    "config-folder": ("train", ["--config", "<tmp>"], "config file <tmp> is a folder: give a YAML file"),
    "resume-folder": (
        "train", ["--resume", "<run>"], "checkpoint <run> is a folder: give the checkpoint file (e.g. "
                                        "<run>/last.pt)",
    ),
    "resume-a-config": (
        "train", ["--resume", "<run>/config.yaml"],
        "<run>/config.yaml is a text file (",
    ),
    "sampler-of-a-classifier": (
        "eval", ["--checkpoint", "<classifier>", "--sampler", "ddim"],
        "--sampler (sample.sampler) applies to generation checkpoints; <classifier> is a classification "
        "checkpoint",
    ),
    "cfg-scale-of-a-detector": (
        "eval", ["--checkpoint", "<detector>", "--cfg-scale", "2"],
        "--cfg-scale (sample.cfg_scale) applies to generation checkpoints; <detector> is a detection "
        "checkpoint",
    ),
    "img-size-of-a-generator": (
        "eval", ["--checkpoint", "<generator>", "--img-size", "64"],
        "--img-size sets classification resolutions; <generator> is a generation checkpoint",
    ),
    "cfg-scale-nan": (
        "eval", ["--checkpoint", "<generator>", "--cfg-scale", "nan"],
        "config key sample.cfg_scale (eval.py --cfg-scale) must be a finite number >= 0, got 'nan'",
    ),
    "base-lr-inf": ("train", ["train.base_lr=.inf"], "config key train.base_lr must be a finite number > 0, "
                                                     "got inf"),
    "base-lr-nan": ("train", ["train.base_lr=.nan"], "config key train.base_lr must be a finite number > 0, "
                                                     "got nan"),
    "num-classes-in-kwargs": (
        "train", ["model.kwargs.num_classes=4"],
        "model.kwargs.num_classes=4: vit3 passes num_classes to test_h_vit3 itself; leave it out of "
        "model.kwargs "
        "and set model.num_classes",
    ),
    "num-classes-in-kwargs-eval": (
        "eval", ["--checkpoint", "<classifier>", "model.kwargs.num_classes=4"],
        "model.kwargs.num_classes=4: vit3 passes num_classes to test_vit3 itself",
    ),
    "img-size-beyond-any-memory": (
        "train", ["data.img_size=10000000"],
        "config key data.img_size must be image sizes test_h_vit3 can run on cpu, got 10000000: one image of "
        "that "
        "size needs more memory than there is",
    ),
    "batch-of-one-with-batchnorm": (
        "train", ["data.batch_size=1"],
        "data.batch_size=1: a BatchNorm layer of test_h_vit3 gets one value per channel in training",
    ),
    "divergence": (
        "train", ["train.base_lr=1e30"],
        "of 3): the run diverged; lower train.base_lr (now 1e+30), lower train.clip_grad (now 5) or lengthen "
        "train.warmup_epochs",
    ),
    "explain-typo": ("explain", ["vit3_tinyy"], "got 'vit3_tinyy': did you mean vit3_tiny"),
    "explain-image-too-small": (
        "explain", ["vit3_tiny", "--img-size", "8"],
        "--img-size must be an image size vit3_tiny takes, got 8: image 8x8 is too small",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("script", "args", "message"), CLI_MISTAKES.values(), ids=CLI_MISTAKES.keys())
def test_a_command_line_mistake_is_one_line(script, args, message, digits, request, tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("model:\n  name: test_h_vit3\ntrain:\n  epochs: 1\n")
    (tmp_path / "empty.yaml").write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("output: somewhere\n")
    (run / "last.pt").write_bytes(b"")
    paths = {"tmp": tmp_path, "run": run}
    paths |= {name: request.getfixturevalue(name) for name in ("classifier", "detector", "generator")
              if f"<{name}>" in " ".join(args) + message}  # fmt: skip
    args = _fill(args, **paths)
    if script == "train" and not any(a.startswith("--") for a in args):
        args = _run(digits, tmp_path / "out", *args)
    main = explain_script.main if script == "explain" else load_script(script).main
    assert main(args) == USER_ERROR_EXIT
    assert _fill([message], **paths)[0] in one_error_line(capsys, last=True)


# A user's inputs beside the run: files and folders the mistakes below name (``<tmp>/...``), and data folders
# built from the digits (``<name>``: a copy changed by ``DATA_VARIANTS[name]``).
def _empty_class(data: Path) -> None:
    (data / "train" / "digit_9").mkdir()


def _unknown_val_class(data: Path) -> None:
    (data / "val" / "digit_7").mkdir()
    shutil.copy(data / "val" / "digit_0" / "0000.png", data / "val" / "digit_7")


DATA_VARIANTS = {
    "empty_class": _empty_class,
    "val_extra": _unknown_val_class,
    "no_val": lambda data: shutil.rmtree(data / "val"),
}


def _scene(tmp: Path, digits: Path, args: list[str], message: str) -> dict[str, Path]:
    """Writes what a case names into ``tmp``; returns the placeholders and their paths."""
    (tmp / "notes.txt").write_text("the user's own notes\n")
    (tmp / "empty").mkdir()
    (tmp / "bad.yaml").write_text("model: [unclosed\n")
    (tmp / "list.yaml").write_text("- a\n- b\n")
    (tmp / "glued.yaml").write_text(
        f"base: {CONFIG_DIR / 'demo_mnist.yaml'}\nmodel:\n  kwargs: {{img_size:32}}\n"
    )
    paths = {"tmp": tmp}
    for name, change in DATA_VARIANTS.items():
        if f"<{name}>" in " ".join(args) + message:
            paths[name] = tmp / name
            shutil.copytree(digits, paths[name])
            change(paths[name])
    return paths


# (script, arguments, what the one line says). "train": the arguments follow those of a one-epoch run on the
# digits (a later override wins) unless they hold a flag; "train-gen": those of the generation demo's.
MORE_CLI_MISTAKES = {
    "override-without-value": (
        "train",
        ["train.epochs"],
        "bad override 'train.epochs': expected key.sub=value",
    ),
    "unknown-flag": ("train", ["--epochs", "3"], "unrecognized arguments: --epochs"),
    "config-not-found": ("train", ["--config", "<tmp>/nope.yaml"], "config file not found: <tmp>/nope.yaml"),
    "config-not-yaml": (
        "train",
        ["--config", "<tmp>/bad.yaml"],
        "cannot parse config file <tmp>/bad.yaml: line 2, column 1: while parsing a flow sequence, expected "
        "',' or ']', but got '<stream end>'",
    ),
    "config-a-list": (
        "train",
        ["--config", "<tmp>/list.yaml"],
        "config file <tmp>/list.yaml must hold a mapping at the top level, got list",
    ),
    "glued-colon-in-a-config-file": (
        "train",
        ["--config", "<tmp>/glued.yaml"],
        "config file <tmp>/glued.yaml: YAML reads 'img_size:32' as one key without a value: write a space "
        "after the colon (img_size: 32)",
    ),
    "epochs-a-fraction": (
        "train",
        ["train.epochs=1.5"],
        "config key train.epochs must be an integer, got 1.5",
    ),
    "batch-a-word": (
        "train",
        ["data.batch_size=abc"],
        "config key data.batch_size must be an integer, got 'abc'",
    ),
    "batch-zero": ("train", ["data.batch_size=0"], "config key data.batch_size must be >= 1, got 0"),
    "img-size-negative": ("train", ["data.img_size=-32"], "config key data.img_size must be >= 1, got -32"),
    "threads-negative": (
        "train",
        ["threads=-1"],
        "config key threads must be >= 1 (or null: torch's default), got -1",
    ),
    "amp-unknown": (
        "train",
        ["train.amp=fp8"],
        "config key train.amp must be one of auto, none, bf16, fp16, got 'fp8'",
    ),
    "model-name-typo": ("train", ["model.name=vit3_tinny"], "got 'vit3_tinny': did you mean vit3_tiny"),
    "kwarg-unknown": (
        "train",
        ["model.kwargs.bogus=1"],
        "model.kwargs.bogus is not an argument of test_h_vit3",
    ),
    "kwargs-a-list": (
        "train",
        ["model.kwargs=[1]"],
        "config key model.kwargs must be a mapping (key: value), got [1]",
    ),
    "kwargs-heads-zero": (
        "train",
        ["model.kwargs.num_heads=[0,1,1,1]"],
        "model.kwargs (img_size: 32, in_chans: 1, num_heads: [0, 1, 1, 1]) do not build test_h_vit3: "
        "TTTMixer "
        "num_heads must be a positive integer, got 0",
    ),
    "kwargs-stage-lists-unequal": (
        "train",
        ["model.kwargs.dims=[16,32,64]"],
        "do not build test_h_vit3: dims, depths and num_heads must have equal lengths",
    ),
    "kwargs-heads-not-a-list": (
        "train",
        ["model.kwargs.num_heads=-1"],
        "do not build test_h_vit3: TypeError: object of type 'int' has no len()",
    ),
    "kwargs-ttt-key-unknown": (
        "train",
        ["model.kwargs.ttt_cfg={bogus: 1}"],
        "do not build test_h_vit3: unknown TTT config keys ['bogus']",
    ),
    "kwargs-ttt-value-unknown": (
        "train",
        ["model.kwargs.ttt_cfg={recompute: sometimes}"],
        "do not build test_h_vit3: recompute must be one of ('auto', 'always', 'never', 'qkv'), got "
        "'sometimes'",
    ),
    "kwargs-drop-path-beyond-one": (
        "train",
        ["model.kwargs.drop_path_rate=2"],
        "model.kwargs.drop_path_rate must be a number in [0, 1), got 2",
    ),
    "seed-negative": ("train", ["seed=-1"], "config key seed must be >= 0, got -1"),
    "workers-negative": (
        "train",
        ["data.num_workers=-1"],
        "config key data.num_workers must be >= 0, got -1",
    ),
    "mean-without-std": (
        "train",
        ["data.mean=[0.5]"],
        "data.mean is set but not its partner: give data.mean and data.std together",
    ),
    "mixup-negative": ("train", ["aug.mixup=-1"], "config key aug.mixup must be >= 0 (or null: off), got -1"),
    "clip-zero": (
        "train",
        ["train.clip_grad=0"],
        "config key train.clip_grad must be > 0 (or null: no clipping)",
    ),
    "accumulation-zero": (
        "train",
        ["train.accum_steps=0"],
        "config key train.accum_steps must be >= 1, got 0",
    ),
    "data-not-found": (
        "train",
        ["data.path=<tmp>/nope"],
        "error: config key data.path must be an existing folder, got '<tmp>/nope': not found",
    ),
    "data-path-for-the-embedded-digits": (
        "train",
        ["--config", str(CONFIG_DIR / "demo_mnist.yaml"), "output=<tmp>/out", "data.path=<tmp>/empty"],
        "error: config key data.path must be empty for data.dataset=mnist5k (the embedded digits",
    ),
    "data-a-file": ("train", ["data.path=<tmp>/notes.txt"], "got '<tmp>/notes.txt': it is a file"),
    "data-without-splits": (
        "train",
        ["data.path=<tmp>/empty"],
        "image folder not found: <tmp>/empty/train (expected <tmp>/empty/train/<class>/<image files>)",
    ),
    "class-without-images": (
        "train",
        ["data.path=<empty_class>"],
        "class folder <empty_class>/train/digit_9 holds no image files",
    ),
    "val-class-unknown-to-training": (
        "train",
        ["data.path=<val_extra>"],
        "<val_extra>/val has class folders that the training data does not know: digit_7",
    ),
    "no-val-split": ("train", ["data.path=<no_val>"], "image folder not found: <no_val>/val"),
    "output-a-file": (
        "train",
        ["output=<tmp>/notes.txt"],
        "config key output (train.py --output) must be a folder this run can "
        "write, got '<tmp>/notes.txt': <tmp>/notes.txt is a file",
    ),
    "output-under-a-file": (
        "train",
        ["output=<tmp>/notes.txt/run"],
        "<tmp>/notes.txt is a file, so nothing can be made under it",
    ),
    "resume-not-found": ("train", ["--resume", "<tmp>/nope.pt"], "checkpoint not found: <tmp>/nope.pt"),
    "resume-with-another-model": (
        "train",
        ["--resume", "<classifier>", "model.name=test_h_vit3"],
        "model 'test_h_vit3' (--model / model.name) does not fit <classifier>: it holds a 'test_vit3'",
    ),
    "eval-img-size-zero": (
        "eval",
        ["--checkpoint", "<classifier>", "--img-size", "0"],
        "config key eval.img_sizes (eval.py --img-size) must be a list of values >= 1, got [0]",
    ),
    "eval-batch-zero": (
        "eval",
        ["--checkpoint", "<classifier>", "--batch-size", "0"],
        "config key eval.batch_size (eval.py --batch-size) must be >= 1, got 0",
    ),
    "eval-report-a-folder": (
        "eval",
        ["--checkpoint", "<classifier>", "--json", "<tmp>/empty"],
        "got '<tmp>/empty': <tmp>/empty is a folder",
    ),
    "eval-data-not-found": (
        "eval",
        ["--checkpoint", "<classifier>", "--data", "<tmp>/nope"],
        "config key data.path (eval.py --data) must be an existing folder, got '<tmp>/nope': not found",
    ),
    "eval-data-of-other-classes": (
        "eval",
        ["--checkpoint", "<classifier>", "--data", "<val_extra>"],
        "<val_extra>/val has class folders that the model of <classifier> does not know: digit_7",
    ),
    "eval-model-unknown": (
        "eval",
        ["--checkpoint", "<classifier>", "--model", "nonexistent_x"],
        "config key model.name (eval.py --model) must be a timm model name",
    ),
    "generator-steps-zero": (
        "eval",
        ["--checkpoint", "<generator>", "--steps", "0"],
        "config key sample.steps (eval.py --steps) must be in [1, diffusion.num_timesteps (1000)], got 0",
    ),
    "generator-sampler-unknown": (
        "eval",
        ["--checkpoint", "<generator>", "--sampler", "bogus"],
        "argument --sampler: invalid choice: 'bogus'",
    ),
    "generator-samples-negative": (
        "eval",
        ["--checkpoint", "<generator>", "--num-samples", "-1"],
        "config key sample.num_samples (eval.py --num-samples) must be >= 1, got -1",
    ),
    "generator-cfg-scale-negative": (
        "eval",
        ["--checkpoint", "<generator>", "--cfg-scale", "-2"],
        "config key sample.cfg_scale (eval.py --cfg-scale) must be >= 0, got -2.0",
    ),
    "generator-data-not-found": (
        "eval",
        ["--checkpoint", "<generator>", "--data", "<tmp>/nope"],
        "config key data.path (eval.py --data) must be an existing folder, got '<tmp>/nope': not found",
    ),
    "generator-with-a-classifier-model": (
        "eval",
        ["--checkpoint", "<generator>", "--model", "vit3_tiny"],
        "config key model.name (eval.py --model) must be a DiT³ model: dit3_{s,b,l,xl}_{2,4,8}, got "
        "'vit3_tiny'",
    ),
    "generation-vae-not-found": (
        "train-gen",
        ["vae.path=<tmp>/nope"],
        "config key vae.path must be an existing folder holding a diffusers "
        "AutoencoderKL (nothing is downloaded), got '<tmp>/nope': not found",
    ),
    "generation-kwarg-unknown": ("train-gen", ["model.kwargs.bogus=1"], "bogus is not create_dit3 overrides"),
    "generation-width-and-heads": (
        "train-gen",
        ["model.kwargs.hidden_size=33"],
        "model.kwargs (hidden_size: 33, depth: 2, num_heads: 2) do not build dit3_s_4: hidden_size 33 must "
        "be divisible by num_heads 2",
    ),
    "onnx-out-a-folder": (
        "export",
        _onnx("<tmp>/empty"),
        "--out must be a .onnx file this run can write, got '<tmp>/empty': <tmp>/empty is a folder",
    ),
    "onnx-out-under-a-file": (
        "export",
        _onnx("<tmp>/notes.txt/m.onnx"),
        "<tmp>/notes.txt is a file, so nothing can be made under it",
    ),
    "onnx-opset-too-old": (
        "export",
        _onnx("<tmp>/m.onnx", "--opset", "3"),
        "--opset must be in [7, ",
    ),
    "onnx-img-size-negative": (
        "export",
        _onnx("<tmp>/m.onnx", "--img-size", "-3"),
        "--img-size must be >= 1, got -3",
    ),
    "features-images-not-found": (
        "export",
        _features("<tmp>/nope", "<tmp>/f"),
        "--images must be an existing folder, got '<tmp>/nope': not found",
    ),
    "features-images-empty": (
        "export",
        _features("<tmp>/empty", "<tmp>/f", "--out-indices", "0", "1"),
        "no images (.jpg, .jpeg, .png, .bmp, .webp, .tif, .tiff) in <tmp>/empty",
    ),
    "features-images-a-file": (
        "export",
        _features("<tmp>/notes.txt", "<tmp>/f"),
        "--images must be an existing folder, got '<tmp>/notes.txt': it is a file",
    ),
    "features-out-a-file": (
        "export",
        _features("<digits>/val", "<tmp>/notes.txt"),
        "--out must be a folder this run can write, got '<tmp>/notes.txt': <tmp>/notes.txt is a file",
    ),
    "features-levels-out-of-range": (
        "export",
        [*FEATURES, "--out-indices", "99"],
        "--out-indices [99] do not fit test_vit3: its 2 feature levels are 0 to 1",
    ),
    "features-levels-a-word": (
        "export",
        [*FEATURES, "--out-indices", "a"],
        "argument --out-indices: invalid int value: 'a'",
    ),
    "features-ema-missing": (
        "export",
        [*FEATURES, "--ema", "--out-indices", "0", "1"],
        "checkpoint <classifier> holds no EMA weights (trained with train.ema=false)",
    ),
    "features-model-unknown": (
        "export",
        [
            "features",
            "--model",
            "nonexistent_x",
            "--random-init",
            "--images",
            "<digits>/val",
            "--out",
            "<tmp>/f",
        ],
        "--model must be a timm model name",
    ),
    "features-no-model": (
        "export",
        ["features", "--random-init", "--images", "<digits>/val", "--out", "<tmp>/f"],
        "no model: give --model NAME or a vit3 --checkpoint",
    ),
    "features-two-weight-sources": (
        "export",
        [*FEATURES, "--pretrained"],
        "argument --pretrained: not allowed with argument --checkpoint",
    ),
    "export-command-unknown": ("export", ["bogus"], "argument command: invalid choice: 'bogus'"),
    "export-no-command": ("export", [], "the following arguments are required: command"),
    "explain-no-model": ("explain", [], "name a model (e.g. vit3-explain vit3_small) or give --config"),
    "explain-size-a-word": (
        "explain",
        ["vit3_tiny", "--img-size", "abc"],
        "argument --img-size: invalid int value",
    ),
    "explain-size-negative": (
        "explain",
        ["vit3_tiny", "--img-size", "-1"],
        "--batch and --img-size must be positive",
    ),
    "explain-batch-zero": (
        "explain",
        ["vit3_tiny", "--img-size", "32", "--batch", "0"],
        "--batch and --img-size must be positive",
    ),
    "ablate-table-not-found": (
        "ablate",
        ["<tmp>/nope", "--quick", "--output", "<tmp>/t"],
        "ablation table or row not found: <tmp>/nope",
    ),
    "ablate-not-a-row": (
        "ablate",
        [str(CONFIG_DIR / "default.yaml"), "--quick", "--output", "<tmp>/t"],
        "is not an ablation row: it needs an 'ablation:' section with table and row",
    ),
    "ablate-no-rows": (
        "ablate",
        ["<tmp>/empty", "--quick", "--output", "<tmp>/t"],
        "no *.yaml rows in <tmp>/empty",
    ),
    "ablate-epochs-zero": (
        "ablate",
        [str(ABLATIONS_DIR / "loss"), "--quick", "--epochs", "0", "--output", "<tmp>/t"],
        "--epochs must be >= 1, got 0",
    ),
    "ablate-data-not-found": (
        "ablate",
        [str(ABLATIONS_DIR / "loss"), "--quick", "--data", "<tmp>/nope", "--output", "<tmp>/t"],
        "--data must be an existing image folder, got '<tmp>/nope': not found",
    ),
    "ablate-output-a-file": (
        "ablate",
        [str(ABLATIONS_DIR / "loss"), "--quick", "--output", "<tmp>/notes.txt"],
        "--output must be a folder this table can write, got '<tmp>/notes.txt': <tmp>/notes.txt is a file",
    ),
    "ablate-resume-and-overwrite": (
        "ablate",
        [str(ABLATIONS_DIR / "loss"), "--resume", "--overwrite"],
        "argument --overwrite: not allowed with argument --resume (see python -m vit3.ablate --help)",
    ),
    "ablate-no-table": (
        "ablate",
        ["--quick"],
        "give a table folder (e.g. configs/ablations/loss/) or row files",
    ),
    "samples-count-negative": (
        "samples",
        ["<tmp>/s", "--train", "-1"],
        "need >= 1 training and val image per class and size >= 8, got -1, 16, 64",
    ),
    "samples-size-zero": ("samples", ["<tmp>/s", "--size", "0"], "got 16, 16, 0"),
    "samples-into-a-file": (
        "samples",
        ["<tmp>/notes.txt"],
        "<tmp>/notes.txt is a file: give a new or empty folder for the sample photos",
    ),
    "samples-under-a-file": (
        "samples",
        ["<tmp>/notes.txt/photos"],
        "<tmp>/notes.txt is a file, so no folder can be made under it",
    ),
    "samples-class-count": (
        "samples",
        ["<tmp>/s", "--classes", "4"],
        "argument --classes: invalid choice: 4 (choose from 3, 6) (see python -m vit3.data.samples --help)",
    ),
}


def _script_main(script: str):
    """The ``main(argv)`` of a command: ``train.py`` / ``eval.py`` / ``export.py``, vit3-explain,
    ``python -m vit3.ablate`` or ``python -m vit3.data.samples``."""
    from vit3.data import samples

    mains = {"explain": explain_script.main, "ablate": ablate.main, "samples": samples.main}
    return mains.get(script) or load_script(script.removesuffix("-gen")).main


@pytest.mark.parametrize(
    ("script", "args", "message"), MORE_CLI_MISTAKES.values(), ids=MORE_CLI_MISTAKES.keys()
)
def test_another_command_line_mistake_is_one_line(script, args, message, digits, request, tmp_path, capsys):
    """Each command refuses the mistake with one line naming the key, flag or file (exit code 2); a refused
    training run writes nothing."""
    paths = _scene(tmp_path, digits, args, message) | {"digits": digits}
    paths |= {name: request.getfixturevalue(name) for name in ("classifier", "generator")
              if f"<{name}>" in " ".join(args) + message}  # fmt: skip
    args, out = _fill(args, **paths), tmp_path / "out"
    if script == "train" and not any(a.startswith("--") for a in args):
        args = _run(digits, out, *args)
    elif script == "train-gen":
        args = ["--config", str(GEN_DEMO), *tiny_gen_args(digits, out, "train.epochs=1"), *args]
    assert _script_main(script)(args) == USER_ERROR_EXIT
    assert _fill([message], **paths)[0] in one_error_line(capsys, last=True)
    assert not out.exists()


# --------------------------------------------------------------------------------------------- checkpoints
# What every tool that reads a checkpoint says first of a file it cannot read as one.
EMPTY = "<empty> is an empty file (0 bytes), not a checkpoint"
RANDOM = "<random> is no torch.save file"
FOREIGN = "<foreign> is a bare state dict of 1 tensor(s) (no vit3 model record)"
# (script, arguments, what the one line says): each checkpoint named for what it holds and what is taken there
CHECKPOINT_MISTAKES = {
    "fine-tune-from-a-generator": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<generator>"],
        "<generator> is a vit3 generation checkpoint (dit3_s_4): fine-tuning (model.pretrained) takes a "
        "classification checkpoint (a run's best.pt) or official ViTTT weights",
    ),
    "fine-tune-from-a-detector": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<detector>"],
        "<detector> is a vit3 detection checkpoint (test_h_vit3): fine-tuning (model.pretrained) takes a "
        "classification checkpoint",
    ),
    "features-of-a-generator": (
        "export", ["features", "--checkpoint", "<generator>"],
        "<generator> is a vit3 generation checkpoint (dit3_s_4): exporting a backbone takes a classification",
    ),
    "onnx-of-a-generator": (
        "export", ["onnx", "--checkpoint", "<generator>"], "<generator> is a vit3 generation checkpoint",
    ),
    "features-of-a-detector": (
        "export", ["features", "--checkpoint", "<detector>"], "<detector> is a vit3 detection checkpoint",
    ),
    "features-of-two-blocks": (
        "export", ["features", "--checkpoint", "<classifier>"],
        "test_vit3's default feature levels do not fit it (last-n (3) is out of range (1 to 2)): its 2 "
        "feature "
        "levels are 0 to 1 (or -2 to -1 from the last); name those to take with --out-indices",
    ),
    "eval-empty": (
        "eval", ["--checkpoint", "<empty>"],
        f"{EMPTY}; expected a vit3 checkpoint (a run's best.pt or last.pt) or official weights (.pth, "
        ".safetensors)",
    ),
    "eval-random": ("eval", ["--checkpoint", "<random>"], f"{RANDOM} (1024 bytes of another"),
    "eval-a-config": ("eval", ["--checkpoint", "<config>"], "<config> is a text file (19 bytes, e.g. a YAML "
                                                            "config)"),
    "eval-foreign": (
        "eval", ["--checkpoint", "<foreign>"],
        f"{FOREIGN}, not a vit3 checkpoint: name its model with --model",
    ),
    "eval-folder": ("eval", ["--checkpoint", "<folder>"], "checkpoint <folder> is a folder: give the "
                                                          "checkpoint file"),
    "eval-random-with-a-model": (
        "eval", ["--checkpoint", "<random>", "--model", "test_h_vit3"], RANDOM,
    ),
    "resume-empty": (
        "train", ["--resume", "<empty>"],
        f"{EMPTY}; expected a vit3 checkpoint (a run's last.pt or best.pt)",
    ),
    "resume-random": ("train", ["--resume", "<random>"], RANDOM),
    "resume-foreign": (
        "train", ["--resume", "<foreign>"],
        f"{FOREIGN}, not a vit3 training checkpoint",
    ),
    "fine-tune-from-empty": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<empty>", "model.name=test_h_vit3"],
        EMPTY,
    ),
    "fine-tune-from-random": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<random>", "model.name=test_h_vit3"],
        RANDOM,
    ),
    "fine-tune-from-foreign": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<foreign>", "model.name=test_h_vit3"],
        "<foreign>: checkpoint does not fit this HViT3: none of its 1 key(s) (e.g. a) names one of the "
        "model's",
    ),
    "features-of-empty": (
        "export", ["features", "--checkpoint", "<empty>", "--model", "test_h_vit3"], EMPTY,
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("script", "args", "message"), CHECKPOINT_MISTAKES.values(), ids=CHECKPOINT_MISTAKES.keys()
)
def test_a_checkpoint_of_another_kind_is_named_in_one_line(
    script, args, message, digits, files, request, tmp_path, capsys
):
    paths = dict(files)
    paths |= {name: request.getfixturevalue(name) for name in ("classifier", "detector", "generator")
              if f"<{name}>" in " ".join(args)}  # fmt: skip
    args = _fill(args, **paths)
    if script == "train" and "--resume" not in args:
        args = _run(digits, tmp_path / "out", *args)
    elif script == "export":
        out = tmp_path / ("feats" if args[0] == "features" else "m.onnx")
        args += ["--out", str(out)] + (["--images", str(digits / "val")] if args[0] == "features" else [])
    assert load_script(script).main(args) == USER_ERROR_EXIT
    assert _fill([message], **paths)[0] in one_error_line(capsys, last=True)


# ---------------------------------------------------------------------------------------------------- data
def _coco_variant(coco_root: Path, root: Path, change) -> Path:
    """A copy of the COCO digits whose training annotation file ``change(data)`` edited in place."""
    shutil.copytree(coco_root, root)
    ann = root / "annotations" / "instances_train.json"
    data = json.loads(ann.read_text())
    change(data)
    ann.write_text(json.dumps(data))
    return root


def _short_polygon(data: dict) -> None:
    # two points, which pycocotools took for a box
    data["annotations"][0]["segmentation"] = [[1.0, 2.0, 3.0, 4.0]]


def _duplicate_image_id(data: dict) -> None:
    data["images"][1]["id"] = data["images"][0]["id"]


def _wrong_width(data: dict) -> None:
    data["images"][0]["width"] = 80


COCO_MISTAKES = {
    "polygon-of-two-points": (
        _short_polygon,
        "<ann>: annotation 1 of image 1 has a segmentation that is neither polygons (lists of 3 or more x, y "
        "pairs) "
        "nor an RLE mask (size and counts)",
    ),
    "image-id-twice": (
        _duplicate_image_id,
        "<ann>: image id 1 is given twice (train_00000.png and train_00001.png); each image needs its own id",
    ),
    "size-unlike-the-file": (
        _wrong_width,
        "<ann>: image 1 (<root>/train/train_00000.png) is 64x64 but the annotation file says 80x64",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("change", "message"), COCO_MISTAKES.values(), ids=COCO_MISTAKES.keys())
def test_a_coco_mistake_names_the_annotation_file_and_the_image(change, message, coco_root, tmp_path, capsys):
    root = _coco_variant(coco_root, tmp_path / "coco", change)
    args = ["--config", str(CONFIG_DIR / "dense" / "demo_detection.yaml"), *det_args(root, tmp_path / "out")]
    assert load_script("train").main([*args, "data.num_workers=0"]) == USER_ERROR_EXIT
    ann = root / "annotations" / "instances_train.json"
    assert _fill([message], ann=ann, root=root)[0] in one_error_line(capsys, last=True)


def test_a_decompression_bomb_names_its_file(digits, tmp_path, monkeypatch, capsys):
    """An image declaring more pixels than PIL opens (twice ``MAX_IMAGE_PIXELS``, lowered here so that a small
    file is one): one line naming the file, where PIL's error named none."""
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    bomb = data / "train" / "digit_0" / "bomb.png"
    Image.new("L", (128, 128)).save(bomb)
    # the 28x28 digits stay below the limit, the 128x128 image is over twice it
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)
    assert load_script("train").main(_run(data, tmp_path / "out", "data.num_workers=0")) == USER_ERROR_EXIT
    line = one_error_line(capsys, last=True)
    assert f"cannot read image file {bomb}: Image size (16384 pixels) exceeds limit of 8000 pixels" in line


def _annotations(change):
    """The change of a COCO copy (its root) that edits its training annotations' data with ``change``."""

    def edit(root: Path) -> None:
        ann = root / "annotations" / "instances_train.json"
        data = json.loads(ann.read_text())
        change(data)
        ann.write_text(json.dumps(data))

    return edit


def _set(data: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


def _rgb_label_map(root: Path) -> None:
    label = root / "annotations" / "training" / "training_00001.png"
    Image.open(label).convert("RGB").save(label)


def _label_beyond_the_classes(root: Path) -> None:
    label = root / "annotations" / "training" / "training_00001.png"
    pixels = np.array(Image.open(label))
    pixels[0, 0] = 200
    Image.fromarray(pixels).save(label)


TRAIN_ANN = "<root>/annotations/instances_train.json"
# (task, change of a copy of its data at <root>, what the one line says): detection runs on the COCO digits,
# segmentation on the ADE20K digits; "det-on-ade" / "seg-on-coco" on the other task's data
DENSE_MISTAKES = {
    "coco-not-json": (
        "detection",
        lambda r: (r / "annotations" / "instances_train.json").write_text("{not json"),
        f"COCO annotation file {TRAIN_ANN} is not valid JSON",
    ),
    "coco-annotations-missing": (
        "detection",
        lambda r: (r / "annotations" / "instances_train.json").unlink(),
        f"COCO annotation file not found: {TRAIN_ANN}",
    ),
    "coco-image-missing": (
        "detection",
        lambda r: (r / "train" / "train_00001.png").unlink(),
        f"1 image(s) of {TRAIN_ANN} missing in <root>/train: ['train_00001.png']",
    ),
    "coco-category-unknown": (
        "detection",
        _annotations(lambda d: _set(d, ("annotations", 0, "category_id"), 999)),
        f"{TRAIN_ANN}: annotation 1 has category_id 999 outside the categories [4, 8]",
    ),
    "coco-box-of-words": (
        "detection",
        _annotations(lambda d: _set(d, ("annotations", 0, "bbox"), ["a", 1, 2, 3])),
        f"{TRAIN_ANN}: annotation 1 has a bbox of non-numbers: ['a', 1, 2, 3]",
    ),
    "coco-no-categories": (
        "detection",
        _annotations(lambda d: _set(d, ("categories",), [])),
        f"COCO annotation file {TRAIN_ANN} has no categories",
    ),
    "coco-nothing-annotated": (
        "detection",
        _annotations(lambda d: _set(d, ("annotations",), [])),
        f"no usable images in {TRAIN_ANN} (every image lacks annotations)",
    ),
    "coco-image-corrupt": (
        "detection",
        lambda r: (r / "train" / "train_00001.png").write_bytes(b"\x89PNG cut short"),
        "cannot read image file <root>/train/train_00001.png: cannot identify image file",
    ),
    "det-on-ade": ("detection-on-ade", None, "COCO image folder not found: <root>/val"),
    "ade-label-map-missing": (
        "segmentation",
        lambda r: (r / "annotations" / "training" / "training_00001.png").unlink(),
        "1 image(s) in <root>/images/training have no label map in <root>/annotations/training: "
        "['training_00001.png']",
    ),
    "ade-label-map-corrupt": (
        "segmentation",
        lambda r: (r / "annotations" / "training" / "training_00001.png").write_bytes(b"junk"),
        "cannot read image file <root>/annotations/training/training_00001.png: cannot identify image file",
    ),
    "ade-label-map-rgb": (
        "segmentation",
        _rgb_label_map,
        "label map <root>/annotations/training/training_00001.png must be a single-channel PNG, got mode RGB",
    ),
    "ade-label-beyond-the-classes": (
        "segmentation",
        _label_beyond_the_classes,
        "label map <root>/annotations/training/training_00001.png has labels [200] outside 0..2 (and ignore "
        "255)",
    ),
    "ade-no-images": (
        "segmentation",
        lambda r: [p.unlink() for p in (r / "images" / "training").iterdir()],
        "no images in <root>/images/training",
    ),
    "seg-on-coco": ("segmentation-on-coco", None, "ADE20K-format folder not found: <root>/images/training"),
}


# The mistakes found as the first batch reads its files (the others stop the run before it writes anything).
READ_IN_THE_RUN = {
    DENSE_MISTAKES[k][1]
    for k in (
        "coco-image-corrupt",
        "ade-label-map-corrupt",
        "ade-label-map-rgb",
        "ade-label-beyond-the-classes",
    )
}


def _dense_args(task: str, root: Path, out: Path) -> list[str]:
    """``train.py`` arguments of a one-epoch ``task`` run on ``root`` (the data read in this process)."""
    config, args = (("demo_detection.yaml", det_args) if task == "detection" else
                    ("demo_segmentation.yaml", seg_args))  # fmt: skip
    return ["--config", str(CONFIG_DIR / "dense" / config), *args(root, out), "data.num_workers=0",
            "train.epochs=1", "train.eval_every=1"]  # fmt: skip


@pytest.mark.parametrize(("task", "change", "message"), DENSE_MISTAKES.values(), ids=DENSE_MISTAKES.keys())
def test_a_dense_data_mistake_names_the_file(task, change, message, coco_root, ade_root, tmp_path, capsys):
    """A detection or segmentation dataset with a mistake in it: one line naming the file, nothing written."""
    task, _, other = task.partition("-on-")
    source = {"coco": coco_root, "ade": ade_root}[other or ("coco" if task == "detection" else "ade")]
    root = tmp_path / "data"
    shutil.copytree(source, root)
    if change is not None:
        change(root)
    assert load_script("train").main(_dense_args(task, root, tmp_path / "out")) == USER_ERROR_EXIT
    assert _fill([message], root=root)[0] in one_error_line(capsys, last=True)
    out = (
        tmp_path / "out"
    )  # a file met in the first batch: the run has written its config.yaml, no checkpoint
    assert not out.exists() if change not in READ_IN_THE_RUN else os.listdir(out) == ["config.yaml"]


@pytest.mark.parametrize(
    "extra", [["data.batch_size=1"], ["dense.num_classes=2"]], ids=["batch-of-one", "classes"]
)
def test_a_segmentation_setting_that_cannot_work_is_one_line(extra, ade_root, tmp_path, capsys):
    messages = {
        "data.batch_size=1": "segmentation needs data.batch_size >= 2 per process (BatchNorm in the decode "
        "heads)",
        "dense.num_classes=2": "config key dense.class_names must be a list of one name per class (or null: "
        "indices), got ['background', 'three', 'seven']: 3 names for dense.num_classes=2",
    }
    args = _dense_args("segmentation", ade_root, tmp_path / "out")
    assert load_script("train").main([*args, *extra]) == USER_ERROR_EXIT
    assert messages[extra[0]] in one_error_line(capsys, last=True)
    assert not (tmp_path / "out").exists()


def _without_sizes(root: Path) -> Path:
    """``root``'s COCO training annotations without the images' width and height (their headers say)."""
    _annotations(lambda d: [(img.pop("width"), img.pop("height")) for img in d["images"]])(root)
    return root


def test_coco_images_without_sizes_train_with_the_sizes_of_their_files(coco_root, tmp_path):
    """pycocotools drew the masks from sizes the file lacks: a KeyError 'width' traceback. Now the sizes come
    from the images' headers, and the training targets are those of the file that states them."""
    from vit3.data.coco import CocoDetection

    root = _without_sizes(shutil.copytree(coco_root, tmp_path / "data"))
    stated, read = (
        CocoDetection(r / "train", r / "annotations" / "instances_train.json", train=False, with_masks=True)
        for r in (coco_root, root)
    )
    assert len(read) == len(stated)
    for i in range(len(read)):
        for key, value in stated[i][1].items():
            assert torch.equal(read[i][1][key], value), key
    assert load_script("train").main(_dense_args("detection", root, tmp_path / "out")) == 0


def test_a_coco_image_without_sizes_beyond_the_pixel_limit_names_its_file(
    coco_root, tmp_path, monkeypatch, capsys
):
    """The image header read for the sizes the file lacks: PIL's DecompressionBombError named no file."""
    root = _without_sizes(shutil.copytree(coco_root, tmp_path / "data"))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the 64x64 images are over twice it
    assert load_script("train").main(_dense_args("detection", root, tmp_path / "out")) == USER_ERROR_EXIT
    assert one_error_line(capsys, last=True).startswith(
        f"error: cannot read image file {root / 'train' / 'train_00000.png'}: Image size (4096 pixels) "
        f"exceeds limit of 2000 pixels"
    )


# ----------------------------------------------------------------------------------------------------- API
# (model, kwargs): each family, at a size whose routes take the C++ kernels' one-op paths
EMPTY_BATCH_MODELS = {
    "test_vit3_ttt": ("test_vit3_ttt", {}),
    "test_h_vit3": ("test_h_vit3", {}),
    "vit3_tiny": ("vit3_tiny", {"img_size": 64}),
    "h_vit3_tiny": ("h_vit3_tiny", {"img_size": 64}),
    "h_vit3_tiny-saving-block": ("h_vit3_tiny", {"img_size": 64, "ttt_cfg": {"recompute": "never"}}),
}


@pytest.mark.parametrize(("name", "kwargs"), EMPTY_BATCH_MODELS.values(), ids=EMPTY_BATCH_MODELS.keys())
def test_an_empty_batch_gives_an_empty_result(name, kwargs):
    """B = 0 after settled calls of B = 2 (whose routes the kernels' one-op paths serve), in inference and in
    training: ``[0, classes]`` as timm's models give, and a backward that gives every weight a zero gradient
    (a SIGFPE in the C++ kernel or a groups error before)."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **kwargs)
    size = kwargs.get("img_size", 32 if name.startswith("test") else 224)
    chans = model.in_chans
    for mode in (model.eval, model.train):
        mode()
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                for _ in range(2):
                    model(torch.randn(2, chans, size, size))
                out = model(torch.zeros(0, chans, size, size))
            assert out.shape == (0, 5)
            if grad:
                model.zero_grad(set_to_none=True)
                out.sum().backward()
                grads = {n: p.grad for n, p in model.named_parameters()}
                assert all(g is not None and not g.any() for g in grads.values()), name


@pytest.mark.parametrize("lr_mode", ["fixed", "token"])
def test_an_empty_batch_through_a_bare_mixer(lr_mode):
    mixer = TTTMixer(64, 2, lr_mode=lr_mode)
    for _ in range(2):
        mixer(torch.randn(2, 16, 64), (4, 4))
    out = mixer(torch.zeros(0, 16, 64, requires_grad=True), (4, 4))
    assert out.shape == (0, 16, 64)
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in mixer.parameters())


API_MISTAKES = {
    "img-size-a-string": (
        lambda: timm.create_model("vit3_tiny", img_size="224"), ConfigError,
        "vit3_tiny: img_size must be a positive integer or (height, width) of them, got '224'",
    ),
    "img-size-a-string-hierarchical": (
        lambda: timm.create_model("h_vit3_tiny", img_size="224"), ConfigError,
        "h_vit3_tiny: img_size must be",
    ),
    "no-input-channel": (
        lambda: timm.create_model("vit3_tiny", in_chans=0), ConfigError,
        "vit3_tiny: in_chans must be an integer >= 1 (the image channels), got 0",
    ),
    "explain-a-name": (
        lambda: vit3.explain("vit3_tiny", 224), TypeError,
        "explain takes a model (an nn.Module), got 'vit3_tiny': build it first, e.g. "
        "explain(timm.create_model('vit3_tiny'), ...)",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("call", "kind", "message"), API_MISTAKES.values(), ids=API_MISTAKES.keys())
def test_an_api_mistake_is_a_clear_error(call, kind, message):
    with pytest.raises(kind) as caught:
        call()
    assert str(caught.value) == message or str(caught.value).startswith(message)


def _vit(**kwargs):
    return timm.create_model("vit3_tiny", **{"img_size": 32, "num_classes": 3, **kwargs}).eval()


def _h_vit(**kwargs):
    return timm.create_model("h_vit3_tiny", **{"img_size": 64, "num_classes": 3, **kwargs}).eval()


def _mixer_call(x: torch.Tensor, grid):
    return lambda: TTTMixer(64, 2)(x, grid)


def _distill(kind: str):
    from vit3.convert import distillation_loss

    return lambda: distillation_loss(torch.randn(2, 3), torch.randn(2, 3), kind)


def _convert_pairs(student_swapped: bool):
    from vit3.convert import layer_pairs

    def call():
        teacher = timm.create_model("test_vit", num_classes=3)
        student = timm.create_model("test_vit", num_classes=3)
        return layer_pairs(teacher, vit3.swap_attention_for_ttt(student) if student_swapped else student)

    return call


# (call, exception type, a pattern of its one line): what the Python API says of an argument it cannot take
MORE_API_MISTAKES = {
    "img-size-zero": (
        lambda: _vit(img_size=0),
        ConfigError,
        r"vit3_tiny: img_size must be a positive integer",
    ),
    "img-size-negative-hierarchical": (
        lambda: _h_vit(img_size=-32),
        ConfigError,
        r"h_vit3_tiny: img_size must be a positive integer",
    ),
    "img-size-a-fraction": (lambda: _vit(img_size=32.5), ConfigError, r"img_size must be .*, got 32\.5"),
    "img-size-a-bool": (lambda: _vit(img_size=True), ConfigError, r"img_size must be .*, got True"),
    "img-size-a-pair-with-a-word": (lambda: _vit(img_size=(32, "a")), ConfigError, r"got \(32, 'a'\)"),
    "in-chans-negative-hierarchical": (
        lambda: _h_vit(in_chans=-1),
        ConfigError,
        r"in_chans must be an integer >= 1 \(the image channels\), got -1",
    ),
    "width-not-divisible-by-heads": (
        lambda: _vit(embed_dim=100),
        ValueError,
        r"dim 100 must be divisible by num_heads 6",
    ),
    "ttt-config-key-unknown": (
        lambda: _vit(ttt_cfg={"bogus": 1}),
        ValueError,
        r"unknown TTT config keys \['bogus'\]",
    ),
    "ttt-config-value-unknown": (
        lambda: _vit(ttt_cfg={"recompute": "sometimes"}),
        ValueError,
        r"recompute must be one of",
    ),
    "stage-lists-unequal": (
        lambda: _h_vit(depths=[1, 1]),
        ValueError,
        r"dims, depths and num_heads must have equal lengths",
    ),
    "images-of-other-channels": (
        lambda: _vit()(torch.randn(1, 1, 32, 32)),
        ValueError,
        r"model expects 3 input channels, got 1",
    ),
    "tokens-for-images": (
        lambda: _vit()(torch.randn(3, 32, 32)),
        ValueError,
        r"expected images \[B, C, H, W\]",
    ),
    "nan-images": (
        lambda: _vit()(torch.full((1, 3, 32, 32), float("nan"))),
        ValueError,
        r"non-finite values \(NaN or Inf\)",
    ),
    "image-below-the-stride": (
        lambda: _h_vit()(torch.randn(1, 3, 16, 16)),
        ValueError,
        r"image 16x16 is too small for this model",
    ),
    "mixer-width-not-divisible": (
        lambda: TTTMixer(64, 3),
        ValueError,
        r"dim 64 must be divisible by num_heads 3",
    ),
    "mixer-lr-mode-unknown": (
        lambda: TTTMixer(64, 2, lr_mode="bogus"),
        ValueError,
        r"lr_mode must be 'fixed' or 'token'",
    ),
    "mixer-grid-of-other-tokens": (
        _mixer_call(torch.randn(2, 16, 64), (3, 4)),
        ValueError,
        r"grid 3x4 = 12 tokens does not fit N=16",
    ),
    "mixer-tokens-of-other-width": (
        _mixer_call(torch.randn(2, 16, 32), (4, 4)),
        ValueError,
        r"TTTMixer built for C=64 channels got C=32",
    ),
    "mixer-tokens-without-batch": (
        _mixer_call(torch.randn(16, 64), (4, 4)),
        ValueError,
        r"TTTMixer expects tokens \[B, N, C\]",
    ),
    "ttt-config-steps-negative": (
        lambda: vit3.TTTConfig(steps=-1),
        ValueError,
        r"steps and mini_batches must be >= 1",
    ),
    "dit3-name-unknown": (
        lambda: vit3.create_dit3("dit3_q_2"),
        ValueError,
        r"unknown DiT³ model 'dit3_q_2'",
    ),
    "dit3-width-not-divisible": (
        lambda: vit3.create_dit3("dit3_s_2", num_heads=5),
        ValueError,
        r"hidden_size 384 must be divisible by",
    ),
    "dit3-mixer-unknown": (
        lambda: vit3.create_dit3("dit3_s_2", mixer="bogus"),
        ValueError,
        r"mixer must be one of",
    ),
    "swap-a-model-without-attention": (
        lambda: vit3.swap_attention_for_ttt(timm.create_model("resnet18")),
        ValueError,
        r"found no timm ViT Attention or Swin WindowAttention to replace in ResNet",
    ),
    "swap-a-name": (
        lambda: vit3.swap_attention_for_ttt("vit_small_patch16_224"),
        TypeError,
        r"swap_attention_for_ttt takes a model \(an nn.Module\), got 'vit_small_patch16_224': build it first",
    ),
    "convert-a-student-without-mixers": (
        _convert_pairs(student_swapped=False),
        ValueError,
        r"has no TTT mixer in place of an attention",
    ),
    "distillation-kind-unknown": (_distill("bogus"), ValueError, r"distillation kind must be one of"),
    "explain-nothing": (lambda: vit3.explain(None, 32), TypeError, r"explain takes a model \(an nn.Module\)"),
    "mixer-tokens-for-the-width": (
        lambda: TTTMixer(torch.randn(2, 16, 64), 16),
        TypeError,
        r"TTTMixer dim must be a positive integer, got Tensor of shape \[2, 16, 64\] \(the tokens go to the "
        r"call",
    ),
    "mixer-tokens-for-the-width-no-heads": (
        lambda: TTTMixer(torch.randn(2, 16, 64), None),
        TypeError,
        r"TTTMixer dim must be a positive integer, got Tensor",
    ),
    "mixer-width-negative": (
        lambda: TTTMixer(-64, 2),
        ValueError,
        r"TTTMixer dim must be a positive integer, got -64",
    ),
    "mixer-width-zero": (
        lambda: TTTMixer(0, 1),
        ValueError,
        r"TTTMixer dim must be a positive integer, got 0",
    ),
    "mixer-heads-none": (
        lambda: TTTMixer(64, None),
        TypeError,
        r"TTTMixer num_heads must be a positive integer, got NoneType None",
    ),
    "explain-size-negative": (
        lambda: vit3.explain(_vit(), -1),
        ValueError,
        r"explain inputs must be an image batch \(a Tensor\) or an image size \(a positive integer or "
        r"\(height, width\) of them\), got -1",
    ),
    "explain-size-a-string": (lambda: vit3.explain(_vit(), "32"), TypeError, r"explain inputs .*, got '32'"),
    "explain-batch-zero": (
        lambda: vit3.explain(_vit(), 32, batch=0),
        ValueError,
        r"explain batch must be a positive integer, got 0",
    ),
    "embed-dim-zero": (
        lambda: _vit(embed_dim=0),
        ConfigError,
        r"vit3_tiny: embed_dim must be a positive integer \(the token width\), got 0",
    ),
    "patch-size-zero": (
        lambda: _vit(patch_size=0),
        ConfigError,
        r"vit3_tiny: patch_size must be a positive integer or \(height, width\) of them, got 0",
    ),
    "stage-width-zero-hierarchical": (
        lambda: _h_vit(dims=(0, 128, 320, 512)),
        ConfigError,
        r"h_vit3_tiny: dims must be positive integers \(the stage widths\), got \(0, 128, 320, 512\)",
    ),
    "patch-size-of-the-hierarchical-model": (
        lambda: _h_vit(patch_size=0),
        TypeError,
        r"HViT3 got an unexpected keyword argument 'patch_size'",
    ),
    "ttt-config-lr-a-string": (
        lambda: vit3.TTTConfig(inner_lr="a"),
        TypeError,
        r"TTTConfig inner_lr must be a real number, got str 'a'",
    ),
    "ttt-config-steps-a-string": (
        lambda: vit3.TTTConfig(steps="2"),
        TypeError,
        r"TTTConfig steps must be an integer, got str '2'",
    ),
    "integer-images": (
        lambda: _vit()(torch.zeros(1, 3, 32, 32, dtype=torch.int64)),
        TypeError,
        r"expected images of a floating-point dtype \(float32, float64, bfloat16, float16\), "
        r"got torch\.int64",
    ),
    "integer-images-hierarchical": (
        lambda: _h_vit()(torch.zeros(1, 3, 64, 64, dtype=torch.int64)),
        TypeError,
        r"expected images of a floating-point dtype .*, got torch\.int64",
    ),
    "bool-images-hierarchical": (
        lambda: _h_vit()(torch.zeros(1, 3, 64, 64, dtype=torch.bool)),
        TypeError,
        r"expected images of a floating-point dtype .*, got torch\.bool",
    ),
}


@pytest.mark.parametrize(
    ("call", "kind", "pattern"), MORE_API_MISTAKES.values(), ids=MORE_API_MISTAKES.keys()
)
def test_another_api_mistake_is_a_clear_error(call, kind, pattern):
    """A clear exception of the type callers catch, its message one line naming the argument."""
    with pytest.raises(kind, match=pattern) as caught:
        call()
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["vit3_tiny", "h_vit3_tiny"])
def test_a_model_built_on_the_meta_device_runs_meta_images(name):
    """Meta tensors (shapes without data, as tools that size a model use): the output's shape, no error."""
    with torch.device("meta"):
        model = timm.create_model(name, img_size=64, num_classes=5)
    out = model(torch.empty(2, 3, 64, 64, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 5)


# ------------------------------------------------------------------------------------------ signals, disk
@pytest.mark.parametrize(
    ("sig", "code", "what"),
    [
        (signal.SIGINT, INTERRUPTED_EXIT, "interrupted (Ctrl-C)"),
        (signal.SIGTERM, TERMINATED_EXIT, "terminated (SIGTERM)"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_ends_with_one_line_naming_the_last_checkpoint(digits, tmp_path, sig, code, what):
    """SIGINT once the first checkpoint is written: exit 130 and one line naming it, no traceback (the data
    read in the main process, the one process the test signals). The run starts with SIGINT's default action
    whatever the test process has (a shell's background job starts with SIGINT ignored, which a child keeps
    through exec); a run that goes on after the signal fails naming its signal masks. SIGTERM (``timeout``,
    a batch scheduler) ends it alike, exit 143 (it killed the run with no word, its folder's lock left)."""
    out = tmp_path / "run"
    args = _run(digits, out, "train.epochs=1000", "data.num_workers=0")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        while not (out / "last.pt").is_file():  # replaced atomically: a file that is there is whole
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # say how the run saw the signal: ignored, caught or blocked
            status = Path(f"/proc/{proc.pid}/status")
            masks = (
                [line for line in status.read_text().splitlines() if line.startswith("Sig")]
                if status.is_file()
                else []
            )
            proc.kill()
            pytest.fail(
                f"train.py ran on 120 s after SIGINT ({'; '.join(masks)}): {proc.communicate()[1][-3000:]}"
            )
    finally:
        proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error: {what}; the last checkpoint written is {out / 'last.pt'} "
        f"(train.py --resume {out / 'last.pt'} continues it)"
    )
    assert not (out / ".vit3.lock").exists()


class _Storage(io.RawIOBase):
    """Storage that takes ``room`` bytes, then raises ``failure()`` in every write: a disk that fills up
    (``OSError`` ENOSPC) or Ctrl-C (``KeyboardInterrupt``) under a buffered file, as ``open(path, "wb")``
    gives."""

    def __init__(self, room: int, failure: Callable[[], BaseException]) -> None:
        self.room = room
        self.failure = failure

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.room <= 0:
            raise self.failure()
        taken = min(len(data), self.room)
        self.room -= taken
        return taken


@contextlib.contextmanager
def _second_last_pt_meets(failure: Callable[[], BaseException], out: Path) -> Iterator[None]:
    """While in the block, torch.save of ``out``'s last.pt, once a first one stands, meets ``failure()`` a
    few KB in (the first epoch's checkpoint is written as usual); torch.save is itself again after it."""
    from vit3.engine import checkpoint as ckpt_module

    save = torch.save

    def failing(obj, f, *args, **kwargs):  # f: the temporary file of the checkpoint, .<name>.tmp<pid>
        if Path(f.name).name.startswith(".last.pt.") and (out / "last.pt").exists():
            return save(obj, io.BufferedWriter(_Storage(4096, failure), buffer_size=1024), *args, **kwargs)
        return save(obj, f, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt_module.torch, "save", failing)
        yield


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_it(digits, tmp_path, capsys):
    """The second epoch's last.pt meets a full disk a few KB in: torch's zip writer reported it as its own
    ``enforce fail at inline_container.cc``; now one line names the file and the system's reason, and the
    first epoch's checkpoint stays as it was."""
    from vit3.engine.checkpoint import load_checkpoint

    out = tmp_path / "run"
    with _second_last_pt_meets(lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), out):
        assert load_script("train").main(_run(digits, out, "train.epochs=2")) == USER_ERROR_EXIT
    kept = f"{out / 'last.pt'}: No space left on device (the checkpoint already there is left as it was)"
    assert one_error_line(capsys, last=True) == f"error: cannot write checkpoint {kept}"
    assert load_checkpoint(out / "last.pt")["epoch"] == 1


def test_ctrl_c_during_a_checkpoint_is_the_one_interrupted_line(digits, tmp_path, capsys):
    """Ctrl-C while torch.save writes the second epoch's last.pt: torch's zip writer turned it into its own
    ``enforce fail at inline_container.cc`` traceback; now the one line of an interrupted run, exit 130,
    naming the first epoch's checkpoint, which is left as it was."""
    from vit3.engine.checkpoint import load_checkpoint

    out = tmp_path / "run"
    with _second_last_pt_meets(KeyboardInterrupt, out):
        assert load_script("train").main(_run(digits, out, "train.epochs=2")) == INTERRUPTED_EXIT
    assert one_error_line(capsys, last=True) == (
        f"error: interrupted (Ctrl-C); the last checkpoint written is {out / 'last.pt'} "
        f"(train.py --resume {out / 'last.pt'} continues it)"
    )
    assert load_checkpoint(out / "last.pt")["epoch"] == 1
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_under_torchrun_is_said_by_rank_0_alone(rank, digits, tmp_path, monkeypatch, capsys):
    """Ctrl-C reaches every process of a torchrun launch: rank 0 says it in one line; the others, which write
    no checkpoint, said "interrupted before this run wrote a checkpoint" as well, and now end quietly (exit
    130 each)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))

    def interrupted(args):
        raise KeyboardInterrupt

    assert run_cli(ArgumentParser(), interrupted, []) == INTERRUPTED_EXIT
    if rank:
        assert capsys.readouterr().err == ""
    else:
        assert one_error_line(capsys, last=True).startswith("error: interrupted (Ctrl-C)")


def test_ctrl_c_in_the_ablation_runner_names_its_own_resume(tmp_path, monkeypatch, capsys):
    """Ctrl-C in ``python -m vit3.ablate`` named ``train.py --resume``, which continues one row; the table
    continues with the runner's own ``--resume``."""
    last = tmp_path / "row" / "last.pt"
    monkeypatch.setattr("vit3.engine.checkpoint.last_saved", lambda: last)

    def interrupted(args, argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(ablate, "_main", interrupted)
    assert ablate.main([str(tmp_path)]) == INTERRUPTED_EXIT
    assert one_error_line(capsys, last=True) == (
        f"error: interrupted (Ctrl-C); the last checkpoint written is {last} (the same command with --resume "
        "continues it)"
    )
