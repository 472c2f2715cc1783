"""What the ViT³ backbones (plain :mod:`vit3.models.vit3`, hierarchical :mod:`vit3.models.h_vit3`) share.

Construction (:class:`FamilyBackbone`, :func:`check_timm_kwargs`, :func:`merge_ttt_cfg`, :func:`init_weights`,
:func:`ttt_blocks`, :func:`stochastic_depth_rates`), the classifier API (:class:`ClassifierHeadMixin` over
:func:`pool_features`), the features API (:class:`LayerStackMixin`), and the pretrained configs, checkpoints
and timm registration (:func:`family_cfg`, :data:`OFFICIAL_WEIGHTS`, :func:`create_family_model`,
:func:`register_family`). ``forward`` and the embedding that checks the image stay in each model file: FX
tracing wraps the leaf functions (``check_image``) found in the globals of the module defining ``forward``.

What each piece does: ``docs/design/models.md``.
"""

from __future__ import annotations

import inspect
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import trunc_normal_
from timm.models import checkpoint_seq, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from vit3.errors import ConfigError
from vit3.layers import TTTConfig
from vit3.layers.blocks import TTTBlock

from ._pretrained import apply_checkpoint_record, create_model_with_official_weights, rename_official_keys

__all__ = [
    "OFFICIAL_WEIGHTS",
    "POOL_TYPES",
    "ClassifierHeadMixin",
    "FamilyBackbone",
    "LayerStackMixin",
    "check_image_kwargs",
    "check_pool_type",
    "check_timm_kwargs",
    "create_family_model",
    "family_cfg",
    "init_weights",
    "merge_ttt_cfg",
    "pool_features",
    "register_family",
    "stochastic_depth_rates",
    "ttt_blocks",
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


def _count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def check_image_kwargs(model: str, kwargs: Mapping[str, Any]) -> None:
    """Refuses an ``img_size`` or ``patch_size`` that is not a positive integer or a ``(height, width)`` pair
    of them (``"224"`` would reach timm's layers as a string), an ``embed_dim`` or a stage width of ``dims``
    below 1, and an ``in_chans`` below 1 (a model of no input channel sees no image: every output would be
    its biases).

    Raises:
        ConfigError: naming the kwarg, what it takes and the value given.
    """
    for key in ("img_size", "patch_size"):
        size = kwargs.get(key)
        sides = list(size) if isinstance(size, list | tuple) else [size]
        if size is not None and not (len(sides) in (1, 2) and all(_count(s) for s in sides)):
            raise ConfigError(
                f"{model}: {key} must be a positive integer or (height, width) of them, got {size!r}"
            )
    width = kwargs.get("embed_dim")
    if width is not None and not _count(width):
        raise ConfigError(f"{model}: embed_dim must be a positive integer (the token width), got {width!r}")
    dims = kwargs.get("dims")
    if dims is not None and not (isinstance(dims, list | tuple) and all(_count(d) for d in dims)):
        raise ConfigError(f"{model}: dims must be positive integers (the stage widths), got {dims!r}")
    chans = kwargs.get("in_chans")
    if chans is not None and not _count(chans):
        raise ConfigError(f"{model}: in_chans must be an integer >= 1 (the image channels), got {chans!r}")


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
            f"qkv_bias={qkv_bias} contradicts ttt_cfg qkv_bias={given}: "
            "set the mixers' qkv bias in one of them"
        )
    return cfg


def pool_features(x: Tensor, pool_type: str, spatial_dims: list[int]) -> Tensor:
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


def ttt_blocks(dim: int, num_heads: int, drop_path: Sequence[float], **block: Any) -> nn.Sequential:
    """The blocks of a model or stage: ``TTTBlock(dim, num_heads, drop_path=rate, **block)`` for each
    stochastic-depth rate in ``drop_path``."""
    return nn.Sequential(*[TTTBlock(dim, num_heads, drop_path=rate, **block) for rate in drop_path])


def stochastic_depth_rates(drop_path_rate: float, n: int) -> list[float]:
    """``n`` rates rising linearly from 0 to ``drop_path_rate`` (plain Python: works on the meta device)."""
    return [drop_path_rate * i / max(n - 1, 1) for i in range(n)]


