"""No crash, one line for every mistake (issue 49): each case here ended in a traceback, a crash (SIGFPE) or a
line that misnamed the problem; now it is one ``error:`` line naming the key, flag or file and what is allowed
(exit code 2), or, for an empty batch, the empty result timm's models give. Grouped by what each protects: the
command line and configs, checkpoints, data, the Python API, signals and the disk.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
from helpers.common import REPO
from helpers.dense import det_args
from helpers.generation import DEMO as GEN_DEMO
from helpers.generation import tiny_gen_args
from helpers.train import TINY_MODEL, load_script, make_digit_folder, one_error_line
from PIL import Image

import vit3
from vit3.engine.cli import INTERRUPTED_EXIT, USER_ERROR_EXIT
from vit3.engine.config import CONFIG_DIR
from vit3.errors import ConfigError
from vit3.layers.ttt import TTTMixer
from vit3.scripts import explain as explain_script

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


# ----------------------------------------------------------------------------------- command line, configs
# (script, arguments, what the one line says)
CLI_MISTAKES = {
    "config-without-base": (
        "train", ["--config", "<tmp>/mine.yaml", "output=<tmp>/out"],
        "config file <tmp>/mine.yaml lacks task, seed, output, device, threads, deterministic, ... (11 keys): a run "
        f"config builds on a shipped one; begin it with 'base: {CONFIG_DIR / 'default.yaml'}'",
    ),
    "config-without-base-no-overrides": (
        "train", ["--config", "<tmp>/mine.yaml"], "config file <tmp>/mine.yaml lacks task, seed, output",
    ),
    "empty-config": ("train", ["--config", "<tmp>/empty.yaml", "output=<tmp>/out"], "config file <tmp>/empty.yaml is empty"),
    "config-folder": ("train", ["--config", "<tmp>"], "config file <tmp> is a folder: give a YAML file"),
    "resume-folder": (
        "train", ["--resume", "<run>"], "checkpoint <run> is a folder: give the checkpoint file (e.g. <run>/last.pt)",
    ),
    "resume-a-config": (
        "train", ["--resume", "<run>/config.yaml"],
        "<run>/config.yaml is a text file (",
    ),
    "sampler-of-a-classifier": (
        "eval", ["--checkpoint", "<classifier>", "--sampler", "ddim"],
        "--sampler (sample.sampler) applies to generation checkpoints; <classifier> is a classification checkpoint",
    ),
    "cfg-scale-of-a-detector": (
        "eval", ["--checkpoint", "<detector>", "--cfg-scale", "2"],
        "--cfg-scale (sample.cfg_scale) applies to generation checkpoints; <detector> is a detection checkpoint",
    ),
    "img-size-of-a-generator": (
        "eval", ["--checkpoint", "<generator>", "--img-size", "64"],
        "--img-size sets classification resolutions; <generator> is a generation checkpoint",
    ),
    "cfg-scale-nan": (
        "eval", ["--checkpoint", "<generator>", "--cfg-scale", "nan"],
        "config key sample.cfg_scale (eval.py --cfg-scale) must be a finite number >= 0, got 'nan'",
    ),
    "base-lr-inf": ("train", ["train.base_lr=.inf"], "config key train.base_lr must be a finite number > 0, got inf"),
    "base-lr-nan": ("train", ["train.base_lr=.nan"], "config key train.base_lr must be a finite number > 0, got nan"),
    "num-classes-in-kwargs": (
        "train", ["model.kwargs.num_classes=4"],
        "model.kwargs.num_classes=4: vit3 passes num_classes to test_h_vit3 itself; leave it out of model.kwargs "
        "and set model.num_classes",
    ),
    "num-classes-in-kwargs-eval": (
        "eval", ["--checkpoint", "<classifier>", "model.kwargs.num_classes=4"],
        "model.kwargs.num_classes=4: vit3 passes num_classes to test_vit3 itself",
    ),
    "img-size-beyond-any-memory": (
        "train", ["data.img_size=10000000"],
        "config key data.img_size must be image sizes test_h_vit3 can run on cpu, got 10000000: one image of that "
        "size needs more memory than there is",
    ),
    "batch-of-one-with-batchnorm": (
        "train", ["data.batch_size=1"],
        "data.batch_size=1: a BatchNorm layer of test_h_vit3 gets one value per channel in training",
    ),
    "divergence": (
        "train", ["train.base_lr=1e30"],
        "of 3): the run diverged; lower train.base_lr (now 1e+30), lower train.clip_grad (now 5) or lengthen "
        "train.warmup_epochs",
    ),
    "explain-typo": ("explain", ["vit3_tinyy"], "got 'vit3_tinyy': did you mean vit3_tiny"),
    "explain-image-too-small": (
        "explain", ["vit3_tiny", "--img-size", "8"],
        "--img-size must be an image size vit3_tiny takes, got 8: image 8x8 is too small",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("script", "args", "message"), CLI_MISTAKES.values(), ids=CLI_MISTAKES.keys())
def test_a_command_line_mistake_is_one_line(script, args, message, digits, request, tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("model:\n  name: test_h_vit3\ntrain:\n  epochs: 1\n")
    (tmp_path / "empty.yaml").write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("output: somewhere\n")
    (run / "last.pt").write_bytes(b"")
    paths = {"tmp": tmp_path, "run": run}
    paths |= {name: request.getfixturevalue(name) for name in ("classifier", "detector", "generator")
              if f"<{name}>" in " ".join(args) + message}  # fmt: skip
    args = _fill(args, **paths)
    if script == "train" and not any(a.startswith("--") for a in args):
        args = _run(digits, tmp_path / "out", *args)
    main = explain_script.main if script == "explain" else load_script(script).main
    assert main(args) == USER_ERROR_EXIT
    assert _fill([message], **paths)[0] in one_error_line(capsys, last=True)


# --------------------------------------------------------------------------------------------- checkpoints
# (script, arguments, what the one line says): each checkpoint named for what it holds and what is taken there
CHECKPOINT_MISTAKES = {
    "fine-tune-from-a-generator": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<generator>"],
        "<generator> is a vit3 generation checkpoint (dit3_s_4): fine-tuning (model.pretrained) takes a "
        "classification checkpoint (a run's best.pt) or official ViTTT weights",
    ),
    "fine-tune-from-a-detector": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<detector>"],
        "<detector> is a vit3 detection checkpoint (test_h_vit3): fine-tuning (model.pretrained) takes a "
        "classification checkpoint",
    ),
    "features-of-a-generator": (
        "export", ["features", "--checkpoint", "<generator>"],
        "<generator> is a vit3 generation checkpoint (dit3_s_4): exporting a backbone takes a classification",
    ),
    "onnx-of-a-generator": (
        "export", ["onnx", "--checkpoint", "<generator>"], "<generator> is a vit3 generation checkpoint",
    ),
    "features-of-a-detector": (
        "export", ["features", "--checkpoint", "<detector>"], "<detector> is a vit3 detection checkpoint",
    ),
    "features-of-two-blocks": (
        "export", ["features", "--checkpoint", "<classifier>"],
        "test_vit3's default feature levels do not fit it (last-n (3) is out of range (1 to 2)): its 2 feature "
        "levels are 0 to 1 (or -2 to -1 from the last); name those to take with --out-indices",
    ),
    "eval-empty": (
        "eval", ["--checkpoint", "<empty>"],
        "<empty> is an empty file (0 bytes), not a checkpoint; expected a vit3 checkpoint (a run's best.pt or "
        "last.pt) or official weights (.pth, .safetensors)",
    ),
    "eval-random": ("eval", ["--checkpoint", "<random>"], "<random> is no torch.save file (1024 bytes of another"),
    "eval-a-config": ("eval", ["--checkpoint", "<config>"], "<config> is a text file (19 bytes, e.g. a YAML config)"),
    "eval-foreign": (
        "eval", ["--checkpoint", "<foreign>"],
        "<foreign> is a bare state dict of 1 tensor(s) (no vit3 model record), not a vit3 checkpoint: name its "
        "model with --model",
    ),
    "eval-folder": ("eval", ["--checkpoint", "<folder>"], "checkpoint <folder> is a folder: give the checkpoint file"),
    "eval-random-with-a-model": (
        "eval", ["--checkpoint", "<random>", "--model", "test_h_vit3"], "<random> is no torch.save file",
    ),
    "resume-empty": (
        "train", ["--resume", "<empty>"],
        "<empty> is an empty file (0 bytes), not a checkpoint; expected a vit3 checkpoint (a run's last.pt or "
        "best.pt)",
    ),
    "resume-random": ("train", ["--resume", "<random>"], "<random> is no torch.save file"),
    "resume-foreign": (
        "train", ["--resume", "<foreign>"],
        "<foreign> is a bare state dict of 1 tensor(s) (no vit3 model record), not a vit3 training checkpoint",
    ),
    "fine-tune-from-empty": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<empty>", "model.name=test_h_vit3"],
        "<empty> is an empty file (0 bytes), not a checkpoint",
    ),
    "fine-tune-from-random": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<random>", "model.name=test_h_vit3"],
        "<random> is no torch.save file",
    ),
    "fine-tune-from-foreign": (
        "train", ["--config", str(FINETUNE), "model.pretrained=<foreign>", "model.name=test_h_vit3"],
        "<foreign>: checkpoint does not fit this HViT3: none of its 1 key(s) (e.g. a) names one of the model's",
    ),
    "features-of-empty": (
        "export", ["features", "--checkpoint", "<empty>", "--model", "test_h_vit3"], "<empty> is an empty file",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("script", "args", "message"), CHECKPOINT_MISTAKES.values(), ids=CHECKPOINT_MISTAKES.keys()
)
def test_a_checkpoint_of_another_kind_is_named_in_one_line(
    script, args, message, digits, files, request, tmp_path, capsys
):
    paths = dict(files)
    paths |= {name: request.getfixturevalue(name) for name in ("classifier", "detector", "generator")
              if f"<{name}>" in " ".join(args)}  # fmt: skip
    args = _fill(args, **paths)
    if script == "train" and "--resume" not in args:
        args = _run(digits, tmp_path / "out", *args)
    elif script == "export":
        out = tmp_path / ("feats" if args[0] == "features" else "m.onnx")
        args += ["--out", str(out)] + (["--images", str(digits / "val")] if args[0] == "features" else [])
    assert load_script(script).main(args) == USER_ERROR_EXIT
    assert _fill([message], **paths)[0] in one_error_line(capsys, last=True)


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


# ------------------------------------------------------------------------------------------ signals, disk
def test_ctrl_c_ends_with_one_line_naming_the_last_checkpoint(digits, tmp_path):
    """SIGINT once the first checkpoint is written: exit 130 and one line naming it, no traceback (the data
    read in the main process, the one process the test signals)."""
    out = tmp_path / "run"
    args = _run(digits, out, "train.epochs=1000", "data.num_workers=0")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        while not (out / "last.pt").is_file():  # replaced atomically: a file that is there is whole
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == INTERRUPTED_EXIT, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error: interrupted (Ctrl-C); the last checkpoint written is {out / 'last.pt'} "
        f"(train.py --resume {out / 'last.pt'} continues it)"
    )


class _Disk(io.RawIOBase):
    """Storage that takes ``room`` bytes, then refuses every write (``ENOSPC``): a disk that fills up under a
    buffered file, as ``open(path, "wb")`` gives."""

    def __init__(self, room: int) -> None:
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        taken = min(len(data), self.room)
        if not taken:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= taken
        return taken


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_it(digits, tmp_path, monkeypatch, capsys):
    """The second epoch's last.pt meets a full disk a few KB in: torch's zip writer reported it as its own
    ``enforce fail at inline_container.cc``; now one line names the file and the system's reason, and the
    first epoch's checkpoint stays as it was."""
    from vit3.engine import checkpoint as ckpt_module

    save = torch.save
    out = tmp_path / "run"

    def fill_the_disk(obj, f, *args, **kwargs):  # f: the temporary file of the checkpoint, .<name>.tmp<pid>
        if Path(f.name).name.startswith(".last.pt.") and (out / "last.pt").exists():
            return save(obj, io.BufferedWriter(_Disk(4096), buffer_size=1024), *args, **kwargs)
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt_module.torch, "save", fill_the_disk)
    assert load_script("train").main(_run(digits, out, "train.epochs=2")) == USER_ERROR_EXIT
    kept = f"{out / 'last.pt'}: No space left on device (the checkpoint already there is left as it was)"
    assert one_error_line(capsys, last=True) == f"error: cannot write checkpoint {kept}"
    monkeypatch.setattr(ckpt_module.torch, "save", save)
    assert ckpt_module.load_checkpoint(out / "last.pt")["epoch"] == 1
