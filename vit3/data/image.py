"""Image files to the 8-bit RGB or grayscale images the models read, for every mode PIL opens.
How each PIL mode is scaled, and the warnings: ``docs/design/data.md``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import UserError

__all__ = [
    "TINY_SIDE",
    "CorruptImageError",
    "TransformError",
    "apply_transform",
    "eight_bit",
    "image_size",
    "open_image",
    "to_model_mode",
    "warn_if_tiny",
    "warn_skipped",
]

SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
TINY_SIDE = 8  # an image with a side below this many pixels holds next to no picture


class CorruptImageError(UserError, OSError):
    """An image file exists but cannot be decoded (or converted); the message names it."""


class TransformError(RuntimeError):
    """An image transform (augmentation) failed; the message names the image it failed on."""


def eight_bit(img: Image.Image) -> Image.Image:
    """A one-channel image of mode ``I;16*``, ``I`` or ``F`` as an 8-bit ``L`` image, scaled by the convention
    of its type and range (``docs/design/data.md``)."""
    pixels = np.nan_to_num(np.asarray(img).astype(np.float64), nan=0.0)  # [H, W]
    top = float(pixels.max(initial=0.0))
    if img.mode == "F":
        if top > 1.0 or pixels.min(initial=0.0) < 0.0:
            return img.convert("L")  # not in [0, 1]: PIL's 0-255 scale
        full = 1.0
    elif img.mode in SIXTEEN_BIT:
        full = 65535.0
    else:  # "I": the range of its largest value
        full = 255.0 if top <= 255 else 65535.0 if top <= 65535 else 2.0**31 - 1
    return Image.fromarray(np.rint(np.clip(pixels, 0, full) / (full / 255.0)).astype(np.uint8))


def to_model_mode(img: Image.Image, mode: str = "RGB") -> Image.Image:
    """``img`` as an 8-bit ``mode`` image ("RGB" or "L"), converting every PIL mode correctly (module doc)."""
    if img.mode == mode:
        return img
    if img.mode in (*SIXTEEN_BIT, "I", "F"):
        img = eight_bit(img)
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # PIL's advice for palette transparency; the alpha is dropped below
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    return img.convert(mode) if img.mode != mode else img


def open_image(path: str | Path, mode: str | None = "RGB") -> Image.Image:
    """Reads an image file as an 8-bit ``mode`` image (:func:`to_model_mode`), or in its own mode (``None``:
    e.g. a label map, whose values are class indices).

    Raises:
        CorruptImageError: the file cannot be decoded or converted, or it declares more pixels than PIL opens
            (a decompression bomb, over twice ``PIL.Image.MAX_IMAGE_PIXELS``); the message names it.
    """
    with _reading(path):
        with Image.open(path) as img:
            img.load()
            return img if mode is None else to_model_mode(img, mode)


def image_size(path: str | Path) -> tuple[int, int]:
    """``(width, height)`` of an image file, from its header (the pixels are not decoded).

    Raises:
        CorruptImageError: as :func:`open_image`.
    """
    with _reading(path):
        with Image.open(path) as img:
            return img.size


@contextlib.contextmanager
def _reading(path: str | Path) -> Iterator[None]:
    """PIL's errors while a block reads ``path`` as one :class:`CorruptImageError` naming the file."""
    try:
        yield
    except Image.DecompressionBombError as e:
        raise CorruptImageError(
            f"cannot read image file {path}: {e} (PIL.Image.MAX_IMAGE_PIXELS sets the limit)"
        ) from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise CorruptImageError(f"cannot read image file {path}: {e}") from e


def apply_transform(transform: Callable[[Image.Image], Any], img: Image.Image, source: str) -> Any:
    """``transform(img)``; a failure is re-raised as :class:`TransformError` naming ``source`` (the file)."""
    try:
        return transform(img)
    except Exception as e:
        raise TransformError(
            f"the image transform failed on {source} ({img.mode} {img.width}x{img.height}): "
            f"{type(e).__name__}: {e}"
        ) from e


def warn_if_tiny(img: Image.Image, source: str | Path) -> bool:
    """Warns (naming ``source``) when a side of ``img`` is below :data:`TINY_SIDE` pixels; returns whether."""
    if min(img.size) >= TINY_SIDE:
        return False
    warnings.warn(
        f"image {source} is only {img.width}x{img.height} pixels: it is resized to the input size like every "
        f"image, but holds next to no picture (remove it if it got there by mistake)",
        stacklevel=2,
    )
    return True


def warn_skipped(folder: str | Path, files: Sequence[str | Path], kinds: Sequence[str]) -> None:
    """Warns once that the ``files`` of ``folder`` are skipped (not images: no suffix of ``kinds``)."""
    if not files:
        return
    shown = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    warnings.warn(
        f"skipping {len(files)} file(s) of {folder} that are not images ({', '.join(kinds)}): {shown}",
        stacklevel=2,
    )