def init_weights(module: nn.Module) -> None:
    """Official init: Linear trunc-normal(0.02), zero bias, norms to identity; convs keep PyTorch's init."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class ClassifierHeadMixin:
    """timm's classifier API over ``self.head`` (Linear of ``self.num_features``), ``self.head_drop`` and
    ``self.global_pool`` (a str); ``self.spatial_dims`` (ints) are the grid dims of ``forward_features``'
    output that ``forward_head`` pools. No class annotations: TorchScript would read them, as strings it
    cannot resolve."""

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """No named exceptions: like the official optimizer, skip 1-D parameters and biases by shape."""
        return set()

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        """The classifier head."""
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replaces the head with a fresh one of ``num_classes`` (0: identity) on the model's device and
        dtype, in its train/eval mode; optionally changes the pooling."""
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = check_pool_type(global_pool)
        if num_classes <= 0:
            self.head = nn.Identity()
            return
        like = next(self.parameters())
        self.head = nn.Linear(self.num_features, num_classes, device=like.device, dtype=like.dtype)
        self.head.train(self.training)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Features -> logits ``[B, num_classes]`` (pooled ``[B, C]`` with ``pre_logits``); unpooled
        (``global_pool=''``) the features themselves, and a classifier's logits a map ``[B, h, w,
        num_classes]`` whatever the features' layout."""
        x = pool_features(x, self.global_pool, self.spatial_dims)
        x = self.head_drop(x)
        if pre_logits:
            return x
        if self.global_pool == "" and self.num_classes > 0 and self.spatial_dims[0] == 2:
            x = x.movedim(1, -1)  # a channels-first map: the classifier reads channels last
        return self.head(x)


