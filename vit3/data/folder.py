"""Image folders (``root/<class>/<image>``) with clear errors for bad input.

* missing root or split directory -> ``FileNotFoundError`` naming the path;
* no class folders, or a class folder without a single image -> ``ValueError`` naming the folder;
* val classes that the training data does not have -> ``ValueError`` listing them;
* a corrupt (unreadable) image file: policy ``corrupt_images``:
  ``"error"`` (default) raises :class:`CorruptImageError` naming the file; ``"skip"`` warns once per file
  (naming it) and returns the next readable image of the split instead, so a batch keeps its size.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

CORRUPT_POLICIES = ("error", "skip")

__all__ = ["CORRUPT_POLICIES", "CorruptImageError", "ImageFolderDataset", "find_classes"]


class CorruptImageError(OSError):
    """An image file exists but cannot be decoded."""


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def find_classes(root: str | Path) -> list[str]:
    """Sorted class-folder names of ``root``, each checked to hold at least one image.

    Raises:
        FileNotFoundError: ``root`` does not exist or is not a directory.
        ValueError: ``root`` has no class folders, or a class folder has no image files.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root} (expected {root}/<class>/<image files>)")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {root} has no class folders (expected {root}/<class>/<image files>)")
    for name in classes:
        if not any(_is_image(f) for _, _, files in os.walk(root / name) for f in files):
            raise ValueError(
                f"class folder {root / name} holds no image files (extensions: {', '.join(IMG_EXTENSIONS)})"
            )
    return classes


class ImageFolderDataset(Dataset):
    """``root/<class>/**/<image>`` samples with labels from a class list.

    Args:
        root: split directory (e.g. ``imagenet/train``).
        transform: applied to the PIL image.
        classes: class names defining the labels (default: the folders of ``root``); every folder of
            ``root`` must be one of them.
        corrupt_images: "error" or "skip" (see the module docstring).
        mode: PIL mode images are converted to ("RGB", or "L" for one-channel models).
    """

    def __init__(
        self,
        root: str | Path,
        transform: Callable | None = None,
        classes: list[str] | None = None,
        corrupt_images: str = "error",
        mode: str = "RGB",
    ) -> None:
        if corrupt_images not in CORRUPT_POLICIES:
            raise ValueError(f"corrupt_images must be one of {CORRUPT_POLICIES}, got '{corrupt_images}'")
        self.root = Path(root)
        found = find_classes(self.root)
        self.classes = list(classes) if classes is not None else found
        unknown = sorted(set(found) - set(self.classes))
        if unknown:
            raise ValueError(
                f"{self.root} has class folders the training data lacks: {', '.join(unknown[:10])}"
            )
        index = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        for name in found:
            for dirpath, _, files in sorted(os.walk(self.root / name)):
                self.samples += [
                    (os.path.join(dirpath, f), index[name]) for f in sorted(files) if _is_image(f)
                ]
        self.targets = [t for _, t in self.samples]
        self.transform = transform
        self.corrupt_images = corrupt_images
        self.mode = mode
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, path: str) -> Image.Image:
        try:
            with Image.open(path) as img:
                return img.convert(self.mode)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise CorruptImageError(f"cannot read image file {path}: {e}") from e

    def __getitem__(self, index: int):
        for offset in range(len(self.samples)):
            path, target = self.samples[(index + offset) % len(self.samples)]
            try:
                img = self._load(path)
            except CorruptImageError as e:
                if self.corrupt_images == "error":
                    raise
                if path not in self._warned:
                    self._warned.add(path)
                    warnings.warn(f"skipping corrupt image file {path} ({e.__cause__})", stacklevel=2)
                continue
            return (self.transform(img) if self.transform is not None else img), target
        raise CorruptImageError(f"no readable image in {self.root}")
