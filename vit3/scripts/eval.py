"""Evaluate a checkpoint: top-1/top-5, throughput, peak memory, params and FLOPs, written as JSON.

    python eval.py --checkpoint output/demo/best.pt                  # the demo's own val split
    python eval.py --checkpoint run/best.pt --data /data/imagenet --img-size 224 256 --ema
    python eval.py --checkpoint h_vittt_t.pth --model h_vit3_tiny --data /data/imagenet   # official file
    python eval.py --checkpoint output/gen_demo/last.pt --sampler ddim --steps 50 --cfg-scale 4   # generation

A vit3 checkpoint needs only ``--checkpoint``; an official file takes ``--model`` and ``--config``.
``key.sub=value`` overrides apply anywhere on the command line. A mistake in the input ends with one
``error:`` line and exit code 2 (``--debug`` shows the traceback). Details: docs/training.md.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from vit3.engine import load_config, run
from vit3.engine.checkpoint import config_for_checkpoint
from vit3.engine.cli import ArgumentParser, check_flag_overrides, flag_override, run_cli
from vit3.engine.config.path_checks import existing
from vit3.errors import ConfigError
from vit3.models.record import file_task

# Where a generation checkpoint's evaluation (its sampler) reads what these flags set.
GENERATION_KEYS = {"eval.use_ema": "sample.use_ema", "eval.batch_size": "sample.batch_size"}


def _task(args: argparse.Namespace) -> str:
    """The task of the evaluation: ``--config``'s, else the checkpoint's (an official file:
    classification)."""
    if args.config is None:
        return file_task(args.checkpoint) or "classification"
    with warnings.catch_warnings():  # its warnings come with the evaluation's own load
        warnings.simplefilter("ignore")
        return str(load_config(args.config).get("task", "classification"))


def _task_flags(
    flags: dict[str, tuple[str, object]], task: str, checkpoint: str
) -> dict[str, tuple[str, object]]:
    """``flags`` (key -> (flag, value)) with each key the one ``task``'s evaluation reads; a flag given that
    it does not read is refused.

    Raises:
        ConfigError: naming the flag, the task it applies to and the checkpoint's.
    """
    generation = task == "generation"
    for key, (flag, value) in flags.items():
        if value is None:
            continue
        if generation and key == "eval.img_sizes":
            raise ConfigError(
                f"{flag} sets classification resolutions; {checkpoint} is a generation checkpoint, which "
                "samples "
                f"at the size it was trained at (data.img_size)"
            )
        # a checkpoint's own data.path may be gone (its sampler reads data only for FID); a given one is read
        why = existing("folder")(value, None) if generation and key == "data.path" else None
        if why:
            raise ConfigError(
                f"config key {key} (eval.py {flag}) must be an existing folder, got '{value}': {why}"
            )
        if not generation and key.startswith("sample."):
            raise ConfigError(
                f"{flag} ({key}) applies to generation checkpoints; {checkpoint} is a {task} checkpoint"
            )
    return {GENERATION_KEYS.get(key, key): v for key, v in flags.items()} if generation else flags


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
    task = _task(args)
    flags = _task_flags(flags, task, args.checkpoint)
    check_flag_overrides(overrides, flags)
    for key, (_, value) in flags.items():
        if value is not None and key != "eval.checkpoint":
            # --data is an image folder, but for a dense checkpoint, which keeps its dataset (COCO, ADE20K)
            dense = task in ("detection", "segmentation")
            overrides += ["data.dataset=folder"] if key == "data.path" and not dense else []
            overrides.append(flag_override(key, value))
    overrides.append(flag_override("eval.checkpoint", args.checkpoint))
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
