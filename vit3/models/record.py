"""vit3 checkpoint files as a model reads them: what a file holds, and the record that rebuilds its model.

A vit3 checkpoint is a ``torch.save`` dict of plain data (``format`` ``"vit3-checkpoint"``; its fields in
:mod:`vit3.engine.checkpoint`), read with ``torch.load(weights_only=True)``. Files that are no vit3 checkpoint
are described in one line (empty, text, truncated, pickled classes, another format). The model record
(:func:`model_record`) is what building the model again needs: ``name``, ``kwargs``, ``in_chans``,
``img_size``, ``num_classes``, ``classes``, ``mean``/``std``, ``interpolation`` and ``crop_pct``.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

FORMAT = "vit3-checkpoint"
RECORD_FIELDS = (
    "name", "kwargs", "in_chans", "img_size", "num_classes", "classes", "mean", "std", "interpolation",
    "crop_pct",
)  # fmt: skip
# The tasks whose checkpoints hold an image classifier (a conversion's student is one).
CLASSIFIER_TASKS = ("classification", "convert")

__all__ = [
    "CLASSIFIER_TASKS",
    "FORMAT",
    "RECORD_FIELDS",
    "checkpoint_kind",
    "checkpoint_task",
    "describe_bytes",
    "describe_checkpoint",
    "file_task",
    "is_vit3_checkpoint",
    "load_checkpoint",
    "model_record",
    "peek_vit3_checkpoint",
    "require_classifier",
]


def is_vit3_checkpoint(obj: Any) -> bool:
    return isinstance(obj, Mapping) and obj.get("format") == FORMAT


def _truncated(path: Path) -> str | None:
    """Why ``path`` looks like a cut-off ``torch.save`` file (a zip archive without its end), or ``None``."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        return (
            f"checkpoint {path} is truncated ({path.stat().st_size} bytes, the end of the file is missing): "
            f"the write or copy that made it was interrupted; use another copy (e.g. best.pt / last.pt)"
        )
    return None


class _PlainDict:
    """What a :class:`~vit3.engine.config.Config` pickled by an earlier vit3 is read back as: a plain dict."""

    def __new__(cls, *args: Any, **kwargs: Any) -> dict:
        return {}


# The class name those earlier files pickle (where the config class lived when they were written).
_CONFIG_GLOBAL = "vit3.engine.config.Config"