class LayerStackMixin:
    """timm's features API over the model's stack of layers ``getattr(self, self.stack_name)`` (an
    ``nn.Sequential``: the plain model's blocks, the hierarchical model's stages) and its final ``self.norm``.

    A model provides ``_embed`` (images ``[B, C_in, H, W]`` -> the stack's input; it checks the image),
    ``_run_stack`` (the stack on it: TorchScript calls no module a method returns), ``_norm_fits`` (whether
    the final norm is sized for layer ``i``'s output), ``_as_features`` (a layer's output ->
    ``forward_features``' layout) and ``_as_fmt`` (a layer's output -> an ``intermediate_fmts`` one); and the
    class attributes ``stack_name`` and ``intermediate_fmts`` (str, tuple of str), the attributes
    ``grad_checkpointing`` and ``norm`` (no class annotations: see :class:`ClassifierHeadMixin`).
    """

    def _embed(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _norm_fits(self, index: int) -> bool:
        raise NotImplementedError

    def _as_features(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _as_fmt(self, x: Tensor, output_fmt: str) -> Tensor:
        raise NotImplementedError

    def _run_stack(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _stack(self) -> nn.Sequential:
        return getattr(self, self.stack_name)

    def _checkpointing(self) -> bool:
        """Whether each layer is recomputed in the backward pass (``set_grad_checkpointing``)."""
        return self.grad_checkpointing and not torch.jit.is_scripting()

    def forward_features(self, x: Tensor) -> Tensor:
        """Images ``[B, C_in, H, W]`` -> the normed, unpooled features (``output_fmt``) that ``forward_head``
        pools."""
        return self._stack_features(x)

    def _stack_features(self, x: Tensor) -> Tensor:
        x = self._embed(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self._stack(), x)
        else:
            x = self._run_stack(x)
        return self._as_features(self.norm(x))

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]] | dict[str, Any]:
        """Forward pass that also returns the outputs of chosen layers (timm's ``forward_intermediates``).

        Args:
            x: images ``[B, C_in, H, W]``.
            indices: last n layers if int, all if None, else the listed layer indices (negative from the end).
            norm: apply the final norm to the intermediates it is sized for (``_norm_fits``).
            stop_early: stop after the last layer asked for.
            output_fmt: one of ``intermediate_fmts`` (``'NCHW'``: ``[B, C_i, h_i, w_i]``).
            intermediates_only: return only the intermediates.
            output_dict: return ``{"image_intermediates": [...], "image_features": final features}`` (no
                ``"image_features"`` with ``intermediates_only``).

        Returns:
            The intermediates, ``(final features, intermediates)`` or the dict; the final features equal
            ``forward_features`` when every layer ran (normed when the norm fits the last layer run).
        """
        if output_fmt not in self.intermediate_fmts:
            *rest, last = (repr(fmt) for fmt in self.intermediate_fmts)
            raise ValueError(f"output_fmt must be {', '.join(rest)} or {last}, got {output_fmt!r}")
        stack = self._stack()
        take_indices, max_index = feature_take_indices(len(stack), indices)
        x = self._embed(x)
        layers = stack if torch.jit.is_scripting() or not stop_early else stack[: max_index + 1]
        intermediates, index = [], -1
        for index, layer in enumerate(layers):
            if self._checkpointing():
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
            if index in take_indices:
                y = self.norm(x) if norm and self._norm_fits(index) else x
                intermediates.append(self._as_fmt(y, output_fmt))
        if intermediates_only and not output_dict:
            return intermediates
        features = self._as_features(self.norm(x) if self._norm_fits(index) else x)
        if output_dict:
            out: dict[str, Any] = {"image_intermediates": intermediates}
            if not intermediates_only:
                out["image_features"] = features
            return out
        return features, intermediates

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drops the layers after the last index kept, the final norm if asked (or when it no longer fits the
        last layer kept) and the head if asked; returns the indices kept."""
        take_indices, max_index = feature_take_indices(len(self._stack()), indices)
        fits = self._norm_fits(max_index)
        setattr(self, self.stack_name, self._stack()[: max_index + 1])
        if prune_norm or not fits:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices


class FamilyBackbone(ClassifierHeadMixin, LayerStackMixin, nn.Module):
    """The construction both ViT³ families share around their own layers: ``__init__`` checks timm's kwargs
    and sets the head's settings and the mixer config ``self.ttt_cfg``; :meth:`_finish`, called after every
    other module, adds the classifier, applies the official init and has ``load_state_dict`` take official
    names.

    Args:
        timm_kwargs: the model's other kwargs, checked against ``fixed`` (:func:`check_timm_kwargs`).
        fixed: timm kwarg -> (the values that describe this model, why another value does not).
        num_classes: classes of the linear head (0: no head).
        global_pool: the head's pooling (:data:`POOL_TYPES`).
        in_chans: image channels.
        num_features: channels of ``forward_features``' output (the head's input).
        ttt_cfg: the user's mixer config, over ``ttt_defaults`` (:func:`merge_ttt_cfg`).
        qkv_bias: the timm-style kwarg for the mixers' qkv bias (:func:`merge_ttt_cfg`).
        **ttt_defaults: the family's own mixer defaults (H-ViT³: ``rope=True``).
    """

    def __init__(
        self,
        timm_kwargs: dict[str, Any],
        fixed: dict[str, tuple[tuple[Any, ...], str]],
        num_classes: int,
        global_pool: str,
        in_chans: int,
        num_features: int,
        ttt_cfg: TTTConfig | dict[str, Any] | None,
        qkv_bias: bool | None,
        **ttt_defaults: Any,
    ) -> None:
        check_timm_kwargs(type(self).__name__, timm_kwargs, fixed)
        super().__init__()
        self.num_classes = num_classes
        self.global_pool = check_pool_type(global_pool)
        self.in_chans = in_chans
        self.num_features = self.head_hidden_size = num_features
        self.grad_checkpointing = False
        self.ttt_cfg = merge_ttt_cfg(ttt_cfg, qkv_bias, **ttt_defaults)
        self.check_finite = (
            self.ttt_cfg.check_finite
        )  # what the image check reads (a value TorchScript reads)

    def _finish(
        self,
        drop_rate: float,
        official_to_ours: Callable[[dict[str, Tensor]], dict[str, Tensor]],
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        """The classifier (dropout ``drop_rate``, then Linear) after every other module, then the official
        init (which draws in module order, as the official code's); official names renamed as any state dict
        loads (``official_to_ours``: the family's); the model on ``device`` in ``dtype`` where given."""
        self.head_drop = nn.Dropout(drop_rate)
        self.reset_classifier(self.num_classes)
        self.apply(init_weights)
        self.register_load_state_dict_pre_hook(partial(rename_official_keys, convert=official_to_ours))
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)


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
    ``features_only`` unless the caller names ``out_indices``.

    Raises:
        ConfigError: a size or width no model has (:func:`check_image_kwargs`).
    """
    taken = inspect.signature(cls.__init__).parameters  # another kwarg is refused by the model's own check
    check_image_kwargs(variant, {key: value for key, value in kwargs.items() if key in taken})
    out_indices = kwargs.pop("out_indices", default_out_indices)
    return create_model_with_official_weights(
        cls,
        variant,
        pretrained,
        filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


# The official release's ImageNet-1k checkpoints (https://github.com/LeapLabTHU/ViTTT), by timm name.
OFFICIAL_WEIGHTS = {
    name: f"https://cloud.tsinghua.edu.cn/f/{file_id}/?dl=1"
    for name, file_id in {
        "vit3_tiny": "e12d1bd1c20c4e06a2da",
        "vit3_small": "4ab59ca54b474dff9b70",
        "vit3_base": "c9e9bb09f85d449ab8cf",
        "h_vit3_tiny": "f0c7c73ceabe49b7b161",
        "h_vit3_small": "3eeab8621a7f43929a87",
        "h_vit3_base": "1d0d7fb840254275b29d",
    }.items()
}


def register_family(
    module: str,
    create: Callable[..., nn.Module],
    variants: Mapping[str, dict[str, Any]],
    stride: int,
    first_conv: str,
) -> dict[str, Any]:
    """Registers a family's variants with timm (``timm.create_model(name)``) and returns its ``default_cfgs``.

    A variant with :data:`OFFICIAL_WEIGHTS` gets the tag ``in1k`` (the official evaluation at 224 px), any
    other one is a test model: tag ``untrained``, evaluated uncropped at its ``img_size``.

    Args:
        module: the family's module (``__name__``): it gets the entrypoints ``module.<name>`` and, before
            timm's ``register_model`` reads it, ``default_cfgs``.
        create: ``create(name, pretrained, **kwargs)`` builds a variant.
        variants: timm name -> architecture (kwargs of the model; the caller's kwargs override them).
        stride: the stride of ``forward_features``' grid (a cfg's ``pool_size`` is its input size over it).
        first_conv: the cfgs' ``first_conv``.
    """
    cfgs = {}
    for name, architecture in variants.items():
        size = 224 if name in OFFICIAL_WEIGHTS else architecture["img_size"]
        cfg = dict(input_size=(3, size, size), pool_size=(size // stride,) * 2, first_conv=first_conv)
        if name in OFFICIAL_WEIGHTS:
            cfgs[f"{name}.in1k"] = family_cfg(OFFICIAL_WEIGHTS[name], **cfg)
        else:
            cfgs[f"{name}.untrained"] = family_cfg(crop_pct=1.0, **cfg)
    mod = sys.modules[module]
    mod.default_cfgs = generate_default_cfgs(cfgs)
    for name, architecture in variants.items():
        setattr(mod, name, register_model(_entrypoint(module, name, create, architecture, stride)))
    return mod.default_cfgs


def _entrypoint(
    module: str, name: str, create: Callable[..., nn.Module], architecture: dict[str, Any], stride: int
) -> Callable[..., nn.Module]:
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        if pretrained:  # a vit3 checkpoint as the weights file: the model of its record
            kwargs = apply_checkpoint_record(name, kwargs, architecture, stride)
        return create(name, pretrained, **{**architecture, **kwargs})

    # timm registers an entrypoint under its name and finds its pretrained cfgs in its module
    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = module
    entrypoint.__doc__ = f"``{name}``: {architecture} (the caller's kwargs override them)."
    return entrypoint
