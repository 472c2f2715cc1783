"""What a dense run (detection / segmentation) is built from: the ``dense:`` section of its config, the
datasets (COCO or ADE20K layout, or the synthetic digits written on first use), the detector or segmenter
around a vit3 backbone (weights from a classification checkpoint). :mod:`vit3.engine.dense` trains and
evaluates on them; their parameter groups and lr schedule are in :mod:`vit3.engine.optim`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..data.ade import ADESegmentation
from ..data.coco import CocoDetection
from ..errors import DataError
from ..models import load_checkpoint_file, to_our_names
from ..models.record import peek_vit3_checkpoint, require_classifier
from ..tasks.backbone import FeatureBackbone
from ..tasks.detection import build_detector
from ..tasks.segmentation import build_segmenter
from .checkpoint import CheckpointError, CheckpointMismatchError
from .config import Config, ConfigError, model_arguments

__all__ = [
    "build_dataset",
    "build_dense_model",
    "dense_backbone",
    "dense_section",
    "ensure_synthetic",
    "load_backbone_weights",
    "model_and_data",
]


def dense_section(cfg: Config) -> Config:
    """The ``dense:`` section of ``cfg`` (a ConfigError where there is none)."""
    if "dense" not in cfg:
        raise ConfigError(f"task '{cfg.task}' needs a 'dense:' config section (see configs/dense/*.yaml)")
    return cfg.dense


# ----------------------------------------------------------------------------------------------- data


def _ann_file(cfg: Config, split: str, override: str | None) -> Path:
    return Path(override) if override else Path(cfg.data.path) / "annotations" / f"instances_{split}.json"


def ensure_synthetic(cfg: Config) -> Path:
    """Writes the synthetic digit data of ``dense.synthetic`` to ``data.path`` unless it is already there."""
    from ..data.synthetic_dense import make_synthetic_ade, make_synthetic_coco

    root, syn = Path(cfg.data.path), cfg.dense.synthetic
    if root.exists():
        return root
    splits = dict(syn.splits or {cfg.data.train_split: 64, cfg.data.val_split: 16})
    kw = dict(
        image_size=syn.image_size,
        max_per_image=syn.max_per_image,
        digit_size=tuple(syn.digit_size),
        seed=cfg.seed,
    )
    tmp = root.with_name(root.name + ".tmp")  # write aside, then move: a killed run leaves no half dataset
    make = make_synthetic_coco if cfg.task == "detection" else make_synthetic_ade
    make(tmp, splits, digits=tuple(syn.digits), **kw)
    tmp.replace(root)
    return root


def build_dataset(
    cfg: Config,
    train: bool,
    mean: tuple[float, ...] = (0.485, 0.456, 0.406),
    std: tuple[float, ...] = (0.229, 0.224, 0.225),
) -> CocoDetection | ADESegmentation:
    """The training or validation dataset of a dense config (COCO or ADE20K layout; ``mean`` / ``std``:
    the segmentation normalisation, detectors normalise inside the model)."""
    d = dense_section(cfg)
    expected = ("coco", "digits") if cfg.task == "detection" else ("ade20k", "digits")
    if cfg.data.dataset not in expected:
        raise ConfigError(
            f"data.dataset '{cfg.data.dataset}' does not fit task {cfg.task}: expected one of {expected}"
        )
    if cfg.data.dataset == "digits":
        ensure_synthetic(cfg)
    split = cfg.data.train_split if train else cfg.data.val_split
    if cfg.task == "detection":
        ann = _ann_file(cfg, split, d.ann_train if train else d.ann_val)
        return CocoDetection(Path(cfg.data.path) / split, ann, train=train, with_masks=d.arch == "mask_rcnn")
    return ADESegmentation(
        cfg.data.path,
        split,
        d.num_classes,
        train=train,
        mean=mean,
        std=std,
        scale=tuple(d.scale),
        crop_size=tuple(d.crop_size),
        ratio_range=tuple(d.ratio_range),
        reduce_zero_label=d.reduce_zero_label,
        cat_max_ratio=d.cat_max_ratio,
    )


# ---------------------------------------------------------------------------------------------- model


def _backbone_kwargs(cfg: Config) -> dict[str, Any]:
    d = cfg.dense
    kw = dict(cfg.model.kwargs or {})
    kw["drop_path_rate"] = cfg.model.drop_path_rate
    if d.out_indices is not None:
        kw["out_indices"], kw["indices_from"] = tuple(d.out_indices), "dense.out_indices"
    return kw


def build_dense_model(cfg: Config, num_classes: int) -> nn.Module:
    """Detector or segmenter of ``cfg`` (backbone weights from ``model.pretrained`` when set)."""
    d = dense_section(cfg)
    with (
        model_arguments(cfg.model.name, cfg.model.kwargs or {}),
        model_arguments(d.arch, d.get("detector_kwargs") or {}, "dense.detector_kwargs"),
    ):
        model = _build_dense_model(cfg, d, num_classes)
    if cfg.model.pretrained:
        load_backbone_weights(dense_backbone(model), cfg.model.pretrained, use_ema=cfg.model.pretrained_ema)
    if cfg.model.grad_checkpointing:
        dense_backbone(model).set_grad_checkpointing(True)
    return model


def _build_dense_model(cfg: Config, d: Config, num_classes: int) -> nn.Module:
    if cfg.task == "detection":
        min_size = d.min_size if isinstance(d.min_size, int) else tuple(d.min_size)
        return build_detector(
            cfg.model.name,
            num_classes,
            arch=d.arch,
            out_channels=d.out_channels,
            min_size=min_size,
            max_size=d.max_size,
            anchor_sizes=tuple(d.anchor_sizes),
            box_head_dim=d.box_head_dim,
            mask_head_dim=d.mask_head_dim,
            backbone_kwargs=_backbone_kwargs(cfg),
            box_detections_per_img=d.detections_per_img,
            image_mean=_rgb_stat(cfg, "mean"),
            image_std=_rgb_stat(cfg, "std"),
            **(d.detector_kwargs or {}),
        )
    return build_segmenter(
        cfg.model.name, num_classes, d.arch, d.aux_weight, d.head_channels, _backbone_kwargs(cfg)
    )


def _rgb_stat(cfg: Config, key: str) -> tuple[float, ...] | None:
    """``data.mean`` or ``data.std`` of a dense config, one value per RGB channel (``None``: unset, the
    backbone's)."""
    values = cfg.data.get(key)
    if not values:
        return None
    if len(values) != 3:
        raise ConfigError(f"data.{key} must hold one value per RGB channel (3), got {list(values)}")
    return tuple(float(v) for v in values)


def dense_backbone(model: nn.Module) -> FeatureBackbone:
    return model.backbone.backbone


def load_backbone_weights(backbone: FeatureBackbone, path: str, use_ema: bool = False) -> list[str]:
    """Loads ImageNet weights (a vit3 checkpoint or an official file) into a ``features_only`` backbone.

    timm's feature wrappers rename modules (``stages.0`` -> ``stages_0``, or add a ``model.`` prefix), so each
    backbone key is matched against the file's keys with those spellings undone; the classifier is ignored.

    Returns:
        Backbone keys that got no weight (the added output norms, normally).

    Raises:
        CheckpointMismatchError: no key matched, or a matched key has another shape.
    """
    obj = peek_vit3_checkpoint(path)
    if obj is not None:
        require_classifier(obj, path, "a backbone's ImageNet weights")
        state = obj["ema" if use_ema else "model"]
        if state is None:
            raise CheckpointError(f"checkpoint {path} holds no EMA weights (trained with train.ema=false)")
    else:
        state = to_our_names(backbone.model_name, load_checkpoint_file(path, use_ema=use_ema))
    body = backbone.body.state_dict()
    loaded, missing = {}, []
    for key, value in body.items():
        head, _, rest = key.partition(".")
        candidates = (key, key.removeprefix("model."), f"{head.replace('_', '.')}.{rest}" if rest else key)
        src = next((c for c in candidates if c in state), None)
        if src is None:
            missing.append(key)
            continue
        if state[src].shape != value.shape:
            raise CheckpointMismatchError(
                f"{path}: weight {src} has shape {tuple(state[src].shape)}, backbone expects "
                f"{tuple(value.shape)}"
            )
        loaded[key] = state[src]
    if not loaded:
        raise CheckpointMismatchError(
            f"{path}: none of its {len(state)} weights fit backbone {backbone.model_name}"
        )
    backbone.body.load_state_dict(loaded, strict=False)
    return missing


def model_and_data(cfg: Config, with_train: bool) -> tuple[nn.Module, Any, Any]:
    """Model, training set (None unless ``with_train``) and validation set of a dense config.

    Detection takes its classes from the COCO files (train and val must agree); segmentation from
    ``dense.num_classes``. Both normalise with the backbone's mean / std (``data.mean`` / ``data.std``
    override).
    """
    d = cfg.dense
    if cfg.task == "detection":
        val_set = build_dataset(cfg, train=False)
        train_set = build_dataset(cfg, train=True) if with_train else None
        if train_set is not None and train_set.label_to_cat_id != val_set.label_to_cat_id:
            raise DataError(
                "train and val annotation files have different categories: "
                f"{sorted(train_set.label_to_cat_id.values())} "
                f"vs {sorted(val_set.label_to_cat_id.values())}"
            )
        return build_dense_model(cfg, val_set.num_classes), train_set, val_set
    if not d.num_classes:
        raise ConfigError("segmentation needs dense.num_classes (150 for ADE20K)")
    model = build_dense_model(cfg, d.num_classes)
    dc = dense_backbone(model).data_config
    mean, std = _rgb_stat(cfg, "mean") or tuple(dc["mean"]), _rgb_stat(cfg, "std") or tuple(dc["std"])
    train_set = build_dataset(cfg, True, mean, std) if with_train else None
    return model, train_set, build_dataset(cfg, False, mean, std)
