"""The path checks of the validation layer: folders and files this process can write, inputs that must exist.

Each runs before anything is written, so that a run fails at once instead of after an epoch of training.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...outputs import RUN_FILES
from .kinds import config_value


def folder_problem(path: Path) -> str | None:
    """Why this process could not write into the folder ``path`` (creating it first if need be), or ``None``.

    The check runs before anything is written: ``path`` must not be a file, none of its existing ancestors a
    file, and the deepest one that exists must be writable (``os.access``; it says yes to root, except on a
    read-only file system).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{path} is a file"
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return f"{base} is a file, so nothing can be made under it"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{base} is not writable here (permission denied or a read-only file system)"
    return None


def file_problem(path: Path, suffix: str = "") -> str | None:
    """Why this process could not write the file ``path`` (ending in ``suffix`` when given), or ``None``."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder"
    if suffix and path.suffix.lower() != suffix:
        return f"the file name must end in {suffix}, so that no other file (a checkpoint, say) is overwritten"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is not writable here"
    if path.parent.is_file():
        return f"{path.parent} is a file, so nothing can be made under it"
    return folder_problem(path.parent)


def writable_folder(value: Any, cfg: Any) -> str | None:
    return folder_problem(Path(str(value))) if value else None


def _checkpoint_folder(cfg: Any) -> Path | None:
    checkpoint = config_value(cfg, "eval.checkpoint")
    return Path(str(checkpoint)).parent if checkpoint else None


def eval_output_folder(value: Any, cfg: Any) -> str | None:
    """``sample.out``: the folder it names, or (empty) the default next to the checkpoint."""
    if value:
        return folder_problem(Path(str(value)))
    folder = _checkpoint_folder(cfg)
    why = folder_problem(folder) if folder is not None else None
    return f"the default output next to the checkpoint cannot be written: {why}" if why else None


# How every vit3 evaluation report begins (classification, dense, generation): a JSON object whose first key
# is the checkpoint it evaluated.
_REPORT_START = re.compile(r'\s*\{\s*"checkpoint"\s*:')


def is_eval_report(path: Path) -> bool:
    """Whether the file ``path`` is a report an evaluation of vit3 wrote (its first bytes say so: a large
    JSON file of another kind, e.g. a COCO annotation file, is not read whole)."""
    try:
        with open(path, "rb") as f:
            start = f.read(256).decode("utf-8", errors="replace")
    except OSError:
        return False
    return _REPORT_START.match(start) is not None


def report_file(value: Any, cfg: Any) -> str | None:
    """``eval.json``: the file it names (never one of a run's own files, e.g. its ``metrics.json``, nor an
    existing file that is no vit3 evaluation report: :func:`is_eval_report`), or (empty) the default next to
    the checkpoint."""
    if value:
        path = Path(str(value))
        rename = (
            "give the report another name (without --json it goes beside the checkpoint as <name>.eval.json, "
            "<name>.<folder>.eval.json for another data folder)"
        )
        if path.name in RUN_FILES and path.suffix == ".json":
            return (
                f"{path.name} is one of a training run's own files, which a report must not replace: {rename}"
            )
        if path.is_file() and path.suffix.lower() == ".json" and not is_eval_report(path):
            return (
                f"{path} exists and is no vit3 evaluation report, which this report would replace: {rename}"
            )
        return file_problem(path, ".json")
    folder = _checkpoint_folder(cfg)
    why = folder_problem(folder) if folder is not None else None
    return f"the default report next to the checkpoint cannot be written: {why}" if why else None


def existing(kind: str, special: tuple[str, ...] = ()) -> Callable[[Any, Any], str | None]:
    """A test for a path that must exist (``kind``: ``"file"`` or ``"folder"``); "" and ``special`` values
    (e.g. ``"auto"``) are not paths."""

    def test(value: Any, cfg: Any) -> str | None:
        if not value or value in special:
            return None
        path = Path(str(value))
        if not path.exists():
            return "not found"
        if kind == "file" and path.is_dir():
            return "it is a folder"
        if kind == "folder" and not path.is_dir():
            return "it is a file"
        return None

    return test


def existing_what(kind: str, special: tuple[str, ...] = ()) -> str:
    word = {"file": "an existing file", "folder": "an existing folder"}[kind]
    return word + (f" (or {', '.join(special)})" if special else "")
