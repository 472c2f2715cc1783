"""vit3: Test-Time-Training (ViT³) token mixers and vision backbones for timm.

``import vit3`` registers the vit3 models in timm (``timm.create_model("vit3_small")``);
``vit3.create_dit3("dit3_b_2")`` builds the DiT³ generators.
"""

from .layers import TTTConfig, TTTMixer
from .layers.backends import explain
from .models import DiT3, HViT3, ViT3, create_dit3, swap_attention_for_ttt  # registers the timm models

__version__ = "0.1.0"

__all__ = [
    "DiT3",
    "HViT3",
    "TTTConfig",
    "TTTMixer",
    "ViT3",
    "__version__",
    "create_dit3",
    "explain",
    "swap_attention_for_ttt",
]
