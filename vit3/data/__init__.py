"""vit3.data: image folders with clear errors, the embedded MNIST demo data, loaders for classification."""

from .build import (
    ResumableDistributedSampler,
    SeededTransform,
    ShardSampler,
    build_datasets,
    build_mixup,
    build_train_loader,
    build_transform,
    build_val_loader,
)
from .folder import CorruptImageError, ImageFolderDataset, find_classes
from .mnist import MNIST5k, load_mnist5k, mnist5k_path

__all__ = [
    "CorruptImageError",
    "ImageFolderDataset",
    "MNIST5k",
    "ResumableDistributedSampler",
    "SeededTransform",
    "ShardSampler",
    "build_datasets",
    "build_mixup",
    "build_train_loader",
    "build_transform",
    "build_val_loader",
    "find_classes",
    "load_mnist5k",
    "mnist5k_path",
]
