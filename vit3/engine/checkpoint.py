"""vit3 training checkpoints: atomic writes, exact-resume state, fine-tuning with a new classifier.

A checkpoint is a ``torch.save`` dict readable with ``torch.load(weights_only=True)``:
``format`` ("vit3-checkpoint"), ``version``, ``model_name``, ``model_kwargs``, ``num_classes``,
``classes``, ``model`` (state dict), ``ema`` (state dict or None), ``optimizer``, ``scheduler``,
``scaler``, ``rng`` (one entry per rank: python/numpy/torch/cuda states), ``epoch`` (the epoch to run
next), ``batch_in_epoch`` (batches of that epoch already done), ``global_step`` (optimizer steps done),
``epoch_loss`` (running loss sum/count of the partial epoch), ``history`` (per-epoch metrics),
``best_top1``, ``config`` (resolved config) and ``meta`` (git commit, command, time).
Files are written to a temporary name in the same directory and moved into place with ``os.replace``,
so a killed run never leaves a truncated checkpoint.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .config import Config, ConfigError, config_from_dict, load_config

FORMAT = "vit3-checkpoint"
VERSION = 1

__all__ = [
    "FORMAT",
    "CheckpointMismatchError",
    "classifier_prefixes",
    "config_for_checkpoint",
    "get_rng_state",
    "is_vit3_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "peek_vit3_checkpoint",
    "save_checkpoint",
    "set_rng_state",
]


class CheckpointMismatchError(ValueError):
    """A checkpoint's weights do not fit the model (another architecture or size)."""


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


def save_checkpoint(path: str | Path, state: Mapping[str, Any]) -> Path:
    """Writes ``state`` (plus ``format``/``version``) atomically: temp file in the same dir + ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save({"format": FORMAT, "version": VERSION, **state}, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def is_vit3_checkpoint(obj: Any) -> bool:
    return isinstance(obj, Mapping) and obj.get("format") == FORMAT


def _read(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated/foreign file: name it
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e


def peek_vit3_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """The vit3 checkpoint at ``path``, or ``None`` for any other file (e.g. an official ViTTT file, whose
    pickled training metadata ``weights_only`` refuses: the model's own loader reads those).

    Raises:
        FileNotFoundError: no such file.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # not ours: unreadable here, left to the model's official-checkpoint loader
        return None
    return obj if is_vit3_checkpoint(obj) else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Reads a vit3 checkpoint on CPU.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unreadable, or not a vit3 checkpoint (an official file goes through model.pretrained).
    """
    obj = _read(path)
    if not is_vit3_checkpoint(obj):
        raise ValueError(
            f"{path} is not a vit3 training checkpoint (no format='{FORMAT}'); official ViTTT weights are "
            f"loaded with model.pretrained=FILE (fine-tuning) or eval.py --model NAME --checkpoint FILE"
        )
    return obj


def config_for_checkpoint(
    path: str | Path, config_path: str | Path | None = None, overrides: Iterable[str] = ()
) -> Config:
    """The config to evaluate ``path`` with: ``config_path`` if given, else the one the checkpoint stores
    (vit3 checkpoints) or ``configs/default.yaml`` (official files); ``overrides`` apply on top."""
    if config_path is not None:
        return load_config(config_path, overrides)
    obj = peek_vit3_checkpoint(path)
    if obj is not None:
        return config_from_dict(obj["config"], overrides)
    cfg = load_config(None, overrides)
    if not any(o.startswith("model.name=") for o in overrides):
        raise ConfigError(f"{path} is not a vit3 checkpoint: name its model with --model (e.g. vit3_tiny)")
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
        new_head: fine-tuning: classifier weights whose shape differs (another class count) are left at
            the model's fresh initialisation.
        source: the file name, for messages.

    Returns:
        The names of the parameters that kept their fresh initialisation (the new head).

    Raises:
        CheckpointMismatchError: any other key or shape differs; the message lists them.
    """
    state = ckpt.get("ema") if use_ema else ckpt["model"]
    if state is None:
        raise ValueError(f"checkpoint {source} holds no EMA weights (trained with train.ema=false)")
    model_sd = model.state_dict()
    fresh: list[str] = []
    if new_head:
        heads = tuple(classifier_prefixes(model))
        fresh = [
            k
            for k in model_sd
            if k.startswith(heads) and (k not in state or state[k].shape != model_sd[k].shape)
        ]
        state = {k: v for k, v in state.items() if k not in fresh}
    problems = [p for p in _diff(model_sd, state) if not any(p.endswith(f": {k}") for k in fresh)]
    if problems:
        ours = type(model).__name__
        shown = "\n  ".join(problems[:20]) + (
            f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise CheckpointMismatchError(
            f"checkpoint {source} (model '{ckpt.get('model_name')}', {ckpt.get('model_kwargs') or {}}) does not "
            f"fit the model being built ({ours}): {len(problems)} mismatched keys:\n  {shown}"
        )
    model.load_state_dict({**model_sd, **state})
    return fresh
