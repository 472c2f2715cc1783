"""vit3: Test-Time-Training (ViT³) token mixers and vision backbones for timm.

``import vit3`` registers the vit3 models in timm (``timm.create_model("vit3_small")``).
"""

from .layers import TTTConfig, TTTMixer

__version__ = "0.1.0"

__all__ = ["TTTConfig", "TTTMixer", "__version__"]
