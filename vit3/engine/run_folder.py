"""A run's output folder: held, claimed and opened before anything is written.

A run holds the lock of its folder for its whole life (:func:`hold_run_folder`). No run writes into a folder
that holds another run's checkpoints or results, or a ``config.yaml`` no run saved: :func:`claim_output`
refuses it in one line naming the ways on, unless ``train.overwrite``, which moves that run's files into
``<output>/replaced-<UTC time>/`` (:func:`move_aside`), deleting nothing. See ``docs/design/engine.md``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..models.record import load_checkpoint
from ..outputs import CHECKPOINT_FILES, RESULT_FILES, RUN_FILES, RUN_PATTERNS, hold_folder
from .checkpoint import CheckpointError
from .config import Config, ConfigError, folder_problem, save_config
from .distributed import DistInfo, all_gather_objects, distributed, log

__all__ = ["OutputFolder", "claim_output", "hold_run_folder", "in_process_group", "move_aside", "open_output"]


def in_process_group(cfg: Config, fn: Callable[..., Any], *args: Any, hold_output: bool = False) -> Any:
    """``fn(cfg, *args, info)`` inside the run's process group (``torchrun``; one process otherwise); with
    ``hold_output`` (a training run) while holding its folder (:func:`hold_run_folder`)."""
    with distributed(cfg.device, cfg.dist.backend) as info:
        with hold_run_folder(cfg, info) if hold_output else contextlib.nullcontext():
            return fn(cfg, *args, info)


@contextlib.contextmanager
def hold_run_folder(cfg: Config, info: DistInfo) -> Iterator[None]:
    """Rank 0 holds the lock of the run's folder ``cfg.output`` while the body runs
    (:func:`~vit3.outputs.hold_folder`); a folder that a live run holds is refused on every rank. A
    folder this process cannot write is left to the config checks (no run can write there).

    Raises:
        ConfigError: a live run holds the folder (one line naming it and the holder's process id).
    """
    out = Path(str(cfg.output or "."))
    with contextlib.ExitStack() as stack:
        problem = None
        if info.is_main and folder_problem(out) is None:
            try:
                stack.enter_context(hold_folder(out))
            except ConfigError as e:
                problem = str(e)
        problem = all_gather_objects(problem)[0]  # every rank stops alike
        if problem:
            raise ConfigError(problem)
        yield


@dataclass
class OutputFolder:
    """A run's output folder, checked by :func:`claim_output`; ``replace``: the earlier run's files there
    are moved aside (``train.overwrite``) by :func:`open_output` before the first write."""

    path: Path
    replace: bool = False


def _global_step(path: Path) -> float:
    """The optimizer step a checkpoint was written at (inf for an unreadable one: never overwrite it)."""
    try:
        return int(load_checkpoint(path, mmap=True).get("global_step", 0))
    except (CheckpointError, OSError):
        return float("inf")


def _saved_config(path: Path) -> bool:
    """Whether ``path`` is a config a run saved (:func:`~vit3.engine.config.save_config`: it holds ``_meta``),
    not one a user wrote."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "_meta" in data


def claim_output(cfg: Config, resume: str, ckpt: Mapping[str, Any] | None) -> OutputFolder:
    """Checks that the run of ``cfg`` (resumed from the checkpoint ``resume``, ``ckpt``, or "" / None) may
    write into ``cfg.output`` (see the module docstring). Call it on every rank before anything is written.

    Raises:
        ConfigError: the folder holds another run's checkpoints or results (or, for a resume in its own
            folder, a checkpoint later than the one resumed from), and ``train.overwrite`` is not set.
    """
    out = Path(cfg.output)
    held = [out / name for name in CHECKPOINT_FILES if (out / name).is_file()]
    results = [out / name for name in RESULT_FILES if (out / name).exists()]
    config = out / "config.yaml"
    own_config = config.is_file() and not _saved_config(config)
    if not held and not results and not own_config:
        return OutputFolder(out)
    overwrite = f"--overwrite moves its files into {out / 'replaced-<time>'}/ first"
    if not held and not results:  # e.g. the user's own config file, given with --config, in the run's folder
        problem = (
            f"{config} is a config file that no run saved, which this run would replace with its resolved "
            f"config: keep your config outside the run's folder, or give this run a new folder "
            f"(output=<folder>); {overwrite.replace('its files', 'it')}"
        )
    elif not held:  # the results of a run whose checkpoints are gone
        problem = (
            f"{out} holds the results of another run ({', '.join(p.name for p in results)}), which this run "
            f"would overwrite: give this one a new folder (output=<folder>); {overwrite}"
        )
    elif resume and Path(resume).resolve().parent == out.resolve():  # the run continues in its own folder
        step = int(ckpt["global_step"]) if ckpt is not None else 0
        later = [p for p in held if not p.samefile(resume) and _global_step(p) > step]
        if not later:
            return OutputFolder(out)
        problem = (
            f"{later[0]} was written later than {resume} (step {step}), which this run resumes from, and "
            "would "
            f"be overwritten: resume from {later[0]} instead, or continue in a new folder (output=<folder>); "
            f"{overwrite}"
        )
    else:
        names = ", ".join(p.name for p in held)
        problem = (
            f"{out} holds the checkpoints of another run ({names}), which this run would overwrite: continue "
            f"that run with --resume {held[0]}, or give this one a new folder (output=<folder>); {overwrite}"
        )
    if cfg.train.get("overwrite"):
        return OutputFolder(out, replace=True)
    raise ConfigError(problem)


def move_aside(
    folder: Path, names: Iterable[str] = RUN_FILES, patterns: Iterable[str] = RUN_PATTERNS
) -> tuple[Path, list[str]]:
    """Moves the entries of ``folder`` named ``names`` or matching one of ``patterns`` into a new
    ``folder/replaced-<UTC time>/`` (nothing is deleted); returns that folder and the names moved."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = folder / f"replaced-{stamp}", 1
    while target.exists():  # two replacements within one second
        n += 1
        target = folder / f"replaced-{stamp}-{n}"
    names, patterns = set(names), tuple(patterns)
    moved = []
    for entry in sorted(folder.iterdir()):
        if entry.name in names or any(entry.match(pattern) for pattern in patterns):
            target.mkdir(exist_ok=True)
            entry.rename(target / entry.name)
            moved.append(entry.name)
    return target, moved


def open_output(folder: OutputFolder, cfg: Config, info: DistInfo) -> Path:
    """Moves the earlier run's files aside when :func:`claim_output` said so, then saves the run's config
    (rank 0 only; the other ranks do nothing)."""
    if info.is_main:
        if folder.replace:
            target, moved = move_aside(folder.path)
            log(
                info, f"warning: train.overwrite=true: moved the earlier run's {', '.join(moved)} to {target}"
            )
        save_config(cfg, folder.path)
    return folder.path
