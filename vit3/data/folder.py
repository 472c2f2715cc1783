"""Image folders (``root/<class>/<image>``) with clear errors for bad input.

What each bad input raises or warns: ``docs/design/data.md``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..errors import DataError
from .image import CorruptImageError, apply_transform, open_image, warn_if_tiny, warn_skipped

CORRUPT_POLICIES = ("error", "skip")

__all__ = ["CORRUPT_POLICIES", "CorruptImageError", "ImageFolderDataset", "find_classes"]


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _walk(folder: Path) -> list[tuple[str, list[str]]]:
    """``(dirpath, files)`` of every folder under ``folder``, sorted by path, files sorted: hidden files and
    folders left out (a leading dot: ``.ipynb_checkpoints``, macOS's ``._*`` copies)."""
    found = []
    for dirpath, dirnames, files in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.append((dirpath, sorted(f for f in files if not f.startswith("."))))
    return sorted(found)


def find_classes(root: str | Path) -> list[str]:
    """Sorted class-folder names of ``root``, each checked to hold at least one image.

    Raises:
        FileNotFoundError: ``root`` does not exist or is not a directory.
        DataError: ``root`` has no class folders, or a class folder has no image files.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root} (expected {root}/<class>/<image files>)")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(f"image folder {root} has no class folders (expected {root}/<class>/<image files>)")
    for name in classes:
        if not any(_is_image(f) for _, files in _walk(root / name) for f in files):
            raise DataError(
                f"class folder {root / name} holds no image files (extensions: {', '.join(IMG_EXTENSIONS)})"
            )
    return classes


class ImageFolderDataset(Dataset):
    """``root/<class>/**/<image>`` samples with labels from a class list.

    Args:
        root: split directory (e.g. ``imagenet/train``).
        transform: applied to the PIL image.
        classes: class names defining the labels, in label order (default: the folders of ``root``); every
            folder of ``root`` must be one of them (a subset, in any order).
        corrupt_images: "error" or "skip" (see ``docs/design/data.md``).
        mode: mode images are converted to ("RGB", or "L" for one-channel models).
        classes_from: what ``classes`` are, for the message naming unknown folders.
    """

    def __init__(
        self,
        root: str | Path,
        transform: Callable | None = None,
        classes: list[str] | None = None,
        corrupt_images: str = "error",
        mode: str = "RGB",
        classes_from: str = "the training data",
    ) -> None:
        if corrupt_images not in CORRUPT_POLICIES:
            raise ValueError(f"corrupt_images must be one of {CORRUPT_POLICIES}, got '{corrupt_images}'")
        self.root = Path(root)
        found = find_classes(self.root)
        self.classes = list(classes) if classes is not None else found
        unknown = sorted(set(found) - set(self.classes))
        if unknown:
            known = ", ".join(self.classes[:20]) + (" ..." if len(self.classes) > 20 else "")
            raise DataError(
                f"{self.root} has class folders that {classes_from} does not know: {', '.join(unknown[:10])} "
                f"(known classes: {known})"
            )
        index = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        skipped = []
        for name in found:
            for dirpath, files in _walk(self.root / name):
                for f in files:
                    if _is_image(f):
                        self.samples.append((os.path.join(dirpath, f), index[name]))
                    else:
                        skipped.append(os.path.join(dirpath, f))
        warn_skipped(self.root, skipped, IMG_EXTENSIONS)
        self.targets = [t for _, t in self.samples]
        self.transform = transform
        self.corrupt_images = corrupt_images
        self.mode = mode
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def read_sample(self, index: int) -> tuple[Image.Image, int, str] | None:
        """``(image, label, file)`` of sample ``index`` without the transform; ``None`` for a corrupt file
        under ``corrupt_images="skip"`` (warned once per file).

        Raises:
            CorruptImageError: a corrupt file under ``corrupt_images="error"``.
        """
        path, target = self.samples[index]
        try:
            img = open_image(path, self.mode)
        except CorruptImageError as e:
            if self.corrupt_images == "error":
                raise
            if path not in self._warned:
                self._warned.add(path)
                warnings.warn(f"skipping corrupt image file {path} ({e.__cause__})", stacklevel=2)
            return None
        if path not in self._warned and warn_if_tiny(img, path):
            self._warned.add(path)
        return img, target, path

    def load_sample(self, index: int) -> tuple[Image.Image, int, str]:
        """:meth:`read_sample` of ``index``, or of the next readable sample when it skips a corrupt file."""
        for offset in range(len(self.samples)):
            sample = self.read_sample((index + offset) % len(self.samples))
            if sample is not None:
                return sample
        raise CorruptImageError(f"no readable image in {self.root}")

    def __getitem__(self, index: int):
        img, target, path = self.load_sample(index)
        return (apply_transform(self.transform, img, path) if self.transform is not None else img), target
