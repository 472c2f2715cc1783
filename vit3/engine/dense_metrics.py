"""The metrics of the dense tasks: COCO box / mask AP through pycocotools (detection); mIoU, per-class IoU,
pixel accuracy (aAcc) and mAcc from a confusion matrix (segmentation, whole-image or sliding-window
inference); and the JSON they are written as (NaN as null).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..data.ade import IGNORE_INDEX, ADESegmentation
from ..data.coco import CocoDetection
from ..tasks.segmentation import SegmentationModel
from .config import Config

__all__ = [
    "COCO_STATS",
    "coco_results",
    "confusion_matrix",
    "evaluate_dense",
    "evaluate_detection",
    "evaluate_segmentation",
    "nan_free_json",
    "scalars",
    "segmentation_metrics",
]

COCO_STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of ``metrics`` (for logs and history rows)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def nan_free_json(obj: Any) -> str:
    """JSON text with NaN (a COCO size range without objects, a class never seen) written as null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), indent=1)


def coco_results(
    outputs: dict[str, Tensor], image_id: int, label_to_cat_id: dict[int, int]
) -> tuple[list, list]:
    """torchvision detector outputs of one image -> COCO ``bbox`` and ``segm`` result entries."""
    from pycocotools import mask as mask_utils

    boxes = outputs["boxes"].float().cpu()
    boxes[:, 2:] -= boxes[:, :2]  # xyxy -> xywh
    scores, labels = outputs["scores"].float().cpu().tolist(), outputs["labels"].cpu().tolist()
    bbox = [
        {
            "image_id": image_id,
            "category_id": label_to_cat_id[lab],
            "bbox": [round(v, 2) for v in box],
            "score": s,
        }
        for box, lab, s in zip(boxes.tolist(), labels, scores)
    ]
    segm = []
    if "masks" in outputs:
        masks = (outputs["masks"][:, 0] > 0.5).cpu().numpy().astype(np.uint8)  # [n, H, W]
        for m, lab, s in zip(masks, labels, scores):
            rle = mask_utils.encode(np.asfortranarray(m))
            rle["counts"] = rle["counts"].decode("ascii")
            segm.append(
                {"image_id": image_id, "category_id": label_to_cat_id[lab], "segmentation": rle, "score": s}
            )
    return bbox, segm


def _coco_eval(coco_gt, results: list[dict], iou_type: str, image_ids: list[int]) -> dict[str, float]:
    from pycocotools.cocoeval import COCOeval

    if not results:  # pycocotools cannot index an empty result list: nothing detected scores 0
        return {f"{iou_type}_{k}": 0.0 for k in COCO_STATS}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress and the summary table
        dt = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, dt, iou_type)
        ev.params.imgIds = image_ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    # A stat of -1 means no ground truth of that size: report it as NaN, not as a score.
    return {
        f"{iou_type}_{k}": (float(v) if v >= 0 else float("nan")) for k, v in zip(COCO_STATS, ev.stats[:6])
    }


@torch.no_grad()
def evaluate_detection(
    model: nn.Module, dataset: CocoDetection, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """COCO box (and mask, for Mask R-CNN) AP of ``model`` on ``dataset`` through pycocotools.

    Returns:
        ``bbox_AP``, ``bbox_AP50``, ... ``segm_APl`` (0..1), and ``num_detections``.
    """
    model.eval()
    bbox, segm = [], []
    for i in range(len(dataset)):
        image, target = dataset[i]
        out = model([image.to(device)])[0]
        b, s = coco_results(out, int(target["image_id"]), dataset.label_to_cat_id)
        bbox += b
        segm += s
    metrics = _coco_eval(dataset.coco, bbox, "bbox", dataset.ids)
    if dataset.with_masks:
        metrics.update(_coco_eval(dataset.coco, segm, "segm", dataset.ids))
    metrics["num_detections"] = float(len(bbox))
    return metrics


def segmentation_metrics(confusion: Tensor, class_names: list[str] | None = None) -> dict[str, Any]:
    """mIoU, mAcc, aAcc and per-class IoU / accuracy from a ``[K, K]`` confusion matrix (rows: truth).

    Classes absent from both the labels and the predictions have NaN IoU and are left out of the means
    (as mmseg's ``nanmean``).
    """
    conf = confusion.double()
    tp = conf.diag()
    iou = tp / (conf.sum(0) + conf.sum(1) - tp)
    acc = tp / conf.sum(1)
    names = class_names or [str(i) for i in range(len(tp))]
    return {
        "mIoU": float(iou.nanmean()),
        "mAcc": float(acc.nanmean()),
        "aAcc": float(tp.sum() / conf.sum().clamp_min(1)),
        "per_class_IoU": {n: float(v) for n, v in zip(names, iou)},
        "per_class_Acc": {n: float(v) for n, v in zip(names, acc)},
    }


def confusion_matrix(
    pred: Tensor, target: Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """``[K, K]`` counts of (truth, prediction) pairs over pixels whose label is not ``ignore_index``."""
    keep = target != ignore_index
    idx = target[keep] * num_classes + pred[keep]
    return torch.bincount(idx, minlength=num_classes**2).view(num_classes, num_classes)


@torch.no_grad()
def evaluate_segmentation(
    model: SegmentationModel,
    dataset: ADESegmentation,
    device: torch.device | str = "cpu",
    mode: str = "whole",
    crop_size: tuple[int, int] = (512, 512),
    stride: tuple[int, int] = (341, 341),
    class_names: list[str] | None = None,
) -> dict[str, Any]:
    """mIoU / per-class IoU / pixel accuracy of ``model`` on ``dataset`` (whole or sliding-window
    inference)."""
    model.eval()
    k = dataset.num_classes
    conf = torch.zeros(k, k, dtype=torch.int64)
    for i in range(len(dataset)):
        x, y = dataset[i]
        prob = model.predict(
            x[None].to(device), out_size=y.shape, mode=mode, crop_size=crop_size, stride=stride
        )
        conf += confusion_matrix(prob.argmax(1)[0].cpu(), y, k)
    return segmentation_metrics(conf, class_names)


def evaluate_dense(cfg: Config, model: nn.Module, dataset, device: torch.device) -> dict[str, Any]:
    """The metrics of ``cfg.task`` for ``model`` on ``dataset``, with the inference settings of
    ``cfg.dense``."""
    d = cfg.dense
    if cfg.task == "detection":
        return evaluate_detection(model, dataset, device)
    return evaluate_segmentation(
        model, dataset, device, d.inference, tuple(d.slide_crop), tuple(d.slide_stride), d.class_names or None
    )
