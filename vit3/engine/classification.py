"""Image classification: training (``train.py``) and evaluation (``eval.py``) of timm / vit3 models.

The recipe follows the official ViTTT code (main.py / main_ema.py): AdamW, scaled lr with per-step warmup +
cosine (:mod:`vit3.engine.optim`), Mixup/CutMix, clipping, AMP, EMA and MESA. Resume is exact
(:mod:`vit3.engine.resume`; the optimizer and schedule: ``loop.TrainRun.load_training_state``); a diverging
run raises :class:`TrainingDiverged`. A task built on this loop
(:mod:`vit3.engine.convert`) hands its model and data to :func:`assemble_run` with a
:class:`ClassificationRun` subclass and runs :func:`train_in_group`. The model, losses and validation are in
:mod:`vit3.engine.classification_model`, ``eval.py`` in :mod:`vit3.engine.classification_eval` (both
re-exported here). Details: ``docs/design/engine.md``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import timm
import torch
from timm.utils import ModelEmaV3
from torch import nn

from ..data import build_datasets, build_mixup, build_train_loader, build_transform, build_val_loader
from ..errors import TrainingDiverged, divergence_advice
from ..layers.ttt import NonFiniteError
from ..models.record import model_record, peek_vit3_checkpoint, require_classifier
from ..outputs import write_text
from .bars import Bar, figures_due, progress_bar
from .checkpoint import apply_model_record, make_model_record
from .classification_eval import evaluate
from .classification_model import (
    build_model,
    data_stats,
    input_channels,
    label_loss,
    official_eval_classes,
    resolve_data_cfg,
    soft_cross_entropy,
    validate,
)
from .config import Config, ConfigError, check_batch_norm_batch, check_config, check_input_size, key_name
from .distributed import DistInfo, log, log_row
from .loop import TrainRun, best_checkpoint, log_setup, optimizer_step, run_epochs, run_summary
from .metrics import plot_curves, write_metrics
from .optim import EpochSteps, build_optimization, epoch_steps
from .process import autocast, wrap_ddp
from .recipe import eval_frozen, fit_batch_size, fit_epochs, freeze_for_training
from .resume import Progress, check_resume, open_run, save_state, start_run
from .run_folder import OutputFolder, claim_output, in_process_group

__all__ = [
    "ClassificationRun",
    "TrainingDiverged",
    "assemble_run",
    "build_model",
    "data_stats",
    "evaluate",
    "input_channels",
    "resolve_data_cfg",
    "soft_cross_entropy",
    "train",
    "train_in_group",
    "validate",
]


# ---------------------------------------------------------------------------------------------- training
@dataclass
class _Progress(Progress):
    """The counters of :class:`~vit3.engine.Progress` plus the partial epoch's loss, the best top-1 and
    the run's time: the checkpoint a resume read, the seconds the run ran before this process (up to that
    checkpoint; ``None``: one from before they were kept) and when this process started (``perf_counter``)."""

    loss_sum: float = 0.0  # running training loss of the partial epoch
    loss_count: int = 0
    best_top1: float = -1.0
    resumed_from: str = ""
    seconds_before: float | None = 0.0
    started: float = field(default_factory=time.perf_counter)

    def run_seconds(self) -> float:
        """The run's time so far: before this process (as far as known) and in it."""
        return (self.seconds_before or 0.0) + time.perf_counter() - self.started


