"""Helpers of the dense-task and export tests: small synthetic digit datasets (real MNIST pixels).

Test modules import it and wrap these writers in their own fixtures.
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


def det_args(coco_root: Path, out: Path) -> list[str]:
    """Overrides of ``configs/dense/demo_detection.yaml`` for a few CPU seconds on :func:`write_coco_digits`:
    4 epochs of 4 steps (7 annotated images in batches of 2), one evaluation at the end."""
    return [
        "data.dataset=coco",
        f"data.path={coco_root}",
        f"output={out}",
        "device=cpu",
        "data.batch_size=2",
        "train.epochs=4",
        "train.eval_every=4",
        "train.log_every=0",
        "dense.warmup_iters=2",
        "dense.milestones=[10]",
        "dense.min_size=64",
        "dense.max_size=64",
        "dense.anchor_sizes=[8,16,32,64,128]",
    ]


def seg_args(ade_root: Path, out: Path) -> list[str]:
    """Overrides of ``configs/dense/demo_segmentation.yaml`` for a few CPU seconds on
    :func:`write_ade_digits`: 2 epochs of 2 steps (8 images in batches of 4), one evaluation at the end."""
    return [
        "data.dataset=ade20k",
        f"data.path={ade_root}",
        f"output={out}",
        "device=cpu",
        "data.batch_size=4",
        "train.epochs=2",
        "train.eval_every=2",
        "train.log_every=0",
        "dense.warmup_iters=2",
        "dense.head_channels=16",
        "dense.scale=[64,64]",
        "dense.crop_size=[64,64]",
        "dense.class_names=[background,three,seven]",
        "dense.num_classes=3",
    ]
