"""Class-conditional image generation (task ``generation``): DiT³ / DiT training (``train.py``) and sampling
with metrics (``eval.py``).

Training follows the official DiT³ recipe (LeapLabTHU/ViTTT ``dittt/train.py``, from DiT): uniform timesteps,
the diffusers forward process and the official objective (``vit3.tasks.diffusion``), AdamW, an EMA of the
weights updated every step, label dropout for classifier-free guidance. In latent space (``vae.path``: a local
``AutoencoderKL``) images are encoded with a posterior sample times the scaling factor; otherwise the model
works on pixels in ``[-1, 1]``. It reuses the classification engine's plumbing: the config system, the seeded,
resumable data pipeline (``vit3.data``), AdamW groups and the warmup + cosine schedule (``engine.optim``;
``min_lr = base_lr`` is the official constant lr), AMP with a GradScaler for fp16, grad clipping, gradient
accumulation, torchrun DDP, atomic checkpoints and exact resume (model, EMA, optimizer, scheduler, scaler,
every rank's RNG states, epoch, batch and step: a run killed after a checkpoint and resumed ends with the same
weights as an uninterrupted one; :mod:`vit3.engine.common`). Outputs in ``output``:
``config.yaml``, ``last.pt``, ``metrics.csv/json`` (per epoch), ``curves.png`` (loss, MSE and VB terms per
``train.log_every`` steps) and ``summary.json``; with ``train.final_eval`` also the samples and metrics.

Sampling (``sample``): ``sample.num_samples`` images with labels cycling through ``sample.classes`` (all
classes by default), sample ``i`` drawn from its own generator seeded ``sample.seed + i`` (so the result does
not depend on the batch size or the number of processes), with the ``ddpm`` / ``ddim`` / ``dpm++`` sampler,
``sample.steps`` steps and guidance ``sample.cfg_scale``. It writes ``samples.npz`` in the layout of the
reference evaluation suite (guided-diffusion's evaluator: ``arr_0`` uint8 ``[N, H, W, 3]``; grayscale is
repeated to 3 channels; ``labels`` beside it), ``grid.png`` and ``eval.json`` with the metrics of
``vit3.engine.generation_metrics`` that are asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from timm.utils import ModelEmaV3
from tqdm import tqdm

from ..data import build_datasets, build_train_loader
from ..data.generation import build_generation_transform, to_uint8
from ..models.dit3 import DiT3, create_dit3
from ..tasks.diffusion import GaussianDiffusion, LatentAutoencoder
from .checkpoint import load_model_weights, peek_vit3_checkpoint
from .common import (
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
from .distributed import DistInfo, barrier
from .metrics import plot_series, write_metrics
from .optim import build_optimizer, build_scheduler, scaled_lrs

__all__ = ["build_diffusion", "build_generator", "evaluate", "generate", "latent_space", "train"]


# ----------------------------------------------------------------------------------------- building blocks
def latent_space(cfg: Config, device: torch.device) -> tuple[LatentAutoencoder | None, int, int]:
    """The VAE (``None`` in pixel space), the model's input channels and its input size.

    Raises:
        FileNotFoundError: ``vae.path`` is set but does not exist.
        ConfigError: the image size is not a multiple of the VAE's downsampling, or the VAE's image channels
            are not ``data.channels``.
    """
    size, channels = int(cfg.data.img_size), int(cfg.data.channels)
    if not cfg.vae.path:
        return None, channels, size
    vae = LatentAutoencoder(cfg.vae.path, cfg.vae.scaling_factor, bool(cfg.vae.sample_posterior)).to(device)
    if size % vae.downsample:
        raise ConfigError(
            f"data.img_size={size} must be a multiple of the VAE's downsampling {vae.downsample}"
        )
    if vae.image_channels != channels:
        raise ConfigError(
            f"the VAE at {cfg.vae.path} encodes {vae.image_channels}-channel images, data.channels={channels}"
        )
    return vae, vae.latent_channels, size // vae.downsample


def _model_kwargs(cfg: Config, num_classes: int, in_channels: int, input_size: int) -> dict[str, Any]:
    """``create_dit3`` overrides of a run: ``model.kwargs`` plus what the data and the VAE decide."""
    kwargs = dict(cfg.model.kwargs or {})
    fixed = {"num_classes": num_classes, "in_channels": in_channels, "input_size": input_size}
    for key, value in fixed.items():
        if key in kwargs and kwargs[key] != value:
            where = "the VAE's latents" if key == "in_channels" and cfg.vae.path else "the data"
            raise ConfigError(
                f"model.kwargs.{key}={kwargs[key]} contradicts {where} ({key}={value}): remove it"
            )
    kwargs.update(fixed)
    kwargs.update(
        mixer=cfg.model.mixer,
        learn_sigma=bool(cfg.model.learn_sigma),
        class_dropout_prob=float(cfg.model.class_dropout_prob),
    )
    return kwargs


def build_generator(
    cfg: Config, num_classes: int, in_channels: int, input_size: int, pretrained: str = ""
) -> tuple[DiT3, dict[str, Any]]:
    """The DiT³ / DiT of ``cfg.model`` (weights from ``pretrained`` when given); returns it and its kwargs."""
    kwargs = _model_kwargs(cfg, num_classes, in_channels, input_size)
    return create_dit3(cfg.model.name, checkpoint_path=pretrained or None, **kwargs), kwargs


def build_diffusion(cfg: Config, learn_sigma: bool) -> GaussianDiffusion:
    d = cfg.diffusion
    return GaussianDiffusion(
        int(d.num_timesteps), d.beta_schedule, float(d.beta_start), float(d.beta_end), learn_sigma
    )


def _check_cfg(cfg: Config, mode: str, sampling: bool) -> None:
    check_config(cfg, mode)  # the config may have been changed in code since it was loaded
    s = cfg.sample
    if sampling and float(s.cfg_scale) != 1.0 and float(cfg.model.class_dropout_prob) <= 0:
        raise ConfigError(
            f"sample.cfg_scale={float(s.cfg_scale)} needs the null class, but model.class_dropout_prob=0 trains none: "
            f"set sample.cfg_scale=1 or model.class_dropout_prob > 0"
        )


# ---------------------------------------------------------------------------------------------- training
@dataclass
class _Progress(Progress):
    """The counters of :class:`~vit3.engine.common.Progress` plus the loss terms, history and curve."""

    sums: dict[str, float] = field(default_factory=dict)  # running loss terms of the partial epoch
    count: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per epoch
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
    batches_per_epoch: int
    out: Path
    model_kwargs: dict[str, Any]
    classes: list[str]
    progress: _Progress


def _state(run: _Run) -> dict[str, Any]:
    """The checkpoint dict (:func:`~vit3.engine.common.save_state` adds the RNG states)."""
    p = run.progress
    return {
        "task": "generation",
        "model_name": run.cfg.model.name,
        "model_kwargs": to_plain(run.model_kwargs),
        "num_classes": run.model.num_classes,
        "classes": list(run.classes),
        **run.training_state(),
        **p.counters(),
        "epoch_loss": {"sums": dict(p.sums), "count": p.count, "window": dict(p.window)},
        "history": p.history,
        "curve": p.curve,
        "config": run.cfg.to_dict(),
        "meta": run_metadata(),
    }


def _save(run: _Run, name: str) -> Path:
    return save_state(lambda: _state(run), run.out / name, run.info)


def _restore(run: _Run, ckpt: dict[str, Any], source: str) -> None:
    run.load_training_state(ckpt, source)
    p, loss = run.progress, ckpt["epoch_loss"]
    p.restore(ckpt, run.cfg.data.batch_size, run.info.world, int(run.cfg.train.accum_steps))
    p.sums, p.count, p.window = dict(loss["sums"]), int(loss["count"]), dict(loss["window"])
    p.history, p.curve = list(ckpt["history"]), list(ckpt["curve"])
    p.roll_over(run.batches_per_epoch)


def _setup(cfg: Config, info: DistInfo) -> _Run:
    """The run of ``cfg`` (resumed from ``train.resume`` when set), its config saved in the output folder."""
    _check_cfg(cfg, "train", sampling=bool(cfg.train.final_eval))
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
    accum, bs = int(cfg.train.accum_steps), int(cfg.data.batch_size)
    batches_per_epoch = sampler.num_samples // bs // accum * accum
    if batches_per_epoch == 0:
        raise ConfigError(
            f"train.accum_steps={accum} exceeds the {sampler.num_samples // bs} batches per epoch"
        )

    model.to(info.device)
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    total_batch = bs * info.world * accum
    lrs = scaled_lrs(cfg.train, total_batch)
    optimizer = build_optimizer(model, cfg.train, lrs["base_lr"])
    scheduler = build_scheduler(optimizer, cfg.train, lrs, batches_per_epoch // accum)
    amp = amp_dtype(cfg.train.amp, info.device)
    scaler = torch.amp.GradScaler(info.device.type, enabled=amp == torch.float16)
    ema = ModelEmaV3(model, decay=float(cfg.train.ema_decay)) if cfg.train.ema else None
    net = wrap_ddp(model, cfg, info)
    diffusion = build_diffusion(cfg, model.learn_sigma)
    run = _Run(
        cfg, info, model, net, ema, optimizer, scheduler, scaler, amp, diffusion, vae, loader, wrapped,
        sampler, batches_per_epoch, out, kwargs, classes, _Progress(),
    )  # fmt: skip
    space = (
        f"latent {in_channels}x{input_size}² (VAE {cfg.vae.path})"
        if vae
        else f"pixels {in_channels}x{input_size}²"
    )
    log(
        info,
        f"model {cfg.model.name} ({model.mixer}): {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{num_classes} classes, {space} | data: {len(data['train'])} images | {info.world} process(es) on "
        f"{info.device}, total batch {total_batch}, lr {lrs['base_lr']:.3g} | amp {amp} | "
        f"ema {'on' if ema else 'off'}",
    )
    if ckpt is not None:
        _restore(run, ckpt, resume)
        p = run.progress
        log(
            info,
            f"resumed from {resume}: epoch {p.epoch + 1}, batch {p.batch_in_epoch}, step {p.global_step}",
        )
    open_output(folder, cfg, info)
    if ckpt is not None:
        restore_rng(ckpt, info)  # last: building the run drew on the RNGs
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
    bar = tqdm(
        total=run.batches_per_epoch, initial=p.batch_in_epoch, desc=f"epoch {p.epoch + 1}/{cfg.train.epochs}",
        disable=not (info.is_main and cfg.train.progress), dynamic_ncols=True, leave=False, file=sys.stdout,
    )  # fmt: skip
    dev, diffusion = info.device, run.diffusion
    for b, (x, y) in enumerate(run.loader, start=p.batch_in_epoch):
        if b >= run.batches_per_epoch:
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
                raise FloatingPointError(
                    f"non-finite training loss {loss.item()} at epoch {p.epoch + 1}, batch {b}"
                )
            run.scaler.scale(loss / accum).backward()
        values = {k: float(v.detach().mean()) for k, v in terms.items()}
        _add(p.sums, values)
        _add(p.window, {**values, "n": 1.0})
        p.count += 1
        p.batch_in_epoch = b + 1
        if update:
            optimizer_step(
                run.model,
                run.optimizer,
                run.scaler,
                cfg.train.clip_grad,
                run.scheduler,
                p.global_step,
                run.ema,
            )
            p.global_step += 1
            if p.global_step % log_every == 0:
                n = p.window.pop("n")
                p.curve.append({"step": p.global_step, **{k: v / n for k, v in p.window.items()}})
                p.window = {}
                bar.set_postfix(loss=f"{p.curve[-1]['loss']:.4f}")
            every = int(cfg.train.save_every_steps or 0)
            if every and p.global_step % every == 0 and p.batch_in_epoch < run.batches_per_epoch:
                _save(run, "last.pt")
        bar.update(1)
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
    return in_process_group(cfg, _train)


def _train(cfg: Config, info: DistInfo) -> dict[str, Any]:
    start = time.perf_counter()
    run = _setup(cfg, info)
    p = run.progress
    run_epochs(
        run, p, run.batches_per_epoch, lambda: _train_epoch(run), lambda s, n: _finish_epoch(run, s, n)
    )
    summary: dict[str, Any] = run_summary(run, run.out, p.history)
    summary["train_time_s"] = round(time.perf_counter() - start, 1)
    if info.is_main:
        curves = _plot(run)
        summary["curves"] = str(curves) if curves else None
    if cfg.train.final_eval:
        model = run.ema.module if run.ema is not None else run.model
        summary["eval"] = sample_and_evaluate(
            cfg, model, run.diffusion, run.vae, run.classes, info, run.out / "samples"
        )
    summary["wall_time_s"] = round(time.perf_counter() - start, 1)
    if info.is_main:
        (run.out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        log(
            info,
            f"\ndone in {summary['wall_time_s']:.0f} s (training {summary['train_time_s']:.0f} s): final loss "
            f"{summary['final'].get('train_loss', float('nan')):.4f}\n  checkpoint: {summary['last']}\n"
            f"  curves:     {summary.get('curves')}\n  sample:     python eval.py --checkpoint {summary['last']}",
        )
    return summary


# ---------------------------------------------------------------------------------------------- sampling
def _labels(cfg: Config, num_classes: int) -> np.ndarray:
    """Labels of the ``sample.num_samples`` images: ``sample.classes`` (default all) cycled."""
    n = int(cfg.sample.num_samples)
    if n < 1:
        raise ConfigError(f"sample.num_samples must be >= 1, got {n}")
    classes = list(cfg.sample.classes) if cfg.sample.get("classes") is not None else list(range(num_classes))
    bad = [c for c in classes if not (isinstance(c, int) and 0 <= c < num_classes)]
    if bad or not classes:
        raise ConfigError(f"sample.classes must be class indices in [0, {num_classes - 1}], got {classes}")
    return np.asarray([classes[i % len(classes)] for i in range(n)], dtype=np.int64)


@torch.no_grad()
def generate(
    model: DiT3,
    diffusion: GaussianDiffusion,
    vae: LatentAutoencoder | None,
    labels: np.ndarray,
    seeds: np.ndarray,
    shape: tuple[int, int, int],
    cfg: Config,
    progress: bool = False,
) -> np.ndarray:
    """Images for ``labels`` (sample ``i`` from a generator seeded ``seeds[i]``) as uint8 ``[N, H, W, C]``.

    ``shape`` is the model's ``(C, H, W)``; ``cfg.sample`` gives the sampler, steps, guidance, batch size
    and autocast dtype.
    """
    s = cfg.sample
    device = next(model.parameters()).device
    amp = amp_dtype(s.amp, device, "sample.amp")
    out = []
    bs = max(1, int(s.batch_size))
    for i in tqdm(
        range(0, len(labels), bs), disable=not progress, desc="sampling", leave=False, file=sys.stdout
    ):
        gens = [torch.Generator().manual_seed(int(seed)) for seed in seeds[i : i + bs]]
        with autocast(device, amp):
            z = diffusion.sample(
                model,
                torch.as_tensor(labels[i : i + bs]),
                shape,
                sampler=s.sampler,
                steps=int(s.steps),
                cfg_scale=float(s.cfg_scale),
                generator=gens,
                guided_channels=s.guided_channels,
            )
        x = vae.decode(z.float()) if vae is not None else z
        out.append(to_uint8(x).numpy())
    return np.concatenate(out) if out else np.zeros((0, shape[1], shape[2], shape[0]), np.uint8)


def _save_grid(images: np.ndarray, num_classes: int, path: Path) -> Path:
    from torchvision.utils import save_image

    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0  # [N, C, H, W] in [0, 1]
    save_image(x, path, nrow=min(10, num_classes), padding=2, pad_value=1.0)
    return path


def _reference_images(cfg: Config, batch: int):
    """Batches of real uint8 images ``[n, H, W, C]`` for FID: ``metrics.reference`` (.npz) or the val split."""
    ref = cfg.metrics.reference
    if ref:
        if not Path(ref).is_file():
            raise FileNotFoundError(f"metrics.reference not found: {ref}")
        arr = np.load(ref)["arr_0"]
        for i in range(0, len(arr), batch):
            yield arr[i : i + batch]
        return
    from ..data.generation import adm_center_crop

    data = build_datasets(cfg, int(cfg.data.channels), splits=("val",))["val"]
    size, chunk = int(cfg.data.img_size), []
    for i in range(len(data)):
        img = data[i][0]
        img = img if img.size == (size, size) else adm_center_crop(img, size)
        arr = np.asarray(img)
        chunk.append(arr[..., None] if arr.ndim == 2 else arr)
        if len(chunk) == batch:
            yield np.stack(chunk)
            chunk = []
    if chunk:
        yield np.stack(chunk)


def sample_and_evaluate(
    cfg: Config,
    model: DiT3,
    diffusion: GaussianDiffusion,
    vae: LatentAutoencoder | None,
    classes: list[str] | None,
    info: DistInfo,
    out_dir: Path,
    source: str = "",
) -> dict[str, Any]:
    """Samples ``sample.num_samples`` images (sharded over the processes), writes ``samples.npz``,
    ``grid.png`` and ``eval.json`` in ``out_dir`` (rank 0) and returns the report."""
    from .generation_metrics import classifier_metrics, inception_metrics, resolve_classifier

    out_dir = Path(out_dir)
    s, m = cfg.sample, cfg.metrics
    if float(s.cfg_scale) != 1.0 and not model.has_null_class:
        raise ConfigError(
            f"sample.cfg_scale={float(s.cfg_scale)} needs the null class, but this model has none (trained with "
            f"class_dropout_prob=0): pass --cfg-scale 1"
        )
    labels = _labels(cfg, model.num_classes)
    seeds = int(s.seed) + np.arange(len(labels))
    mine = np.arange(info.rank, len(labels), info.world)
    size = int(cfg.data.img_size) // (vae.downsample if vae is not None else 1)
    shape = (model.in_channels, size, size)
    classifier = resolve_classifier(m.classifier) if m.classifier else None  # may train it: before sampling
    tick = time.perf_counter()
    images = generate(model, diffusion, vae, labels[mine], seeds[mine], shape, cfg, progress=info.is_main)
    sample_time = time.perf_counter() - tick
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    if info.distributed:
        np.save(out_dir / f".shard{info.rank}.npy", images)
        barrier()
    report: dict[str, Any] = {}
    if info.is_main:
        if info.distributed:
            shards = [np.load(out_dir / f".shard{r}.npy") for r in range(info.world)]
            images = np.empty((len(labels), *shards[0].shape[1:]), np.uint8)
            for r, shard in enumerate(shards):
                images[r :: info.world] = shard
                (out_dir / f".shard{r}.npy").unlink()
        rgb = np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images
        npz = out_dir / "samples.npz"
        tmp = out_dir / ".samples.tmp.npz"
        np.savez(tmp, arr_0=rgb, labels=labels)
        os.replace(tmp, npz)
        grid = _save_grid(images[: int(s.grid)], model.num_classes, out_dir / "grid.png")
        report = {
            "checkpoint": source,
            "model": cfg.model.name,
            "mixer": model.mixer,
            "sampler": s.sampler,
            "steps": int(s.steps),
            "cfg_scale": float(s.cfg_scale),
            "num_samples": len(labels),
            "seed": int(s.seed),
            "classes": classes,
            "sample_time_s": round(sample_time, 1),
            "processes": info.world,
            "npz": str(npz),
            "grid": str(grid),
        }
        if classifier is not None:
            report.update(
                classifier_metrics(
                    images,
                    labels,
                    classifier,
                    int(m.batch_size),
                    info.device,
                    int(m.floor_draws),
                    int(s.seed),
                )
            )
        if m.fid:
            report.update(
                inception_metrics(
                    images,
                    _reference_images(cfg, int(m.batch_size)),
                    m.inception_weights,
                    int(m.batch_size),
                    info.device,
                )
            )
        path = Path(cfg.eval.json) if cfg.eval.get("json") else out_dir / "eval.json"
        path.write_text(json.dumps(report, indent=1), encoding="utf-8")
        report["json"] = str(path)
        shown = {k: v for k, v in report.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        log(info, "generation: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))
        if report.get("fid_note"):
            log(info, report["fid_note"])
        log(info, f"  samples: {npz}\n  grid:    {grid}\n  report:  {path}")
    barrier()
    return report


# -------------------------------------------------------------------------------------------- evaluation
def _default_out(cfg: Config, path: str) -> Path:
    s = cfg.sample
    name = (
        f"samples_{s.sampler}{int(s.steps)}_cfg{float(s.cfg_scale):g}_n{int(s.num_samples)}_seed{int(s.seed)}"
    )
    return Path(s.out) if s.out else Path(path).parent / name


def evaluate(cfg: Config) -> dict[str, Any]:
    """Samples from ``eval.checkpoint`` (a vit3 generation checkpoint or an official DiT³ file with
    ``model.name`` set) and evaluates the samples (see the module docstring); returns the report."""
    return in_process_group(cfg, _evaluate)


def _evaluate(cfg: Config, info: DistInfo) -> dict[str, Any]:
    _check_cfg(cfg, "eval", sampling=False)  # the model itself says whether it has the null class
    set_threads(cfg)
    path = str(cfg.eval.checkpoint)
    if not path:
        raise ConfigError("eval.checkpoint is empty: pass --checkpoint FILE")
    vae, in_channels, input_size = latent_space(cfg, info.device)
    ckpt = peek_vit3_checkpoint(path)
    classes = None
    if ckpt is not None:
        if ckpt.get("task") != "generation":
            raise ConfigError(
                f"{path} is a {ckpt.get('task', 'classification')} checkpoint, not a generation one"
            )
        kwargs = dict(ckpt["model_kwargs"])
        if kwargs["in_channels"] != in_channels:
            raise ConfigError(
                f"{path} was trained on {kwargs['in_channels']}-channel inputs; this config gives {in_channels} "
                f"({'VAE latents' if vae else 'pixels'})"
            )
        model = create_dit3(ckpt["model_name"], **kwargs)
        use_ema = bool(cfg.sample.use_ema) and ckpt.get("ema") is not None
        if cfg.sample.use_ema and not use_ema:
            log(info, f"note: {path} holds no EMA weights; sampling with the model weights")
        load_model_weights(model, ckpt, use_ema=use_ema, source=path)
        classes = ckpt.get("classes")
    else:  # an official DiTTT file (bare state dict or training checkpoint): the config names the model
        num_classes = cfg.model.num_classes
        if not num_classes:
            raise ConfigError(
                f"{path} is not a vit3 checkpoint: set model.num_classes (1000 for ImageNet) and --model"
            )
        model, _ = build_generator(cfg, int(num_classes), in_channels, input_size, path)
    model.to(info.device).eval()
    diffusion = build_diffusion(cfg, model.learn_sigma)
    return sample_and_evaluate(cfg, model, diffusion, vae, classes, info, _default_out(cfg, path), path)
