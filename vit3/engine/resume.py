"""Checkpoints and exact resume: where a run stands (:class:`Progress`), saved and restored.

:func:`start_run` reads the checkpoint ``train.resume`` names, :func:`check_resume` refuses data-stream
changes, :func:`save_state` writes every rank's RNG state (collective), :func:`open_run` restores a run.
A run killed at any point and resumed from its last checkpoint ends with the weights of an uninterrupted
run, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models.record import checkpoint_task, load_checkpoint
from .checkpoint import get_rng_state, resume_differences, save_checkpoint, set_rng_state
from .config import Config, ConfigError
from .distributed import DistInfo, all_gather_objects, barrier, log
from .optim import EpochSteps
from .process import seed_process, set_threads
from .run_folder import OutputFolder, open_output

__all__ = [
    "Progress",
    "check_resume",
    "check_resume_task",
    "open_run",
    "restore_rng",
    "resume_path",
    "save_state",
    "start_run",
]


@dataclass
class Progress:
    """Where a run stands: what a checkpoint stores and a resume restores (engines extend it)."""

    epoch: int = 0  # the epoch to run (0-based)
    batch_in_epoch: int = 0  # batches of that epoch already done
    global_step: int = 0  # optimizer updates done
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per epoch (dense: per evaluation)

    def counters(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step}

    def restore(
        self, ckpt: Mapping[str, Any], batch_size: int, world: int, accum: int, steps: EpochSteps,
        by_epochs: bool = True,
    ) -> None:  # fmt: skip
        """Restores the counters of ``ckpt`` and moves on to the next epoch where its epoch was done.

        A (forced) resume with another batch per update (``batch_size`` per process x ``world`` x ``accum``)
        continues after the samples already seen: the batch inside the epoch is rescaled to whole
        accumulation steps, and, where the schedule counts epochs (``by_epochs``; not a dense run of
        ``dense.iters``), the step is the one this run's schedule has there (updates per epoch x epochs done
        + updates into the epoch), so the lr goes on from the same point of training. Every task restores
        its step here (classification, generation, dense); ``tests/engine/test_optim.py`` resumes a run at an
        epoch's end and inside an epoch against the schedule's formula.
        """
        self.epoch, self.batch_in_epoch = int(ckpt["epoch"]), int(ckpt["batch_in_epoch"])
        self.global_step = int(ckpt["global_step"])
        old = int(ckpt["config"]["data"]["batch_size"]) * int(ckpt.get("world_size", 1))
        new = int(batch_size) * int(world)
        old_accum = int(ckpt["config"]["train"].get("accum_steps", 1))
        changed = old != new or old_accum != accum
        if changed:
            self.batch_in_epoch = self.batch_in_epoch * old // new // accum * accum
        self.roll_over(steps.batches)
        if by_epochs and changed:
            self.global_step = self.epoch * steps.updates + self.batch_in_epoch // accum

    def roll_over(self, batches_per_epoch: int) -> None:
        """Moves to the start of the next epoch when this one's batches are all done."""
        if self.batch_in_epoch >= batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0


def start_run(cfg: Config, info: DistInfo, task: str) -> tuple[str, dict[str, Any] | None]:
    """The opening every task's run shares: this process's threads and seeds, and the checkpoint a resume
    reads (``train.resume``; :func:`resume_path`), checked to be one of ``task``.

    Returns:
        The checkpoint's path ("" for a fresh run) and its contents (None for a fresh run).
    """
    set_threads(cfg)
    seed_process(cfg, info)
    resume = resume_path(cfg, Path(cfg.output))
    ckpt = load_checkpoint(resume) if resume else None
    if ckpt is not None:
        check_resume_task(ckpt, task, resume)
    return resume, ckpt


def resume_path(cfg: Config, out: Path) -> str:
    """The checkpoint ``train.resume`` names (``auto``: ``<output>/last.pt`` if it exists), or ""."""
    resume = cfg.train.resume or ""
    if resume == "auto":
        return str(out / "last.pt") if (out / "last.pt").is_file() else ""
    return str(resume)


def check_resume_task(ckpt: Mapping[str, Any], task: str, source: str) -> None:
    """Raises :class:`ConfigError` when ``ckpt`` was written by another task than ``task``."""
    if checkpoint_task(ckpt) != task:
        raise ConfigError(
            f"cannot resume a {task} run from {source}: it is a {checkpoint_task(ckpt)} checkpoint"
        )


def check_resume(cfg: Config, ckpt: Mapping[str, Any], world: int, source: str) -> list[str]:
    """The data-stream settings a resume changes; refused unless ``train.force_resume``.

    Raises:
        ConfigError: a setting of :data:`~vit3.engine.checkpoint.DATA_STREAM_KEYS` or the number of
            processes differs from the run that wrote ``source``.
    """
    changed = resume_differences(ckpt["config"], cfg)
    if int(ckpt.get("world_size", world)) != world:
        changed.append(f"world size (processes): was {ckpt.get('world_size')}, now {world}")
    if changed and not cfg.train.force_resume:
        raise ConfigError(
            f"cannot resume exactly from {source}: settings that decide the data stream changed ("
            + "; ".join(changed)
            + "), so the run would continue at other samples than it stopped at. Set them back, or force "
            "the resume with train.force_resume=true (it continues after the samples already seen)."
        )
    return changed


def save_state(
    make_state: Callable[[], dict[str, Any]], path: Path, info: DistInfo, copies: Iterable[Path] = ()
) -> Path:
    """Writes ``make_state()`` plus every rank's RNG state (``"rng"``, one per rank) to ``path`` (and to
    each of ``copies``, e.g. ``best.pt``) on rank 0.

    Collective: every rank must call it at the same point of the run (``copies`` matters on rank 0 only).
    """
    rng = all_gather_objects(get_rng_state())
    if info.is_main:
        state = {**make_state(), "rng": rng, "world_size": info.world}
        for target in (path, *copies):
            save_checkpoint(target, state)
    barrier()
    return path


def restore_rng(ckpt: Mapping[str, Any], info: DistInfo) -> None:
    """Restores this rank's RNG states of ``ckpt`` (rank r of a run with another process count: r mod n)."""
    rng = ckpt["rng"]
    if len(rng) != info.world:
        log(info, f"warning: checkpoint from {len(rng)} process(es), now {info.world}: RNG streams differ")
    set_rng_state(rng[info.rank % len(rng)])


def open_run(
    folder: OutputFolder,
    cfg: Config,
    info: DistInfo,
    ckpt: Mapping[str, Any] | None,
    resume: str,
    restore: Callable[[], Progress],
) -> None:
    """The close of a run's setup: with ``ckpt`` (read from ``resume``), ``restore()`` the run from it (it
    returns the progress restored, which the log names, or says it holds a finished run); then the config
    saved in ``folder`` (:func:`open_output`); last the RNG states of ``ckpt``, since building the run drew on
    the RNGs."""
    if ckpt is not None:
        p = restore()
        epochs = int(cfg.train.epochs)
        if p.epoch >= epochs:  # nothing left to train: the run's files are only rewritten as they are
            log(
                info,
                f"note: {resume} ends a finished run ({p.epoch} epoch(s) done, train.epochs={epochs}): "
                f"nothing is left to train; raise train.epochs to train on",
            )
        else:
            log(
                info,
                f"resumed from {resume}: epoch {p.epoch + 1}, batch {p.batch_in_epoch}, step {p.global_step}",
            )
    open_output(folder, cfg, info)
    if ckpt is not None:
        restore_rng(ckpt, info)
