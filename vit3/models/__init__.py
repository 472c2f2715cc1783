"""vit3.models: ViT³ backbones registered in timm (``timm.create_model("vit3_small")``), TTT for timm models,
and DiT³ for class-conditional generation (``create_dit3``; not a timm classifier, so not registered)."""

from .dit3 import DiT3, create_dit3
from .h_vit3 import HViT3
from .swap import swap_attention_for_ttt
from .vit3 import ViT3

__all__ = ["DiT3", "HViT3", "ViT3", "create_dit3", "swap_attention_for_ttt"]
