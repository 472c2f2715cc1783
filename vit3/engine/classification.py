"""Image classification: training (``train.py``) and evaluation (``eval.py``) of timm / vit3 models.

The training recipe follows the official ViTTT code (main.py / main_ema.py): AdamW with no decay on 1-D
params, linearly scaled lr with per-step warmup + cosine, Mixup/CutMix with label smoothing, gradient
clipping, AMP, EMA of the weights and MESA. MESA (``train.mesa`` = m > 0, needs ``train.ema``): from epoch
``int(mesa_start * epochs)`` on, the EMA model acts as a teacher on the same (mixed) batch and the loss
becomes ``CE(student, target) + m * CE(student, softmax(teacher))`` (teacher without gradient).

Resuming (``train.resume``) restores the model, optimizer, scheduler, grad scaler, EMA, every rank's RNG
states, the epoch, the batch inside it and the optimizer step; together with the per-sample seeded data
pipeline (vit3.data.build) a run killed after a checkpoint and resumed ends with the same weights as an
uninterrupted one (the plumbing: :mod:`vit3.engine.common`).

A run that diverges — a non-finite training loss, a non-finite gradient norm (with ``train.clip_grad``, no
fp16 loss scaling) or non-finite tokens met by a TTT mixer of the forward — raises :class:`TrainingDiverged`
(a ``FloatingPointError``) naming the epoch and batch, so callers such as ``vit3.ablate`` can report it.

A task built on this loop (the conversion, :mod:`vit3.engine.convert`) builds its model and data, hands them to
:func:`_assemble` with a :class:`_Run` subclass (its hooks: ``start_epoch``, ``batch_loss``, ``epoch_metrics``,
``extra_state`` / ``restore_extra``, ``summary_extra``) and runs :func:`_train` with that setup.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import timm
import torch
import torch.nn.functional as F
from timm.data import resolve_data_config
from timm.utils import ModelEmaV3
from torch import nn
from tqdm import tqdm

from ..data import build_datasets, build_mixup, build_train_loader, build_transform, build_val_loader
from ..data.folder import find_classes
from ..data.mnist import MEAN as MNIST_MEAN
from ..data.mnist import STD as MNIST_STD
from ..errors import DataError
from ..layers.ttt import NonFiniteError
from .checkpoint import (
    apply_model_record,
    classifier_prefixes,
    load_model_weights,
    make_model_record,
    model_record,
    peek_vit3_checkpoint,
)
from .common import (
    OutputFolder,
    Progress,
    TrainRun,
    amp_dtype,
    autocast,
    check_resume,
    claim_output,
    in_process_group,
    log,
    log_row,
    open_output,
    optimizer_step,
    restore_rng,
    run_epochs,
    run_summary,
    save_state,
    set_threads,
    start_run,
    wrap_ddp,
)
from .config import Config, ConfigError, check_config, run_metadata, to_plain
from .distributed import DistInfo, sum_tensor
from .metrics import plot_curves, write_metrics
from .optim import build_optimizer, build_scheduler, lr_factor, scaled_lrs
from .recipe import eval_frozen, fit_batch_size, fit_epochs, freeze_for_training
from .validation import check_input_size, key_name, model_arguments

__all__ = [
    "TrainingDiverged",
    "build_model",
    "data_stats",
    "evaluate",
    "input_channels",
    "resolve_data_cfg",
    "soft_cross_entropy",
    "train",
    "validate",
]


class TrainingDiverged(FloatingPointError):
    """The training run diverged: its loss, gradient norm or weights became non-finite (NaN or Inf)."""


# ----------------------------------------------------------------------------------------------- helpers
def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``-sum_c probs[b, c] log_softmax(logits)[b, c]``; logits/probs [B, K]."""
    return torch.sum(-probs * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


def _label_loss(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Soft targets [B, K] (Mixup, smoothing included) or class indices [B] with label smoothing."""
    if target.ndim == 2:
        return soft_cross_entropy(logits, target)
    return F.cross_entropy(logits.float(), target, label_smoothing=smoothing)


def input_channels(cfg: Config) -> int:
    """The model's input channels (``model.kwargs.in_chans``, default 3)."""
    return int(cfg.model.kwargs.get("in_chans", 3))


def resolve_data_cfg(cfg: Config, model: nn.Module, in_chans: int) -> None:
    """Fills the null ``data.img_size``/``interpolation``/``crop_pct``/``mean``/``std`` in place: MNIST's
    statistics for the demo data, else the model's ``pretrained_cfg`` (a one-channel model on RGB statistics
    takes their average); checks that ``data.mean``/``std`` fit the model's channels.

    Raises:
        ConfigError: only one of mean / std given, or a length other than the model's input channels.
    """
    d = cfg.data
    resolved = resolve_data_config({}, model=model)
    if d.img_size is None:
        d.img_size = int(resolved["input_size"][-1])
    if d.interpolation is None:
        d.interpolation = resolved["interpolation"]
    if d.crop_pct is None:
        d.crop_pct = float(resolved["crop_pct"])
    if (d.mean is None) != (d.std is None):
        given = "data.mean" if d.mean is not None else "data.std"
        raise ConfigError(f"{given} is set but not its partner: give data.mean and data.std together")
    if d.mean is None:
        if d.dataset == "mnist5k":
            mean, std = MNIST_MEAN, MNIST_STD
        else:
            mean, std = tuple(resolved["mean"]), tuple(resolved["std"])
            if in_chans == 1 and len(mean) == 3:  # a one-channel model on RGB statistics: use their average
                mean, std = (sum(mean) / 3,), (sum(std) / 3,)
        d.mean, d.std = [float(v) for v in mean], [float(v) for v in std]
    for key in ("mean", "std"):
        values = d[key]
        if not isinstance(values, list | tuple) or len(values) != in_chans:
            raise ConfigError(
                f"data.{key} must hold one value per input channel of the model ({in_chans}), got {values!r}"
            )


def data_stats(cfg: Config) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The normalisation of a resolved config (:func:`resolve_data_cfg`)."""
    return tuple(cfg.data.mean), tuple(cfg.data.std)


def _official_classes(num_classes: int) -> list[str] | None:
    """The class names of an official (ImageNet-1k) classifier: timm's ImageNet synsets, in label order."""
    if num_classes != 1000:
        return None
    from timm.data import ImageNetInfo

    return list(ImageNetInfo().label_names())


def _official_eval_classes(cfg: Config, num_classes: int, path: str) -> list[str] | None:
    """Labels for evaluating an official (ImageNet-1k) classifier on a folder: its synsets, matched to the
    folders by name when every folder is one; else the sorted folders, when there are as many as classes.

    Raises:
        DataError: the folders are neither synsets nor as many as the classifier's classes.
    """
    names = _official_classes(num_classes)
    if cfg.data.dataset != "folder" or not cfg.data.path or names is None:
        return None
    folders = find_classes(Path(cfg.data.path) / cfg.data.val_split)
    if set(folders) <= set(names):
        return names
    if len(folders) == num_classes:
        warnings.warn(
            f"the class folders of {cfg.data.path} are not ImageNet synsets: their sorted order is taken as "
            f"the label order of {path}",
            stacklevel=2,
        )
        return None
    raise DataError(
        f"cannot label the {len(folders)} class folders of {cfg.data.path} for {path}: its {num_classes}-class "
        f"classifier knows ImageNet synsets (e.g. {names[0]}), and {folders[0]!r} is not one"
    )


def build_model(
    cfg: Config, num_classes: int, pretrained: str = "", keep_head: bool | None = None
) -> tuple[nn.Module, list[str]]:
    """``timm.create_model(cfg.model.name, ...)``, optionally initialised from ``pretrained``.

    Args:
        cfg: run config (``model`` section).
        num_classes: classifier size K.
        pretrained: a vit3 checkpoint or an official ViTTT file (through the model's
            ``pretrained_cfg_overlay``); "" for random init. The classifier is replaced by a fresh one for
            K classes unless ``keep_head`` (then K must be the checkpoint's class count).
        keep_head: load the pretrained classifier too (default: ``model.keep_head``).

    Returns:
        ``(model, fresh)`` where ``fresh`` names the parameters of a new (re-initialised) head.
    """
    import vit3.models  # noqa: F401  (registers the vit3 models in timm)

    with model_arguments(cfg.model.name, cfg.model.kwargs):
        return _build_model(cfg, num_classes, pretrained, keep_head)


def _build_model(
    cfg: Config, num_classes: int, pretrained: str, keep_head: bool | None
) -> tuple[nn.Module, list[str]]:
    kwargs = dict(cfg.model.kwargs)
    kwargs.setdefault("drop_path_rate", cfg.model.drop_path_rate)
    name = cfg.model.name
    keep_head = bool(cfg.model.get("keep_head", False)) if keep_head is None else keep_head
    if pretrained:
        if not Path(pretrained).is_file():
            raise FileNotFoundError(f"model.pretrained file not found: {pretrained}")
        obj = peek_vit3_checkpoint(pretrained)
        if obj is not None:
            model = timm.create_model(name, num_classes=num_classes, **kwargs)
            fresh = load_model_weights(
                model, obj, cfg.model.pretrained_ema, new_head=not keep_head, source=pretrained
            )
            return model, fresh
        # An official ViTTT file: the vit3 models' loader converts it (EMA weights with pretrained_ema).
        if cfg.model.pretrained_ema:
            kwargs["pretrained_ema"] = True
        model = timm.create_model(
            name,
            pretrained=True,
            pretrained_cfg_overlay={"file": str(pretrained)},
            num_classes=num_classes,
            **kwargs,
        )
        if keep_head:
            return model, []
        heads = tuple(classifier_prefixes(model))
        fresh = [k for k in model.state_dict() if k.startswith(heads)]
        if num_classes == model.pretrained_cfg.get("num_classes"):  # timm kept the file's classifier
            init = timm.create_model(name, num_classes=num_classes, **kwargs).state_dict()
            model.load_state_dict({k: init[k] for k in fresh}, strict=False)
        return model, fresh
    return timm.create_model(name, num_classes=num_classes, **kwargs), []


@torch.no_grad()
def validate(
    model: nn.Module, loader, device: torch.device, amp_dtype: torch.dtype | None = None
) -> dict[str, float]:
    """Top-1/top-5 (%) and mean cross-entropy over the loader, summed over all ranks."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, amp_dtype):
            logits = model(x)
        logits = logits.float()
        k = min(5, logits.shape[-1])
        topk = logits.topk(k, dim=-1).indices  # [B, k]
        hits = topk.eq(y[:, None])
        batch = [
            F.cross_entropy(logits, y, reduction="sum"),
            hits[:, 0].sum(),
            hits.any(-1).sum(),
            y.new_tensor(len(y)),
        ]
        sums += torch.stack([v.to(sums.dtype) for v in batch])
    loss, top1, top5, n = sum_tensor(sums).tolist()
    n = max(n, 1.0)
    return {"top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n, "loss": loss / n, "images": int(n)}


# ---------------------------------------------------------------------------------------------- training
@dataclass
class _Progress(Progress):
    """The counters of :class:`~vit3.engine.common.Progress` plus the partial epoch's loss and the history."""

    loss_sum: float = 0.0  # running training loss of the partial epoch
    loss_count: int = 0
    best_top1: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Run(TrainRun):
    mixup: Any
    loader: Any
    wrapped: Any
    sampler: Any
    val_loader: Any
    batches_per_epoch: int
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
        """The training loss of one (mixed) batch ``x [B, C, H, W]``, ``y [B]`` or ``[B, K]``; under autocast."""
        logits = self.net(x)
        loss = _label_loss(logits, y, self.cfg.aug.label_smoothing)
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


def _state(run: _Run) -> dict[str, Any]:
    """The checkpoint dict (:func:`~vit3.engine.common.save_state` adds the RNG states)."""
    p = run.progress
    mean, std = data_stats(run.cfg)
    return {
        "record": make_model_record(run.cfg, run.num_classes, run.classes, mean, std),
        "model_name": run.cfg.model.name,
        "model_kwargs": to_plain(run.cfg.model.kwargs),
        "num_classes": run.num_classes,
        "classes": list(run.classes),
        **run.training_state(),
        **p.counters(),
        "epoch_loss": (p.loss_sum, p.loss_count),
        "best_top1": p.best_top1,
        "history": p.history,
        "config": run.cfg.to_dict(),
        "meta": run_metadata(),
        **run.extra_state(),
    }


def _save(run: _Run, name: str) -> Path:
    return save_state(lambda: _state(run), run.out / name, run.info)


def _restore(run: _Run, ckpt: dict[str, Any], source: str) -> None:
    schedule = (
        "epochs",
        "warmup_epochs",
        "base_lr",
        "warmup_lr",
        "min_lr",
        "lr_batch",
        "lr_scale",
        "accum_steps",
    )
    before = {"lr_scale": "linear", **ckpt["config"].get("train", {})}  # linear: runs from before the key
    same_schedule = all(before.get(k) == run.cfg.train[k] for k in schedule)
    run.load_training_state(ckpt, source, scheduler=same_schedule)
    if not same_schedule:  # e.g. more epochs: the new config's schedule applies from the restored step on
        log(
            run.info,
            f"note: the lr schedule settings differ from {source}; the new config's schedule applies",
        )
    p = run.progress
    p.restore(ckpt, run.cfg.data.batch_size, run.info.world, int(run.cfg.train.accum_steps))
    p.loss_sum, p.loss_count = ckpt["epoch_loss"]
    p.best_top1, p.history = ckpt["best_top1"], list(ckpt["history"])
    run.restore_extra(ckpt)
    p.roll_over(run.batches_per_epoch)


def _setup(cfg: Config, info: DistInfo) -> _Run:
    """The run of ``cfg`` (resumed from ``train.resume`` when set), its config saved in the output folder."""
    check_config(cfg, "train")  # the config may have been changed in code since it was loaded
    resume, ckpt = start_run(cfg, info, "classification")
    folder = claim_output(cfg, resume, ckpt)
    # A resumed run takes its weights from the checkpoint, never from model.pretrained.
    pretrained = "" if ckpt else str(cfg.model.pretrained or "")
    source = ckpt if ckpt is not None else (peek_vit3_checkpoint(pretrained) if pretrained else None)
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
    in_chans = input_channels(cfg)
    data = build_datasets(
        cfg,
        in_chans,
        classes=head["classes"] if head else None,
        classes_from=f"the classifier of {resume or pretrained}",
    )
    classes = data["classes"]
    if head is not None:
        num_classes = int(head["num_classes"])
        if cfg.model.num_classes and int(cfg.model.num_classes) != num_classes:
            raise ConfigError(
                f"model.num_classes={cfg.model.num_classes}, but the classifier of {resume or pretrained} has "
                f"{num_classes} classes (it is kept: {'resume' if ckpt else 'model.keep_head=true'})"
            )
    elif keep_head:  # an official file's classifier
        default = timm.models.get_pretrained_cfg_value(cfg.model.name, "num_classes") or 1000
        num_classes = int(cfg.model.num_classes or default)
    else:
        num_classes = int(cfg.model.num_classes or len(classes))
    if num_classes < len(classes):
        raise ConfigError(f"model.num_classes={num_classes} is below the {len(classes)} classes of the data")
    model, fresh = build_model(cfg, num_classes, pretrained)
    if fresh:
        log(
            info,
            f"fine-tuning from {cfg.model.pretrained}: new classifier ({', '.join(fresh)}) for {num_classes} classes",
        )
    return _assemble(cfg, info, folder, model, data, num_classes, ckpt, resume)


def _assemble(
    cfg: Config,
    info: DistInfo,
    folder: OutputFolder,
    model: nn.Module,
    data: dict[str, Any],
    num_classes: int,
    ckpt: dict[str, Any] | None,
    resume: str,
    run_type: Callable[..., _Run] = _Run,
) -> _Run:
    """The run around a built ``model`` and its ``data`` (:func:`~vit3.data.build_datasets`): preprocessing,
    loaders, optimizer, schedule, EMA and DDP, resumed from ``ckpt`` (read from ``resume``) when given; its
    config saved in ``folder`` (what :func:`~vit3.engine.common.claim_output` allowed). ``run_type`` makes
    the run (a :class:`_Run` subclass, given the fields of :class:`_Run` in order)."""
    classes = data["classes"]
    in_chans = input_channels(cfg)
    resolve_data_cfg(cfg, model, in_chans)
    check_input_size(model, in_chans, int(cfg.data.img_size), key_name("data.img_size"))
    mixup = build_mixup(cfg, num_classes)
    # the recipe fitted to the data (vit3.engine.recipe): each change lands in the saved config and the log;
    # the batch before the resume check, which compares it with the checkpoint's (fitted alike)
    fitted = [fit_batch_size(cfg, -(-len(data["train"]) // info.world), even=mixup is not None)]
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
    accum = int(cfg.train.accum_steps)
    batches_per_epoch = (sampler.num_samples // cfg.data.batch_size) // accum * accum
    if batches_per_epoch == 0:
        raise ConfigError(
            f"train.accum_steps={accum} exceeds the {sampler.num_samples // cfg.data.batch_size} batches per epoch"
        )
    if mixup is not None and cfg.data.batch_size % 2:
        raise ConfigError(f"Mixup/CutMix needs an even data.batch_size, got {cfg.data.batch_size}")
    fitted.append(fit_epochs(cfg, batches_per_epoch // accum))
    trainable = freeze_for_training(model, cfg.train.freeze)
    if cfg.train.freeze != "none":
        fitted.append(f"train.freeze={cfg.train.freeze}: only {', '.join(trainable)} train")
    for note in filter(None, fitted):
        log(info, note)

    model.to(info.device)
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    total_batch = cfg.data.batch_size * info.world * accum
    lrs = scaled_lrs(cfg.train, total_batch)
    optimizer = build_optimizer(model, cfg.train, lrs["base_lr"])
    scheduler = build_scheduler(optimizer, cfg.train, lrs, batches_per_epoch // accum)
    amp = amp_dtype(cfg.train.amp, info.device)
    scaler = torch.amp.GradScaler(info.device.type, enabled=amp == torch.float16)
    ema = None
    if cfg.train.ema:
        decay = float(cfg.train.ema_decay) ** (total_batch / float(cfg.train.ema_batch))  # as official
        ema = ModelEmaV3(model, decay=decay)
    net = wrap_ddp(model, cfg, info)
    run = run_type(
        cfg, info, model, net, ema, optimizer, scheduler, scaler, amp, mixup,
        loader, wrapped, sampler, val_loader, batches_per_epoch, folder.path, num_classes, classes, _Progress(),
    )  # fmt: skip
    log(
        info,
        f"model {cfg.model.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {num_classes} "
        f"classes | data: {len(data['train'])} train / {len(data['val'])} val images | {info.world} process(es) "
        f"on {info.device}, total batch {total_batch}, lr {lrs['base_lr']:.3g} (train.base_lr "
        f"{cfg.train.base_lr:g} x {lr_factor(cfg.train, total_batch):.4g}, {cfg.train.lr_scale} in the batch) | amp {amp} | "
        f"ema {'on' if ema else 'off'} | mesa {cfg.train.mesa}",
    )
    if ckpt is not None:
        _restore(run, ckpt, resume)
        log(
            info,
            f"resumed from {resume}: epoch {run.progress.epoch + 1}, batch {run.progress.batch_in_epoch}, step {run.progress.global_step}",
        )
    open_output(folder, cfg, info)
    if ckpt is not None:
        restore_rng(ckpt, info)  # last: building the run drew on the RNGs
    return run


@contextlib.contextmanager
def _diverged_on_nonfinite_tokens(where: str):
    """Reports the TTT mixers' non-finite-token error as :class:`TrainingDiverged`: inside a training step on
    finite images (the model checks them first) only the model itself can have produced them."""
    try:
        yield
    except NonFiniteError as exc:
        raise TrainingDiverged(f"non-finite activations {where}: {exc}") from exc


def _train_epoch(run: _Run, run_bar: tqdm | None = None) -> None:
    """One epoch (from ``progress.batch_in_epoch`` on); ``run_bar``: the run's bar (``train.progress=run``)."""
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
        bar = tqdm(
            total=run.batches_per_epoch, initial=p.batch_in_epoch, desc=desc,
            disable=not (info.is_main and cfg.train.progress), dynamic_ncols=True, leave=False, file=sys.stdout,
        )  # fmt: skip
    else:
        bar = run_bar
        bar.set_description(f"{Path(cfg.output).name} {desc}")
    tick, seen = time.perf_counter(), 0
    dev = info.device
    for b, (x, y) in enumerate(run.loader, start=p.batch_in_epoch):
        if b >= run.batches_per_epoch:
            break
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        if run.mixup is not None:
            x, y = run.mixup(x, y)
        update = (b + 1) % accum == 0
        sync = run.net.no_sync() if info.distributed and not update else contextlib.nullcontext()
        where = f"at epoch {p.epoch + 1}, batch {b}"
        with sync, _diverged_on_nonfinite_tokens(where):
            with autocast(dev, run.amp_dtype):
                loss = run.batch_loss(x, y, mesa_on)
            if not torch.isfinite(loss):
                raise TrainingDiverged(f"non-finite training loss {loss.item()} {where}")
            run.scaler.scale(loss / accum).backward()
        p.loss_sum += float(loss.detach())
        p.loss_count += 1
        seen += x.shape[0] * info.world
        p.batch_in_epoch = b + 1
        if update:

            def check_norm(norm: torch.Tensor, where: str = where) -> None:
                # fp16 loss scaling skips steps with Inf gradients by design; anything else has diverged
                if not run.scaler.is_enabled() and not torch.isfinite(norm):
                    raise TrainingDiverged(f"non-finite gradient norm {float(norm)} {where}")

            optimizer_step(
                run.model, run.optimizer, run.scaler, cfg.train.clip_grad, run.scheduler, p.global_step,
                run.ema, check_norm,
            )  # fmt: skip
            p.global_step += 1
            every = int(cfg.train.save_every_steps or 0)
            if every and p.global_step % every == 0 and p.batch_in_epoch < run.batches_per_epoch:
                _save(run, "last.pt")
        bar.update(1)
        if info.is_main and (b + 1) % max(1, int(cfg.train.log_every)) == 0:
            rate = seen / max(time.perf_counter() - tick, 1e-9)
            lr = max(g["lr"] for g in run.optimizer.param_groups)
            bar.set_postfix(loss=f"{p.loss_sum / p.loss_count:.4f}", lr=f"{lr:.2e}", img_s=f"{rate:.0f}")
    if run_bar is None:
        bar.close()


def _finish_epoch(run: _Run, epoch_time: float, images: int) -> dict[str, Any]:
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


def train(cfg: Config) -> dict[str, Any]:
    """Trains ``cfg`` (see module docstring) and returns the run summary (also in ``<output>/summary.json``)."""
    return in_process_group(cfg, _train)


def _train(cfg: Config, info: DistInfo, setup: Callable[[Config, DistInfo], _Run] = _setup) -> dict[str, Any]:
    """Runs the epochs of the run ``setup`` makes (:func:`_setup`, or a task's own built on :func:`_assemble`)."""
    start = time.perf_counter()
    run = setup(cfg, info)
    p = run.progress
    run_bar = None
    if cfg.train.progress == "run":  # one bar for the whole run instead of one per epoch
        run_bar = tqdm(
            total=cfg.train.epochs * run.batches_per_epoch, initial=p.epoch * run.batches_per_epoch + p.batch_in_epoch,
            desc=Path(cfg.output).name, disable=not info.is_main, dynamic_ncols=True, file=sys.stdout,
        )  # fmt: skip
    try:
        run_epochs(
            run, p, run.batches_per_epoch, lambda: _train_epoch(run, run_bar),
            lambda seconds, images: _finish_epoch(run, seconds, images),
        )  # fmt: skip
    finally:
        if run_bar is not None:
            run_bar.close()
    summary = {
        **run_summary(run, run.out, p.history),
        "best": str(run.out / "best.pt") if cfg.train.keep_best else None,
        "best_top1": p.best_top1,
        **run.summary_extra(),
        "wall_time_s": round(time.perf_counter() - start, 1),
    }
    if info.is_main:
        curves = plot_curves(p.history, run.out / "curves.png")
        summary["curves"] = str(curves) if curves else None
        (run.out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        final = summary["final"]
        log(
            info,
            f"\ndone in {summary['wall_time_s']:.0f} s: val top-1 {final.get('val_top1', float('nan')):.2f}% "
            f"(best {p.best_top1:.2f}%)\n  checkpoint: {summary['last']}\n  best:       {summary['best']}\n"
            f"  curves:     {summary['curves']}\n  metrics:    {run.out / 'metrics.csv'}\n"
            f"  evaluate:   python eval.py --checkpoint {summary['best'] or summary['last']}",
        )
    return summary


# -------------------------------------------------------------------------------------------- evaluation
def _peak_memory_mb(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process peak RSS"


@torch.no_grad()
def _throughput(model: nn.Module, x: torch.Tensor, batches: int, amp_dtype: torch.dtype | None) -> float:
    dev = x.device
    with autocast(dev, amp_dtype):
        model(x)  # warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        tick = time.perf_counter()
        for _ in range(batches):
            model(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return batches * x.shape[0] / max(time.perf_counter() - tick, 1e-9)


def _flops(model: nn.Module, x: torch.Tensor) -> float | None:
    with warnings.catch_warnings():  # fvcore uses the deprecated torch.jit helpers
        warnings.simplefilter("ignore", FutureWarning)
        try:
            from fvcore.nn import FlopCountAnalysis
        except ImportError:
            return None
        analysis = FlopCountAnalysis(model, x[:1])
        analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        return float(analysis.total())


def evaluate(cfg: Config) -> dict[str, Any]:
    """Evaluates ``cfg.eval.checkpoint`` on the val split at each of ``cfg.eval.img_sizes``.

    Returns (and writes as JSON): params, and per resolution top-1/top-5/loss, images/s, peak memory
    and fvcore FLOPs (per image).
    """
    return in_process_group(cfg, _evaluate)


def _evaluate(cfg: Config, info: DistInfo) -> dict[str, Any]:
    import vit3.models  # noqa: F401  (registers the vit3 models in timm)

    check_config(cfg, "eval")  # the config may have been changed in code since it was loaded
    set_threads(cfg)
    path = str(cfg.eval.checkpoint)
    if not path:
        raise ConfigError("eval.checkpoint is empty: pass --checkpoint FILE")
    ckpt = peek_vit3_checkpoint(path)
    if ckpt is not None:
        # The checkpoint's model (an explicit --model / model.kwargs wins, with a warning); labels by class name.
        record = model_record(ckpt)
        apply_model_record(cfg, record, path)
        num_classes, classes = int(record["num_classes"]), record["classes"]
        data = build_datasets(
            cfg, input_channels(cfg), splits=("val",), classes=classes, classes_from=f"the model of {path}"
        )
        model, _ = build_model(cfg, num_classes)
        load_model_weights(model, ckpt, use_ema=cfg.eval.use_ema, source=path)
    else:
        if cfg.eval.use_ema:
            raise ConfigError(
                "eval.use_ema applies to vit3 checkpoints; an official file holds one set of weights"
            )
        default = timm.models.get_pretrained_cfg_value(cfg.model.name, "num_classes") or 1000
        num_classes = int(cfg.model.num_classes or default)
        data = build_datasets(
            cfg, input_channels(cfg), splits=("val",), classes=_official_eval_classes(cfg, num_classes, path)
        )
        model, _ = build_model(cfg, num_classes, path, keep_head=True)
    if len(data["classes"]) > num_classes:
        raise DataError(
            f"{len(data['classes'])} val classes but the checkpoint's classifier has {num_classes}"
        )
    name = cfg.model.name
    model.to(info.device).eval()
    resolve_data_cfg(cfg, model, input_channels(cfg))
    mean, std = data_stats(cfg)
    amp = amp_dtype(cfg.train.amp, info.device)
    sizes = [int(s) for s in (cfg.eval.img_sizes or [cfg.data.img_size])]
    for size in sizes:  # every size before the first is evaluated
        check_input_size(
            model,
            input_channels(cfg),
            size,
            key_name("eval.img_sizes" if cfg.eval.img_sizes else "data.img_size"),
        )
    results = []
    for size in sizes:
        loader = build_val_loader(
            data["val"],
            build_transform(cfg, False, mean, std, size),
            cfg,
            cfg.eval.batch_size,
            info.rank,
            info.world,
        )
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(info.device)
        metrics = validate(model, loader, info.device, amp)
        x = next(iter(loader))[0].to(info.device)
        rate = _throughput(model, x, int(cfg.eval.throughput_batches), amp)
        memory, memory_kind = _peak_memory_mb(info.device)
        flops = _flops(model, x) if cfg.eval.flops else None
        results.append(
            {
                "img_size": size,
                **metrics,
                "throughput_img_s": round(rate, 1),
                "throughput_batch": int(x.shape[0]),
                "peak_memory_mb": round(memory, 1),
                "peak_memory_kind": memory_kind,
                "gflops_per_image": None if flops is None else flops / 1e9,
            }
        )
    report = {
        "checkpoint": path,
        "model": name,
        "weights": "ema" if cfg.eval.use_ema else "model",
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "device": str(info.device),
        "amp": str(amp),
        "results": results,
    }
    out = Path(cfg.eval.json) if cfg.eval.json else Path(path).with_suffix(".eval.json")
    if info.is_main:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1), encoding="utf-8")
        log(info, f"{name} ({report['weights']} weights, {report['params_m']:.2f}M params) on {info.device}")
        log(
            info,
            f"{'size':>5} {'top-1':>7} {'top-5':>7} {'loss':>7} {'img/s':>9} {'peak MB':>9} {'GFLOPs':>8}",
        )
        for r in results:
            g = "n/a" if r["gflops_per_image"] is None else f"{r['gflops_per_image']:.3f}"
            log(
                info,
                f"{r['img_size']:>5} {r['top1']:>7.2f} {r['top5']:>7.2f} {r['loss']:>7.4f} "
                f"{r['throughput_img_s']:>9.1f} {r['peak_memory_mb']:>9.1f} {g:>8}",
            )
        log(info, f"wrote {out}")
    report["json"] = str(out)
    return report
