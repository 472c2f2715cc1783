"""Train / evaluate loops for detection (torchvision Mask / Faster R-CNN) and segmentation (UperNet, FPN).

``train(cfg)`` and ``evaluate(cfg)`` are what ``train.py`` / ``eval.py`` call for ``task: detection`` and
``task: segmentation``; they read the shared keys plus a ``dense:`` section (``configs/dense/*.yaml``).
Outputs: ``config.yaml``, ``last.pt`` / ``best.pt`` and ``metrics.json``; resume is exact
(:mod:`vit3.engine.resume`). The data and the model are in :mod:`vit3.engine.dense_model`, the parameter
groups and the schedule in :mod:`vit3.engine.optim`, the metrics in :mod:`vit3.engine.dense_metrics`.
The keys and the recipe: ``docs/design/engine.md``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.build import build_train_loader
from ..data.coco import collate_detection
from ..errors import TrainingDiverged, divergence_advice
from ..models.record import load_checkpoint
from ..outputs import write_text
from .bars import figures_due, progress_bar
from .checkpoint import CheckpointMismatchError, eval_report_path, make_model_record
from .config import Config, ConfigError, check_config, run_metadata
from .dense_metrics import (
    coco_results,
    confusion_matrix,
    evaluate_dense,
    evaluate_detection,
    evaluate_segmentation,
    nan_free_json,
    scalars,
    segmentation_metrics,
)
from .dense_model import (
    build_dense_model,
    dense_backbone,
    dense_section,
    load_backbone_weights,
    model_and_data,
)
from .distributed import DistInfo, barrier, distributed, log
from .loop import best_checkpoint, optimizer_step, run_summary
from .optim import DenseSchedule, build_dense_optimizer, epoch_steps, load_optimizer_state, scaled_lrs
from .process import amp_dtype, autocast, wrap_ddp
from .resume import Progress, check_resume, restore_rng, save_state, start_run
from .run_folder import claim_output, in_process_group, open_output

__all__ = [
    "build_dense_model",
    "coco_results",
    "confusion_matrix",
    "evaluate",
    "evaluate_detection",
    "evaluate_segmentation",
    "load_backbone_weights",
    "segmentation_metrics",
    "train",
]


# ---------------------------------------------------------------------------------------------- train


def _to(batch, device: torch.device, task: str):
    if task == "detection":
        images, targets = batch
        return [i.to(device) for i in images], [{k: v.to(device) for k, v in t.items()} for t in targets]
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train(cfg: Config) -> dict[str, Any]:
    """Trains a detector or segmenter as ``cfg`` says; evaluates every ``train.eval_every`` epochs and at the
    end.

    Returns:
        ``{"history": [...], "final": metrics of the last evaluation, "losses": per-step total losses,
        "summary": the run summary}`` (the summary also in ``<output>/summary.json``).
    """
    d = dense_section(cfg)
    return in_process_group(cfg, _train, d, hold_output=True)


@dataclass
class _Progress(Progress):
    """The counters of :class:`~vit3.engine.Progress` plus the losses and the best score."""

    losses: list[float] = field(default_factory=list)  # one total loss per optimizer step
    best: float = -math.inf


def _train(cfg: Config, d: Any, info: DistInfo) -> dict[str, Any]:
    check_config(cfg, "train")  # the config may have been changed in code since it was loaded
    device = info.device
    amp = amp_dtype(cfg.train.amp, device)
    if cfg.task == "segmentation" and cfg.data.batch_size < 2:
        raise ConfigError(
            "segmentation needs data.batch_size >= 2 per process (BatchNorm in the decode heads)"
        )
    resume, ckpt = start_run(cfg, info, cfg.task)
    out = Path(cfg.output)
    if ckpt is not None:
        for change in check_resume(cfg, ckpt, info.world, resume):
            log(info, f"warning: train.force_resume=true: {change}")
    folder = claim_output(cfg, resume, ckpt)
    synthetic = cfg.data.dataset == "digits" and not Path(cfg.data.path).exists()  # written on first use
    model, train_set, val_set = model_and_data(cfg, with_train=True)
    open_output(folder, cfg, info)  # nothing written before the model and the data are known to be right
    model.to(device)
    num_classes = val_set.num_classes
    # The per-sample seeded, resumable stream of the classification engine (vit3.data.build); BatchNorm in
    # the segmentation heads needs full batches.
    loader, wrapped, sampler = build_train_loader(
        train_set, None, cfg, info.rank, info.world, drop_last=cfg.task == "segmentation",
        collate_fn=collate_detection if cfg.task == "detection" else None,
    )  # fmt: skip
    accum, bs = int(cfg.train.accum_steps), int(cfg.data.batch_size)
    steps = epoch_steps(len(loader), accum)
    total = d.iters or cfg.train.epochs * steps.updates
    lr = scaled_lrs(cfg.train, bs * info.world * accum)["base_lr"]
    opt = build_dense_optimizer(model, dense_backbone(model).body, cfg, lr)
    schedule = DenseSchedule(opt, lr, total, d, steps.updates)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    net = wrap_ddp(model, cfg, info)
    wrote = " (the synthetic digits, written now)" if synthetic else ""
    log(
        info,
        f"{cfg.task} {d.arch} on {cfg.model.name}: {sum(q.numel() for q in model.parameters()) / 1e6:.2f}M "
        f"params | data: {len(train_set)} train / {len(val_set)} val images in {cfg.data.path}{wrote} | "
        f"{info.world} process(es) on {device}, total batch {bs * info.world * accum}, lr {lr:.3g}, {total} "
        f"steps | amp {amp} | output {out}",
    )
    p = _Progress()
    if ckpt is not None:  # not resume.open_run: its finished-run note counts train.epochs, not dense.iters
        model.load_state_dict(ckpt["model"])
        load_optimizer_state(opt, ckpt["optimizer"], source=resume)
        scaler.load_state_dict(ckpt["scaler"])
        p.restore(ckpt, bs, info.world, accum, steps, by_epochs=not d.iters)
        p.history, p.losses, p.best = list(ckpt["history"]), list(ckpt["losses"]), float(ckpt["best"])
        restore_rng(ckpt, info)
        log(
            info,
            f"resumed from {resume}: epoch {p.epoch + 1}, batch {p.batch_in_epoch}, step {p.global_step}",
        )
    class_names = getattr(val_set, "class_names", d.class_names)

    def state() -> dict[str, Any]:
        return {
            "task": cfg.task,
            "record": make_model_record(cfg, num_classes, class_names, cfg.data.mean, cfg.data.std),
            "model_name": cfg.model.name,
            "num_classes": num_classes,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(),
            **p.counters(),
            "history": p.history,
            "losses": p.losses,
            "best": p.best,
            "config": cfg.to_dict(),
            "meta": run_metadata(),
        }

    eval_every = d.eval_interval or (cfg.train.eval_every or 1) * steps.updates
    save_every = int(cfg.train.save_every_steps or 0)
    key = "bbox_AP" if cfg.task == "detection" else "mIoU"
    net.train()
    t0 = time.time()
    bar = progress_bar(
        total, "step", info.is_main and bool(cfg.train.progress), initial=p.global_step, leave=True
    )
    while p.global_step < total:
        wrapped.set_epoch(p.epoch)
        sampler.set_epoch(p.epoch, start=p.batch_in_epoch * bs)
        step_loss = 0.0
        for b, batch in enumerate(loader, start=p.batch_in_epoch):
            if b >= steps.batches or p.global_step >= total:
                break
            update = (b + 1) % accum == 0
            sync = net.no_sync() if info.distributed and not update else contextlib.nullcontext()
            with sync:
                with autocast(device, amp):
                    parts = net(*_to(batch, device, cfg.task))  # detector(images, targets) / segmenter(x, y)
                    loss = sum(parts.values())
                if not torch.isfinite(loss):
                    advice = divergence_advice(cfg.train.base_lr, cfg.train.clip_grad, "dense.warmup_iters")
                    raise TrainingDiverged(
                        f"non-finite loss at step {p.global_step + 1} "
                        f"({ {k: float(v) for k, v in parts.items()} }): {advice}"
                    )
                scaler.scale(loss / accum).backward()
            step_loss += float(loss.detach()) / accum
            p.batch_in_epoch = b + 1
            if not update:
                continue
            optimizer_step(model, opt, scaler, cfg.train.clip_grad, schedule, p)
            p.losses.append(step_loss)
            step, step_loss = p.global_step, 0.0
            bar.update(1)
            if figures_due(step, int(cfg.train.log_every)):
                bar.set_postfix(loss=f"{p.losses[-1]:.4f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
            if step % eval_every == 0 or step == total:
                metrics = evaluate_dense(cfg, model, val_set, device) if info.is_main else {}
                improved = info.is_main and metrics[key] > p.best
                if info.is_main:
                    p.history.append({"step": step, "loss": p.losses[-1], **scalars(metrics)})
                    p.best = max(p.best, metrics[key])
                best = [out / "best.pt"] if improved and cfg.train.keep_best else []
                save_state(state, out / "last.pt", info, best)
                if info.is_main:
                    write_text(out / "metrics.json", nan_free_json(p.history), "metrics")
                    log(
                        info,
                        f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in scalars(metrics).items()),
                    )
                barrier()
                net.train()
            elif (save_every and step % save_every == 0) or p.batch_in_epoch == steps.batches:
                save_state(state, out / "last.pt", info)  # every epoch's end, as classification saves
        p.roll_over(steps.batches)
    bar.close()
    summary = {
        **run_summary(model, info.world, out, p.history),
        "best": best_checkpoint(out, cfg.train.keep_best, resume),
        f"best_{key}": p.best if p.history else None,
        "steps": p.global_step,
        "wall_time_this_process_s": round(time.time() - t0, 1),
    }
    if info.is_main:
        write_text(out / "summary.json", nan_free_json(summary), "summary")
        log(
            info,
            f"\ndone in {summary['wall_time_this_process_s']:.0f} s: {key} "
            f"{summary['final'].get(key, math.nan):.4f} (best {p.best:.4f})\n"
            f"  checkpoint: {summary['last']}\n  best:       {summary['best']}\n"
            f"  metrics:    {out / 'metrics.json'}\n"
            f"  evaluate:   python eval.py --checkpoint {summary['best'] or summary['last']}",
        )
    return {"history": p.history, "final": summary["final"], "losses": p.losses, "summary": summary}


def evaluate(cfg: Config) -> dict[str, Any]:
    """Evaluates ``eval.checkpoint`` (a dense vit3 checkpoint) on the validation split; writes a JSON.

    Returns:
        The metrics (COCO AP for detection; mIoU, mAcc, aAcc and per-class IoU for segmentation).
    """
    dense_section(cfg)
    with distributed(cfg.device, cfg.dist.backend) as dist_info:
        return _evaluate(cfg, dist_info.device)


def _evaluate(cfg: Config, device: torch.device) -> dict[str, Any]:
    check_config(cfg, "eval")  # the config may have been changed in code since it was loaded
    if cfg.eval.img_sizes:
        raise ConfigError(
            f"--img-size / eval.img_sizes={list(cfg.eval.img_sizes)} sets classification resolutions; a "
            f"{cfg.task} "
            "model's test scale is "
            + (
                "dense.min_size / dense.max_size (e.g. dense.min_size=640)"
                if cfg.task == "detection"
                else "dense.scale (long, short), e.g. dense.scale=[2048,640], and dense.slide_crop"
            )
        )
    path = cfg.eval.checkpoint
    ckpt = load_checkpoint(path) if path else None
    model, _, dataset = model_and_data(cfg, with_train=False)
    if ckpt:
        if ckpt.get("num_classes") != dataset.num_classes:
            raise CheckpointMismatchError(
                f"checkpoint {path} has {ckpt.get('num_classes')} classes, the validation data "
                f"{dataset.num_classes}"
            )
        model.load_state_dict(ckpt["model"])
    model.to(device)
    metrics = evaluate_dense(cfg, model, dataset, device)
    out = (
        Path(cfg.eval.json)
        if cfg.eval.json
        else (eval_report_path(path, ckpt, cfg) if path else Path(cfg.output) / "eval.json")
    )
    d = cfg.dense  # the test-time settings: two evaluations of one checkpoint tell themselves apart
    keys = (
        ("min_size", "max_size")
        if cfg.task == "detection"
        else ("inference", "scale", "slide_crop", "slide_stride")
    )
    settings = {f"dense.{k}": d[k] for k in keys} | {"data.path": str(cfg.data.path)}
    report = {"checkpoint": path, "task": cfg.task, "settings": settings, "metrics": metrics}
    write_text(out, nan_free_json(report), "report")
    print(nan_free_json(scalars(metrics)))
    return metrics
