"""COCO-format instance detection / segmentation data for torchvision detectors, read with pycocotools.

Conventions (torchvision's): an image is a float tensor ``[3, H, W]`` in [0, 1] (the detector normalises and
resizes it itself); its target holds ``boxes [n, 4]`` (x1, y1, x2, y2 in pixels), ``labels [n]`` (contiguous,
1..K, 0 is the background), ``masks [n, H, W]`` uint8 and ``image_id``. Category ids of the file map to
contiguous labels in sorted id order; ``label_to_cat_id`` maps back for the evaluation.

Bad input, box handling: ``docs/design/data.md``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import random
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from ..errors import DataError
from .image import image_size, open_image

log = logging.getLogger(__name__)

REQUIRED_KEYS = ("images", "annotations", "categories")


def load_coco(ann_file: str | Path):
    """Loads and validates a COCO annotation file.

    Returns:
        A ``pycocotools.coco.COCO`` index.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not JSON, lacks a required key, or an annotation names an unknown image or category.
    """
    from pycocotools.coco import COCO

    path = Path(ann_file)
    if not path.is_file():
        raise FileNotFoundError(f"COCO annotation file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"COCO annotation file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or any(k not in data for k in REQUIRED_KEYS):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise DataError(f"COCO annotation file {path} must hold {REQUIRED_KEYS}, found {found}")
    image_ids: dict[object, str] = {}
    for img in data["images"]:
        if not isinstance(img, dict) or "id" not in img or "file_name" not in img:
            raise DataError(f"{path}: every entry of images needs an id and a file_name, got {str(img)[:80]}")
        if img["id"] in image_ids:
            raise DataError(
                f"{path}: image id {img['id']} is given twice ({image_ids[img['id']]} and "
                f"{img['file_name']}); "
                f"each image needs its own id"
            )
        image_ids[img["id"]] = img["file_name"]
    cat_ids = {c["id"] for c in data["categories"]}
    if not cat_ids:
        raise DataError(f"COCO annotation file {path} has no categories")
    for ann in data["annotations"]:
        if ann.get("image_id") not in image_ids:
            raise DataError(
                f"{path}: annotation {ann.get('id')} names unknown image_id {ann.get('image_id')}"
            )
        if ann.get("category_id") not in cat_ids:
            raise DataError(
                f"{path}: annotation {ann.get('id')} has category_id {ann.get('category_id')} outside the "
                f"categories {sorted(cat_ids)}"
            )
        box = ann.get("bbox")
        if not isinstance(box, list | tuple) or len(box) != 4:
            raise DataError(f"{path}: annotation {ann.get('id')} has no 4-number bbox")
        if not all(_finite(v) for v in box):
            raise DataError(f"{path}: annotation {ann.get('id')} has a bbox of non-numbers: {box}")
        if "segmentation" in ann and not _segmentation_form(ann["segmentation"]):
            raise DataError(
                f"{path}: annotation {ann.get('id')} of image {ann['image_id']} has a segmentation that is "
                "neither "
                f"polygons (lists of 3 or more x, y pairs) nor an RLE mask (size and counts): "
                f"{str(ann['segmentation'])[:80]}"
            )
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        coco.createIndex()
    return coco


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _segmentation_form(seg: object) -> bool:
    """Whether ``seg`` is a COCO segmentation pycocotools draws: polygons (lists of 3 or more x, y pairs of
    numbers) or an RLE mask (a dict with ``size`` and ``counts``)."""
    if isinstance(seg, dict):
        return "size" in seg and "counts" in seg
    return isinstance(seg, list) and all(
        isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0 and all(_finite(v) for v in p) for p in seg
    )


class CocoDetection(Dataset):
    """COCO-format images and instance annotations.

    Args:
        image_dir: folder of the images (``file_name`` is relative to it).
        ann_file: COCO JSON annotation file.
        train: random horizontal flip, and drop images without annotations when ``skip_empty`` is None.
        skip_empty: drop images with no usable annotation (default: ``train``).
        with_masks: decode instance masks (Mask R-CNN); off for Faster R-CNN.
        flip_prob: horizontal flip probability when training.
    """

    def __init__(
        self,
        image_dir: str | Path,
        ann_file: str | Path,
        train: bool = False,
        skip_empty: bool | None = None,
        with_masks: bool = True,
        flip_prob: float = 0.5,
    ) -> None:
        self.image_dir = Path(image_dir)
        if not self.image_dir.is_dir():
            raise FileNotFoundError(f"COCO image folder not found: {self.image_dir}")
        self.coco = load_coco(ann_file)
        self.train, self.with_masks, self.flip_prob = train, with_masks, flip_prob
        cat_ids = sorted(self.coco.getCatIds())
        self.cat_id_to_label = {c: i + 1 for i, c in enumerate(cat_ids)}
        self.label_to_cat_id = {i + 1: c for i, c in enumerate(cat_ids)}
        self.class_names = [self.coco.cats[c]["name"] for c in cat_ids]
        ids = sorted(self.coco.getImgIds())
        missing = [
            self.coco.imgs[i]["file_name"]
            for i in ids
            if not (self.image_dir / self.coco.imgs[i]["file_name"]).is_file()
        ]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} image(s) of {ann_file} missing in {self.image_dir}: {missing[:5]}"
            )
        self.ann_file = Path(ann_file)
        self._targets = self._usable_boxes(ids)
        if train if skip_empty is None else skip_empty:
            kept = [i for i in ids if self._usable_anns(i)]
            if len(kept) < len(ids):
                log.warning(
                    "CocoDetection: skipping %d of %d images with no usable annotation",
                    len(ids) - len(kept),
                    len(ids),
                )
            ids = kept
        if not ids:
            raise DataError(f"no usable images in {ann_file} (every image lacks annotations)")
        self.ids = ids

    @property
    def num_classes(self) -> int:
        """Number of object classes (without the background)."""
        return len(self.cat_id_to_label)

    def _usable_boxes(self, ids: list[int]) -> dict[int, tuple[list[dict], list[list[float]]]]:
        """Per image: the annotations used as targets and their boxes (xyxy), clipped to the image; boxes
        clipped or skipped (degenerate) are listed in one warning each (see ``docs/design/data.md``)."""
        out: dict[int, tuple[list[dict], list[list[float]]]] = {}
        clipped, skipped = [], []
        for image_id in ids:
            info = self.coco.imgs[image_id]
            w, h = info.get("width"), info.get("height")
            if w is None or h is None:  # the file does not say: the image header's, kept for the masks
                w, h = image_size(self.image_dir / info["file_name"])
                info["width"], info["height"] = w, h
            anns, boxes = [], []
            for ann in self.coco.imgToAnns.get(image_id, []):
                if ann.get("iscrowd", 0):
                    continue
                x, y, bw, bh = (float(v) for v in ann["bbox"])
                box = [max(x, 0.0), max(y, 0.0), min(x + bw, float(w)), min(y + bh, float(h))]
                where = f"{info['file_name']} annotation {ann.get('id')} bbox {ann['bbox']}"
                if bw < 1 or bh < 1 or box[2] - box[0] < 1 or box[3] - box[1] < 1:
                    skipped.append(where)
                    continue
                if box != [x, y, x + bw, y + bh]:
                    clipped.append(where)
                anns.append(ann)
                boxes.append(box)
            out[image_id] = (anns, boxes)
        reasons = (
            (clipped, "box(es) reaching outside their image were clipped to it"),
            (skipped, "degenerate box(es) (width or height below 1 px, or outside the image) were skipped"),
        )
        for items, what in reasons:
            if items:
                shown = "; ".join(items[:10]) + (
                    f"; ... and {len(items) - 10} more" if len(items) > 10 else ""
                )
                warnings.warn(f"{self.ann_file}: {len(items)} {what}: {shown}", stacklevel=3)
        return out

    def _usable_anns(self, image_id: int) -> list[dict]:
        return self._targets[image_id][0]

    def __len__(self) -> int:
        return len(self.ids)

    def load_image(self, image_id: int) -> Image.Image:
        """Loads an image as RGB, checking its size against the annotation file."""
        info = self.coco.imgs[image_id]
        path = self.image_dir / info["file_name"]
        image = open_image(path, "RGB")
        if "width" in info and (image.width, image.height) != (info["width"], info["height"]):
            raise DataError(
                f"{self.ann_file}: image {image_id} ({path}) is {image.width}x{image.height} but the "
                "annotation "
                f"file says {info['width']}x{info['height']}"
            )
        return image

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        image_id = self.ids[index]
        pil = self.load_image(image_id)
        w, h = pil.size
        image = torch.from_numpy(np.asarray(pil, np.float32) / 255.0).permute(2, 0, 1)  # [3, H, W]
        anns, xyxy = self._targets[image_id]
        boxes = torch.tensor(xyxy, dtype=torch.float32).reshape(-1, 4)  # clipped to the image
        target = {
            "boxes": boxes,
            "labels": torch.tensor([self.cat_id_to_label[a["category_id"]] for a in anns], dtype=torch.int64),
            "image_id": torch.tensor(image_id),
        }
        if self.with_masks:
            masks = [self.coco.annToMask(a) for a in anns]
            target["masks"] = torch.from_numpy(np.stack(masks) if masks else np.zeros((0, h, w), np.uint8))
        if self.train and random.random() < self.flip_prob:
            image = image.flip(-1)
            target["boxes"] = torch.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], 1)
            if self.with_masks:
                target["masks"] = target["masks"].flip(-1)
        return image, target


def collate_detection(batch: list) -> tuple[list[Tensor], list[dict]]:
    """Keeps images and targets as lists (torchvision detectors take images of different sizes)."""
    images, targets = zip(*batch)
    return list(images), list(targets)
