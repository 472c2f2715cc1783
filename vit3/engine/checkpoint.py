"""vit3 training checkpoints: atomic writes, exact-resume state, the model record, fine-tuning with a new
head.

A checkpoint is a ``torch.save`` dict of plain data (checked on save, :func:`check_plain`) that
``torch.load(weights_only=True)`` reads; files are written atomically (:mod:`vit3.outputs`). The model record
(:func:`~vit3.models.record.model_record`) is what building the model again needs; fine-tuning, ``eval.py``
and ``export.py`` build from it (:func:`merge_model_spec`, :func:`apply_model_record`).
:func:`config_for_resume` is what ``train.py --resume FILE`` runs with. The entries and the rules:
``docs/design/engine.md``.
"""

from __future__ import annotations

import collections
import random
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import CheckpointError, CheckpointMismatchError
from ..models.record import FORMAT, describe_checkpoint, load_checkpoint, peek_vit3_checkpoint
from ..outputs import atomic_write
from .config import Config, ConfigError, config_from_checkpoint, load_config, to_plain

VERSION = 2  # 2: adds the model record
# Settings that fix which samples form each batch: a resume that changes one would continue at another sample.
DATA_STREAM_KEYS = (
    "seed",
    "data.dataset",
    "data.path",
    "data.train_split",
    "data.batch_size",
    "data.img_size",
)

__all__ = [
    "DATA_STREAM_KEYS",
    "CheckpointError",
    "CheckpointMismatchError",
    "apply_model_record",
    "check_plain",
    "classifier_prefixes",
    "config_for_checkpoint",
    "config_for_resume",
    "eval_report_path",
    "get_rng_state",
    "last_saved",
    "load_model_weights",
    "make_model_record",
    "merge_model_spec",
    "resume_differences",
    "save_checkpoint",
    "set_rng_state",
]


