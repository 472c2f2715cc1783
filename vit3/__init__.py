"""vit3: Test-Time-Training (ViT³) token mixers and vision backbones for timm.

``import vit3`` registers the vit3 models in timm (``timm.create_model("vit3_small")``);
``vit3.create_dit3("dit3_b_2")`` builds the DiT³ generators (diffusers models, imported on first use: they
need the ``generation`` extra). It is also all ``diffusers.DiffusionPipeline.from_pretrained(folder)`` needs
to load a saved ``DiT3Pipeline`` (``vit3._diffusers_names``; no diffusers import).
"""

from typing import Any

from ._diffusers_names import expose_pipelines
from .layers import TTTConfig, TTTMixer
from .layers.ttt import explain
from .models import HViT3, ViT3, swap_attention_for_ttt  # registers the timm models

__version__ = "0.1.0"

expose_pipelines()  # diffusers finds DiT3Pipeline by name once it is imported

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


def __getattr__(name: str) -> Any:
    if name in ("DiT3", "create_dit3"):  # DiT³ needs diffusers: imported on first use
        from .models import dit3

        return getattr(dit3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
