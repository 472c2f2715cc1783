"""Class-conditional image generation (task ``generation``): DiT³ / DiT training (``train.py``) and sampling
with metrics (``eval.py``).

Training follows the official DiT³ recipe (LeapLabTHU/ViTTT ``dittt/train.py``) on the shared plumbing:
config, seeded data, AdamW and warmup + cosine (:mod:`vit3.engine.optim`; ``min_lr = base_lr`` is the
official constant lr), AMP, DDP and exact resume (:mod:`vit3.engine.resume`). Building the generator,
sampling and ``eval.py`` are in :mod:`vit3.engine.generation_sampling` (re-exported here). Outputs and the
sampling rules: ``docs/design/engine.md``.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from timm.utils import ModelEmaV3

from ..data import build_datasets, build_train_loader
from ..data.generation import build_generation_transform
from ..errors import TrainingDiverged, divergence_advice
from ..models.dit3 import DiT3
from ..outputs import write_text
from ..tasks.diffusion import GaussianDiffusion, LatentAutoencoder
from .bars import figures_due, progress_bar
from .config import Config, ConfigError
from .distributed import DistInfo, log, log_row
from .generation_sampling import (
    build_diffusion,
    build_generator,
    check_generation_cfg,
    evaluate,
    generate,
    latent_space,
    sample_and_evaluate,
)
from .loop import TrainRun, log_setup, optimizer_step, run_epochs, run_summary
from .metrics import plot_series, write_metrics
from .optim import EpochSteps, build_optimization, epoch_steps
from .process import autocast, wrap_ddp
from .resume import Progress, check_resume, open_run, save_state, start_run
from .run_folder import claim_output, in_process_group

__all__ = ["build_diffusion", "build_generator", "evaluate", "generate", "latent_space", "train"]


# ---------------------------------------------------------------------------------------------- training
@dataclass
class _Progress(Progress):
    """The counters of :class:`~vit3.engine.Progress` plus the loss terms and the curve."""

    sums: dict[str, float] = field(default_factory=dict)  # running loss terms of the partial epoch
    count: int = 0
    curve: list[dict[str, float]] = field(default_factory=list)  # one point per train.log_every steps
    window: dict[str, float] = field(default_factory=dict)  # loss terms since the last curve point


@dataclass
class _Run(TrainRun):
    model: DiT3
    diffusion: GaussianDiffusion
    vae: LatentAutoencoder | None
    loader: Any
    wrapped: Any
    sampler: Any
    steps: EpochSteps  # the epoch's micro-batches and updates (``optim.epoch_steps``)
    out: Path
    model_kwargs: dict[str, Any]
    classes: list[str]
    progress: _Progress


def _state(run: _Run) -> dict[str, Any]:
    """The checkpoint dict (:func:`~vit3.engine.save_state` adds the RNG states)."""
    p = run.progress
    return {
        "task": "generation",
        **run.run_state(p, run.model_kwargs, run.model.num_classes, run.classes),
        "epoch_loss": {"sums": dict(p.sums), "count": p.count, "window": dict(p.window)},
        "curve": p.curve,
    }


def _save(run: _Run, name: str) -> Path:
    return save_state(lambda: _state(run), run.out / name, run.info)


def _restore(run: _Run, ckpt: dict[str, Any], source: str) -> _Progress:
    """Restores ``run`` from ``ckpt`` (read from ``source``); returns its progress."""
    run.load_training_state(ckpt, source)
    p, loss = run.progress, ckpt["epoch_loss"]
    p.restore(ckpt, run.cfg.data.batch_size, run.info.world, int(run.cfg.train.accum_steps), run.steps)
    p.sums, p.count, p.window = dict(loss["sums"]), int(loss["count"]), dict(loss["window"])
    p.history, p.curve = list(ckpt["history"]), list(ckpt["curve"])
    return p


def _setup(cfg: Config, info: DistInfo) -> _Run:
    """The run of ``cfg`` (resumed from ``train.resume`` when set), its config saved in the output folder."""
    check_generation_cfg(cfg, "train", sampling=bool(cfg.train.final_eval))
    resume, ckpt = start_run(cfg, info, "generation")
    out = Path(cfg.output)
    if ckpt is not None:
        for change in check_resume(cfg, ckpt, info.world, resume):
            log(info, f"warning: train.force_resume=true: {change}")
    folder = claim_output(cfg, resume, ckpt)
    vae, in_channels, input_size = latent_space(cfg, info.device)
    data = build_datasets(cfg, int(cfg.data.channels), splits=("train",))
    classes = list(data["classes"])
    num_classes = int(cfg.model.num_classes or len(classes))
    if num_classes < len(classes):
        raise ConfigError(f"model.num_classes={num_classes} is below the {len(classes)} classes of the data")
    model, kwargs = build_generator(
        cfg, num_classes, in_channels, input_size, "" if ckpt else cfg.model.pretrained
    )
    transform = build_generation_transform(int(cfg.data.img_size), float(cfg.data.hflip))
    loader, wrapped, sampler = build_train_loader(data["train"], transform, cfg, info.rank, info.world)
    steps = epoch_steps(len(loader), int(cfg.train.accum_steps))
    opt = build_optimization(cfg, info, model, steps)
    ema = ModelEmaV3(model, decay=float(cfg.train.ema_decay)) if cfg.train.ema else None
    net = wrap_ddp(model, cfg, info)
    diffusion = build_diffusion(cfg, model.learn_sigma)
    run = _Run(
        cfg, info, model, net, ema, opt.optimizer, opt.scheduler, opt.scaler, opt.amp_dtype, diffusion, vae,
        loader, wrapped, sampler, steps, out, kwargs, classes, _Progress(),
    )  # fmt: skip
    space = (
        f"latent {in_channels}x{input_size}² (VAE {cfg.vae.path})"
        if vae
        else f"pixels {in_channels}x{input_size}²"
    )
    name, about = f"{cfg.model.name} ({model.mixer})", f"{num_classes} classes, {space}"
    log_setup(info, cfg, model, opt, ema, name, about, f"{len(data['train'])} images")
    open_run(folder, cfg, info, ckpt, resume, lambda: _restore(run, ckpt, resume))
    return run


def _add(acc: dict[str, float], terms: dict[str, float]) -> None:
    for k, v in terms.items():
        acc[k] = acc.get(k, 0.0) + v


def _train_epoch(run: _Run) -> None:
    cfg, info, p = run.cfg, run.info, run.progress
    accum, bs = int(cfg.train.accum_steps), int(cfg.data.batch_size)
    log_every = max(1, int(cfg.train.log_every))
    run.net.train()
    run.wrapped.set_epoch(p.epoch)
    run.sampler.set_epoch(p.epoch, start=p.batch_in_epoch * bs)
    desc = f"epoch {p.epoch + 1}/{cfg.train.epochs}"
    shown = info.is_main and bool(cfg.train.progress)
    bar = progress_bar(run.steps.batches, desc, shown, initial=p.batch_in_epoch)
    dev, diffusion = info.device, run.diffusion
    for b, (x, y) in enumerate(run.loader, start=p.batch_in_epoch):
        if b >= run.steps.batches:
            break
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        if run.vae is not None:
            x = run.vae.encode(x)
        t = diffusion.sample_timesteps(x.shape[0], dev)
        noise = torch.randn_like(x)
        x_t = diffusion.q_sample(x, t, noise)
        update = (b + 1) % accum == 0
        sync = run.net.no_sync() if info.distributed and not update else contextlib.nullcontext()
        with sync:
            with autocast(dev, run.amp_dtype):
                out = run.net(x_t, t, y)
            terms = diffusion.training_losses(out, x, x_t, t, noise)
            loss = terms["loss"].mean()
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"non-finite training loss {loss.item()} at step {p.global_step + 1} (epoch "
                    f"{p.epoch + 1}, "
                    f"batch {b + 1}): {divergence_advice(cfg.train.base_lr, cfg.train.clip_grad)}"
                )
            run.scaler.scale(loss / accum).backward()
        values = {k: float(v.detach().mean()) for k, v in terms.items()}
        _add(p.sums, values)
        _add(p.window, {**values, "n": 1.0})
        p.count += 1
        p.batch_in_epoch = b + 1
        bar.update(1)
        if update:
            optimizer_step(
                run.model,
                run.optimizer,
                run.scaler,
                cfg.train.clip_grad,
                run.scheduler,
                p,
                run.ema,
            )
            if p.global_step % log_every == 0:
                n = p.window.pop("n")
                p.curve.append({"step": p.global_step, **{k: v / n for k, v in p.window.items()}})
                p.window = {}
                if figures_due(p.global_step, int(cfg.train.log_every)):
                    bar.set_postfix(loss=f"{p.curve[-1]['loss']:.4f}")
            every = int(cfg.train.save_every_steps or 0)
            if every and p.global_step % every == 0 and p.batch_in_epoch < run.steps.batches:
                _save(run, "last.pt")
    bar.close()


def _plot(run: _Run) -> Path | None:
    curve = run.progress.curve
    lines = {k: [(c["step"], c[k]) for c in curve] for k in ("loss", "mse", "vb") if curve and k in curve[0]}
    return plot_series(
        {"training loss (per step)": lines}, run.out / "curves.png", "optimizer step", log_y=True
    )


def _finish_epoch(run: _Run, epoch_time: float, images: int) -> dict[str, Any]:
    p = run.progress
    row: dict[str, Any] = {"epoch": p.epoch + 1, "step": p.global_step}
    row.update({f"train_{k}": v / max(p.count, 1) for k, v in p.sums.items()})
    row.update(
        lr=max(g["lr"] for g in run.optimizer.param_groups),
        epoch_time_s=round(epoch_time, 3),
        img_per_s=round(images / max(epoch_time, 1e-9), 1),
    )
    p.history.append(row)
    p.epoch, p.batch_in_epoch, p.sums, p.count = p.epoch + 1, 0, {}, 0
    _save(run, "last.pt")
    if run.info.is_main:
        write_metrics(p.history, run.out)
        _plot(run)
        log_row(run.info, row)
    return row


def train(cfg: Config) -> dict[str, Any]:
    """Trains ``cfg`` (see the module docstring); returns the run summary (also ``<output>/summary.json``)."""
    return in_process_group(cfg, _train, hold_output=True)


def _train(cfg: Config, info: DistInfo) -> dict[str, Any]:
    start = time.perf_counter()
    run = _setup(cfg, info)
    p = run.progress
    run_epochs(run, p, run.steps.batches, lambda: _train_epoch(run), lambda s, n: _finish_epoch(run, s, n))
    summary: dict[str, Any] = run_summary(run.model, run.info.world, run.out, p.history)
    summary["train_time_s"] = round(time.perf_counter() - start, 1)
    if info.is_main:
        curves = _plot(run)
        summary["curves"] = str(curves) if curves else None
    if cfg.train.final_eval:
        model = run.ema.module if run.ema is not None and cfg.sample.use_ema else run.model
        summary["eval"] = sample_and_evaluate(
            cfg, model, run.diffusion, run.vae, run.classes, info, run.out / "samples", summary["last"]
        )
    summary["wall_time_s"] = round(time.perf_counter() - start, 1)
    if info.is_main:
        write_text(run.out / "summary.json", json.dumps(summary, indent=1), "summary")
        log(
            info,
            f"\ndone in {summary['wall_time_s']:.0f} s (training {summary['train_time_s']:.0f} s): final "
            "loss "
            f"{summary['final'].get('train_loss', float('nan')):.4f}\n  checkpoint: {summary['last']}\n"
            f"  curves:     {summary.get('curves')}\n  sample:     python eval.py --checkpoint "
            f"{summary['last']}",
        )
    return summary
