"""Images for diffusion training: the ADM center crop, flips, and pixels scaled to ``[-1, 1]``.

The official DiT/DiT³ training pipeline (from guided-diffusion, ADM): halve the image with a box filter while
its short side is at least twice the target, resize the short side to the target with bicubic filtering,
center-crop a square, flip horizontally with probability 0.5, and map pixels to ``[-1, 1]``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch import Tensor

__all__ = ["adm_center_crop", "build_generation_transform", "to_model_range", "to_uint8"]


def adm_center_crop(image: Image.Image, size: int) -> Image.Image:
    """ADM's resize + center crop of a PIL image to ``size x size``."""
    while min(image.size) >= 2 * size:
        image = image.resize(tuple(s // 2 for s in image.size), resample=Image.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(s * scale) for s in image.size), resample=Image.BICUBIC)
    arr = np.asarray(image)
    top, left = (arr.shape[0] - size) // 2, (arr.shape[1] - size) // 2
    return Image.fromarray(arr[top : top + size, left : left + size])


def to_model_range(image: Image.Image) -> Tensor:
    """PIL image -> float tensor ``[C, H, W]`` in ``[-1, 1]``."""
    arr = np.asarray(image, dtype=np.float32)
    if arr.ndim == 2:
        arr = arr[:, :, None]  # grayscale "L" -> [H, W, 1]
    return torch.from_numpy(arr.transpose(2, 0, 1).copy()) / 127.5 - 1.0


def build_generation_transform(size: int, hflip: float = 0.5) -> Callable[[Image.Image], Tensor]:
    """The training transform: ADM center crop to ``size``, random flip with probability ``hflip``, [-1, 1].

    The flip draws on ``torch``'s global RNG, which ``vit3.data.SeededTransform`` seeds per sample.
    """

    def transform(image: Image.Image) -> Tensor:
        if image.size != (size, size):
            image = adm_center_crop(image, size)
        x = to_model_range(image)
        if hflip > 0 and torch.rand(()) < hflip:
            x = x.flip(-1)
        return x

    return transform


def to_uint8(x: Tensor) -> Tensor:
    """Model-range images ``[B, C, H, W]`` -> uint8 ``[B, H, W, C]``, as the official sampler writes them
    (``clamp(127.5 x + 128, 0, 255)``, truncated)."""
    return (
        torch.clamp(127.5 * x.float() + 128.0, 0, 255).permute(0, 2, 3, 1).to(device="cpu", dtype=torch.uint8)
    )
