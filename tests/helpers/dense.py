"""Helpers of the dense-task and export tests: small synthetic digit datasets (real MNIST pixels).

Test modules import it and wrap these
writers in their own fixtures.
"""

from __future__ import annotations

from pathlib import Path

from vit3.data.synthetic_dense import make_synthetic_ade, make_synthetic_coco

DIGITS = (3, 7)  # a subset, so COCO category ids (4, 8) are not contiguous labels


def write_coco_digits(root: Path) -> Path:
    """COCO-format digits: ``train`` (8 images, the last without digits) and ``val`` (4 images), 64x64."""
    make_synthetic_coco(
        root, {"train": 8, "val": 4}, digits=DIGITS, image_size=64, digit_size=(20, 30), empty_images=1
    )
    return root


def write_ade_digits(root: Path) -> Path:
    """ADE20K-format digits: ``training`` (8) and ``validation`` (4), 64x64, 3 classes + ignored rims."""
    make_synthetic_ade(
        root, {"training": 8, "validation": 4}, digits=DIGITS, image_size=64, digit_size=(20, 30)
    )
    return root