def get_rng_state() -> dict[str, Any]:
    """python, numpy, torch CPU and CUDA RNG states in ``weights_only``-loadable types."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # noqa: NPY002  (timm Mixup uses it)
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores what :func:`get_rng_state` returned."""
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))  # noqa: NPY002
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x: Any) -> Any:
    """random.setstate needs tuples where serialisation may have produced lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


# What torch.load(weights_only=True) reads back besides tensors (checked on save: check_plain).
_PLAIN_LEAVES = (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


def check_plain(obj: Any, where: str = "checkpoint") -> None:
    """Checks that ``obj`` is plain data that ``torch.load(weights_only=True)`` reads back: dicts (and the
    ``OrderedDict`` of state dicts), lists and tuples of tensors, strings, numbers, booleans and None.

    Raises:
        TypeError: naming the first entry of another type (e.g. a :class:`~vit3.engine.config.Config` in a
            model record: a bug of the code that built it, which should have used ``to_plain``).
    """
    kind = type(obj)
    if kind in (dict, collections.OrderedDict):
        for key, value in obj.items():
            check_plain(key, f"{where} (a key)")
            check_plain(value, f"{where}.{key}")
    elif kind in (list, tuple):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, torch.Tensor) and kind not in _PLAIN_LEAVES:
        raise TypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, which torch.load(weights_only=True) cannot "
            f"read back: store plain data (vit3.engine.config.to_plain)"
        )


_last_saved: Path | None = None  # what save_checkpoint wrote last in this process


def save_checkpoint(path: str | Path, state: Mapping[str, Any]) -> Path:
    """Writes ``state`` (plus ``format``/``version``) atomically (:func:`~vit3.outputs.atomic_write`: a
    temp file in the same directory, flushed to disk with ``fsync``, then ``os.replace``; stale temp files of
    earlier, killed writes are removed).

    Raises:
        TypeError: ``state`` holds something other than plain data (:func:`check_plain`).
        OutputError: the system refused the write (no permission, a full disk, a path under a file): the
            message names the file and the reason; a checkpoint already at ``path`` is left as it was.
    """
    global _last_saved
    check_plain(dict(state))
    if Path(path).name != "best.pt":  # best.pt copies a last.pt's state: a run continues from the last.pt
        _last_saved = Path(path)
    with atomic_write(path, "checkpoint") as f:
        try:
            torch.save({"format": FORMAT, "version": VERSION, **state}, f)
        except RuntimeError as e:
            # torch's zip writer reports a refused write (a full disk), or a KeyboardInterrupt in the middle
            # of its writing (where atomic_write cannot hold Ctrl-C back), as its own error ("enforce fail
            # at inline_container.cc")
            if isinstance(e.__context__, OSError | KeyboardInterrupt):
                raise e.__context__ from None
            raise
    return Path(path)


def last_saved() -> Path | None:
    """The checkpoint this process wrote (or was writing) last, best.pt aside, if it is on disk: the file an
    interrupted run continues from (whole, as every write is atomic: the new state or the one before);
    ``None`` before one is."""
    return _last_saved if _last_saved is not None and _last_saved.is_file() else None


# ------------------------------------------------------------------------------------------ model record
def make_model_record(
    cfg: Config,
    num_classes: int,
    classes: Iterable[str] | None,
    mean: Iterable[float] | None,
    std: Iterable[float] | None,
) -> dict[str, Any]:
    """The record of the model a run of ``cfg`` trains (see the module docstring), as plain data."""
    kwargs = to_plain(cfg.model.kwargs or {})
    data = cfg.data
    return {
        "name": str(cfg.model.name),
        "kwargs": kwargs,
        "in_chans": int(kwargs.get("in_chans", 3)),
        "img_size": data.get("img_size"),
        "num_classes": int(num_classes),
        "classes": list(classes) if classes is not None else None,
        "mean": [float(v) for v in mean] if mean is not None else None,
        "std": [float(v) for v in std] if std is not None else None,
        "interpolation": data.get("interpolation"),
        "crop_pct": data.get("crop_pct"),
    }


def merge_model_spec(
    record: Mapping[str, Any], name: str | None, kwargs: Mapping[str, Any] | None, source: str
) -> tuple[str, dict[str, Any]]:
    """The model to build for a checkpoint: the record's, with what the user set explicitly on top.

    Args:
        record: :func:`model_record` of the checkpoint.
        name: the model name the user gave (``None``/"" or the record's: build the record's model).
        kwargs: ``timm.create_model`` kwargs the user gave; each wins over the record's value of that key.
        source: the checkpoint file, for messages.

    Returns:
        ``(name, kwargs)``. A name other than the record's builds that model with the user's kwargs only
        (the record's are for another model); a warning says so, as it does for each kwarg that differs.

    Raises:
        ConfigError: ``name`` is a model of another family (timm module) than the record's: the
            checkpoint's weights and settings are for another architecture.
    """
    kwargs = dict(kwargs or {})
    if name and name != record["name"]:
        asked, held = _model_family(name), _model_family(str(record["name"]))
        if asked and held and asked != held:
            raise ConfigError(
                f"model {name!r} (--model / model.name) does not fit {source}: it holds a "
                f"{record['name']!r}, a "
                f"model of {held}, and {name!r} is one of {asked}; leave the model name out to build the "
                f"checkpoint's model"
            )
        warnings.warn(
            f"model {name!r} was asked for, but {source} holds a {record['name']!r} "
            f"({record.get('kwargs') or {}}): building {name!r} (leave the model name out to build the "
            f"checkpoint's model)",
            stacklevel=2,
        )
        return name, kwargs
    merged = dict(record.get("kwargs") or {})
    for key, value in kwargs.items():
        if key in merged and merged[key] != value:
            warnings.warn(
                f"model.kwargs.{key}={value!r} differs from {source}'s {merged[key]!r}: using {value!r}",
                stacklevel=2,
            )
        merged[key] = value
    return str(record["name"]), merged


def _model_family(name: str) -> str | None:
    """The module that registers the timm model ``name`` (its architecture family), or ``None`` if unknown."""
    import timm

    import vit3.models  # noqa: F401  (registers the vit3 models in timm)

    try:
        return timm.models.model_entrypoint(name).__module__
    except KeyError:  # not a timm model name: building it says so
        return None


def apply_model_record(cfg: Config, record: Mapping[str, Any], source: str) -> None:
    """Fills ``cfg`` from a checkpoint's record, in place: ``model.name``/``model.kwargs`` by
    :func:`merge_model_spec`, and every ``data.img_size``/``interpolation``/``crop_pct``/``mean``/``std``
    that is null (or ``mean`` and ``std`` both, as they go together)."""
    cfg.model.name, cfg.model.kwargs = merge_model_spec(record, cfg.model.name, cfg.model.kwargs, source)
    for key in ("img_size", "interpolation", "crop_pct"):
        if cfg.data.get(key) is None and record.get(key) is not None:
            cfg.data[key] = record[key]
    if cfg.data.mean is None and cfg.data.std is None and record.get("mean") is not None:
        cfg.data.mean, cfg.data.std = list(record["mean"]), list(record["std"])


def resume_differences(
    saved: Mapping[str, Any], cfg: Config, keys: Iterable[str] = DATA_STREAM_KEYS
) -> list[str]:
    """``"key: was A, now B"`` for each of ``keys`` whose value in ``cfg`` differs from the saved config."""
    out = []
    for key in keys:
        old: Any = saved
        for part in key.split("."):
            old = old.get(part) if isinstance(old, Mapping) else None
        new = cfg.get_path(key)
        if old != new:
            out.append(f"{key}: was {old!r}, now {new!r}")
    return out


def config_for_checkpoint(
    path: str | Path, config_path: str | Path | None = None, overrides: Iterable[str] = ()
) -> Config:
    """The config to evaluate ``path`` with: ``config_path`` if given, else the one the checkpoint stores
    (vit3 checkpoints, :func:`~vit3.engine.config.config_from_checkpoint`) or ``configs/default.yaml``
    (official files); ``overrides`` apply on top."""
    if config_path is not None:
        return load_config(config_path, overrides)
    obj = peek_vit3_checkpoint(path)
    if obj is not None:
        return config_from_checkpoint(obj["config"], overrides)
    cfg = load_config(None, overrides)
    if not any(o.startswith("model.name=") for o in overrides):
        raise ConfigError(
            f"{path} is {describe_checkpoint(path)}, not a vit3 checkpoint: name its model with --model "
            f"(e.g. --model vit3_small for an official vittt_s.pth)"
        )
    return cfg


def config_for_resume(
    path: str | Path,
    config_path: str | Path | None = None,
    overrides: Iterable[str] = (),
    output: str | None = None,
) -> Config:
    """The config that continues the run of the checkpoint ``path`` (``train.py --resume``).

    Its own config, task included, as the checkpoint stores it
    (:func:`~vit3.engine.config.config_from_checkpoint`), or ``config_path`` when one is given; ``overrides``
    apply on top (the engines refuse those that change the data stream, unless ``train.force_resume``). The
    run continues in the checkpoint's own folder unless ``output`` (or an ``output=`` override) names
    another one.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: not a vit3 training checkpoint (or unreadable).
        ConfigError: a bad override.
    """
    path = Path(path)
    saved = load_checkpoint(path, mmap=True)["config"]
    cfg = (
        load_config(config_path, overrides)
        if config_path is not None
        else config_from_checkpoint(saved, overrides)
    )
    if output is None and not any(o.partition("=")[0].strip() == "output" for o in overrides):
        started = saved.get("output")
        moved = not started or Path(started).resolve() != path.parent.resolve()
        output = str(path.parent) if moved else str(started)
        if moved:
            warnings.warn(
                f"{path} was written by a run in {started}; it continues in the checkpoint's folder {output}",
                stacklevel=2,
            )
    if output is not None:
        cfg.output = output
    cfg.train.resume = str(path)
    return cfg


def classifier_prefixes(model: nn.Module) -> list[str]:
    """Parameter-name prefixes of the classifier (``pretrained_cfg['classifier']``, default "head")."""
    names = getattr(model, "pretrained_cfg", {}).get("classifier", "head") or "head"
    return [f"{n}." for n in ([names] if isinstance(names, str) else names)]


def _diff(model_sd: Mapping[str, torch.Tensor], ckpt_sd: Mapping[str, torch.Tensor]) -> list[str]:
    lines = [f"missing in checkpoint: {k}" for k in model_sd if k not in ckpt_sd]
    lines += [f"unexpected in checkpoint: {k}" for k in ckpt_sd if k not in model_sd]
    lines += [
        f"shape mismatch: {k} checkpoint {tuple(v.shape)} vs model {tuple(model_sd[k].shape)}"
        for k, v in ckpt_sd.items()
        if k in model_sd and tuple(v.shape) != tuple(model_sd[k].shape)
    ]
    return lines


def load_model_weights(
    model: nn.Module, ckpt: Mapping[str, Any], use_ema: bool = False, new_head: bool = False, source: str = ""
) -> list[str]:
    """Loads a vit3 checkpoint's (EMA) weights into ``model``.

    Args:
        model: the target model (unwrapped).
        ckpt: what :func:`load_checkpoint` returned.
        use_ema: take ``ckpt["ema"]`` (error if the run had no EMA).
        new_head: fine-tuning: the classifier keeps the model's fresh initialisation (the checkpoint's
            classifier weights, whatever their shape, are not loaded).
        source: the file name, for messages.

    Returns:
        The names of the parameters that kept their fresh initialisation (the new head).

    Raises:
        CheckpointMismatchError: any other key or shape differs; the message lists them.
    """
    state = ckpt.get("ema") if use_ema else ckpt["model"]
    if state is None:
        raise CheckpointError(f"checkpoint {source} holds no EMA weights (trained with train.ema=false)")
    model_sd = model.state_dict()
    fresh: list[str] = []
    if new_head:
        heads = tuple(classifier_prefixes(model))
        fresh = [k for k in model_sd if k.startswith(heads)]
        state = {k: v for k, v in state.items() if not k.startswith(heads)}
    problems = [p for p in _diff(model_sd, state) if not any(p.endswith(f": {k}") for k in fresh)]
    if problems:
        ours = type(model).__name__
        shown = "\n  ".join(problems[:20]) + (
            f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise CheckpointMismatchError(
            f"checkpoint {source} (model '{ckpt.get('model_name')}', {ckpt.get('model_kwargs') or {}}) does "
            "not "
            f"fit the model being built ({ours}): {len(problems)} mismatched keys:\n  {shown}"
        )
    model.load_state_dict({**model_sd, **state})
    return fresh


def eval_report_path(path: str, ckpt: dict[str, Any] | None, cfg: Config) -> Path:
    """Where an evaluation of checkpoint ``path`` (``ckpt``: its contents, ``None`` for an official file)
    writes its report without ``eval.json``: ``<checkpoint>.eval.json`` on the data it was trained on,
    ``<checkpoint>.<folder>.eval.json`` on another folder (so that it keeps the first)."""
    own = ((ckpt or {}).get("config") or {}).get("data") or {}
    here = str(cfg.data.path or "")
    same = own.get("dataset") == cfg.data.dataset and _same_folder(str(own.get("path") or ""), here)
    other = ckpt is not None and not same and here
    return Path(path).with_suffix(f".{Path(here).name}.eval.json" if other else ".eval.json")


def _same_folder(a: str, b: str) -> bool:
    return a == b or (bool(a) and bool(b) and Path(a).resolve() == Path(b).resolve())
