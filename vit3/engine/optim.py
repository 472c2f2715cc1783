"""AdamW with the paper's parameter groups and the per-step warmup + cosine schedule.

* Weight decay is applied to every parameter except 1-D ones (norms, biases, scales), ``*.bias`` and the
  names in ``model.no_weight_decay()`` (official optimizer.py).
* Optional layer-wise lr decay (``train.layer_decay``): timm's ``param_groups_layer_decay`` through the
  model's ``group_matcher``; each group's ``lr_scale`` is applied by the timm scheduler.
* The learning rates scale with the total batch (batch x processes x accumulation) over ``lr_batch`` — base,
  warmup-start and minimum lr alike: linearly (``train.lr_scale: linear``, as in the official main.py) or with
  its square root (``sqrt``: timm's ``--lr-base-scale`` rule for Adam-type optimizers, the fine-tuning recipe's:
  a batch fitted down to a few images keeps a usable lr).
* ``CosineLRScheduler(t_in_epochs=False)`` stepped per optimizer update: linear warmup from ``warmup_lr``
  over ``warmup_epochs``, then cosine to ``min_lr`` at ``epochs`` (cosine counted from step 0, as official).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from timm.scheduler import CosineLRScheduler
from torch import nn

from .config import Config, ConfigError
from .distributed import DistInfo
from .process import amp_dtype

__all__ = [
    "LR_SCALES",
    "Optimization",
    "build_optimization",
    "build_optimizer",
    "build_scheduler",
    "lr_factor",
    "scaled_lrs",
]

LR_SCALES = ("linear", "sqrt")


def lr_factor(train_cfg, total_batch: int) -> float:
    """What the lrs are multiplied by: ``total_batch / lr_batch``, or its square root (``lr_scale: sqrt``).

    Raises:
        ConfigError: an unknown ``train.lr_scale`` or a non-positive ``train.lr_batch``.
    """
    rule = train_cfg.get("lr_scale", "linear")
    if rule not in LR_SCALES:
        raise ConfigError(f"train.lr_scale must be one of {', '.join(LR_SCALES)}, got {rule!r}")
    if float(train_cfg.lr_batch) <= 0:
        raise ConfigError(f"train.lr_batch must be positive, got {train_cfg.lr_batch}")
    ratio = total_batch / float(train_cfg.lr_batch)
    return ratio**0.5 if rule == "sqrt" else ratio


def scaled_lrs(train_cfg, total_batch: int) -> dict[str, float]:
    """``base_lr``, ``warmup_lr`` and ``min_lr`` times :func:`lr_factor`."""
    scale = lr_factor(train_cfg, total_batch)
    return {k: float(train_cfg[k]) * scale for k in ("base_lr", "warmup_lr", "min_lr")}


def build_optimizer(model: nn.Module, train_cfg, lr: float) -> torch.optim.AdamW:
    """AdamW over decay / no-decay (and, with ``layer_decay``, per-layer) parameter groups.

    Raises:
        ValueError: ``layer_decay`` is set but the model has no ``group_matcher``.
    """
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    wd = float(train_cfg.weight_decay)
    if train_cfg.layer_decay is not None:
        if not hasattr(model, "group_matcher"):
            raise ConfigError(
                f"train.layer_decay needs model.group_matcher(), which {type(model).__name__} lacks"
            )
        groups: list[dict[str, Any]] = param_groups_layer_decay(
            model, weight_decay=wd, no_weight_decay_list=skip, layer_decay=float(train_cfg.layer_decay)
        )
    else:
        groups = param_groups_weight_decay(model, weight_decay=wd, no_weight_decay_list=skip)
    # timm's groups exclude 1-D params; the official code also exempts every "*.bias" (e.g. a 2-D bias).
    split: list[dict[str, Any]] = []
    for g in groups:
        if g.get("weight_decay", 0.0) > 0:
            names = {id(p): n for n, p in model.named_parameters()}
            bias = [p for p in g["params"] if names.get(id(p), "").endswith(".bias")]
            if bias:
                keep = [p for p in g["params"] if not names.get(id(p), "").endswith(".bias")]
                split.append({**g, "params": bias, "weight_decay": 0.0})
                g = {**g, "params": keep}
        split.append(g)
    return torch.optim.AdamW(
        [g for g in split if g["params"]], lr=lr, betas=tuple(train_cfg.betas), eps=float(train_cfg.eps)
    )


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg, lrs: dict[str, float], steps_per_epoch: int):
    """Per-update warmup + cosine (``step_update(num_updates)`` before each optimizer step)."""
    return CosineLRScheduler(
        optimizer,
        t_initial=max(1, int(train_cfg.epochs * steps_per_epoch)),
        lr_min=lrs["min_lr"],
        warmup_lr_init=lrs["warmup_lr"],
        warmup_t=int(train_cfg.warmup_epochs * steps_per_epoch),
        cycle_limit=1,
        t_in_epochs=False,
    )


class Optimization(NamedTuple):
    """What :func:`build_optimization` builds."""

    total_batch: int  # data.batch_size x processes x train.accum_steps
    lrs: dict[str, float]  # train.base_lr / warmup_lr / min_lr scaled to the total batch
    optimizer: torch.optim.Optimizer
    scheduler: Any
    amp_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler  # enabled for fp16 only


def build_optimization(cfg: Config, info: DistInfo, model: nn.Module, batches_per_epoch: int) -> Optimization:
    """Moves ``model`` to the run's device (with gradient checkpointing when ``model.grad_checkpointing``)
    and builds the AdamW optimizer, the warmup + cosine schedule of ``batches_per_epoch // accum_steps``
    steps per epoch, the AMP dtype and the grad scaler of ``cfg.train``."""
    model.to(info.device)
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    accum = int(cfg.train.accum_steps)
    total_batch = int(cfg.data.batch_size) * info.world * accum
    lrs = scaled_lrs(cfg.train, total_batch)
    optimizer = build_optimizer(model, cfg.train, lrs["base_lr"])
    scheduler = build_scheduler(optimizer, cfg.train, lrs, batches_per_epoch // accum)
    amp = amp_dtype(cfg.train.amp, info.device)
    scaler = torch.amp.GradScaler(info.device.type, enabled=amp == torch.float16)
    return Optimization(total_batch, lrs, optimizer, scheduler, amp, scaler)
