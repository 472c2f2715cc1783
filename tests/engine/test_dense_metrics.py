"""Dense metrics: mIoU / accuracy against a direct count, COCO AP through pycocotools on known predictions
(the dense lr schedule: ``test_optim.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from vit3.data.coco import CocoDetection
from vit3.engine.dense import confusion_matrix, evaluate_detection, segmentation_metrics


# ------------------------------------------------------------------------------------------ mIoU
def _reference_iou(pred: np.ndarray, gt: np.ndarray, k: int) -> tuple[list[float], float]:
    """Per-class IoU by set counting, and pixel accuracy, over pixels whose label is not 255."""
    keep = gt != 255
    p, g = pred[keep], gt[keep]
    ious = []
    for c in range(k):
        inter, union = np.sum((p == c) & (g == c)), np.sum((p == c) | (g == c))
        ious.append(inter / union if union else float("nan"))
    return ious, float(np.mean(p == g))


def test_segmentation_metrics_match_direct_counts():
    rng = np.random.default_rng(0)
    k = 5
    gt = rng.integers(0, k - 1, (3, 20, 30))  # class 4 never appears in the labels...
    gt[:, :4] = 255
    pred = np.where(rng.random(gt.shape) < 0.7, gt, rng.integers(0, k - 2, gt.shape))  # ...nor in predictions
    pred[gt == 255] = 1  # predictions on ignored pixels must not count
    conf = confusion_matrix(torch.from_numpy(pred.ravel()), torch.from_numpy(gt.ravel()), k)
    assert int(conf.sum()) == int((gt != 255).sum())
    m = segmentation_metrics(conf, [f"c{i}" for i in range(k)])
    ious, acc = _reference_iou(pred, gt, k)
    assert np.isnan(m["per_class_IoU"]["c4"]) and np.isnan(ious[4])
    np.testing.assert_allclose([m["per_class_IoU"][f"c{i}"] for i in range(4)], ious[:4], rtol=1e-12)
    assert m["mIoU"] == pytest.approx(np.nanmean(ious))  # absent classes are left out of the mean
    assert m["aAcc"] == pytest.approx(acc)
    recall = [np.sum((pred == c) & (gt == c)) / np.sum(gt == c) for c in range(4)]
    assert m["mAcc"] == pytest.approx(np.mean(recall))


def test_perfect_segmentation_scores_one():
    gt = torch.tensor([[0, 1, 2], [2, 255, 1]])
    m = segmentation_metrics(confusion_matrix(gt.clamp(max=2).ravel(), gt.ravel(), 3))
    assert m["mIoU"] == 1.0 and m["aAcc"] == 1.0


# ------------------------------------------------------------------------------------------ COCO AP
class _Oracle(nn.Module):
    """Returns a dataset's ground truth as detections, optionally shifted or relabelled."""

    def __init__(
        self, dataset: CocoDetection, shift: float = 0.0, relabel: bool = False, drop: bool = False
    ) -> None:
        super().__init__()
        self.dataset, self.shift, self.relabel, self.drop = dataset, shift, relabel, drop

    def forward(self, images):
        image = images[0]
        i = next(i for i in range(len(self.dataset)) if torch.equal(self.dataset[i][0], image))
        t = self.dataset[i][1]
        n = 0 if self.drop else len(t["labels"])
        boxes = t["boxes"][:n].clone()
        boxes[:, 0::2] += self.shift * (boxes[:, 2:3] - boxes[:, 0:1])
        labels = 3 - t["labels"][:n] if self.relabel else t["labels"][:n]
        masks = t["masks"][:n, None].float()
        return [{"boxes": boxes, "labels": labels, "scores": torch.linspace(1.0, 0.5, n), "masks": masks}]


@pytest.mark.parametrize(
    "oracle, box_ap, mask_ap",
    [({}, 1.0, 1.0), ({"shift": 0.6}, 0.0, 1.0), ({"relabel": True}, 0.0, 0.0), ({"drop": True}, 0.0, 0.0)],
    ids=["perfect", "shifted-boxes-only", "wrong-class", "no-detections"],
)
def test_coco_ap_through_pycocotools(coco_root, oracle, box_ap, mask_ap):
    ds = CocoDetection(coco_root / "val", coco_root / "annotations" / "instances_val.json")
    m = evaluate_detection(_Oracle(ds, **oracle), ds)
    assert m["bbox_AP"] == pytest.approx(box_ap) and m["segm_AP"] == pytest.approx(mask_ap)
    assert m["num_detections"] == (
        0 if oracle.get("drop") else sum(len(ds[i][1]["labels"]) for i in range(len(ds)))
    )


def test_coco_ap_of_a_slightly_shifted_oracle_is_between_zero_and_one(coco_root):
    ds = CocoDetection(coco_root / "val", coco_root / "annotations" / "instances_val.json")
    m = evaluate_detection(_Oracle(ds, shift=0.15), ds)
    assert 0.0 < m["bbox_AP"] < 1.0 and m["bbox_AP50"] == pytest.approx(1.0)
    assert m["segm_AP"] == pytest.approx(1.0)  # the masks were not moved
