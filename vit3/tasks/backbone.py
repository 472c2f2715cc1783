"""Multi-scale backbones for dense tasks, built from timm ``features_only`` models.

- :class:`FeatureBackbone`: a timm model created with ``features_only=True`` plus one LayerNorm per output
  (as the official dense backbones add), returning NCHW maps. Hierarchical models (H-ViT³) give four maps at
  strides 4, 8, 16, 32; plain models (ViT³) give maps at one stride (16).
- :class:`SimplePyramid`: ViTDet's simple feature pyramid, which turns the last single-stride map into
  strides 4, 8, 16, 32 with transposed convs (up) and max pooling (down).
- :func:`pyramid_backbone`: the two combined, so that dense heads always see four maps at strides 4..32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import timm
from timm.layers import LayerNorm2d
from torch import Tensor, nn

from ..errors import ConfigError

PYRAMID_STRIDES = (4, 8, 16, 32)


def set_grad_checkpointing(model: nn.Module, enable: bool = True) -> None:
    """Turns activation checkpointing on in a timm model or its ``features_only`` wrapper.

    Raises:
        ValueError: neither the model nor the model it wraps supports it.
    """
    for m in (model, getattr(model, "model", None)):
        if m is not None and hasattr(m, "set_grad_checkpointing"):
            m.set_grad_checkpointing(enable)
            return
    raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")


class FeatureBackbone(nn.Module):
    """A timm ``features_only`` model with a LayerNorm on each output map.

    Args:
        model_name: timm model name (``import vit3`` registers the vit3 models).
        out_indices: feature indices passed to timm (None: the model's default).
        pretrained: load timm pretrained weights.
        drop_path_rate: stochastic depth of the backbone.
        out_norm: add a channel LayerNorm per output (the official dense backbones do).
        indices_from: the config key or flag ``out_indices`` came from (named when they do not fit).
        **kwargs: forwarded to ``timm.create_model`` (e.g. ``img_size``, ``pretrained_cfg_overlay``).

    Forward: ``[B, 3, H, W]`` -> list of ``[B, C_i, H / s_i, W / s_i]``.

    Raises:
        ConfigError: ``out_indices`` are not feature levels of the model (the message says which are).
    """

    def __init__(
        self,
        model_name: str,
        out_indices: Sequence[int] | None = None,
        pretrained: bool = False,
        drop_path_rate: float = 0.0,
        out_norm: bool = True,
        indices_from: str = "out_indices",
        **kwargs,
    ) -> None:
        super().__init__()
        if drop_path_rate:
            kwargs["drop_path_rate"] = drop_path_rate
        try:
            self.body = timm.create_model(
                model_name,
                features_only=True,
                pretrained=pretrained,
                **kwargs,
                **({"out_indices": tuple(out_indices)} if out_indices is not None else {}),
            )
        except (AssertionError, IndexError) as e:  # timm's check of the indices (vit3's and timm's models)
            if out_indices is None and "out of range" not in str(e):
                raise
            n = len(timm.create_model(model_name, **kwargs).feature_info)
            levels = f"its {n} feature levels are 0 to {n - 1} (or -{n} to -1 from the last)"
            if out_indices is None:  # timm's default, e.g. the last 3 blocks of a ViT with fewer
                raise ConfigError(
                    f"{model_name}'s default feature levels do not fit it ({e}): {levels}; name those to "
                    "take "
                    f"with {indices_from}"
                ) from e
            raise ConfigError(f"{indices_from} {list(out_indices)} do not fit {model_name}: {levels}") from e
        self.model_name = model_name
        self.channels: list[int] = list(self.body.feature_info.channels())
        self.strides: list[int] = list(self.body.feature_info.reduction())
        self.norms = nn.ModuleList(LayerNorm2d(c) if out_norm else nn.Identity() for c in self.channels)
        self.data_config = timm.data.resolve_model_data_config(self.body)

    @property
    def hierarchical(self) -> bool:
        """True when the outputs have different strides (a multi-stage model)."""
        return len(set(self.strides)) > 1

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing in the timm model."""
        set_grad_checkpointing(self.body, enable)

    def forward(self, x: Tensor) -> list[Tensor]:
        return [norm(f) for norm, f in zip(self.norms, self.body(x))]


class SimplePyramid(nn.Module):
    """ViTDet simple feature pyramid from one map of stride ``in_stride`` to ``PYRAMID_STRIDES``.

    Up by a factor 2^n: n transposed 2x2 convs (stride 2) halving the channels, LayerNorm + GELU between them.
    Down by 2^n: n 2x2 max pools. With ``out_channels``, each level then gets ViTDet's 1x1 conv + LN,
    3x3 conv + LN to ``out_channels``; without, levels keep their channels (``self.channels``).

    Forward: ``[B, C, H/s, W/s]`` -> four maps ``[B, C_i, H/4, W/4] ... [B, C_i, H/32, W/32]``.
    """

    def __init__(self, in_channels: int, in_stride: int = 16, out_channels: int | None = None) -> None:
        super().__init__()
        self.stages = nn.ModuleList()
        self.channels: list[int] = []
        for stride in PYRAMID_STRIDES:
            steps = math.log2(in_stride / stride)
            if steps != int(steps):
                raise ValueError(f"SimplePyramid needs a power-of-two input stride, got {in_stride}")
            layers: list[nn.Module] = []
            c = in_channels
            for i in range(int(steps)):  # upsampling
                if i:
                    layers += [LayerNorm2d(c), nn.GELU()]
                layers.append(nn.ConvTranspose2d(c, c // 2, 2, stride=2))
                c //= 2
            layers += [nn.MaxPool2d(2) for _ in range(int(-steps))]  # downsampling
            if out_channels is not None:
                layers += [
                    nn.Conv2d(c, out_channels, 1, bias=False),
                    LayerNorm2d(out_channels),
                    nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
                    LayerNorm2d(out_channels),
                ]
                c = out_channels
            self.stages.append(nn.Sequential(*layers))
            self.channels.append(c)

    def forward(self, x: Tensor) -> list[Tensor]:
        return [stage(x) for stage in self.stages]


class PyramidBackbone(nn.Module):
    """Backbone whose outputs are always four maps at strides 4, 8, 16, 32.

    Hierarchical backbones pass their maps at those strides through; plain ones feed their last map to a
    :class:`SimplePyramid` (``pyramid_channels`` as its ``out_channels``).

    Forward: ``[B, 3, H, W]`` -> list of four ``[B, C_i, H / s_i, W / s_i]``.
    """

    def __init__(self, backbone: FeatureBackbone, pyramid_channels: int | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        if backbone.hierarchical:
            missing = [s for s in PYRAMID_STRIDES if s not in backbone.strides]
            if missing:
                raise ValueError(f"hierarchical backbone has strides {backbone.strides}, missing {missing}")
            self.pyramid = None
            self.take = [backbone.strides.index(s) for s in PYRAMID_STRIDES]  # e.g. drops a stride-2 map
            self.channels = [backbone.channels[i] for i in self.take]
        else:
            self.pyramid = SimplePyramid(backbone.channels[-1], backbone.strides[-1], pyramid_channels)
            self.channels = self.pyramid.channels
        self.strides = list(PYRAMID_STRIDES)

    def forward(self, x: Tensor) -> list[Tensor]:
        feats = self.backbone(x)
        return [feats[i] for i in self.take] if self.pyramid is None else self.pyramid(feats[-1])


def pyramid_backbone(model_name: str, pyramid_channels: int | None = None, **kwargs) -> PyramidBackbone:
    """Builds a :class:`FeatureBackbone` (``**kwargs``) wrapped in a :class:`PyramidBackbone`."""
    return PyramidBackbone(FeatureBackbone(model_name, **kwargs), pyramid_channels)


def block_layer_ids(backbone: nn.Module) -> tuple[dict[str, int], int]:
    """Depth index of every parameter of a backbone, for layer-wise lr decay.

    Transformer / residual blocks are found as the children of any ``blocks`` container (timm's naming) in
    registration order, which is the order of depth. Parameters before the first block (stem, patch embed) get
    0, those of block i get i + 1, those between blocks (downsampling between stages) the id of the next
    block, and those after the last block (final norms) ``num_blocks + 1``.

    Returns:
        ``({parameter name: layer id}, number of ids)``.
    """
    block_of: dict[int, int] = {}  # id(parameter) -> block index
    n_blocks = 0
    for name, module in backbone.named_modules():
        if name.rsplit(".", 1)[-1] == "blocks" and isinstance(module, (nn.Sequential, nn.ModuleList)):
            for block in module:
                for p in block.parameters():
                    block_of.setdefault(id(p), n_blocks)
                n_blocks += 1
    ids, last = {}, -1  # last: the deepest block seen so far in parameter order
    for name, p in backbone.named_parameters():
        if id(p) in block_of:
            last = max(last, block_of[id(p)])
            ids[name] = block_of[id(p)] + 1
        else:  # stem -> 0; a downsampling layer between stages -> the next block's id; final norms -> last
            ids[name] = 0 if last < 0 else last + 2
    return ids, n_blocks + 2
