"""Errors that a user's input causes (a config value, a data folder, a checkpoint file).

Every such error derives from :class:`UserError` (and from the built-in type callers used to catch, e.g.
``ValueError``), so that the command-line scripts print its message without a traceback and exit with one
fixed code (``vit3.engine.cli``), while a bug inside vit3 still shows its traceback. A missing file is a
``FileNotFoundError``, which the scripts treat the same way.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "DataError",
    "MissingWeightsError",
    "UserError",
    "WeightsUnavailableError",
]


class UserError(Exception):
    """A mistake in what the user gave vit3; the message names the key, file or value and what is expected."""


class DataError(UserError, ValueError):
    """A dataset does not hold what the run needs (no class folders, an unknown class, a bad annotation)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint file is truncated, unreadable or of another kind than the one asked for."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's weights do not fit the model (another architecture or size)."""


class MissingWeightsError(CheckpointError, KeyError):
    """The weights asked for (e.g. the EMA weights) are not in the checkpoint file."""

    __str__ = Exception.__str__  # the message, not KeyError's quoted repr


class WeightsUnavailableError(UserError, RuntimeError):
    """Pretrained weights cannot be had here (none published, or the download failed); says how to pass a file."""
