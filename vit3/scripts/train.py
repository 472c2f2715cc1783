"""Train (or fine-tune) a vit3 / timm model from a YAML config.

    python train.py                                   # the embedded demo: MNIST digits, a few minutes on CPU
    python train.py --config configs/imagenet/h_vit3_tiny.yaml data.path=/data/imagenet
    torchrun --nproc_per_node=8 train.py --config configs/imagenet/vit3_small.yaml data.path=/data/imagenet
    python train.py --config configs/finetune.yaml data.path=/data/flowers model.pretrained=output/demo/best.pt
    python train.py --resume output/demo/last.pt      # continue a run exactly

Any config key can be overridden as ``key.sub=value`` (value parsed as YAML, anywhere on the command line);
see configs/default.yaml. A mistake in the input ends with one ``error:`` line and exit code 2 (``--debug``
or VIT3_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import argparse
import sys

from vit3.engine import load_config, run
from vit3.engine.cli import run_cli
from vit3.engine.config import CONFIG_DIR

DEMO_CONFIG = CONFIG_DIR / "demo_mnist.yaml"


def _train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"train.resume={args.resume}")
    if args.output is not None:
        overrides.append(f"output={args.output}")
    run(load_config(args.config, overrides), "train")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(DEMO_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--resume", default=None, help="checkpoint to continue exactly (train.resume)")
    parser.add_argument("--output", default=None, help="run directory (output)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return run_cli(parser, _train, argv)


if __name__ == "__main__":
    sys.exit(main())
