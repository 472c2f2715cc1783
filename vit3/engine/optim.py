"""The optimizer and lr schedules of every engine: AdamW, its parameter groups, lr scaling and schedules.

* Classification, generation, conversion (:func:`build_optimization`): AdamW without decay on 1-D params,
  ``*.bias`` and ``model.no_weight_decay()`` (official optimizer.py), optional layer-wise lr decay
  (``train.layer_decay``, timm's ``group_matcher``), and the per-update warmup + cosine schedule
  (:func:`build_scheduler`).
* Every engine scales its lrs to the total batch (:func:`scaled_lrs`: ``train.lr_batch_rule`` linear or sqrt).
* Detection / segmentation keep the official dense recipes' groups (:func:`dense_param_groups`) and their
  per-iteration warmup + step / poly schedule (:func:`dense_lr_factor`, :class:`DenseSchedule`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from torch import Tensor, nn

from ..tasks.backbone import block_layer_ids
from .config import Config, ConfigError
from .distributed import DistInfo
from .process import amp_dtype

__all__ = [
    "LR_BATCH_RULES",
    "DenseSchedule",
    "EpochSteps",
    "Optimization",
    "WarmupCosine",
    "build_dense_optimizer",
    "build_optimization",
    "build_optimizer",
    "build_scheduler",
    "dense_lr_factor",
    "dense_param_groups",
    "epoch_steps",
    "load_optimizer_state",
    "lr_factor",
    "scaled_lrs",
    "schedule_changed",
]

LR_BATCH_RULES = ("linear", "sqrt")


class EpochSteps(NamedTuple):
    """An epoch's length in micro-batches and in optimizer updates (:func:`epoch_steps`)."""

    batches: int  # micro-batches per process: whole updates only
    updates: int  # batches // train.accum_steps: what the schedule counts


def epoch_steps(loader_batches: int, accum: int) -> EpochSteps:
    """The length of an epoch of ``loader_batches`` batches (a whole epoch's: ``len(loader)`` before a resume
    offsets its sampler) and ``accum`` micro-batches per update: the left-over batches of an incomplete
    update are dropped, so every update accumulates within one epoch.

    Raises:
        ConfigError: not one update of ``accum`` (``train.accum_steps``) batches fits in an epoch.
    """
    updates = loader_batches // accum
    if updates == 0:
        raise ConfigError(f"train.accum_steps={accum} exceeds the {loader_batches} batches per epoch")
    return EpochSteps(updates * accum, updates)


def lr_factor(train_cfg, total_batch: int) -> float:
    """The lrs' factor: ``total_batch / lr_batch``, or its square root (``lr_batch_rule: sqrt``).

    Raises:
        ConfigError: an unknown ``train.lr_batch_rule`` or a non-positive ``train.lr_batch``.
    """
    rule = train_cfg.get("lr_batch_rule", "linear")
    if rule not in LR_BATCH_RULES:
        raise ConfigError(f"train.lr_batch_rule must be one of {', '.join(LR_BATCH_RULES)}, got {rule!r}")
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


def build_scheduler(
    optimizer: torch.optim.Optimizer, train_cfg, lrs: dict[str, float], updates_per_epoch: int
) -> WarmupCosine:
    """Per-update warmup + cosine over ``epochs * updates_per_epoch`` updates (:class:`WarmupCosine`).

    Update k (0-based) of W warmup and T updates in all (``int(warmup_epochs * updates_per_epoch)``,
    ``int(epochs * updates_per_epoch)``) runs group g at ``s_g * (warmup_lr + k * (base_lr - warmup_lr) / W)``
    for k < W, else ``s_g * (min_lr + (base_lr - min_lr) * (1 + cos(pi * k / T)) / 2)``: the warmup lies
    inside the cosine's span, so it never reaches ``base_lr``: update W starts on the cosine at W / T; from
    update T on, ``min_lr``. ``s_g`` is the group's ``lr_scale`` (1 without one). The settings are the keys
    ``train.base_lr``, ``warmup_lr``, ``min_lr``, ``warmup_epochs``, ``epochs`` (defaults:
    ``configs/default.yaml``; a key ``lr`` is refused). Tested in ``tests/engine/test_optim.py``: the
    formula, timm's scheduler bit for bit, and whole runs applying it at every update (with accumulation, a
    resume, the recipe's fitting). Where each input comes from: ``docs/design/engine.md``.
    """
    return WarmupCosine(
        optimizer,
        t_initial=max(1, int(train_cfg.epochs * updates_per_epoch)),
        lr_min=lrs["min_lr"],
        warmup_t=int(train_cfg.warmup_epochs * updates_per_epoch),
        warmup_lr_init=lrs["warmup_lr"],
    )


