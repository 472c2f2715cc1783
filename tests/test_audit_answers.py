"""No silent wrong answer (issue 49): each input that used to give a wrong figure without a word is refused,
warned about or made right. Grouped by what each test protects; tiny data made in tmp."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import vit3.models  # noqa: F401  (registers the models)
from vit3.data.image import open_image

pytestmark = pytest.mark.usefixtures("one_thread")


# --- images load as they look ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pixels", "want"),
    [
        (
            np.linspace(0.0, 1.0, 64, dtype=np.float32),
            np.rint(np.linspace(0.0, 255.0, 64)),
        ),  # float in [0, 1]
        (np.arange(0, 256, 4, dtype=np.int32), np.arange(0, 256, 4)),  # int32 holding 8-bit values
        (
            np.arange(64, dtype=np.int32) * (2**31 // 64),
            np.rint(np.arange(64) * (2**31 // 64) * 255 / (2**31 - 1)),
        ),
    ],
    ids=["float-0-1", "int32-8-bit", "int32-32-bit"],
)
def test_float_and_int32_tiffs_keep_their_range(tmp_path, pixels, want):
    """A float TIFF in [0, 1] or an int32 TIFF of 8-bit values loaded black (clipped or / 257); an int32 one
    beyond 16 bits white (clipped at 65535). Each is scaled by its type's convention."""
    path = tmp_path / "img.tif"
    Image.fromarray(pixels.reshape(8, 8)).save(path)
    gray = np.asarray(open_image(path, "L")).reshape(-1)
    np.testing.assert_array_equal(gray, want.astype(np.uint8))
    sixteen = tmp_path / "sixteen.tif"  # an int32 image in the 16-bit range keeps the 16-bit rule (/ 257)
    Image.fromarray(np.arange(64, dtype=np.int32).reshape(8, 8) * 1000).save(sixteen)
    np.testing.assert_array_equal(
        np.asarray(open_image(sixteen, "L")).reshape(-1), np.rint(np.arange(64) * 1000 / 257).astype(np.uint8)
    )
