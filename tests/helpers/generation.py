"""Helpers for the generation tests: a tiny local AutoencoderKL, tiny DiT³ configs on real digits.

Test modules import it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.train import short_run
from vit3.engine import Config, load_config
from vit3.engine.config import CONFIG_DIR

DEMO = CONFIG_DIR / "generation" / "demo_mnist.yaml"

# A DiT³ small enough for a few CPU seconds per epoch on 28x28 digits (patch 4: 7x7 tokens).
TINY_DIT = [
    "model.name=dit3_s_4",
    "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}",
    "data.img_size=28",
]


def write_tiny_vae(root: Path) -> Path:
    """Saves a randomly initialised diffusers AutoencoderKL (3 -> 4 channels, downsampling 2) in ``root``."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    vae.save_pretrained(root)
    return root


def tiny_gen_args(data_root: Path, out: Path, *overrides: str) -> list[str]:
    """The overrides of :func:`tiny_gen_cfg` (``python train.py --config <DEMO>`` takes them for the same
    run)."""
    return [
        *short_run(data_root, out, 3e-3),
        "train.final_eval=false",
        "train.log_every=2",
        "sample.num_samples=8",
        "sample.batch_size=4",
        "sample.steps=3",
        "sample.cfg_scale=2",
        "metrics.classifier=",
        *TINY_DIT,
        *overrides,
    ]


def tiny_gen_cfg(data_root: Path, out: Path, *overrides: str) -> Config:
    """The generation demo on a digit folder with the tiny model: a few seconds per epoch on one CPU core."""
    return load_config(DEMO, tiny_gen_args(data_root, out, *overrides))