class WarmupCosine:
    """The warmup + cosine schedule of :func:`build_scheduler`, per optimizer update.

    Each group's base lr is its lr when the schedule is made (kept as ``initial_lr``, where a group has none
    yet); the lr of update ``t`` is the group's value times its ``lr_scale`` (timm's parameter-group key,
    1 without one). Same arithmetic as timm's ``CosineLRScheduler`` with one cycle, no noise and the warmup
    inside the cycle, whose state names ``state_dict`` keeps (checkpoints hold them: ``schedule_changed``).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, t_initial: int, lr_min: float, warmup_t: int,
        warmup_lr_init: float,
    ) -> None:  # fmt: skip
        if t_initial < 1 or warmup_t < 0:
            raise ValueError(f"a schedule of {t_initial} updates with {warmup_t} of warmup")
        self.optimizer = optimizer
        self.t_initial, self.lr_min = t_initial, lr_min
        self.warmup_t, self.warmup_lr_init = warmup_t, warmup_lr_init
        self.base_values = [g.setdefault("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.warmup_steps = [(v - warmup_lr_init) / warmup_t if warmup_t else 1 for v in self.base_values]
        self._set([warmup_lr_init] * len(self.base_values) if warmup_t else self.base_values)

    def lrs(self, t: int) -> list[float]:
        """Each group's lr of update ``t`` (0-based) before its ``lr_scale``."""
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        if t >= self.t_initial:
            return [self.lr_min for _ in self.base_values]
        cos = 1 + math.cos(math.pi * t / self.t_initial)
        return [self.lr_min + 0.5 * (v - self.lr_min) * cos for v in self.base_values]

    def step_update(self, num_updates: int) -> None:
        """Sets every group's lr for optimizer update ``num_updates`` (0-based)."""
        self._set(self.lrs(num_updates))

    def _set(self, values: list[float]) -> None:
        for group, value in zip(self.optimizer.param_groups, values):
            group["lr"] = value * group["lr_scale"] if "lr_scale" in group else value

    def state_dict(self) -> dict[str, Any]:
        """The schedule's settings and base lrs (no optimizer): what ``schedule_changed`` compares."""
        return {k: v for k, v in vars(self).items() if k != "optimizer"}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    saved_order: Sequence[Tensor] | None = None,
    source: str = "the checkpoint",
) -> None:
    """Loads a checkpoint's optimizer ``state`` (AdamW's moments and step counts) into ``optimizer`` and keeps
    the hyperparameters its groups were built with from this run's config (weight decay, layer-decay lr
    scales, betas, eps), which ``load_state_dict`` alone would replace by the checkpoint's.

    Where this config groups the parameters otherwise than the checkpoint's run did (``train.weight_decay``
    0 puts them in one group, ``train.layer_decay`` in one per layer), ``saved_order`` (the checkpoint
    run's parameters in its optimizer's order: :func:`build_optimizer` of its config on this model) carries
    each parameter's moments to its group here.

    Raises:
        ConfigError: the state does not fit this optimizer's parameters (another ``train.freeze``, or groups
            that ``saved_order`` does not map), naming ``source``.
    """
    built = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in state["param_groups"]] != sizes:
        state = _regrouped(optimizer, state, saved_order, source)
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, built):
        group.update(settings)


def _regrouped(
    optimizer: torch.optim.Optimizer, state: dict[str, Any], saved_order: Sequence[Tensor] | None, source: str
) -> dict[str, Any]:
    """``state`` laid out in ``optimizer``'s groups, each parameter's moments found by ``saved_order``."""
    here = [p for g in optimizer.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(here)}
    positions = [i for g in state["param_groups"] for i in g["params"]]
    fits = (
        saved_order is not None
        and len(saved_order) == len(positions) == len(here)
        and all(id(p) in index for p in saved_order)
    )
    moments: dict[int, Any] = {}
    if fits:
        to_here = {saved: index[id(p)] for saved, p in zip(positions, saved_order)}
        for saved, values in state["state"].items():
            i = to_here[saved]
            avg = values.get("exp_avg") if isinstance(values, dict) else None
            fits = fits and (avg is None or avg.shape == here[i].shape)
            moments[i] = values
    if not fits:
        raise ConfigError(
            f"cannot resume the optimizer of {source}: its {len(positions)} trained parameters do not map "
            f"onto the {len(here)} this config trains (train.freeze, train.weight_decay or "
            "train.layer_decay changed); keep the checkpoint's settings, or start a run from its weights "
            "(model.pretrained)"
        )
    groups, start = [], 0
    for group in optimizer.param_groups:
        n = len(group["params"])
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))}
        )
        start += n
    return {"state": moments, "param_groups": groups}


def schedule_changed(scheduler: Any, saved: dict[str, Any]) -> bool:
    """Whether the schedule ``scheduler`` (this run's, built from its config) differs from a checkpoint's
    ``saved`` state. A schedule is a function of its settings and the step, so a resume never loads
    ``saved``; it only says when the schedule changed."""
    mine = scheduler.state_dict()
    return any(mine[k] != saved[k] for k in mine.keys() & saved.keys())


class Optimization(NamedTuple):
    """What :func:`build_optimization` builds."""

    total_batch: int  # data.batch_size x processes x train.accum_steps
    lrs: dict[str, float]  # train.base_lr / warmup_lr / min_lr scaled to the total batch
    optimizer: torch.optim.Optimizer
    scheduler: Any
    amp_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler  # enabled for fp16 only