def _load(path: Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``; a checkpoint written before records held plain data only (a
    :class:`~vit3.engine.config.Config` pickled in its model kwargs) is read with that class rebuilt as plain
    dicts (nothing is imported from the file). ``mmap``: tensors stay on disk until touched (reading the
    config of a large checkpoint)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as first:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # not a zip checkpoint: the first problem is the one to report
            raise first from None
        if names != [_CONFIG_GLOBAL]:
            raise
        with torch.serialization.safe_globals([(_PlainDict, _CONFIG_GLOBAL)]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def _pickled_classes(path: Path) -> list[str]:
    """The classes a zip ``torch.save`` file pickles (which weights-only loading refuses); ``[]`` for any
    other file."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # not a zip checkpoint
        return []


def _unreadable(path: Path) -> str:
    """One line on why ``path`` could not be read (torch's own message takes a dozen lines)."""
    names = _pickled_classes(path)
    if names:
        return (
            f"cannot read checkpoint {path}: it pickles {', '.join(names)}, "
            f"which weights-only loading does not import (a vit3 checkpoint holds plain data only)"
        )
    return f"{path} is {describe_bytes(path)}; expected a vit3 checkpoint (a run's last.pt or best.pt)"


_LEGACY_MAGIC = (
    b"l\xfc\x9cF\xf9 j\xa8P\x19"  # the number a legacy (before torch 1.6) torch.save file begins with
)


def describe_bytes(path: Path) -> str:
    """What a file that no checkpoint loader reads holds, in a few words: an empty file, a text file (e.g. a
    YAML config), a zip archive of another kind, or bytes of no format ``torch.save`` writes."""
    size = path.stat().st_size
    if not size:
        return "an empty file (0 bytes), not a checkpoint"
    with open(path, "rb") as f:
        head = f.read(512)
    if b"\0" not in head:
        try:
            head.decode("utf-8")
            text = True
        except UnicodeDecodeError as e:  # a character cut at the end of the head is still text
            text = e.start >= len(head) - 3
        if text:
            return f"a text file ({size} bytes, e.g. a YAML config), not a checkpoint"
    if head[:1] == b"\x80":  # the pickle protocol's opcode
        if _LEGACY_MAGIC in head[:32]:
            return (
                f"a torch.save file of the legacy format ({size} bytes) that pickles objects "
                "weights-only loading refuses"
            )
        return f"a Python pickle ({size} bytes) of no torch.save file"
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            saved = any(name.rpartition("/")[2] == "data.pkl" for name in z.namelist())
        return (
            f"a corrupt torch.save file ({size} bytes)"
            if saved
            else "a zip archive that is no torch.save file"
        )
    return f"no torch.save file ({size} bytes of another format, or corrupt)"


def describe_checkpoint(path: str | Path) -> str:
    """What the file ``path`` is, for messages: ``"a vit3 generation checkpoint (dit3_s_4)"``, ``"a bare state
    dict (189 tensors)"``, ``"an empty file (0 bytes), not a checkpoint"``, ``"a folder"``, ..."""
    path = Path(path)
    if path.is_dir():
        return "a folder"
    if not path.is_file():
        return "not found"
    try:
        obj = _load(path)
    except Exception:
        names = _pickled_classes(path)
        if names:
            return f"a checkpoint of another program (it pickles {', '.join(names[:3])})"
        return _truncated(path) or describe_bytes(path)
    if is_vit3_checkpoint(obj):
        return checkpoint_kind(obj)
    if isinstance(obj, torch.Tensor):
        return f"a single tensor {tuple(obj.shape)}"
    if isinstance(obj, Mapping):
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return f"a bare state dict of {len(obj)} tensor(s) (no vit3 model record)"
        keys = ", ".join(map(str, list(obj)[:5])) + (", ..." if len(obj) > 5 else "")
        return f"a dict of {keys} (no vit3 model record)"
    return f"a {type(obj).__name__}"


def checkpoint_task(ckpt: Mapping[str, Any]) -> str:
    """The task whose run wrote the vit3 checkpoint ``ckpt``: ``classification``, ``detection``, ...
    (classification checkpoints predate the ``task`` field)."""
    return str(ckpt.get("task") or (ckpt.get("config") or {}).get("task") or "classification")


def file_task(path: str | Path) -> str | None:
    """The task of the vit3 checkpoint at ``path``, read without its tensors, or ``None`` for any other file
    (one that cannot be read too: what reads it reports that)."""
    path = Path(path)
    try:
        obj = _load(path, mmap=zipfile.is_zipfile(path))
    except Exception:
        return None
    return checkpoint_task(obj) if is_vit3_checkpoint(obj) else None


def checkpoint_kind(ckpt: Mapping[str, Any]) -> str:
    """``"a vit3 generation checkpoint (dit3_s_4)"``: the task and model of the vit3 checkpoint ``ckpt``."""
    return (
        f"a vit3 {checkpoint_task(ckpt)} checkpoint ({ckpt.get('model_name') or model_record(ckpt)['name']})"
    )


def require_classifier(ckpt: Mapping[str, Any], path: str | Path, use: str) -> None:
    """Refuses a vit3 checkpoint whose model is no image classifier (:data:`CLASSIFIER_TASKS`: a generation
    run's DiT³, a detection or segmentation run's detector around its backbone) where ``use`` (e.g.
    ``"fine-tuning (model.pretrained)"``) needs a classifier's weights.

    Raises:
        CheckpointError: naming the file, what it holds and what ``use`` takes.
    """
    if checkpoint_task(ckpt) not in CLASSIFIER_TASKS:
        raise CheckpointError(
            f"{path} is {checkpoint_kind(ckpt)}: {use} takes a classification checkpoint "
            f"(a run's best.pt) or official ViTTT weights"
        )


def _no_file(path: Path) -> Exception:
    """The error for a checkpoint path that is no file: a folder (naming the checkpoint in it), or none."""
    if path.is_dir():
        inside = f" (e.g. {path / 'last.pt'})" if (path / "last.pt").is_file() else ""
        return CheckpointError(f"checkpoint {path} is a folder: give the checkpoint file{inside}")
    return FileNotFoundError(f"checkpoint not found: {path}")


def _read(path: str | Path, mmap: bool = False) -> Any:
    path = Path(path)
    if not path.is_file():
        raise _no_file(path)
    if mmap and not zipfile.is_zipfile(path):  # mmap reads zip files only; no need for it on others
        mmap = False
    try:
        return _load(path, mmap)
    except Exception as e:  # a truncated/foreign file: name it
        raise CheckpointError(_truncated(path) or _unreadable(path)) from e


def peek_vit3_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """The vit3 checkpoint at ``path``, or ``None`` for any other file (e.g. an official ViTTT file, whose
    pickled training metadata ``weights_only`` refuses: the model's own loader reads those).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: a folder, or a file that no checkpoint loader reads: truncated, empty, a text file,
            bytes of another format (the official loaders read official ``torch.save`` files and
            ``.safetensors``).
    """
    path = Path(path)
    if not path.is_file():
        raise _no_file(path)
    if path.suffix == ".safetensors":  # weights only: the official loader reads them
        return None
    try:
        obj = _load(path)
    except Exception as e:  # not ours: an official file is left to the model's official-checkpoint loader
        why = _truncated(path)
        if why or not _pickled_classes(path):
            raise CheckpointError(
                why
                or f"{path} is {describe_bytes(path)}; expected a vit3 checkpoint (a run's best.pt or "
                f"last.pt) or official weights (.pth, .safetensors)"
            ) from e
        return None
    return obj if is_vit3_checkpoint(obj) else None


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Reads a vit3 checkpoint on CPU (``mmap``: its tensors read from disk when touched).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: truncated, unreadable, or not a vit3 checkpoint (an official file goes through
            model.pretrained).
    """
    obj = _read(path, mmap)
    if not is_vit3_checkpoint(obj):
        raise CheckpointError(
            f"{path} is {describe_checkpoint(path)}, not a vit3 training checkpoint "
            "(a run's last.pt or best.pt); official ViTTT weights are loaded with model.pretrained=FILE "
            "(fine-tuning) or eval.py --model NAME --checkpoint FILE"
        )
    return obj


def model_record(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    """The model record of a vit3 checkpoint; for version-1 files (no ``record``) rebuilt from the fields and
    the config they hold (``mean``/``std`` ``None`` where the run used the model's defaults)."""
    record = ckpt.get("record")
    if isinstance(record, Mapping):
        return {k: record.get(k) for k in RECORD_FIELDS}
    cfg = ckpt.get("config") or {}
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    kwargs = dict(ckpt.get("model_kwargs") or model.get("kwargs") or {})
    mean, std = data.get("mean"), data.get("std")
    if mean is None and data.get("dataset") == "mnist5k":
        from ..data.mnist import MEAN, STD

        mean, std = MEAN, STD
    return {
        "name": ckpt.get("model_name") or model.get("name"),
        "kwargs": kwargs,
        "in_chans": int(kwargs.get("in_chans", 3)),
        "img_size": data.get("img_size"),
        "num_classes": ckpt.get("num_classes"),
        "classes": list(ckpt["classes"]) if ckpt.get("classes") is not None else None,
        "mean": list(mean) if mean is not None else None,
        "std": list(std) if std is not None else None,
        "interpolation": data.get("interpolation"),
        "crop_pct": data.get("crop_pct"),
    }
