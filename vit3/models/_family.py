"""What the ViT³ backbones (plain :mod:`vit3.models.vit3`, hierarchical :mod:`vit3.models.h_vit3`) share.

* construction: :func:`check_timm_kwargs` (timm's standard kwargs at the values that describe the model),
  :func:`merge_ttt_cfg` (the mixer config, with the rule for ``qkv_bias``), :func:`stochastic_depth_rates`,
  :func:`init_weights` (the official initialisation);
* the classifier API: :class:`ClassifierHeadMixin` (``get_classifier`` / ``reset_classifier`` /
  ``forward_head`` / ``no_weight_decay``) over :func:`pool_features`. ``forward`` stays in each model file:
  FX tracing wraps the leaf functions (``check_image``) found in the globals of the module defining it;
* pretrained configs and checkpoints: :func:`family_cfg` (the official evaluation preprocessing and the
  paper's metadata) and :func:`create_family_model` (the checkpoint filters unwrap a training checkpoint with
  :func:`vit3.models._pretrained.select_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import trunc_normal_
from torch import Tensor, nn

from vit3.layers import TTTConfig

from ._pretrained import create_model_with_official_weights

__all__ = [
    "POOL_TYPES",
    "ClassifierHeadMixin",
    "check_pool_type",
    "check_timm_kwargs",
    "create_family_model",
    "family_cfg",
    "init_weights",
    "merge_ttt_cfg",
    "pool_features",
    "stochastic_depth_rates",
]

POOL_TYPES = ("avg", "max", "avgmax", "")


def check_timm_kwargs(
    model: str, kwargs: dict[str, Any], fixed: dict[str, tuple[tuple[Any, ...], str]]
) -> None:
    """Accepts timm's standard kwargs at the values that describe this model; refuses others by name.

    Raises:
        ValueError: a known timm kwarg with a value this model cannot honour (the message says why).
        TypeError: a kwarg timm's models do not have either.
    """
    for key, value in kwargs.items():
        if key not in fixed:
            raise TypeError(f"{model} got an unexpected keyword argument {key!r}")
        allowed, why = fixed[key]
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise ValueError(f"{model} does not support {key}={value!r}: {why}")


def merge_ttt_cfg(
    ttt_cfg: TTTConfig | dict[str, Any] | None, qkv_bias: bool | None = None, **defaults: Any
) -> TTTConfig:
    """The mixer config of a model: ``defaults`` (the model's own, e.g. ``rope=True``) under a user dict.

    A ``TTTConfig`` instance is taken as the complete mixer spec; a dict only overrides the keys it names.
    ``qkv_bias`` (the timm-style model kwarg) sets the mixers' qkv bias when ``ttt_cfg`` does not; when both
    say it, they must agree.

    Raises:
        ValueError: ``qkv_bias`` contradicts ``ttt_cfg``'s ``qkv_bias`` (the message names both keys).
    """
    if isinstance(ttt_cfg, TTTConfig):
        given, cfg = ttt_cfg.qkv_bias, TTTConfig.create(ttt_cfg)
    else:
        user = dict(ttt_cfg or {})
        given = user.get("qkv_bias")
        cfg = TTTConfig.create({**defaults, **user})
    if qkv_bias is None or given is None:
        return cfg if qkv_bias is None else TTTConfig.create(cfg, qkv_bias=bool(qkv_bias))
    if bool(qkv_bias) != bool(given):
        raise ValueError(
            f"qkv_bias={qkv_bias} contradicts ttt_cfg qkv_bias={given}: set the mixers' qkv bias in one of them"
        )
    return cfg


def pool_features(x: Tensor, pool_type: str, spatial_dims: tuple[int, int]) -> Tensor:
    """Global pooling over ``spatial_dims`` (``'avg'``, ``'max'``, ``'avgmax'``; ``''`` returns ``x``)."""
    if pool_type == "avg":
        return x.mean(spatial_dims)
    if pool_type == "max":
        return x.amax(spatial_dims)
    if pool_type == "avgmax":
        return 0.5 * (x.mean(spatial_dims) + x.amax(spatial_dims))
    return x


def check_pool_type(global_pool: str) -> str:
    """Validates a ``global_pool`` name."""
    if global_pool not in POOL_TYPES:
        raise ValueError(f"global_pool must be one of {POOL_TYPES}, got {global_pool!r}")
    return global_pool


def stochastic_depth_rates(drop_path_rate: float, n: int) -> list[float]:
    """``n`` rates rising linearly from 0 to ``drop_path_rate`` (plain Python: works under the meta device)."""
    return [drop_path_rate * i / max(n - 1, 1) for i in range(n)]


def init_weights(module: nn.Module) -> None:
    """Official init: Linear trunc-normal(0.02) with zero bias, norms to identity; convs keep PyTorch's init."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class ClassifierHeadMixin:
    """timm's classifier API over ``self.head`` (Linear of ``self.num_features``), ``self.head_drop`` and
    ``self.global_pool``; ``spatial_dims`` are the token-grid dims of ``forward_features``' output."""

    spatial_dims: tuple[int, int]
    num_features: int
    num_classes: int
    global_pool: str
    head: nn.Module
    head_drop: nn.Module

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """No named exceptions: like the official optimizer, skip 1-D parameters and biases by shape."""
        return set()

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        """The classifier head."""
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replaces the head with a fresh one of ``num_classes`` (0: identity); optionally changes the pooling."""
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = check_pool_type(global_pool)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Features -> logits ``[B, num_classes]`` (pooled ``[B, C]`` with ``pre_logits``)."""
        x = pool_features(x, self.global_pool, self.spatial_dims)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)


def family_cfg(url: str = "", **kwargs: Any) -> dict[str, Any]:
    """Official evaluation: resize 256 -> center crop 224 (crop_pct 0.875), bicubic, ImageNet mean/std; the
    paper's metadata. ``kwargs`` (``pool_size``, ``first_conv``, ...) complete or override it."""
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "classifier": "head",
        "license": "mit",
        "paper_ids": "arXiv:2512.01643",
        "paper_name": "ViT³: Unlocking Test-Time Training in Vision",
        "origin_url": "https://github.com/LeapLabTHU/ViTTT",
        **kwargs,
    }


def create_family_model(
    cls: type[nn.Module],
    variant: str,
    pretrained: bool,
    filter_fn: Callable[[dict[str, Tensor], Any], dict[str, Tensor]],
    default_out_indices: Any,
    **kwargs: Any,
) -> nn.Module:
    """timm's ``build_model_with_cfg`` with the official-weights loader; ``default_out_indices``: the maps of
    ``features_only`` unless the caller names ``out_indices``."""
    out_indices = kwargs.pop("out_indices", default_out_indices)
    return create_model_with_official_weights(
        cls,
        variant,
        pretrained,
        filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )
