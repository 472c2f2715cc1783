"""vit3.models: ViT³ backbones registered in timm (``timm.create_model("vit3_small")``) and TTT for timm models."""

from .h_vit3 import HViT3
from .swap import swap_attention_for_ttt
from .vit3 import ViT3

__all__ = ["HViT3", "ViT3", "swap_attention_for_ttt"]
