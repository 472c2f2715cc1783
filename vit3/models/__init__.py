"""vit3.models: ViT³ backbones registered in timm (``timm.create_model("vit3_small")``), TTT for timm models,
and DiT³ for class-conditional generation (``create_dit3``; not a timm classifier, so not registered).

DiT³ is a diffusers model: ``DiT3`` and ``create_dit3`` import ``vit3.models.dit3`` (and diffusers, the
``generation`` extra) on first use, so the classification models never need diffusers.
"""

from typing import Any

from ._pretrained import load_checkpoint_file
from .h_vit3 import HViT3
from .swap import swap_attention_for_ttt
from .vit3 import ViT3

__all__ = ["DiT3", "HViT3", "ViT3", "create_dit3", "load_checkpoint_file", "swap_attention_for_ttt"]


def __getattr__(name: str) -> Any:
    if name in ("DiT3", "create_dit3"):
        from . import dit3

        return getattr(dit3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
