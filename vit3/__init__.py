"""vit3: Test-Time-Training (ViT³) token mixers and vision backbones for timm.

``import vit3`` registers the vit3 models in timm (``timm.create_model("vit3_small")``).
"""

from .layers import TTTConfig, TTTMixer
from .layers.backends import explain
from .models import HViT3, ViT3, swap_attention_for_ttt  # registers the timm models

__version__ = "0.1.0"

__all__ = ["HViT3", "TTTConfig", "TTTMixer", "ViT3", "__version__", "explain", "swap_attention_for_ttt"]
