"""No crash, one line for every mistake (issue 49): each case here ended in a traceback, a crash (SIGFPE) or a
line that misnamed the problem; now it is one ``error:`` line naming the key, flag or file and what is allowed
(exit code 2), or, for an empty batch, the empty result timm's models give. Grouped by what each protects: the
command line and configs, checkpoints, data, the Python API, signals and the disk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import timm
import torch
from helpers.dense import det_args
from helpers.generation import DEMO as GEN_DEMO
from helpers.generation import tiny_gen_args
from helpers.train import TINY_MODEL, load_script, make_digit_folder, one_error_line
from PIL import Image

import vit3
from vit3.engine.cli import USER_ERROR_EXIT
from vit3.engine.config import CONFIG_DIR
from vit3.errors import ConfigError
from vit3.layers.ttt import TTTMixer

pytestmark = pytest.mark.usefixtures("one_thread")

FINETUNE = CONFIG_DIR / "finetune.yaml"
# timm's own test ViT cut to two blocks: fewer than the three its features take by default.
TWO_BLOCK_VIT = [
    "model.name=test_vit3",
    "model.kwargs={img_size: 32, in_chans: 1, depth: 2}",
    "data.img_size=32",
]


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1), n_train=12, n_val=4)


def _run(digits: Path, out: Path, *extra: str, model: list[str] = TINY_MODEL) -> list[str]:
    """``train.py`` arguments of a one-epoch run on the digits (a few CPU seconds)."""
    return [
        "data.dataset=folder", f"data.path={digits}", f"output={out}", "data.batch_size=8", "train.epochs=1",
        "train.warmup_epochs=0", "train.progress=false", *model, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def classifier(digits, tmp_path_factory) -> Path:
    """The best.pt of a one-epoch classification run of a two-block ViT."""
    out = tmp_path_factory.mktemp("classifier") / "run"
    with torch.random.fork_rng():
        assert load_script("train").main(_run(digits, out, model=TWO_BLOCK_VIT)) == 0
    return out / "best.pt"


@pytest.fixture(scope="module")
def generator(digits, tmp_path_factory) -> Path:
    """The last.pt of a one-epoch generation run (a tiny DiT³ on the digits)."""
    out = tmp_path_factory.mktemp("generator") / "run"
    args = ["--config", str(GEN_DEMO), *tiny_gen_args(digits, out, "train.epochs=1")]
    with torch.random.fork_rng():
        assert load_script("train").main(args) == 0
    return out / "last.pt"


@pytest.fixture(scope="module")
def detector(coco_root, tmp_path_factory) -> Path:
    """The last.pt of a one-epoch detection run on the COCO digits."""
    out = tmp_path_factory.mktemp("detector") / "run"
    args = ["--config", str(CONFIG_DIR / "dense" / "demo_detection.yaml"), *det_args(coco_root, out)]
    with torch.random.fork_rng():
        assert load_script("train").main([*args, "train.epochs=1", "train.eval_every=1"]) == 0
    return out / "last.pt"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Files that are no vit3 checkpoint: empty, random bytes, a config, a bare state dict, a folder."""
    root = tmp_path_factory.mktemp("files")
    (root / "empty.pt").write_bytes(b"")
    (root / "random.pt").write_bytes(bytes(range(256)) * 4)
    (root / "config.yaml").write_text("train:\n  epochs: 1\n")
    torch.save({"a": torch.ones(2)}, root / "foreign.pt")
    (root / "folder").mkdir()
    return {p.stem: p for p in root.iterdir()}


def _fill(args: list[str], **paths: Path) -> list[str]:
    """``args`` with each ``<name>`` replaced by ``paths[name]``."""
    for name, path in paths.items():
        args = [a.replace(f"<{name}>", str(path)) for a in args]
    return args


# ---------------------------------------------------------------------------------------------------- data
def _coco_variant(coco_root: Path, root: Path, change) -> Path:
    """A copy of the COCO digits whose training annotation file ``change(data)`` edited in place."""
    shutil.copytree(coco_root, root)
    ann = root / "annotations" / "instances_train.json"
    data = json.loads(ann.read_text())
    change(data)
    ann.write_text(json.dumps(data))
    return root


def _short_polygon(data: dict) -> None:
    # two points, which pycocotools took for a box
    data["annotations"][0]["segmentation"] = [[1.0, 2.0, 3.0, 4.0]]


def _duplicate_image_id(data: dict) -> None:
    data["images"][1]["id"] = data["images"][0]["id"]


def _wrong_width(data: dict) -> None:
    data["images"][0]["width"] = 80


