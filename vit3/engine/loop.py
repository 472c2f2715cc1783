"""The epoch loop every epoch-based engine shares (classification, generation, conversion).

:class:`TrainRun` holds a run's model, optimizer, scheduler and scaler; :func:`optimizer_step` is one update
(the scheduler's lr, clipping, scaler, EMA) and counts it (``Progress.global_step``); :func:`run_epochs` runs
the epochs left; :func:`run_summary` reports the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint import load_model_weights
from .config import Config, ConfigError, run_metadata, to_plain
from .distributed import DistInfo, log
from .optim import Optimization, build_optimizer, load_optimizer_state, lr_factor, schedule_changed
from .process import check_ranks_agree
from .resume import Progress

__all__ = [
    "TrainRun",
    "best_checkpoint",
    "log_setup",
    "optimizer_step",
    "run_epochs",
    "run_summary",
]


@dataclass
class TrainRun:
    """What every epoch-based training run holds (engines extend it with their data and task state)."""

    cfg: Config
    info: DistInfo
    model: nn.Module  # unwrapped
    net: nn.Module  # DDP-wrapped or the model itself
    ema: Any  # timm ModelEmaV3 or None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None

    def training_state(self) -> dict[str, Any]:
        """The weights (model, EMA) and the optimizer, scheduler and scaler states, for a checkpoint."""
        return {
            "model": self.model.state_dict(),
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def run_state(
        self, progress: Progress, model_kwargs: Mapping[str, Any], num_classes: int, classes: Iterable[str]
    ) -> dict[str, Any]:
        """The checkpoint entries every epoch-based run writes: the model (name, ``model_kwargs``, classes),
        :meth:`training_state`, the counters and history of ``progress``, the config and the run metadata
        (an engine adds its own; :func:`save_state` the RNG states)."""
        return {
            "model_name": self.cfg.model.name,
            "model_kwargs": to_plain(model_kwargs),
            "num_classes": num_classes,
            "classes": list(classes),
            **self.training_state(),
            **progress.counters(),
            "history": progress.history,
            "config": self.cfg.to_dict(),
            "meta": run_metadata(),
        }

    def load_training_state(self, ckpt: Mapping[str, Any], source: str) -> None:
        """Restores :meth:`training_state` from ``ckpt``, but for the settings this run's config gives: the
        optimizer's hyperparameters and the lr schedule (a note says when the schedule changed).

        Raises:
            ConfigError: the run has an EMA and ``ckpt`` holds none.
            CheckpointMismatchError: the weights are another model's.
        """
        load_model_weights(self.model, ckpt, source=source)
        if self.ema is not None:
            if ckpt.get("ema") is None:
                raise ConfigError(f"cannot resume with train.ema=true from {source}: it holds no EMA weights")
            self.ema.module.load_state_dict(ckpt["ema"])
        load_optimizer_state(self.optimizer, ckpt["optimizer"], self._saved_order(ckpt), source)
        if schedule_changed(self.scheduler, ckpt["scheduler"]):  # e.g. more epochs, a forced resume's batch
            log(self.info, f"note: the lr schedule differs from {source}'s; this config's applies")
        self.scaler.load_state_dict(ckpt["scaler"])

    def _saved_order(self, ckpt: Mapping[str, Any]) -> list[Tensor] | None:
        """The checkpoint run's trained parameters in its optimizer's order: :func:`build_optimizer` of its
        config on this model (``None`` where that config cannot build one)."""
        try:
            saved = build_optimizer(self.model, Config(ckpt["config"]["train"]), 0.0)
        except (KeyError, AttributeError, TypeError, ValueError):
            return None
        return [p for group in saved.param_groups for p in group["params"]]


def log_setup(
    info: DistInfo,
    cfg: Config,
    model: nn.Module,
    opt: Optimization,
    ema: Any,
    name: str,
    about: str,
    data: str,
) -> None:
    """Logs what a run trains: the model (``name``, whether ``model.kwargs`` changed it, its size, ``about``
    it), the ``data``, the processes, total batch, lr (and how it was scaled), AMP and EMA."""
    changed = " + model.kwargs" if cfg.model.get("kwargs") else ""
    log(
        info,
        f"model {name}{changed}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {about} | "
        f"data: {data} | {info.world} process(es) on {info.device}, total batch {opt.total_batch}, "
        f"lr {opt.lrs['base_lr']:.3g} "
        f"(train.base_lr {cfg.train.base_lr:g} x {lr_factor(cfg.train, opt.total_batch):.4g}, "
        f"{cfg.train.get('lr_batch_rule', 'linear')} in the batch) | amp {opt.amp_dtype} | "
        f"ema {'on' if ema else 'off'}",
    )


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    clip_grad: float | None,
    scheduler: Any,
    progress: Progress,
    ema: Any = None,
    check_norm: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """One update of accumulated gradients: the scheduler's lr for update ``progress.global_step``, gradient
    clipping (unscaled; ``check_norm`` sees the norm before the step), the (scaled) optimizer step, zeroed
    gradients, the EMA; then ``progress.global_step`` counts the update (also one the fp16 scaler skips).
    The one place every engine's step counter rises."""
    scheduler.step_update(progress.global_step)  # lr of this update
    if clip_grad:
        scaler.unscale_(optimizer)
        norm = nn.utils.clip_grad_norm_(model.parameters(), float(clip_grad))
        if check_norm is not None:
            check_norm(norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.update(model)
    progress.global_step += 1


def run_epochs(
    run: TrainRun,
    progress: Progress,
    batches_per_epoch: int,
    train_epoch: Callable[[], None],
    finish_epoch: Callable[[float, int], Any],
) -> None:
    """Runs the epochs left (``train.epochs``): ``train_epoch()`` from the batch ``progress`` stands at, then
    ``finish_epoch(seconds, images)`` with the epoch's time and the images it trained on (all ranks)."""
    cfg = run.cfg
    while progress.epoch < cfg.train.epochs:
        tick, batch0 = time.perf_counter(), progress.batch_in_epoch
        train_epoch()
        images = (batches_per_epoch - batch0) * int(cfg.data.batch_size) * run.info.world
        finish_epoch(time.perf_counter() - tick, images)


def best_checkpoint(out: Path, keep_best: bool, resumed_from: str) -> str | None:
    """The checkpoint of the run's best evaluation (``train.keep_best``): ``out``'s ``best.pt``, else, for a
    run resumed (from checkpoint ``resumed_from``, "" for a fresh run) into another folder that has not
    beaten its checkpoint's best, the resumed run's; ``None`` where neither exists (a summary names no file
    that is not there)."""
    if not keep_best:
        return None
    folders = [out, *([Path(resumed_from).parent] if resumed_from else [])]
    found = next((f / "best.pt" for f in folders if (f / "best.pt").is_file()), None)
    return str(found) if found is not None else None


def run_summary(model: nn.Module, world: int, out: Path, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary fields every engine reports, of a run of ``world`` processes writing to ``out``
    (collective: the ranks' weights of ``model`` are compared first)."""
    digests = check_ranks_agree(model)
    return {
        "output": str(out),
        "last": str(out / "last.pt"),
        "final": history[-1] if history else {},
        "world_size": world,
        "rank_weights_sha1": digests,  # compared by check_ranks_agree: one per rank, all equal
        "weights_sha1": digests[0],
    }
