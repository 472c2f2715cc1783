"""ADE20K-format semantic segmentation data: ``images/<split>/*`` with ``annotations/<split>/*.png``
label maps.

Label maps hold one class index per pixel; 255 is ignored. The real ADE20K stores 0 = "other" and 1..150 for
its classes, so it is read with ``reduce_zero_label=True`` (0 -> 255, k -> k - 1, as in mmseg). Any other
value outside ``[0, num_classes)`` raises a ``ValueError`` naming the file and the values, as do an image /
label map size mismatch and a missing label map (``FileNotFoundError``); a label map PIL cannot read (or a
decompression bomb) is a ``CorruptImageError`` naming it.

Label conventions, bad input and the pipelines: ``docs/design/data.md``.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from ..errors import DataError
from .image import open_image

IGNORE_INDEX = 255
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def rescale_size(size: tuple[int, int], scale: tuple[int, int]) -> tuple[int, int]:
    """mmcv's keep-ratio rescale: the largest ``(h, w)`` with long side <= max(scale), short side <=
    min(scale)."""
    h, w = size
    factor = min(max(scale) / max(h, w), min(scale) / min(h, w))
    return max(round(h * factor), 1), max(round(w * factor), 1)


class ADESegmentation(Dataset):
    """ADE20K-format semantic segmentation dataset.

    Args:
        root: folder holding ``images/`` and ``annotations/``.
        split: sub-folder, e.g. ``training`` / ``validation``.
        num_classes: number of classes (labels ``0..num_classes-1``, plus 255 ignored).
        train: training pipeline (random rescale, crop, flip, pad) instead of the evaluation one.
        mean, std: normalisation of the model, in [0, 1] pixel units.
        scale: ``(long, short)`` bound of the rescale (mmseg ADE20K: ``(2048, 512)``).
        crop_size: ``(h, w)`` training crop.
        ratio_range: random rescale factor range when training.
        reduce_zero_label: map 0 -> 255 and k -> k - 1 (the real ADE20K files).
        cat_max_ratio: crop re-draw threshold (1.0 disables it).
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        num_classes: int,
        train: bool = False,
        mean: tuple[float, ...] = (0.485, 0.456, 0.406),
        std: tuple[float, ...] = (0.229, 0.224, 0.225),
        scale: tuple[int, int] = (2048, 512),
        crop_size: tuple[int, int] = (512, 512),
        ratio_range: tuple[float, float] = (0.5, 2.0),
        reduce_zero_label: bool = False,
        cat_max_ratio: float = 0.75,
    ) -> None:
        root = Path(root)
        self.image_dir, self.ann_dir = root / "images" / split, root / "annotations" / split
        for d in (self.image_dir, self.ann_dir):
            if not d.is_dir():
                raise FileNotFoundError(f"ADE20K-format folder not found: {d}")
        self.images = sorted(p for p in self.image_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.images:
            raise DataError(f"no images in {self.image_dir}")
        missing = [p.name for p in self.images if not (self.ann_dir / f"{p.stem}.png").is_file()]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} image(s) in {self.image_dir} have no label map in {self.ann_dir}: "
                f"{missing[:5]}"
            )
        if num_classes < 1 or num_classes > IGNORE_INDEX:
            raise ValueError(f"num_classes must be in 1..{IGNORE_INDEX}, got {num_classes}")
        self.num_classes, self.train, self.reduce_zero_label = num_classes, train, reduce_zero_label
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
        self.scale, self.crop_size, self.ratio_range, self.cat_max_ratio = (
            scale,
            crop_size,
            ratio_range,
            cat_max_ratio,
        )

    def __len__(self) -> int:
        return len(self.images)

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Loads and checks one pair.

        Returns:
            ``(image [H, W, 3] uint8, labels [H, W] int64)`` with labels in ``0..num_classes-1`` or 255.
        """
        path = self.images[index]
        ann = self.ann_dir / f"{path.stem}.png"
        image = np.asarray(open_image(path, "RGB"))
        label_img = open_image(ann, None)
        if label_img.mode not in ("L", "P", "I", "I;16"):
            raise DataError(f"label map {ann} must be a single-channel PNG, got mode {label_img.mode}")
        label = np.asarray(label_img).astype(np.int64)
        if label.shape != image.shape[:2]:
            raise DataError(
                f"label map {ann} is {label.shape[1]}x{label.shape[0]} but image {path} is "
                f"{image.shape[1]}x{image.shape[0]}"
            )
        if self.reduce_zero_label:
            label = np.where(label == 0, IGNORE_INDEX, label - 1)
            label[label == IGNORE_INDEX - 1] = IGNORE_INDEX  # 255 stays ignored after the shift
        bad = np.unique(label[(label != IGNORE_INDEX) & ((label < 0) | (label >= self.num_classes))])
        if bad.size:
            raise DataError(
                f"label map {ann} has labels {bad[:10].tolist()} outside 0..{self.num_classes - 1} (and "
                f"ignore {IGNORE_INDEX})"
            )
        return image, label

    def normalize(self, image: np.ndarray) -> Tensor:
        """``[H, W, 3]`` uint8 -> ``[3, H, W]`` normalised float."""
        x = (
            torch.from_numpy(np.array(image, np.float32)).permute(2, 0, 1) / 255.0
        )  # copy: PIL arrays are read-only
        return (x - self.mean) / self.std

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        """Returns ``(image [3, h, w], labels [H, W] int64)``.

        Training: both ``crop_size``. Evaluation: the image rescaled to ``scale``, the labels at full size.
        """
        image, label = self.load(index)
        if not self.train:
            h, w = rescale_size(label.shape, self.scale)
            x = self.normalize(image)[None]
            x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)[0]
            return x, torch.from_numpy(label)
        ratio = random.uniform(*self.ratio_range)
        h, w = rescale_size(label.shape, (round(self.scale[0] * ratio), round(self.scale[1] * ratio)))
        image = np.asarray(Image.fromarray(image).resize((w, h), Image.BILINEAR))
        label = np.asarray(Image.fromarray(label.astype(np.uint8)).resize((w, h), Image.NEAREST)).astype(
            np.int64
        )
        ch, cw = self.crop_size
        for _ in range(10):
            y0, x0 = random.randint(0, max(h - ch, 0)), random.randint(0, max(w - cw, 0))
            crop = label[y0 : y0 + ch, x0 : x0 + cw]
            _, counts = np.unique(crop[crop != IGNORE_INDEX], return_counts=True)
            if len(counts) > 1 and counts.max() / counts.sum() < self.cat_max_ratio:
                break
        image, label = image[y0 : y0 + ch, x0 : x0 + cw], label[y0 : y0 + ch, x0 : x0 + cw]
        if random.random() < 0.5:
            image, label = image[:, ::-1], label[:, ::-1]
        x = self.normalize(image)
        out = torch.zeros(3, ch, cw)  # pad: image 0 after normalisation, labels ignored
        out[:, : x.shape[1], : x.shape[2]] = x
        y = torch.full((ch, cw), IGNORE_INDEX, dtype=torch.int64)
        y[: label.shape[0], : label.shape[1]] = torch.from_numpy(np.ascontiguousarray(label))
        return out, y