COCO_MISTAKES = {
    "polygon-of-two-points": (
        _short_polygon,
        "<ann>: annotation 1 of image 1 has a segmentation that is neither polygons (lists of 3 or more x, y pairs) "
        "nor an RLE mask (size and counts)",
    ),
    "image-id-twice": (
        _duplicate_image_id,
        "<ann>: image id 1 is given twice (train_00000.png and train_00001.png); each image needs its own id",
    ),
    "size-unlike-the-file": (
        _wrong_width,
        "<ann>: image 1 (<root>/train/train_00000.png) is 64x64 but the annotation file says 80x64",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("change", "message"), COCO_MISTAKES.values(), ids=COCO_MISTAKES.keys())
def test_a_coco_mistake_names_the_annotation_file_and_the_image(change, message, coco_root, tmp_path, capsys):
    root = _coco_variant(coco_root, tmp_path / "coco", change)
    args = ["--config", str(CONFIG_DIR / "dense" / "demo_detection.yaml"), *det_args(root, tmp_path / "out")]
    assert load_script("train").main([*args, "data.num_workers=0"]) == USER_ERROR_EXIT
    ann = root / "annotations" / "instances_train.json"
    assert _fill([message], ann=ann, root=root)[0] in one_error_line(capsys, last=True)


def test_a_decompression_bomb_names_its_file(digits, tmp_path, monkeypatch, capsys):
    """An image declaring more pixels than PIL opens (twice ``MAX_IMAGE_PIXELS``, lowered here so that a small
    file is one): one line naming the file, where PIL's error named none."""
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    bomb = data / "train" / "digit_0" / "bomb.png"
    Image.new("L", (128, 128)).save(bomb)
    # the 28x28 digits stay below the limit, the 128x128 image is over twice it
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)
    assert load_script("train").main(_run(data, tmp_path / "out", "data.num_workers=0")) == USER_ERROR_EXIT
    line = one_error_line(capsys, last=True)
    assert f"cannot read image file {bomb}: Image size (16384 pixels) exceeds limit of 8000 pixels" in line


# ----------------------------------------------------------------------------------------------------- API
# (model, kwargs): each family, at a size whose plans take the C++ kernels' one-op paths
EMPTY_BATCH_MODELS = {
    "test_vit3_ttt": ("test_vit3_ttt", {}),
    "test_h_vit3": ("test_h_vit3", {}),
    "vit3_tiny": ("vit3_tiny", {"img_size": 64}),
    "h_vit3_tiny": ("h_vit3_tiny", {"img_size": 64}),
    "h_vit3_tiny-saving-block": ("h_vit3_tiny", {"img_size": 64, "ttt_cfg": {"recompute": "never"}}),
}


@pytest.mark.parametrize(("name", "kwargs"), EMPTY_BATCH_MODELS.values(), ids=EMPTY_BATCH_MODELS.keys())
def test_an_empty_batch_gives_an_empty_result(name, kwargs):
    """B = 0 after settled calls of B = 2 (whose plans the kernels' one-op paths serve), in inference and in
    training: ``[0, classes]`` as timm's models give, and a backward that gives every weight a zero gradient
    (a SIGFPE in the C++ kernel or a groups error before)."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **kwargs)
    size = kwargs.get("img_size", 32 if name.startswith("test") else 224)
    chans = model.in_chans
    for mode in (model.eval, model.train):
        mode()
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                for _ in range(2):
                    model(torch.randn(2, chans, size, size))
                out = model(torch.zeros(0, chans, size, size))
            assert out.shape == (0, 5)
            if grad:
                model.zero_grad(set_to_none=True)
                out.sum().backward()
                grads = {n: p.grad for n, p in model.named_parameters()}
                assert all(g is not None and not g.any() for g in grads.values()), name


@pytest.mark.parametrize("lr_mode", ["fixed", "token"])
def test_an_empty_batch_through_a_bare_mixer(lr_mode):
    mixer = TTTMixer(64, 2, lr_mode=lr_mode)
    for _ in range(2):
        mixer(torch.randn(2, 16, 64), (4, 4))
    out = mixer(torch.zeros(0, 16, 64, requires_grad=True), (4, 4))
    assert out.shape == (0, 16, 64)
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in mixer.parameters())


API_MISTAKES = {
    "img-size-a-string": (
        lambda: timm.create_model("vit3_tiny", img_size="224"), ConfigError,
        "vit3_tiny: img_size must be a positive integer or (height, width) of them, got '224'",
    ),
    "img-size-a-string-hierarchical": (
        lambda: timm.create_model("h_vit3_tiny", img_size="224"), ConfigError, "h_vit3_tiny: img_size must be",
    ),
    "no-input-channel": (
        lambda: timm.create_model("vit3_tiny", in_chans=0), ConfigError,
        "vit3_tiny: in_chans must be an integer >= 1 (the image channels), got 0",
    ),
    "explain-a-name": (
        lambda: vit3.explain("vit3_tiny", 224), TypeError,
        "explain takes a model (an nn.Module), got 'vit3_tiny': build it first, e.g. "
        "explain(timm.create_model('vit3_tiny'), ...)",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("call", "kind", "message"), API_MISTAKES.values(), ids=API_MISTAKES.keys())
def test_an_api_mistake_is_a_clear_error(call, kind, message):
    with pytest.raises(kind) as caught:
        call()
    assert str(caught.value) == message or str(caught.value).startswith(message)
