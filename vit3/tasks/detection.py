"""torchvision Mask R-CNN / Faster R-CNN on vit3 (or any timm ``features_only``) backbones.

The backbone gives four maps at strides 4..32 (:class:`~vit3.tasks.backbone.PyramidBackbone`): hierarchical
models through a torchvision FPN (the official Mask R-CNN neck), plain models through ViTDet's simple
pyramid (which already ends in ``out_channels`` convs, so no top-down path). Both add a stride-64 level by max
pooling (torchvision's ``LastLevelMaxPool``), giving the five levels the RPN expects.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import Tensor, nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from .backbone import FeatureBackbone, PyramidBackbone

ARCHS = ("mask_rcnn", "faster_rcnn")
LEVEL_NAMES = ("0", "1", "2", "3")


class DetectionBackbone(nn.Module):
    """Backbone + neck for torchvision detectors.

    Forward: ``[B, 3, H, W]`` -> ``OrderedDict`` of ``[B, out_channels, H / s, W / s]`` maps named
    ``"0"..."3"`` (strides 4..32) and ``"pool"`` (stride 64). ``out_channels`` is read by torchvision.
    """

    def __init__(self, backbone: FeatureBackbone, out_channels: int = 256) -> None:
        super().__init__()
        self.out_channels = out_channels
        if backbone.hierarchical:
            self.body = PyramidBackbone(backbone)
            self.fpn = FeaturePyramidNetwork(
                self.body.channels, out_channels, extra_blocks=LastLevelMaxPool()
            )
        else:
            self.body = PyramidBackbone(backbone, pyramid_channels=out_channels)
            self.fpn = None
            self.extra = LastLevelMaxPool()

    @property
    def backbone(self) -> FeatureBackbone:
        """The timm feature model (for layer-wise lr and checkpointing)."""
        return self.body.backbone

    def forward(self, x: Tensor) -> OrderedDict[str, Tensor]:
        feats = OrderedDict(zip(LEVEL_NAMES, self.body(x)))
        if self.fpn is not None:
            return self.fpn(feats)
        maps = list(feats.values())
        maps, names = self.extra(maps, maps, list(feats))
        return OrderedDict(zip(names, maps))


def build_detector(
    model_name: str,
    num_classes: int,
    arch: str = "mask_rcnn",
    out_channels: int = 256,
    min_size: int | Sequence[int] = 800,
    max_size: int = 1333,
    anchor_sizes: Sequence[int] = (32, 64, 128, 256, 512),
    box_head_dim: int = 1024,
    mask_head_dim: int = 256,
    backbone_kwargs: dict | None = None,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
    **detector_kwargs,
) -> nn.Module:
    """Builds a torchvision two-stage detector on a timm backbone.

    Args:
        model_name: timm backbone name, e.g. ``h_vit3_tiny`` (hierarchical) or ``vit3_small`` (plain).
        num_classes: object classes, without the background.
        arch: ``mask_rcnn`` or ``faster_rcnn``.
        out_channels: FPN width.
        min_size, max_size: torchvision's resize (shorter side, cap on the longer side); a sequence of
            ``min_size`` values is sampled per image during training (multi-scale training).
        anchor_sizes: one anchor size per level (stride 4..64), three aspect ratios each.
        box_head_dim: width of the two-FC box head (torchvision: 1024).
        mask_head_dim: width of the four-conv mask head and its deconv (torchvision: 256).
        backbone_kwargs: forwarded to :class:`FeatureBackbone` (``pretrained``, ``drop_path_rate``, ...).
        image_mean, image_std: the normalisation (``None``: the backbone's).
        **detector_kwargs: forwarded to the torchvision detector (``box_detections_per_img``, ...).

    Returns:
        The detector.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown detection arch {arch!r}; expected one of {ARCHS}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if len(anchor_sizes) != 5:
        raise ValueError(f"anchor_sizes needs one size per level (5), got {tuple(anchor_sizes)}")
    backbone = FeatureBackbone(model_name, **(backbone_kwargs or {}))
    neck = DetectionBackbone(backbone, out_channels)
    anchors = AnchorGenerator(tuple((s,) for s in anchor_sizes), ((0.5, 1.0, 2.0),) * len(anchor_sizes))
    res = 7  # torchvision's box RoIAlign output size
    heads = {
        "box_head": TwoMLPHead(out_channels * res * res, box_head_dim),
        "box_predictor": FastRCNNPredictor(box_head_dim, num_classes + 1),
    }
    if arch == "mask_rcnn":
        heads["mask_head"] = MaskRCNNHeads(out_channels, (mask_head_dim,) * 4, dilation=1)
        heads["mask_predictor"] = MaskRCNNPredictor(mask_head_dim, mask_head_dim, num_classes + 1)
    cls = MaskRCNN if arch == "mask_rcnn" else FasterRCNN
    return cls(
        neck,
        num_classes=None,  # given through the predictors
        min_size=min_size,
        max_size=max_size,
        image_mean=list(image_mean or backbone.data_config["mean"]),
        image_std=list(image_std or backbone.data_config["std"]),
        rpn_anchor_generator=anchors,
        **heads,
        **detector_kwargs,
    )
