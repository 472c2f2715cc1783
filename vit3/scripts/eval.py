"""Evaluate a checkpoint: top-1/top-5, throughput, peak memory, params and FLOPs, written as JSON.

    python eval.py --checkpoint output/demo/best.pt                  # the demo's own val split
    python eval.py --checkpoint run/best.pt --data /data/imagenet --img-size 224 256 --ema
    python eval.py --checkpoint h_vittt_t.pth --model h_vit3_tiny --data /data/imagenet   # official file
    python eval.py --checkpoint output/gen_demo/last.pt --sampler ddim --steps 50 --cfg-scale 4   # generation

A vit3 checkpoint carries its model (name, kwargs, classes, normalisation) and config (preprocessing,
dataset), so only ``--checkpoint`` is needed; ``--model`` or ``model.kwargs.*`` given anyway win, with a
warning. Class folders of ``--data`` are matched to the model's classes by name (a subset or another order
is fine). An official checkpoint takes its model from ``--model`` and the rest from ``--config`` (default:
configs/default.yaml; for an official DiT³ file a generation config, e.g.
``--config configs/generation/imagenet256.yaml --model dit3_b_2``). Further ``key.sub=value`` overrides
apply on top, anywhere on the command line. A generation checkpoint samples images (grid PNG, ``.npz`` for
the reference evaluation suite) and computes the metrics its config asks for.
A mistake in the input ends with one ``error:`` line and exit code 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import sys

from vit3.engine import run
from vit3.engine.checkpoint import config_for_checkpoint
from vit3.engine.cli import ArgumentParser, check_flag_overrides, run_cli


def _evaluate(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    flags = {
        "eval.checkpoint": ("--checkpoint", args.checkpoint),
        "model.name": ("--model", args.model),
        "data.path": ("--data", args.data),
        "eval.img_sizes": ("--img-size", None if args.img_size is None else list(args.img_size)),
        "eval.use_ema": ("--ema", True if args.ema else None),
        "eval.batch_size": ("--batch-size", args.batch_size),
        "eval.json": ("--json", args.json),
    }
    for key in ("sampler", "steps", "cfg_scale", "num_samples"):
        flags[f"sample.{key}"] = (f"--{key.replace('_', '-')}", getattr(args, key))
    check_flag_overrides(overrides, flags)
    if args.model is not None:
        overrides.append(f"model.name={args.model}")
    if args.data is not None:
        overrides += ["data.dataset=folder", f"data.path={args.data}"]
    if args.img_size is not None:
        overrides.append(f"eval.img_sizes={list(args.img_size)}")
    if args.ema:
        overrides.append("eval.use_ema=true")
    if args.batch_size is not None:
        overrides.append(f"eval.batch_size={args.batch_size}")
    if args.json is not None:
        overrides.append(f"eval.json={args.json}")
    for key in ("sampler", "steps", "cfg_scale", "num_samples"):
        if getattr(args, key) is not None:
            overrides.append(f"sample.{key}={getattr(args, key)}")
    overrides.append(f"eval.checkpoint={args.checkpoint}")
    run(config_for_checkpoint(args.checkpoint, args.config, overrides), "eval")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="vit3 checkpoint (.pt) or official weights file")
    parser.add_argument(
        "--config", default=None, help="YAML config (default: the one stored in the checkpoint)"
    )
    parser.add_argument("--model", default=None, help="timm model name (model.name), for official files")
    parser.add_argument("--data", default=None, help="image folder root with val/<class>/ (data.path)")
    parser.add_argument("--img-size", type=int, nargs="+", default=None, help="one or several resolutions")
    parser.add_argument("--ema", action="store_true", help="evaluate the EMA weights (eval.use_ema)")
    parser.add_argument("--batch-size", type=int, default=None, help="eval.batch_size")
    parser.add_argument("--json", default=None, help="output JSON path (eval.json)")
    gen = parser.add_argument_group("generation (task: generation)")
    gen.add_argument("--sampler", choices=("ddpm", "ddim", "dpm++"), default=None, help="sample.sampler")
    gen.add_argument("--steps", type=int, default=None, help="sampling steps (sample.steps)")
    gen.add_argument("--cfg-scale", type=float, default=None, help="guidance scale (sample.cfg_scale)")
    gen.add_argument("--num-samples", type=int, default=None, help="images to generate (sample.num_samples)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return run_cli(parser, _evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
