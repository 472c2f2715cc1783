"""Image files of every mode PIL reads become the right 8-bit RGB / grayscale images (16-bit keeps its
contrast), in image folders and in the feature export."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vit3.data import ImageFolderDataset
from vit3.data.image import CorruptImageError, open_image

H, W = 8, 64


def _ramp16() -> np.ndarray:
    """A 16-bit horizontal ramp over the full range, ``[H, W]`` uint16."""
    return np.tile(np.linspace(0, 65535, W).round().astype(np.uint16), (H, 1))


def _palette() -> tuple[np.ndarray, np.ndarray]:
    """Indices ``[H, W]`` into a 4-colour palette ``[4, 3]``."""
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [250, 200, 10]], np.uint8)
    return (np.arange(H * W).reshape(H, W) % 4).astype(np.uint8), colours


def _write(tmp_path, kind: str):
    """Writes one image file of ``kind``; returns ``(path, expected RGB [H, W, 3] uint8)``."""
    ramp = _ramp16()
    if kind in ("I;16", "I"):
        path = tmp_path / ("i16.png" if kind == "I;16" else "i32.tiff")  # PNG has no 32-bit grey
        img = Image.fromarray(ramp) if kind == "I;16" else Image.fromarray(ramp.astype(np.int32), "I")
        img.save(path)
        grey = np.rint(ramp / 257).astype(np.uint8)  # the full 16-bit range onto 0..255
        return path, np.repeat(grey[..., None], 3, -1)
    if kind in ("P", "P+transparency"):
        idx, colours = _palette()
        img = Image.fromarray(idx, "P")
        img.putpalette(colours.flatten().tolist())
        path = tmp_path / f"{kind.replace('+', '_')}.png"
        img.save(path, transparency=3) if kind == "P+transparency" else img.save(path)
        return path, colours[idx]
    if kind == "CMYK":
        cmyk = np.zeros((H, W, 4), np.uint8)
        cmyk[..., 0] = np.linspace(0, 255, W).astype(np.uint8)  # cyan ramp, no black: R = 255 - C
        cmyk[..., 2] = 100  # yellow: B = 255 - Y
        path = tmp_path / "cmyk.tiff"
        Image.fromarray(cmyk, "CMYK").save(path)
        rgb = np.stack([255 - cmyk[..., 0], np.full((H, W), 255, np.uint8), 255 - cmyk[..., 2]], -1)
        return path, rgb
    if kind in ("LA", "RGBA"):
        grey = np.tile(np.linspace(0, 255, W).astype(np.uint8), (H, 1))
        alpha = np.full((H, W), 128, np.uint8)
        path = tmp_path / f"{kind}.png"
        if kind == "LA":
            Image.fromarray(np.stack([grey, alpha], -1), "LA").save(path)
            return path, np.repeat(grey[..., None], 3, -1)
        rgb = np.stack([grey, 255 - grey, np.full_like(grey, 7)], -1)
        Image.fromarray(np.concatenate([rgb, alpha[..., None]], -1), "RGBA").save(path)
        return path, rgb  # alpha dropped, as torchvision / timm loaders do
    raise AssertionError(kind)


MODES = ["I;16", "I", "P", "P+transparency", "CMYK", "LA", "RGBA"]


@pytest.mark.parametrize("kind", MODES)
def test_every_mode_becomes_the_right_rgb_image(tmp_path, kind):
    path, expected = _write(tmp_path, kind)
    with Image.open(path) as raw:
        assert raw.mode.startswith(kind.split("+")[0]), raw.mode  # the file really holds that mode
    img = open_image(path, "RGB")
    assert img.mode == "RGB" and img.size == (W, H)
    np.testing.assert_allclose(np.asarray(img, np.int16), expected.astype(np.int16), atol=1)


def test_a_16_bit_image_keeps_its_contrast(tmp_path):
    """PIL's own conversion clips 16-bit values to 255: the ramp came out almost white (mean ~254)."""
    path, _ = _write(tmp_path, "I;16")
    grey = np.asarray(open_image(path, "L"), np.float64)
    assert grey.min() == 0 and grey.max() == 255 and 120 < grey.mean() < 135


@pytest.mark.parametrize("kind", ["I;16", "P+transparency", "CMYK", "LA"])
def test_image_folders_read_every_mode_in_rgb_and_grayscale(tmp_path, kind):
    folder = tmp_path / "train" / "a"
    folder.mkdir(parents=True)
    _, expected = _write(folder, kind)
    rgb, _ = ImageFolderDataset(tmp_path / "train")[0]
    np.testing.assert_allclose(np.asarray(rgb, np.int16), expected.astype(np.int16), atol=1)
    grey, _ = ImageFolderDataset(tmp_path / "train", mode="L")[0]
    reference = np.asarray(Image.fromarray(expected).convert("L"), np.int16)
    assert grey.mode == "L"
    np.testing.assert_allclose(np.asarray(grey, np.int16), reference, atol=1)


def test_an_undecodable_file_is_named(tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(CorruptImageError, match=r"cannot read image file .*broken\.png"):
        open_image(bad)


def test_hidden_files_and_folders_in_a_class_folder_are_not_samples(tmp_path):
    """macOS's ``._*`` copies (no image) and a Jupyter ``.ipynb_checkpoints`` copy (an image, of any class)
    are hidden: never samples, never counted, never warned about."""
    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "train" / name / "0.png")
    (tmp_path / "train" / "a" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    hidden = tmp_path / "train" / "b" / ".ipynb_checkpoints"
    hidden.mkdir()
    Image.new("RGB", (8, 8)).save(hidden / "0-checkpoint.png")
    data = ImageFolderDataset(tmp_path / "train")
    assert [(p.rsplit("train/", 1)[1], t) for p, t in data.samples] == [("a/0.png", 0), ("b/0.png", 1)]
    assert all(data[i][1] == t for i, (_, t) in enumerate(data.samples))
