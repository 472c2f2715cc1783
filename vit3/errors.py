"""Errors that a user's input causes (a config value, a data folder, a checkpoint file).

Every such error derives from :class:`UserError` (and from the built-in type callers used to catch, e.g.
``ValueError``), so that the command-line scripts print its message without a traceback and exit with one
fixed code (``vit3.engine.cli``), while a bug inside vit3 still shows its traceback. A missing file is a
``FileNotFoundError``, which the scripts treat the same way, and so is an output the system refuses to take
(:class:`OutputError`, or any ``OSError`` of :data:`OUTPUT_ERRNOS`: no permission, a full disk, a path under a
file).
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = [
    "OUTPUT_ERRNOS",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigError",
    "DataError",
    "MissingWeightsError",
    "OutputError",
    "Terminated",
    "TrainingDiverged",
    "UserError",
    "WeightsUnavailableError",
    "describe_os_error",
    "divergence_advice",
    "raise_terminated",
]

# What the system answers when it will not take an output the user pointed at: no permission, a read-only or
# full file system (or quota), a path under a file, a directory where a file goes (or the reverse), a name too
# long. None of them is a bug of vit3.
OUTPUT_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EFBIG,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.ENAMETOOLONG,
    }
)


class UserError(Exception):
    """A mistake in what the user gave vit3; the message names the key, file or value and what is expected."""


class ConfigError(UserError, ValueError):
    """A config file, override or command-line value is invalid (unknown key, bad syntax, type or value)."""


class OutputError(UserError, OSError):
    """An output (checkpoint, config, report, export) could not be written: the message names the file, the
    system's reason and what was left on disk."""


def describe_os_error(exc: OSError) -> str:
    """``"<file>: <reason>"`` for an ``OSError`` (``"No space left on device"``, ``"Permission denied"``,
    ...)."""
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, a batch scheduler's stop) where a script takes it as Ctrl-C
    (``vit3.engine.cli.run_cli``): the run ends as an interrupted one, naming its last checkpoint."""


def raise_terminated(signum: int, frame: Any) -> None:
    """A SIGTERM handler: raises :class:`Terminated` in the main thread."""
    raise Terminated


class DataError(UserError, ValueError):
    """A dataset does not hold what the run needs (no class folders, an unknown class, a bad annotation)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint file is truncated, unreadable or of another kind than the one asked for."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's weights do not fit the model (another architecture or size)."""


class MissingWeightsError(CheckpointError, KeyError):
    """The weights asked for (e.g. the EMA weights) are not in the checkpoint file."""

    __str__ = Exception.__str__  # the message, not KeyError's quoted repr


class TrainingDiverged(UserError, FloatingPointError):
    """The training run diverged: its loss, gradient norm or activations became non-finite (NaN or Inf); the
    message names the step and what to try (:func:`divergence_advice`)."""


def divergence_advice(base_lr: float, clip_grad: float | None, warmup: str = "train.warmup_epochs") -> str:
    """What to try after a run diverged: a lower ``train.base_lr``, gradient clipping (``train.clip_grad``)
    and a longer warmup (``warmup``: the task's key)."""
    clip = (
        "set train.clip_grad (e.g. 1.0)"
        if clip_grad is None
        else f"lower train.clip_grad (now {clip_grad:g})"
    )
    return f"the run diverged; lower train.base_lr (now {base_lr:g}), {clip} or lengthen {warmup}"


class WeightsUnavailableError(UserError, RuntimeError):
    """Pretrained weights cannot be had here (none published, or the download failed); says how to pass a
    file."""
