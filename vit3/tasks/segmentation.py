"""Semantic segmentation on vit3 backbones: UperNet (PPM + FPN) and a light semantic-FPN head.

- :class:`UperHead` follows UperNet as in mmseg (the official ViT³ ADE20K setup): a pyramid pooling module
  (scales 1, 2, 3, 6) on the stride-32 map, 1x1 laterals + top-down sum on the others, 3x3 FPN convs, all
  levels upsampled to stride 4, concatenated, fused by a 3x3 conv, dropout 0.1, 1x1 classifier.
- :class:`FCNHead`: the auxiliary head on the stride-16 map (loss weight 0.4 in the official recipe).
- :class:`SemanticFPNHead`: Panoptic-FPN's semantic branch (FPN neck, per-level 3x3 conv + 2x upsample
  stacks down to stride 4, summed, classifier): lighter than UperNet.
- :class:`SegmentationModel`: backbone + head(s); ``forward(x, target)`` gives the losses, ``predict``
  whole-image or sliding-window inference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .backbone import FeatureBackbone, PyramidBackbone

HEADS = ("upernet", "semantic_fpn")
IGNORE_INDEX = 255


def conv_bn_relu(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    """``k x k`` conv (same padding, no bias) + BatchNorm + ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


def resize(x: Tensor, size: Sequence[int]) -> Tensor:
    """Bilinear resize of ``[B, C, h, w]`` to ``size`` (no-op when equal)."""
    return (
        x
        if tuple(x.shape[-2:]) == tuple(size)
        else F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    )


def top_down(laterals: list[Tensor]) -> list[Tensor]:
    """FPN top-down pathway: each level plus the upsampled coarser level, coarsest first (in place order
    kept)."""
    out = list(laterals)
    for i in range(len(out) - 1, 0, -1):
        out[i - 1] = out[i - 1] + resize(out[i], out[i - 1].shape[-2:])
    return out


