"""Building blocks of vit3: the TTT mixer, its inner models and losses, 2-D RoPE."""

from . import inner_models
from .config import INNER_LOSSES, INNER_MODELS, TTTConfig
from .inner_models import *  # noqa: F403 -- the inner models and their registry, listed once (inner_models.__all__)
from .losses import loss_grad, loss_value
from .rope import apply_rope_2d, rope_angles
from .ttt import OFFICIAL_MIXER_KEYS, TTTMixer, inner_loop, mixer_key_from_official, normalize_grad

__all__ = [
    "INNER_LOSSES",
    "INNER_MODELS",
    "OFFICIAL_MIXER_KEYS",
    "TTTConfig",
    "TTTMixer",
    "apply_rope_2d",
    "mixer_key_from_official",
    "inner_loop",
    "loss_grad",
    "loss_value",
    "normalize_grad",
    "rope_angles",
    *inner_models.__all__,
]
