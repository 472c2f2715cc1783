"""``vit3-explain <timm model> --img-size 224`` (or ``python -m vit3.scripts.explain``): which backend runs
every TTT mixer branch of a model, and why each other one was passed over (``vit3.explain``).

``--config FILE`` takes the model of a classification config instead, built as ``train.py`` builds it, at its
run's image size, ``train.amp`` and ``device``, where no flag gives them.
Honours ``$VIT3_TTT_BACKEND`` and the model's ``TTTConfig.backend``; ``--dtype bf16``/``fp16`` run the forward
under autocast (the mixers then read 16-bit q, k, v), ``fp32``/``fp64`` cast the model. A mistake in the input
ends with one ``error:`` line and exit code 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import timm
import torch
from torch import nn

import vit3  # registers the vit3 models in timm
from vit3.engine.classification_model import build_model, input_channels, resolve_data_cfg
from vit3.engine.cli import ArgumentParser, run_cli
from vit3.engine.config import Config, load_config
from vit3.engine.config.value_checks import dit3_model, timm_model, torch_device
from vit3.engine.process import amp_dtype
from vit3.errors import ConfigError
from vit3.layers.backends import BACKEND_ENV, STRICT_ENV
from vit3.layers.ttt import explain

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="vit3-explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="timm model name (e.g. vit3_small, h_vit3_tiny)")
    parser.add_argument(
        "--config", help="a classification config: its model.name, model.kwargs, data.img_size, train.amp"
    )
    parser.add_argument(
        "--img-size",
        type=int,
        help="input height and width in pixels (default: the config's run's, else 224)",
    )
    parser.add_argument(
        "--device", help="cpu, cuda or cuda:N (default: the config's device, else cuda if any)"
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="default: the config's train.amp on the device, else fp32"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--train", action="store_true", help="explain the training route (gradients flowing)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return run_cli(parser, _explain, argv, intermixed=False)


def _explain(args: argparse.Namespace) -> int:
    cfg = _read_config(args) if args.config else None
    if args.model is None:
        raise ConfigError("name a model (e.g. vit3-explain vit3_small) or give --config")
    if args.batch < 1 or (args.img_size is not None and args.img_size < 1):
        raise ConfigError("--batch and --img-size must be positive")
    problem = timm_model(args.model, None)
    if problem is not None and dit3_model(args.model, None) is None:
        raise ConfigError(
            f"{args.model} is a DiT³ generator (vit3.create_dit3), which vit3-explain does not build: it "
            "runs timm models on images. A DiT³ mixer explains itself: "
            f"vit3.create_dit3({args.model!r}).blocks[0].attn.explain(tokens, grid)"
        )
    if problem is not None:
        raise ConfigError(
            f"model must be a timm model name (e.g. vit3_small, h_vit3_tiny), got {args.model!r}: {problem}"
        )
    if args.device is None:
        written = cfg.device if cfg is not None and cfg.device != "auto" else None
        args.device = written or ("cuda" if torch.cuda.is_available() else "cpu")
    why = torch_device(args.device, None)
    if why is not None:
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}: {why}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if args.dtype is None:
        amp = amp_dtype(cfg.train.amp, device) if cfg is not None else None
        args.dtype = next((name for name, dtype in DTYPES.items() if dtype == amp), "fp32")
    dtype = DTYPES[args.dtype]
    model = _build(args, cfg).to(device).eval()
    autocast = dtype in (torch.bfloat16, torch.float16)
    if not autocast:
        model = model.to(dtype)
    context = torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext()
    try:
        with context:
            report = explain(model, args.img_size, grad=args.train, batch=args.batch)
    except (ValueError, AssertionError) as e:  # the model's check of the image ("image 8x8 is too small ...")
        if isinstance(e, ValueError) and not str(e).startswith("image "):
            raise
        raise ConfigError(
            f"--img-size must be an image size {args.model} takes, got {args.img_size}: {e}"
        ) from e
    setting = {
        "model": args.model,
        "config": args.config or "",
        "img_size": args.img_size,
        "batch": args.batch,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        "dtype": args.dtype + (" (autocast)" if autocast else ""),
        "train": args.train,
        "torch": torch.__version__,
        "vit3": vit3.__version__,
        BACKEND_ENV: os.environ.get(BACKEND_ENV, ""),
        STRICT_ENV: os.environ.get(STRICT_ENV, ""),
    }
    if args.json:
        print(
            json.dumps({**setting, "mixers": report.to_dict(), "blocks": report.blocks_to_dict()}, indent=2)
        )
    else:
        print(" | ".join(f"{key} {value}" for key, value in setting.items() if value not in ("", False)))
        print(report)
    return 0


def _read_config(args: argparse.Namespace) -> Config:
    """The classification config ``args.config``; fills ``args.model`` from its ``model.name``.

    Raises:
        ConfigError: the config is not a classification one, names another model than ``args.model``, or
            none (``model.name: ""``, the model of ``model.pretrained``) where no model is named either.
    """
    cfg = load_config(args.config)
    if cfg.task != "classification":
        raise ConfigError(
            f"--config {args.config}: vit3-explain takes classification configs, this one's task is "
            f"{cfg.task}; name its model instead (vit3-explain MODEL --img-size N)"
        )
    name = cfg.model.name
    if not name and args.model is None:
        raise ConfigError(
            f"{args.config} has no model.name (its model is model.pretrained's): name the model, e.g. "
            f"vit3-explain h_vit3_tiny --config {args.config}"
        )
    if name and args.model not in (None, name):
        raise ConfigError(
            f"model {args.model} and {args.config}'s model.name {name} differ: give one of them"
        )
    args.model = args.model or name
    return cfg


def _build(args: argparse.Namespace, cfg: Config | None) -> nn.Module:
    """The model to explain; sets ``args.img_size`` where no flag gave it.

    Without a config: ``args.model`` built for ``--img-size`` (224) where it takes one (a timm ViT fixes its
    patch grid). With one: by ``train.py``'s ``build_model`` (``model.kwargs``, ``drop_path_rate``; gradient
    checkpointing too) with ``model.num_classes`` classes (1000 where the data would say: a head's width
    routes no mixer), at the image size training resolves (``data.img_size``, else the size the model was
    built at).
    """
    if cfg is None:
        args.img_size = args.img_size or 224
        try:
            return timm.create_model(args.model, pretrained=False, img_size=args.img_size)
        except TypeError:  # no img_size argument: the model reads the size from its input
            return timm.create_model(args.model, pretrained=False)
    cfg.set_path("model.name", args.model)
    model, _ = build_model(cfg, int(cfg.model.num_classes or 1000))
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    if args.img_size is None:
        resolve_data_cfg(cfg, model, input_channels(cfg))
        args.img_size = int(cfg.data.img_size)
    return model


if __name__ == "__main__":
    sys.exit(main())
