"""Dense tasks on vit3 backbones: torchvision Mask / Faster R-CNN detectors and UperNet / semantic-FPN
segmenters, built on timm ``features_only`` models (hierarchical: four stages; plain: ViTDet's simple
feature pyramid). Generation: ``vit3.tasks.diffusion`` (DiT³'s Gaussian diffusion and the official samplers
on diffusers) and ``vit3.tasks.pipeline`` (``DiT3Pipeline``), each imported on its own so that the dense tasks
never need diffusers."""

from .backbone import FeatureBackbone, PyramidBackbone, SimplePyramid, block_layer_ids, pyramid_backbone
from .detection import DetectionBackbone, build_detector
from .segmentation import FCNHead, SegmentationModel, SemanticFPNHead, UperHead, build_segmenter

__all__ = [
    "DetectionBackbone",
    "FCNHead",
    "FeatureBackbone",
    "PyramidBackbone",
    "SegmentationModel",
    "SemanticFPNHead",
    "SimplePyramid",
    "UperHead",
    "block_layer_ids",
    "build_detector",
    "build_segmenter",
    "pyramid_backbone",
]
