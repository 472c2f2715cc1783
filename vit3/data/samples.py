"""A small image folder of real photographs, built from the photos that ship inside installed packages.

What a first fine-tune needs when no photographs are at hand (and what the fine-tuning tests and
``benchmarks/finetune.py`` train on): scikit-learn's ``china.jpg`` and ``flower.jpg`` and matplotlib's
``grace_hopper.jpg``, nothing downloaded. Each class is one photograph (3 classes) or one half of one (6
classes: ``<photo>_left`` / ``<photo>_right``); its images are random square crops of that region, a quarter
to a half of its shorter side, resized to ``size`` pixels and written as JPEGs in the layout of
``data.dataset=folder``, into a new or empty folder (one holding files is refused)::

    python -m vit3.data.samples photos --classes 3 --train 16 --val 16
    # photos/train/<class>/000.jpg ..., photos/val/<class>/000.jpg ...
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import OUTPUT_ERRNOS, UserError, describe_os_error
from ..outputs import atomic_write

__all__ = ["CLASS_COUNTS", "make_photo_folder", "sample_photos"]

CLASS_COUNTS = (3, 6)  # one class per photograph, or per half of one


@functools.cache
def sample_photos() -> dict[str, Image.Image]:
    """The photographs that ship inside installed packages, by name: scikit-learn's ``china`` and ``flower``
    and matplotlib's ``hopper`` (RGB; shared between callers: crop or copy them, do not modify them).

    Raises:
        UserError: scikit-learn is not installed.
    """
    import matplotlib.cbook

    try:
        from sklearn.datasets import load_sample_images
    except ImportError as e:
        raise UserError(
            "the sample photographs china.jpg and flower.jpg ship with scikit-learn: pip install scikit-learn"
        ) from e
    sk = load_sample_images()
    photos = {Path(f).stem: Image.fromarray(a) for f, a in zip(sk.filenames, sk.images)}
    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")) as img:
        photos["hopper"] = img.convert("RGB")
    return photos


def _regions(photo: Image.Image, halves: bool) -> list[tuple[str, Image.Image]]:
    """The class regions of a photograph: the whole of it, or its left and right halves (suffix, region)."""
    if not halves:
        return [("", photo)]
    w, h = photo.size
    return [("_left", photo.crop((0, 0, w // 2, h))), ("_right", photo.crop((w // 2, 0, w, h)))]


def make_photo_folder(
    root: str | Path, n_train: int = 24, n_val: int = 8, size: int = 48, seed: int = 0, classes: int = 6
) -> Path:
    """Writes ``root/{train,val}/<class>/<i>.jpg``: ``n_train`` / ``n_val`` random square crops (a quarter to
    a half of the region's shorter side, resized to ``size`` px) of each class region.

    Args:
        root: the folder to write: a new or empty one (created), so that no file of the user's is replaced and
            no other image joins a class; each image is written to a temporary name and renamed.
        classes: 3 (one class per photograph: ``china``, ``flower``, ``hopper``) or 6 (``<photo>_left``,
            ``<photo>_right``).

    Raises:
        UserError: a class count other than 3 or 6, too few images asked for, or ``root`` holds files.
    """
    if classes not in CLASS_COUNTS:
        raise UserError(
            f"a sample photo folder has {' or '.join(map(str, CLASS_COUNTS))} classes, not {classes}"
        )
    if n_train < 1 or n_val < 1 or size < 8:
        raise UserError(
            f"need >= 1 training and val image per class and size >= 8, got {n_train}, {n_val}, {size}"
        )
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} is a file: give a new or empty folder for the sample photos")
    above = next((p for p in root.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise UserError(f"{above} is a file, so no folder can be made under it: give a new or empty folder")
    held = (
        sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        if root.is_dir()
        else []
    )
    if held:
        raise UserError(
            f"{root} holds other files (e.g. {held[0].relative_to(root)}), which the sample photos would "
            "replace "
            f"or mix with: give a new or empty folder"
        )
    rng = np.random.default_rng(seed)
    for name, photo in sample_photos().items():
        for suffix, region in _regions(photo, halves=classes == 6):
            rw, rh = region.size
            for split, n in (("train", n_train), ("val", n_val)):
                folder = root / split / f"{name}{suffix}"
                folder.mkdir(parents=True, exist_ok=True)
                for i in range(n):
                    s = int(rng.integers(min(rw, rh) // 4, min(rw, rh) // 2))
                    x, y = int(rng.integers(0, rw - s)), int(rng.integers(0, rh - s))
                    crop = region.crop((x, y, x + s, y + s)).resize((size, size), Image.BICUBIC)
                    with atomic_write(folder / f"{i:03d}.jpg", "sample image", durable=False) as f:
                        crop.save(f, format="JPEG", quality=90)
    return root


class _Parser(argparse.ArgumentParser):
    """Usage errors (an unknown flag, a bad number) in one ``error:`` line, exit code 2, as vit3's scripts."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m vit3.data.samples OUT [--classes 3|6] [--train N] [--val N] [--size PX] [--seed S]``."""
    parser = _Parser(prog="python -m vit3.data.samples", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="a new or empty folder to write (train/<class>/, val/<class>/)")
    parser.add_argument("--classes", type=int, default=3, choices=CLASS_COUNTS)
    parser.add_argument("--train", type=int, default=16, help="training images per class")
    parser.add_argument("--val", type=int, default=16, help="val images per class")
    parser.add_argument("--size", type=int, default=64, help="side of the written images (px)")
    parser.add_argument("--seed", type=int, default=0)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed: the exit code
        return e.code if isinstance(e.code, int) else 2
    try:
        root = make_photo_folder(args.out, args.train, args.val, args.size, args.seed, args.classes)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the system refused a folder or file (no permission, a read-only file system, ...)
        if e.errno not in OUTPUT_ERRNOS:
            raise
        print(f"error: cannot write the sample photos: {describe_os_error(e)}", file=sys.stderr)
        return 2
    print(f"wrote {root}: {args.classes} classes, {args.train} train / {args.val} val images each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
