"""Train (or fine-tune) a vit3 / timm model from a YAML config.

    python train.py                                   # the embedded demo: MNIST digits, a few minutes on CPU
    python train.py --config configs/imagenet/h_vit3_tiny.yaml data.path=/data/imagenet
    torchrun --nproc_per_node=8 train.py --config configs/imagenet/vit3_small.yaml data.path=/data/imagenet
    python train.py --config configs/finetune.yaml data.path=/data/flowers model.pretrained=best.pt
    python train.py --resume output/demo/last.pt      # continue a run exactly (its config, task, folder)

Any config key can be overridden as ``key.sub=value`` (YAML, anywhere on the command line; see
configs/default.yaml). A run never writes over another run's checkpoints unless ``--overwrite`` (which moves
them aside); a mistake ends with one ``error:`` line, exit 2. Details: ``docs/errors-and-outputs.md``.
"""

from __future__ import annotations

import argparse
import sys

from vit3.engine import load_config, run
from vit3.engine.checkpoint import config_for_resume
from vit3.engine.cli import ArgumentParser, check_flag_overrides, flag_override, run_cli
from vit3.engine.config import CONFIG_DIR, parse_override

DEMO_CONFIG = CONFIG_DIR / "demo_mnist.yaml"


def _train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    check_flag_overrides(
        overrides,
        {
            "output": ("--output", args.output),
            "train.resume": ("--resume", args.resume),
            "train.overwrite": ("--overwrite", True if args.overwrite else None),
        },
    )
    if args.overwrite:
        overrides.append("train.overwrite=true")
    resume = args.resume
    if resume is None:  # train.resume=FILE is --resume FILE
        given = [value for key, value in map(parse_override, args.overrides) if key == "train.resume"]
        resume = str(given[-1]) if given and given[-1] else None
    if resume is not None and resume != "auto":
        cfg = config_for_resume(resume, args.config, overrides, args.output)
    else:  # a new run, or train.resume=auto (<output>/last.pt if it exists: the config names the folder)
        if resume == "auto":
            overrides.append("train.resume=auto")
        if args.output is not None:
            overrides.append(flag_override("output", args.output))
        cfg = load_config(args.config or DEMO_CONFIG, overrides)
    run(cfg, "train")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        default=None,
        help=f"YAML config (default: {DEMO_CONFIG}; with --resume: the checkpoint's own config)",
    )
    parser.add_argument(
        "--resume",
        default=None,
        help="checkpoint to continue exactly, in its own folder "
        "(train.resume; auto: <output>/last.pt if any)",
    )
    parser.add_argument("--output", default=None, help="run directory (output)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start in a folder that holds another run's checkpoints, after moving that run's files into "
        "<output>/replaced-<time>/ (train.overwrite)",
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return run_cli(parser, _train, argv)


if __name__ == "__main__":
    sys.exit(main())
