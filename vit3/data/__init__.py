"""vit3.data: image folders with clear errors, the embedded MNIST demo data, loaders for classification."""

from . import build
from .build import *  # noqa: F403  (the datasets, samplers, transforms and loaders: build.__all__)
from .folder import CorruptImageError, ImageFolderDataset, find_classes
from .mnist import MNIST5k, load_mnist5k, mnist5k_path

__all__ = [
    "CorruptImageError",
    "ImageFolderDataset",
    "MNIST5k",
    "find_classes",
    "load_mnist5k",
    "mnist5k_path",
]
__all__ += build.__all__