@dataclass
class ClassificationRun(TrainRun):
    mixup: Any
    loader: Any
    wrapped: Any
    sampler: Any
    val_loader: Any
    steps: EpochSteps  # the epoch's micro-batches and updates (``optim.epoch_steps``)
    out: Path
    num_classes: int
    classes: list[str]
    progress: _Progress

    # What a task built on this loop (the conversion, vit3.engine.convert) changes: the task a checkpoint
    # belongs to, the loss of a batch and what an epoch, a checkpoint and the summary report besides.
    task: ClassVar[str] = "classification"

    def start_epoch(self) -> None:
        """Called before each epoch's batches (the run may change what trains)."""

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor, mesa_on: bool) -> torch.Tensor:
        """The training loss of one (mixed) batch ``x [B, C, H, W]``, ``y [B]`` or ``[B, K]``; under
        autocast."""
        logits = self.net(x)
        loss = label_loss(logits, y, self.cfg.aug.label_smoothing)
        if mesa_on:
            with torch.no_grad():
                teacher = self.ema.module(x).float().softmax(dim=-1)  # [B, K]
            loss = loss + float(self.cfg.train.mesa) * soft_cross_entropy(logits, teacher)
        return loss

    def epoch_metrics(self, validated: bool) -> dict[str, Any]:
        """More columns of the epoch's metrics row (``validated``: the row has this epoch's val figures)."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        """More checkpoint entries (restored by :meth:`restore_extra`)."""
        return {}

    def restore_extra(self, ckpt: Mapping[str, Any]) -> None:
        """Restores what :meth:`extra_state` saved."""

    def summary_extra(self) -> dict[str, Any]:
        """More fields of the run summary (called on every rank at the end of the run)."""
        return {}


def _state(run: ClassificationRun) -> dict[str, Any]:
    """The checkpoint dict (:func:`~vit3.engine.save_state` adds the RNG states)."""
    p = run.progress
    mean, std = data_stats(run.cfg)
    return {
        "record": make_model_record(run.cfg, run.num_classes, run.classes, mean, std),
        **run.run_state(p, run.cfg.model.kwargs, run.num_classes, run.classes),
        "epoch_loss": (p.loss_sum, p.loss_count),
        "best_top1": p.best_top1,
        "run_seconds": None if p.seconds_before is None else p.run_seconds(),
        **run.extra_state(),
    }


def _save(run: ClassificationRun, name: str) -> Path:
    return save_state(lambda: _state(run), run.out / name, run.info)


def _restore(run: ClassificationRun, ckpt: dict[str, Any], source: str) -> _Progress:
    """Restores ``run`` from ``ckpt`` (read from ``source``); returns its progress."""
    run.load_training_state(ckpt, source)
    p = run.progress
    p.restore(ckpt, run.cfg.data.batch_size, run.info.world, int(run.cfg.train.accum_steps), run.steps)
    p.loss_sum, p.loss_count = ckpt["epoch_loss"]
    p.best_top1, p.history = ckpt["best_top1"], list(ckpt["history"])
    p.resumed_from, p.seconds_before = source, ckpt.get("run_seconds")
    run.restore_extra(ckpt)
    return p


def _setup(cfg: Config, info: DistInfo) -> ClassificationRun:
    """The run of ``cfg`` (resumed from ``train.resume`` when set), its config saved in the output folder."""
    check_config(cfg, "train")  # the config may have been changed in code since it was loaded
    resume, ckpt = start_run(cfg, info, "classification")
    folder = claim_output(cfg, resume, ckpt)
    # A resumed run takes its weights from the checkpoint, never from model.pretrained.
    pretrained = "" if ckpt else str(cfg.model.pretrained or "")
    source = ckpt if ckpt is not None else (peek_vit3_checkpoint(pretrained) if pretrained else None)
    if pretrained and source is not None:
        require_classifier(source, pretrained, "fine-tuning (model.pretrained)")
    record = model_record(source) if source is not None else None
    if record is not None:  # the model (and unset preprocessing) of the checkpoint
        apply_model_record(cfg, record, resume or pretrained)
    if not cfg.model.name:
        raise ConfigError(
            f"model.name is empty and model.pretrained={pretrained} is no vit3 checkpoint to take the model "
            f"from: name the model, e.g. model.name=vit3_small for an official vittt_s.pth"
            if pretrained
            else "model.name is empty: name the model (model.name=...) or fine-tune from a vit3 checkpoint "
            "(model.pretrained=FILE)"
        )
    keep_head = bool(cfg.model.keep_head) and bool(pretrained)
    # The labels of a kept (or resumed) classifier are its own classes, matched to the folders by name.
    head = record if record is not None and (ckpt is not None or keep_head) else None
    labels = head["classes"] if head else None
    if keep_head and head is None:  # an official file's classifier: its synsets label the folders
        default = timm.models.get_pretrained_cfg_value(cfg.model.name, "num_classes") or 1000
        num_classes = int(cfg.model.num_classes or default)
        labels = official_eval_classes(cfg, num_classes, pretrained)
    in_chans = input_channels(cfg)
    data = build_datasets(
        cfg,
        in_chans,
        classes=labels,
        classes_from=f"the classifier of {resume or pretrained}",
        min_classes=2,
    )
    classes = data["classes"]
    if head is not None:
        num_classes = int(head["num_classes"])
        if cfg.model.num_classes and int(cfg.model.num_classes) != num_classes:
            raise ConfigError(
                f"model.num_classes={cfg.model.num_classes}, but the classifier of {resume or pretrained} "
                "has "
                f"{num_classes} classes (it is kept: {'resume' if ckpt else 'model.keep_head=true'})"
            )
    elif not keep_head:
        num_classes = int(cfg.model.num_classes or len(classes))
    if num_classes < len(classes):
        raise ConfigError(f"model.num_classes={num_classes} is below the {len(classes)} classes of the data")
    model, fresh = build_model(cfg, num_classes, pretrained)
    if fresh:
        log(
            info,
            f"fine-tuning from {cfg.model.pretrained}: new classifier ({', '.join(fresh)}) for {num_classes} "
            "classes",
        )
    return assemble_run(cfg, info, folder, model, data, num_classes, ckpt, resume)


def assemble_run(
    cfg: Config,
    info: DistInfo,
    folder: OutputFolder,
    model: nn.Module,
    data: dict[str, Any],
    num_classes: int,
    ckpt: dict[str, Any] | None,
    resume: str,
    run_type: Callable[..., ClassificationRun] = ClassificationRun,
) -> ClassificationRun:
    """The run around a built ``model`` and its ``data`` (:func:`~vit3.data.build_datasets`): preprocessing,
    loaders, optimizer, schedule, EMA and DDP, resumed from ``ckpt`` (read from ``resume``) when given; its
    config saved in ``folder`` (what :func:`~vit3.engine.claim_output` allowed). ``run_type`` makes
    the run (a :class:`ClassificationRun` subclass, given the fields of :class:`ClassificationRun` in
    order)."""
    classes = data["classes"]
    in_chans = input_channels(cfg)
    resolve_data_cfg(cfg, model, in_chans)
    check_input_size(model, in_chans, int(cfg.data.img_size), key_name("data.img_size"))
    mixup = build_mixup(cfg, num_classes)
    # the recipe fitted to the data (vit3.engine.recipe): each change lands in the saved config and the log;
    # the batch before the resume check, which compares it with the checkpoint's (fitted alike)
    fitted = [fit_batch_size(cfg, -(-len(data["train"]) // info.world), even=mixup is not None)]
    frozen = model.get_classifier() if cfg.train.freeze == "backbone" else None
    check_batch_norm_batch(
        model, in_chans, int(cfg.data.img_size), int(cfg.data.batch_size), cfg.model.name, frozen
    )
    if ckpt is not None:
        for change in check_resume(cfg, ckpt, info.world, resume):
            log(info, f"warning: train.force_resume=true: {change}")
    mean, std = data_stats(cfg)
    loader, wrapped, sampler = build_train_loader(
        data["train"], build_transform(cfg, True, mean, std), cfg, info.rank, info.world
    )
    val_loader = build_val_loader(
        data["val"], build_transform(cfg, False, mean, std), cfg, cfg.data.batch_size, info.rank, info.world
    )
    steps = epoch_steps(len(loader), int(cfg.train.accum_steps))
    if mixup is not None and cfg.data.batch_size % 2:
        raise ConfigError(f"Mixup/CutMix needs an even data.batch_size, got {cfg.data.batch_size}")
    fitted.append(fit_epochs(cfg, steps.updates))
    trainable = freeze_for_training(model, cfg.train.freeze)
    if cfg.train.freeze != "none":
        fitted.append(f"train.freeze={cfg.train.freeze}: only {', '.join(trainable)} train")
    for note in filter(None, fitted):
        log(info, note)

    opt = build_optimization(cfg, info, model, steps)
    ema = None
    if cfg.train.ema:
        decay = float(cfg.train.ema_decay) ** (opt.total_batch / float(cfg.train.ema_batch))  # as official
        ema = ModelEmaV3(model, decay=decay)
    net = wrap_ddp(model, cfg, info)
    run = run_type(
        cfg, info, model, net, ema, opt.optimizer, opt.scheduler, opt.scaler, opt.amp_dtype, mixup,
        loader, wrapped, sampler, val_loader, steps, folder.path, num_classes, classes,
        _Progress(),
    )  # fmt: skip
    images = f"{len(data['train'])} train / {len(data['val'])} val images"
    mesa = float(cfg.train.mesa or 0.0)  # the official recipe's self-distillation from the EMA (train.mesa)
    about = f"{num_classes} classes" + (f", MESA self-distillation x{mesa:g}" if mesa else "")
    log_setup(info, cfg, model, opt, ema, cfg.model.name, about, images)
    open_run(folder, cfg, info, ckpt, resume, lambda: _restore(run, ckpt, resume))
    return run


@contextlib.contextmanager
def _diverged_on_nonfinite_tokens(where: str, advice: str = ""):
    """Reports the TTT mixers' non-finite-token error as :class:`TrainingDiverged` (``advice``: what to try):
    inside a training step on finite images (the model checks them first) only the model itself can have
    produced them."""
    try:
        yield
    except NonFiniteError as exc:
        raise TrainingDiverged(
            f"non-finite activations {where}: {exc}" + (f"; {advice}" if advice else "")
        ) from exc


@contextlib.contextmanager
def _one_image_batches_refused(batch_size: int, model_name: str):
    """Reports BatchNorm's refusal of a training batch with one value per channel (one image whose map is 1x1
    at that layer) as a :class:`ConfigError` naming ``data.batch_size``."""
    try:
        yield
    except ValueError as exc:
        if "Expected more than 1 value per channel" not in str(exc):
            raise
        raise ConfigError(
            f"data.batch_size={batch_size}: a BatchNorm layer of {model_name} gets one value per channel in "
            f"training ({exc}); use data.batch_size >= 2"
        ) from exc


def _train_epoch(run: ClassificationRun, run_bar: Bar | None = None) -> None:
    """One epoch (from ``progress.batch_in_epoch`` on); ``run_bar``: the run's bar
    (``train.progress=run``)."""
    cfg, info, p = run.cfg, run.info, run.progress
    accum, bs = int(cfg.train.accum_steps), cfg.data.batch_size
    run.start_epoch()
    run.net.train()
    eval_frozen(run.model, cfg.train.freeze)
    run.wrapped.set_epoch(p.epoch)
    run.sampler.set_epoch(p.epoch, start=p.batch_in_epoch * bs)
    mesa_on = float(cfg.train.mesa or 0.0) > 0 and p.epoch >= int(cfg.train.mesa_start * cfg.train.epochs)
    desc = f"epoch {p.epoch + 1}/{cfg.train.epochs}"
    if run_bar is None:
        shown = info.is_main and bool(cfg.train.progress)
        bar = progress_bar(run.steps.batches, desc, shown, initial=p.batch_in_epoch)
    else:
        bar = run_bar
        bar.set_description(f"{Path(cfg.output).name} {desc}")
    tick, seen = time.perf_counter(), 0
    dev = info.device
    advice = divergence_advice(cfg.train.base_lr, cfg.train.clip_grad)
    for b, (x, y) in enumerate(run.loader, start=p.batch_in_epoch):
        if b >= run.steps.batches:
            break
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        if run.mixup is not None:
            x, y = run.mixup(x, y)
        update = (b + 1) % accum == 0
        sync = run.net.no_sync() if info.distributed and not update else contextlib.nullcontext()
        where = f"at step {p.global_step + 1} (epoch {p.epoch + 1}, batch {b + 1} of {run.steps.batches})"
        with (
            sync,
            _diverged_on_nonfinite_tokens(where, advice),
            _one_image_batches_refused(bs, cfg.model.name),
        ):
            with autocast(dev, run.amp_dtype):
                loss = run.batch_loss(x, y, mesa_on)
            if not torch.isfinite(loss):
                raise TrainingDiverged(f"non-finite training loss {loss.item()} {where}: {advice}")
            run.scaler.scale(loss / accum).backward()
        p.loss_sum += float(loss.detach())
        p.loss_count += 1
        seen += x.shape[0] * info.world
        p.batch_in_epoch = b + 1
        if update:

            def check_norm(norm: torch.Tensor, where: str = where) -> None:
                # fp16 loss scaling skips steps with Inf gradients by design; anything else has diverged
                if not run.scaler.is_enabled() and not torch.isfinite(norm):
                    raise TrainingDiverged(f"non-finite gradient norm {float(norm)} {where}: {advice}")

            optimizer_step(
                run.model, run.optimizer, run.scaler, cfg.train.clip_grad, run.scheduler, p, run.ema,
                check_norm,
            )  # fmt: skip
            every = int(cfg.train.save_every_steps or 0)
            if every and p.global_step % every == 0 and p.batch_in_epoch < run.steps.batches:
                _save(run, "last.pt")
        bar.update(1)
        if info.is_main and figures_due(b + 1, int(cfg.train.log_every)):
            rate = seen / max(time.perf_counter() - tick, 1e-9)
            lr = max(g["lr"] for g in run.optimizer.param_groups)
            bar.set_postfix(loss=f"{p.loss_sum / p.loss_count:.4f}", lr=f"{lr:.2e}", img_s=f"{rate:.0f}")
    if run_bar is None:
        bar.close()


def _finish_epoch(run: ClassificationRun, epoch_time: float, images: int) -> dict[str, Any]:
    cfg, p = run.cfg, run.progress
    row: dict[str, Any] = {
        "epoch": p.epoch + 1,
        "step": p.global_step,
        "train_loss": p.loss_sum / max(p.loss_count, 1),
        "lr": max(g["lr"] for g in run.optimizer.param_groups),
        "epoch_time_s": round(epoch_time, 3),
        "img_per_s": round(images / max(epoch_time, 1e-9), 1),
    }
    last = p.epoch + 1 == cfg.train.epochs
    validated = last or (p.epoch + 1) % max(1, int(cfg.train.eval_every)) == 0
    if validated:
        val = validate(run.model, run.val_loader, run.info.device, run.amp_dtype)
        row.update(val_loss=val["loss"], val_top1=val["top1"], val_top5=val["top5"])
        if run.ema is not None:
            ev = validate(run.ema.module, run.val_loader, run.info.device, run.amp_dtype)
            row.update(ema_loss=ev["loss"], ema_top1=ev["top1"], ema_top5=ev["top5"])
    row.update(run.epoch_metrics(validated))
    p.history.append(row)
    p.epoch, p.batch_in_epoch, p.loss_sum, p.loss_count = p.epoch + 1, 0, 0.0, 0
    top1 = max(row.get("val_top1", -1.0), row.get("ema_top1", -1.0))
    improved = top1 > p.best_top1
    p.best_top1 = max(p.best_top1, top1)
    _save(run, "last.pt")
    if improved and cfg.train.keep_best:
        _save(run, "best.pt")
    if run.info.is_main:
        write_metrics(p.history, run.out)
        log_row(run.info, row)
    return row


def _time_summary(p: _Progress) -> dict[str, Any]:
    """The summary's run time: ``wall_time_s`` the whole run's (the time before a resume is what its
    checkpoint kept), ``wall_time_covers`` says what it covers, and for a resumed run
    ``wall_time_this_process_s``."""
    here = time.perf_counter() - p.started
    if not p.resumed_from:
        return {"wall_time_s": round(here, 1), "wall_time_covers": "the whole run"}
    if p.seconds_before is None:
        covers = f"only the part resumed from {p.resumed_from}, which holds no earlier time"
    else:
        covers = f"the whole run, {here:.0f} s of it since the resume from {p.resumed_from}"
    return {
        "wall_time_s": round(p.run_seconds(), 1),
        "wall_time_covers": covers,
        "wall_time_this_process_s": round(here, 1),
    }


def train(cfg: Config) -> dict[str, Any]:
    """Trains ``cfg`` (see module docstring) and returns the run summary (also in
    ``<output>/summary.json``)."""
    return in_process_group(cfg, train_in_group, hold_output=True)


def train_in_group(
    cfg: Config, info: DistInfo, setup: Callable[[Config, DistInfo], ClassificationRun] = _setup
) -> dict[str, Any]:
    """Runs the epochs of the run ``setup`` makes (:func:`_setup`, or a task's own built on
    :func:`assemble_run`)."""
    start = time.perf_counter()
    run = setup(cfg, info)
    p = run.progress
    p.started = start
    run_bar = None
    if cfg.train.progress == "run":  # one bar for the whole run instead of one per epoch
        total, done = cfg.train.epochs * run.steps.batches, p.epoch * run.steps.batches + p.batch_in_epoch
        run_bar = progress_bar(total, Path(cfg.output).name, info.is_main, initial=done, leave=True)
    try:
        run_epochs(
            run, p, run.steps.batches, lambda: _train_epoch(run, run_bar),
            lambda seconds, images: _finish_epoch(run, seconds, images),
        )  # fmt: skip
    finally:
        if run_bar is not None:
            run_bar.close()
    summary = {
        **run_summary(run.model, run.info.world, run.out, p.history),
        "best": best_checkpoint(run.out, run.cfg.train.keep_best, p.resumed_from),
        "best_top1": p.best_top1,
        **run.summary_extra(),
        **_time_summary(p),
    }
    if info.is_main:
        curves = plot_curves(p.history, run.out / "curves.png")
        summary["curves"] = str(curves) if curves else None
        write_text(run.out / "summary.json", json.dumps(summary, indent=1), "summary")
        final = summary["final"]
        covers = f" ({summary['wall_time_covers']})" if p.resumed_from else ""
        log(
            info,
            f"\ndone in {summary['wall_time_s']:.0f} s{covers}: val top-1 "
            f"{final.get('val_top1', float('nan')):.2f}% "
            f"(best {p.best_top1:.2f}%)\n  checkpoint: {summary['last']}\n  best:       {summary['best']}\n"
            f"  curves:     {summary['curves']}\n  metrics:    {run.out / 'metrics.csv'}\n"
            f"  evaluate:   python eval.py --checkpoint {summary['best'] or summary['last']}",
        )
    return summary
