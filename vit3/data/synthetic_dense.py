"""Small dense-prediction datasets made of real pixels: MNIST digits pasted on canvases.

Where the digits come from and the two layouts written: ``docs/design/data.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from .mnist import load_mnist5k

IGNORE_INDEX = 255
# Alpha above which a pixel belongs to the digit (mask / label); between the two thresholds it is ignored.
MASK_THRESHOLD = 0.5
RIM_THRESHOLD = 0.1


@dataclass
class Instance:
    """One pasted digit: its digit value, soft alpha ``[H, W]`` in [0, 1] and derived mask / COCO box."""

    digit: int
    alpha: np.ndarray

    @property
    def mask(self) -> np.ndarray:
        """``[H, W]`` bool instance mask."""
        return self.alpha > MASK_THRESHOLD

    @property
    def box(self) -> list[float]:
        """Tight COCO box ``[x, y, w, h]`` of the mask, in pixels (a pixel spans [i, i + 1))."""
        ys, xs = np.nonzero(self.mask)
        return [
            float(xs.min()),
            float(ys.min()),
            float(xs.max() - xs.min() + 1),
            float(ys.max() - ys.min() + 1),
        ]


@dataclass
class Canvas:
    """A synthetic image ``[H, W, 3]`` uint8 with its instances."""

    image: np.ndarray
    instances: list[Instance] = field(default_factory=list)

    def label_map(self, digits: tuple[int, ...]) -> np.ndarray:
        """``[H, W]`` uint8 semantic labels: 0 background, ``1 + digits.index(d)``, 255 on the soft rims."""
        out = np.zeros(self.image.shape[:2], np.uint8)
        for inst in self.instances:
            out[inst.alpha > RIM_THRESHOLD] = IGNORE_INDEX
            out[inst.mask] = 1 + digits.index(inst.digit)
        return out


def make_canvases(
    num_images: int,
    image_size: int | tuple[int, int] = 96,
    digits: tuple[int, ...] = tuple(range(10)),
    max_per_image: int = 3,
    digit_size: tuple[int, int] = (20, 40),
    empty_images: int = 0,
    seed: int = 0,
) -> list[Canvas]:
    """Pastes real MNIST digits on smooth coloured backgrounds.

    Args:
        num_images: number of canvases.
        image_size: ``size`` or ``(height, width)`` in pixels.
        digits: digit classes to use.
        max_per_image: each canvas gets 1..max_per_image digits (fewer when they do not fit).
        digit_size: min and max side of a pasted digit in pixels.
        empty_images: the last ``empty_images`` canvases get no digit (for the "no annotation" paths).
        seed: random seed; the same arguments give the same canvases.

    Returns:
        ``num_images`` canvases.
    """
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    if digit_size[1] > min(h, w):
        raise ValueError(f"digit_size {digit_size} does not fit in an image of {h}x{w}")
    bad = [d for d in digits if not 0 <= d <= 9]
    if bad or not digits:
        raise ValueError(f"digits must be a non-empty subset of 0..9, got {digits}")
    mnist, labels = load_mnist5k()
    pools = {d: np.flatnonzero(labels == d) for d in digits}
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    canvases = []
    for i in range(num_images):
        # Smooth dark background: a random linear colour gradient plus mild noise.
        c0, c1 = rng.uniform(0, 90, 3), rng.uniform(0, 90, 3)
        t = (yy * rng.uniform(-1, 1) + xx * rng.uniform(-1, 1))[..., None]
        t = (t - t.min()) / max(float(np.ptp(t)), 1e-6)
        image = c0 * (1 - t) + c1 * t + rng.normal(0, 4, (h, w, 3))
        instances: list[Instance] = []
        taken = np.zeros((h, w), bool)
        count = 0 if i >= num_images - empty_images else int(rng.integers(1, max_per_image + 1))
        for _ in range(count * 10):  # a few tries per digit to find a free spot
            if len(instances) == count:
                break
            digit = int(rng.choice(digits))
            src = mnist[int(rng.choice(pools[digit]))]
            side = int(rng.integers(digit_size[0], digit_size[1] + 1))
            y0, x0 = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
            if taken[max(y0 - 1, 0) : y0 + side + 1, max(x0 - 1, 0) : x0 + side + 1].any():
                continue
            patch = np.asarray(Image.fromarray(src).resize((side, side), Image.BILINEAR), np.float64) / 255.0
            alpha = np.zeros((h, w))
            alpha[y0 : y0 + side, x0 : x0 + side] = patch
            if not (alpha > MASK_THRESHOLD).any():
                continue
            colour = rng.uniform(150, 255, 3)
            image = image * (1 - alpha[..., None]) + colour * alpha[..., None]
            taken[y0 : y0 + side, x0 : x0 + side] = True
            instances.append(Instance(digit, alpha))
        canvases.append(Canvas(np.clip(image, 0, 255).round().astype(np.uint8), instances))
    return canvases


def categories(digits: tuple[int, ...]) -> list[dict]:
    """COCO categories of the digits: id ``digit + 1`` (non-contiguous when ``digits`` is a subset)."""
    return [{"id": d + 1, "name": f"digit_{d}", "supercategory": "digit"} for d in digits]


def write_coco(root: str | Path, split: str, canvases: list[Canvas], digits: tuple[int, ...]) -> Path:
    """Writes ``<root>/<split>/*.png`` and ``<root>/annotations/instances_<split>.json``.

    Returns:
        The annotation file.
    """
    from pycocotools import mask as mask_utils

    root = Path(root)
    (root / split).mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    images, anns = [], []
    for i, canvas in enumerate(canvases):
        name = f"{split}_{i:05d}.png"
        Image.fromarray(canvas.image).save(root / split / name)
        h, w = canvas.image.shape[:2]
        images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
        for inst in canvas.instances:
            rle = mask_utils.encode(np.asfortranarray(inst.mask.astype(np.uint8)))
            rle["counts"] = rle["counts"].decode("ascii")
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": i + 1,
                    "category_id": inst.digit + 1,
                    "bbox": inst.box,
                    "area": float(inst.mask.sum()),
                    "segmentation": rle,
                    "iscrowd": 0,
                }
            )
    ann_file = root / "annotations" / f"instances_{split}.json"
    data = {"images": images, "annotations": anns, "categories": categories(digits)}
    ann_file.write_text(json.dumps(data))
    return ann_file


def write_ade(root: str | Path, split: str, canvases: list[Canvas], digits: tuple[int, ...]) -> Path:
    """Writes ``<root>/images/<split>/*.png`` and ``<root>/annotations/<split>/*.png`` label maps.

    Returns:
        ``root``.
    """
    root = Path(root)
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
    for i, canvas in enumerate(canvases):
        name = f"{split}_{i:05d}"
        Image.fromarray(canvas.image).save(root / "images" / split / f"{name}.png")
        Image.fromarray(canvas.label_map(digits)).save(root / "annotations" / split / f"{name}.png")
    return root


def make_synthetic_coco(
    root: str | Path,
    splits: dict[str, int] | None = None,
    digits: tuple[int, ...] = tuple(range(10)),
    seed: int = 0,
    **canvas_kwargs,
) -> dict[str, Path]:
    """Writes a COCO-format digit dataset, one annotation file per split.

    Args:
        root: output folder.
        splits: images per split (default ``{"train": 32, "val": 8}``); each split gets its own seed.
        digits: digit classes.
        seed: base seed.
        **canvas_kwargs: forwarded to :func:`make_canvases`.

    Returns:
        ``{split: annotation file}``.
    """
    splits = splits or {"train": 32, "val": 8}
    return {
        s: write_coco(root, s, make_canvases(n, digits=digits, seed=seed + k, **canvas_kwargs), digits)
        for k, (s, n) in enumerate(splits.items())
    }


def make_synthetic_ade(
    root: str | Path,
    splits: dict[str, int] | None = None,
    digits: tuple[int, ...] = tuple(range(10)),
    seed: int = 0,
    **canvas_kwargs,
) -> Path:
    """Writes an ADE20K-format digit dataset (splits ``training`` / ``validation`` by default).

    Returns:
        ``root``.
    """
    splits = splits or {"training": 32, "validation": 8}
    for k, (s, n) in enumerate(splits.items()):
        write_ade(root, s, make_canvases(n, digits=digits, seed=seed + k, **canvas_kwargs), digits)
    return Path(root)
