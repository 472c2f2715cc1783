"""Train (or fine-tune) a vit3 / timm model from a YAML config.

    python train.py                                   # the embedded demo: MNIST digits, a few minutes on CPU
    python train.py --config configs/imagenet/h_vit3_tiny.yaml data.path=/data/imagenet
    torchrun --nproc_per_node=8 train.py --config configs/imagenet/vit3_small.yaml data.path=/data/imagenet
    python train.py --config configs/finetune.yaml data.path=/data/flowers model.pretrained=run/best.pt
    python train.py --resume output/demo/last.pt      # continue a run exactly

Any config key can be overridden as ``key.sub=value`` (value parsed as YAML); see configs/default.yaml.
"""

from __future__ import annotations

import argparse
import sys

from vit3.engine import ConfigError, load_config, run
from vit3.engine.config import CONFIG_DIR

DEMO_CONFIG = CONFIG_DIR / "demo_mnist.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(DEMO_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--resume", default=None, help="checkpoint to continue exactly (train.resume)")
    parser.add_argument("--output", default=None, help="run directory (output)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"train.resume={args.resume}")
    if args.output is not None:
        overrides.append(f"output={args.output}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run(cfg, "train")
    return 0


if __name__ == "__main__":
    sys.exit(main())