class PPM(nn.Module):
    """Pyramid pooling: ``[B, C, h, w]`` -> ``[B, channels, h, w]`` (pooled branches + input, fused by
    3x3)."""

    def __init__(self, in_channels: int, channels: int, scales: Sequence[int] = (1, 2, 3, 6)) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(s), conv_bn_relu(in_channels, channels, 1)) for s in scales
        )
        self.bottleneck = conv_bn_relu(in_channels + len(scales) * channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        pooled = [resize(b(x), x.shape[-2:]) for b in self.branches]
        return self.bottleneck(torch.cat([x, *pooled], 1))


class UperHead(nn.Module):
    """UperNet decode head.

    Args:
        in_channels: channels of the four maps (strides 4..32).
        num_classes: output classes.
        channels: head width (512 in the official configs).
        dropout: before the classifier.

    Forward: four maps -> ``[B, num_classes, H/4, W/4]`` logits.
    """

    def __init__(
        self, in_channels: Sequence[int], num_classes: int, channels: int = 512, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.ppm = PPM(in_channels[-1], channels)
        self.laterals = nn.ModuleList(conv_bn_relu(c, channels, 1) for c in in_channels[:-1])
        self.fpn_convs = nn.ModuleList(conv_bn_relu(channels, channels) for _ in in_channels[:-1])
        self.fuse = conv_bn_relu(len(in_channels) * channels, channels)
        self.classifier = nn.Sequential(nn.Dropout2d(dropout), nn.Conv2d(channels, num_classes, 1))

    def forward(self, feats: list[Tensor]) -> Tensor:
        levels = top_down([lat(f) for lat, f in zip(self.laterals, feats)] + [self.ppm(feats[-1])])
        outs = [conv(x) for conv, x in zip(self.fpn_convs, levels[:-1])] + [levels[-1]]
        size = outs[0].shape[-2:]
        return self.classifier(self.fuse(torch.cat([resize(o, size) for o in outs], 1)))


class FCNHead(nn.Module):
    """Auxiliary head: one 3x3 conv-BN-ReLU, dropout, 1x1 classifier on one map (``in_index``)."""

    def __init__(
        self, in_channels: int, num_classes: int, channels: int = 256, in_index: int = 2, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.in_index = in_index
        self.layers = nn.Sequential(
            conv_bn_relu(in_channels, channels), nn.Dropout2d(dropout), nn.Conv2d(channels, num_classes, 1)
        )

    def forward(self, feats: list[Tensor]) -> Tensor:
        return self.layers(feats[self.in_index])


class SemanticFPNHead(nn.Module):
    """Panoptic-FPN semantic head with its FPN neck.

    Args:
        in_channels: channels of the four maps (strides 4..32).
        num_classes: output classes.
        fpn_channels: FPN neck width (256).
        channels: per-level conv width (128).

    Forward: four maps -> ``[B, num_classes, H/4, W/4]`` logits.
    """

    def __init__(
        self,
        in_channels: Sequence[int],
        num_classes: int,
        fpn_channels: int = 256,
        channels: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.laterals = nn.ModuleList(nn.Conv2d(c, fpn_channels, 1) for c in in_channels)
        self.fpn_convs = nn.ModuleList(
            nn.Conv2d(fpn_channels, fpn_channels, 3, padding=1) for _ in in_channels
        )
        # Level i (stride 4 * 2^i) gets max(i, 1) conv blocks, each but the first-level one followed by a 2x
        # upsample.
        self.scale_heads = nn.ModuleList(
            nn.Sequential(
                *[conv_bn_relu(fpn_channels if j == 0 else channels, channels) for j in range(max(i, 1))]
            )
            for i in range(len(in_channels))
        )
        self.classifier = nn.Sequential(nn.Dropout2d(dropout), nn.Conv2d(channels, num_classes, 1))

    def forward(self, feats: list[Tensor]) -> Tensor:
        levels = [
            conv(x)
            for conv, x in zip(self.fpn_convs, top_down([lat(f) for lat, f in zip(self.laterals, feats)]))
        ]
        size = levels[0].shape[-2:]
        out = 0
        for i, (head, x) in enumerate(zip(self.scale_heads, levels)):
            for block in head:
                x = block(x)
                if i:  # upsample 2x after every block of the coarser levels
                    x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
            out = out + resize(x, size)
        return self.classifier(out)


class SegmentationModel(nn.Module):
    """Backbone + decode head (+ optional auxiliary FCN head).

    Args:
        backbone: a :class:`PyramidBackbone` (four maps at strides 4..32).
        head: ``upernet`` or ``semantic_fpn``.
        num_classes: output classes.
        aux_weight: loss weight of the auxiliary FCN head on the stride-16 map (0 disables the head).
        head_channels: decode head width (UperNet 512, semantic FPN per-level width 128).
        ignore_index: label ignored by the loss and metrics.
    """

    def __init__(
        self,
        backbone: PyramidBackbone,
        num_classes: int,
        head: str = "upernet",
        aux_weight: float = 0.4,
        head_channels: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"unknown segmentation head {head!r}; expected one of {HEADS}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.backbone, self.num_classes, self.ignore_index = backbone, num_classes, ignore_index
        chans = backbone.channels
        if head == "upernet":
            self.head = UperHead(chans, num_classes, channels=head_channels or 512)
        else:
            self.head = SemanticFPNHead(chans, num_classes, channels=head_channels or 128)
        self.aux_weight = aux_weight
        self.aux_head = (
            FCNHead(chans[2], num_classes, channels=max((head_channels or 512) // 2, 16))
            if aux_weight
            else None
        )

    @property
    def data_config(self) -> dict:
        """The timm backbone's preprocessing (mean, std, ...)."""
        return self.backbone.backbone.data_config

    def forward(self, x: Tensor, target: Tensor | None = None) -> Tensor | dict[str, Tensor]:
        """Decode-head logits ``[B, K, H/4, W/4]`` of ``[B, 3, H, W]`` images, or the losses given ``target``.

        With ``target`` (``[B, H, W]`` int64), returns the cross-entropy losses (ignoring ``ignore_index``) of
        the logits upsampled to the label size: ``loss_seg`` and, with the auxiliary head, ``loss_aux``.
        """
        if target is None:
            return self.head(self.backbone(x))
        feats = self.backbone(x)
        out = {
            "loss_seg": F.cross_entropy(
                resize(self.head(feats), target.shape[-2:]), target, ignore_index=self.ignore_index
            )
        }
        if self.aux_head is not None:
            aux = resize(self.aux_head(feats), target.shape[-2:])
            out["loss_aux"] = self.aux_weight * F.cross_entropy(aux, target, ignore_index=self.ignore_index)
        return out

    def _logits(self, x: Tensor, size_divisor: int) -> Tensor:
        """Whole-image logits ``[B, K, H, W]``, padding the input to a multiple of ``size_divisor``."""
        h, w = x.shape[-2:]
        ph, pw = -h % size_divisor, -w % size_divisor
        logits = self(F.pad(x, (0, pw, 0, ph)))
        return resize(logits, (h + ph, w + pw))[..., :h, :w]

    @torch.no_grad()
    def predict(
        self,
        x: Tensor,
        out_size: Sequence[int] | None = None,
        mode: str = "whole",
        crop_size: Sequence[int] = (512, 512),
        stride: Sequence[int] = (341, 341),
        size_divisor: int = 32,
    ) -> Tensor:
        """Class scores (softmax) for ``[B, 3, H, W]`` images, resized to ``out_size`` (default ``(H, W)``).

        Args:
            mode: ``whole`` (one pass) or ``slide`` (``crop_size`` windows every ``stride`` pixels, scores
                averaged where they overlap, as mmseg's slide inference; the official ADE20K eval uses whole).

        Returns:
            ``[B, K, *out_size]`` probabilities.
        """
        if mode == "whole":
            logits = self._logits(x, size_divisor)
        elif mode == "slide":
            b, _, h, w = x.shape
            (ch, cw), (sh, sw) = crop_size, stride
            logits = x.new_zeros(b, self.num_classes, h, w)
            count = x.new_zeros(1, 1, h, w)
            for i in range(max(h - ch + sh - 1, 0) // sh + 1):
                for j in range(max(w - cw + sw - 1, 0) // sw + 1):
                    y1, x1 = min(i * sh, max(h - ch, 0)), min(j * sw, max(w - cw, 0))
                    y2, x2 = min(y1 + ch, h), min(x1 + cw, w)
                    logits[..., y1:y2, x1:x2] += self._logits(x[..., y1:y2, x1:x2], size_divisor)
                    count[..., y1:y2, x1:x2] += 1
            logits = logits / count
        else:
            raise ValueError(f"unknown inference mode {mode!r}; expected 'whole' or 'slide'")
        return resize(logits, out_size or x.shape[-2:]).softmax(1)


def build_segmenter(
    model_name: str,
    num_classes: int,
    head: str = "upernet",
    aux_weight: float = 0.4,
    head_channels: int | None = None,
    backbone_kwargs: dict | None = None,
) -> SegmentationModel:
    """Builds a :class:`SegmentationModel` on a timm backbone (plain ones get ViTDet's simple pyramid)."""
    backbone = PyramidBackbone(FeatureBackbone(model_name, **(backbone_kwargs or {})))
    return SegmentationModel(backbone, num_classes, head, aux_weight, head_channels)
