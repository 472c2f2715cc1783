"""The default training recipe's augmentation on real images, under the installed Pillow.

timm's RandAugment ``PosterizeIncreasing`` keeps 0 bits when the sampled magnitude reaches 10, which
Pillow >= 13 refuses; ``vit3.data.build`` corrects the op. The recipe is run on thousands of real images
(MNIST digits resized and coloured, crops of the photographs that ship with scikit-learn and matplotlib).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.train import make_digit_folder
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from vit3.data import ImageFolderDataset, SeededTransform
from vit3.data.build import _augment_ops, build_transform, posterize
from vit3.data.image import TransformError
from vit3.data.mnist import load_mnist5k
from vit3.data.samples import sample_photos
from vit3.engine import load_config

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class _Images(Dataset):
    """In-memory ``(name, PIL image)`` pairs with the ``load_sample`` interface of vit3's datasets."""

    def __init__(self, images: list[tuple[str, Image.Image]]) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def load_sample(self, index: int) -> tuple[Image.Image, int, str]:
        name, img = self.images[index]
        return img, 0, name

    def __getitem__(self, index: int):
        return self.load_sample(index)[:2]


def _real_images(n_digits: int, n_photos: int, seed: int = 0) -> list[tuple[str, Image.Image]]:
    """MNIST digits resized to 32-96 px and coloured (random ink and paper colours), and random crops
    (48-192 px) of the sample photographs, all RGB."""
    rng = np.random.default_rng(seed)
    digits, _ = load_mnist5k()
    out = []
    for i in rng.choice(len(digits), n_digits, replace=False):
        size = int(rng.integers(32, 97))
        ink = (
            np.asarray(Image.fromarray(digits[i]).resize((size, size), Image.BICUBIC), np.float32)[..., None]
            / 255
        )
        fg, bg = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        rgb = (ink * fg + (1 - ink) * bg).round().astype(np.uint8)  # [size, size, 3]
        out.append((f"mnist_5k row {i}", Image.fromarray(rgb)))
    photos = list(sample_photos().items())
    for j in range(n_photos):
        name, photo = photos[j % len(photos)]
        s = int(rng.integers(48, 193))
        x, y = int(rng.integers(0, photo.width - s)), int(rng.integers(0, photo.height - s))
        out.append((f"{name}.jpg crop {j}", photo.crop((x, y, x + s, y + s))))
    return out


def test_posterize_keeps_randaugments_meaning_of_zero_bits():
    img = sample_photos()["china"].crop((0, 0, 64, 48))
    assert not np.asarray(posterize(img, 0)).any()  # every bit dropped: black, of the same size and mode
    assert posterize(img, 0).size == img.size and posterize(img, 0).mode == img.mode
    assert posterize(img, 8) is img
    for bits in range(1, 8):
        assert np.array_equal(np.asarray(posterize(img, bits)), np.asarray(ImageOps.posterize(img, bits)))


def test_the_recipes_posterize_at_its_top_magnitude_runs():
    """Magnitude 10 (``m9-mstd0.5`` draws it for ~2% of the posterize calls) asks for 0 bits."""
    transform = build_transform(load_config(None), True, MEAN, STD)
    ops = [op for op in _augment_ops(transform) if op.name.startswith("Posterize")]
    assert ops, "the default recipe's RandAugment has a posterize op"
    img = sample_photos()["flower"].crop((0, 0, 80, 80))
    for op in ops:
        op.prob, op.magnitude, op.magnitude_std = 1.0, 10, 0
        assert not np.asarray(op(img)).any()


@pytest.mark.slow
@pytest.mark.parametrize("channels", [3, 1], ids=["rgb", "grayscale"])
def test_default_training_transform_on_thousands_of_real_images(channels):
    """configs/default.yaml's training transform (RandomResizedCrop 224, flip, rand-m9-mstd0.5-inc1,
    random erasing) on 2,400 coloured digits and 600 photo crops (the fine-tuning recipe of a one-channel
    model sees the same images in grayscale): every image gives a finite [C, 224, 224] tensor."""
    cfg = load_config(None)
    images = _real_images(2400, 600) if channels == 3 else _real_images(800, 200, seed=1)
    if channels == 1:
        images = [(name, img.convert("L")) for name, img in images]
    mean, std = (MEAN, STD) if channels == 3 else ((0.449,), (0.226,))
    data = SeededTransform(_Images(images), build_transform(cfg, True, mean, std), cfg.seed)
    for i in range(len(data)):
        x, _ = data[i]
        assert x.shape == (channels, 224, 224) and torch.isfinite(x).all(), images[i][0]


def test_a_failing_transform_names_the_image_file(tmp_path):
    root = make_digit_folder(tmp_path, digits=(0, 1), n_train=2, n_val=1)

    def broken(img):
        raise ValueError("bits must be between or equal to 1 and 8")

    data = SeededTransform(ImageFolderDataset(root / "train"), broken, seed=0)
    with pytest.raises(TransformError, match=r"digit_0/0000\.png .*ValueError: bits must be"):
        data[0]
    with pytest.raises(TransformError, match=r"digit_1/0001\.png"):
        ImageFolderDataset(root / "train", transform=broken)[3]