def build_optimization(cfg: Config, info: DistInfo, model: nn.Module, steps: EpochSteps) -> Optimization:
    """Moves ``model`` to the run's device (with gradient checkpointing when ``model.grad_checkpointing``)
    and builds the AdamW optimizer, the warmup + cosine schedule of ``steps.updates`` updates per epoch,
    the AMP dtype and the grad scaler of ``cfg.train``."""
    model.to(info.device)
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    accum = int(cfg.train.accum_steps)
    total_batch = int(cfg.data.batch_size) * info.world * accum
    lrs = scaled_lrs(cfg.train, total_batch)
    optimizer = build_optimizer(model, cfg.train, lrs["base_lr"])
    scheduler = build_scheduler(optimizer, cfg.train, lrs, steps.updates)
    amp = amp_dtype(cfg.train.amp, info.device)
    scaler = torch.amp.GradScaler(info.device.type, enabled=amp == torch.float16)
    return Optimization(total_batch, lrs, optimizer, scheduler, amp, scaler)


def dense_param_groups(
    model: nn.Module,
    body: nn.Module,
    lr: float,
    weight_decay: float,
    backbone_lr_mult: float = 1.0,
    layer_decay: float | None = None,
    no_decay_keys: tuple[str, ...] = ("norm",),
) -> list[dict[str, Any]]:
    """A dense run's AdamW parameter groups: per-group lr for the backbone and layer-wise lr decay (the
    official detection / segmentation recipes group by names and backbone blocks, not by timm's rules).

    Backbone parameters (those of ``body``, the backbone's feature trunk) get ``lr * backbone_lr_mult``, times
    ``layer_decay ** (num_layers - 1 - layer_id)`` when ``layer_decay`` is set (stem deepest decay, last
    blocks least; see :func:`~vit3.tasks.backbone.block_layer_ids`). Parameters whose name contains one of
    ``no_decay_keys`` get no weight decay. Each group records its ``lr_scale`` for the scheduler.
    """
    layer_of, n_layers = block_layer_ids(body)
    body_ids = {id(p): layer_of[n] for n, p in body.named_parameters()}
    groups: dict[tuple[float, float], list[Tensor]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        scale = 1.0
        if id(p) in body_ids:
            scale = backbone_lr_mult * (
                layer_decay ** (n_layers - 1 - body_ids[id(p)]) if layer_decay else 1.0
            )
        wd = 0.0 if any(k in name for k in no_decay_keys) else weight_decay
        groups.setdefault((scale, wd), []).append(p)
    return [{"params": ps, "lr": lr * s, "lr_scale": s, "weight_decay": wd} for (s, wd), ps in groups.items()]


def dense_lr_factor(step: int, total: int, d: Config, iters_per_epoch: int) -> float:
    """A dense run's schedule factor at optimizer step ``step`` of ``total``: linear warmup over
    ``dense.warmup_iters``, then step or poly decay per iteration (the official dense recipes' schedules,
    not the classification warmup + cosine)."""
    if d.lr_schedule == "poly":
        factor = (1 - min(step, total) / max(total, 1)) ** d.poly_power
    elif d.lr_schedule == "step":
        unit = 1 if d.iters else iters_per_epoch  # milestones are epochs unless training by iterations
        factor = d.gamma ** sum(step >= m * unit for m in d.milestones)
    else:
        raise ConfigError(f"unknown dense.lr_schedule '{d.lr_schedule}': expected step or poly")
    if step < d.warmup_iters:
        factor *= d.warmup_factor + (1 - d.warmup_factor) * step / d.warmup_iters
    return factor


def build_dense_optimizer(model: nn.Module, body: nn.Module, cfg: Config, lr: float) -> torch.optim.AdamW:
    """AdamW over :func:`dense_param_groups` of a dense run (``cfg.dense``: the backbone's lr multiplier and
    the names without decay; ``cfg.train``: weight decay, layer decay, betas and eps)."""
    d, t = cfg.dense, cfg.train
    groups = dense_param_groups(
        model, body, lr, t.weight_decay, d.backbone_lr_mult, t.layer_decay, tuple(d.no_decay_keys)
    )
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(t.betas), eps=t.eps)


class DenseSchedule:
    """:func:`dense_lr_factor` as a scheduler :func:`~vit3.engine.loop.optimizer_step` steps: each group's
    lr is ``lr * lr_scale * dense_lr_factor(step)`` (``d``: the ``dense:`` section)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, lr: float, total: int, d: Config, iters_per_epoch: int
    ) -> None:
        self.optimizer, self.lr, self.d = optimizer, lr, d
        self.total, self.iters_per_epoch = total, iters_per_epoch

    def step_update(self, num_updates: int) -> None:
        """Sets the lrs of optimizer update ``num_updates`` (0-based)."""
        factor = dense_lr_factor(num_updates, self.total, self.d, self.iters_per_epoch)
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr * g["lr_scale"] * factor
