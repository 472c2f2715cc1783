"""vit3.models: ViT³ backbones registered in timm (``timm.create_model("vit3_small")``), TTT for timm models,
and DiT³ for class-conditional generation (``create_dit3``; not a timm classifier, so not registered).

DiT³ is a diffusers model: ``DiT3`` and ``create_dit3`` import ``vit3.models.dit3`` (and diffusers, the
``generation`` extra) on first use, so the classification models never need diffusers.
"""

from typing import Any

from torch import Tensor

from . import h_vit3, vit3
from ._pretrained import load_checkpoint_file
from .h_vit3 import HViT3
from .swap import swap_attention_for_ttt
from .vit3 import ViT3

__all__ = [
    "DiT3",
    "HViT3",
    "ViT3",
    "create_dit3",
    "load_checkpoint_file",
    "swap_attention_for_ttt",
    "to_our_names",
]


def to_our_names(model_name: str, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state_dict`` in the names of the vit3 model ``model_name`` (a timm name, tag or not): an official
    ViTTT file's keys converted as its family's ``official_to_ours`` does; other models' weights as they
    are."""
    arch = model_name.split(".")[0]
    for family in (vit3, h_vit3):
        if arch in family.VARIANTS:
            return family.official_to_ours(state_dict)
    return state_dict


def __getattr__(name: str) -> Any:
    if name in ("DiT3", "create_dit3"):
        from . import dit3

        return getattr(dit3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
