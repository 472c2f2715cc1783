"""The generator of the generation engine and sampling from it: the DiT³ / DiT and its diffusion built from
the config (in the VAE's latent space or on pixels), ``sample.num_samples`` images drawn with per-sample
seeds, the files in the reference evaluation suite's layout and their metrics (``eval.py`` for task
``generation``; :mod:`vit3.engine.generation` trains, and samples at the end of a run with
``train.final_eval``). See :mod:`vit3.engine.generation` for the sampling settings and the files written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data import build_datasets
from ..data.generation import to_uint8
from ..models.dit3 import DiT3, create_dit3
from ..models.record import peek_vit3_checkpoint
from ..outputs import atomic_write, write_text
from ..tasks.diffusion import GaussianDiffusion, LatentAutoencoder
from .bars import progress_iter
from .checkpoint import load_model_weights
from .config import Config, ConfigError, check_config, model_arguments
from .distributed import DistInfo, barrier, log
from .process import amp_dtype, autocast, set_threads
from .run_folder import in_process_group

__all__ = [
    "build_diffusion",
    "build_generator",
    "check_generation_cfg",
    "evaluate",
    "generate",
    "latent_space",
    "sample_and_evaluate",
]


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
    with model_arguments(cfg.model.name, cfg.model.kwargs or {}):
        return create_dit3(cfg.model.name, checkpoint_path=pretrained or None, **kwargs), kwargs


def build_diffusion(cfg: Config, learn_sigma: bool) -> GaussianDiffusion:
    """The diffusion of ``cfg.diffusion`` (``learn_sigma``: the model outputs ``[eps, v]``)."""
    d = cfg.diffusion
    return GaussianDiffusion(
        int(d.num_timesteps), d.beta_schedule, float(d.beta_start), float(d.beta_end), learn_sigma
    )


def check_generation_cfg(cfg: Config, mode: str, sampling: bool) -> None:
    """Checks ``cfg`` for a run of ``mode``; ``sampling``: the run samples (guidance needs the null class)."""
    check_config(cfg, mode)  # the config may have been changed in code since it was loaded
    s = cfg.sample
    if sampling and float(s.cfg_scale) != 1.0 and float(cfg.model.class_dropout_prob) <= 0:
        raise ConfigError(
            f"sample.cfg_scale={float(s.cfg_scale)} needs the null class, but model.class_dropout_prob=0 "
            "trains none: "
            f"set sample.cfg_scale=1 or model.class_dropout_prob > 0"
        )


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
    for i in progress_iter(range(0, len(labels), bs), "sampling", progress):
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
    with atomic_write(path, "sample grid") as f:
        save_image(x, f, format="png", nrow=min(10, num_classes), padding=2, pad_value=1.0)
    return path


def _reference_images(cfg: Config, batch: int):
    """Batches of real uint8 images ``[n, H, W, C]`` for FID: ``metrics.reference`` (.npz) or the val
    split."""
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
            f"sample.cfg_scale={float(s.cfg_scale)} needs the null class, but this model has none (trained "
            "with "
            f"class_dropout_prob=0): pass --cfg-scale 1"
        )
    labels = _labels(cfg, model.num_classes)
    seeds = int(s.seed) + np.arange(len(labels))
    mine = np.arange(info.rank, len(labels), info.world)
    size = int(cfg.data.img_size) // (vae.downsample if vae is not None else 1)
    shape = (model.in_channels, size, size)
    classifier = resolve_classifier(m.classifier) if m.classifier else None  # may train it: before sampling
    tick = time.perf_counter()
    shown = info.is_main and bool(cfg.train.get("progress", True))
    images = generate(model, diffusion, vae, labels[mine], seeds[mine], shape, cfg, progress=shown)
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
        with atomic_write(npz, "samples") as f:
            np.savez(f, arr_0=rgb, labels=labels)
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
            "sampled_classes": None if s.get("classes") is None else list(s.classes),
            "guided_channels": s.get("guided_channels"),
            "amp": str(s.get("amp", "none")),
            "use_ema": bool(s.get("use_ema", True)),
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
        write_text(path, json.dumps(report, indent=1), "report")
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
    """``sample.out``, else a folder beside the checkpoint named after every setting the samples depend on
    (the defaults' names unchanged: other classes, guided channels, autocast and the raw weights added)."""
    s = cfg.sample
    name = (
        f"samples_{s.sampler}{int(s.steps)}_cfg{float(s.cfg_scale):g}_n{int(s.num_samples)}_seed{int(s.seed)}"
    )
    if s.get("classes") is not None:
        name += "_classes" + "-".join(str(c) for c in s.classes)
    if s.get("guided_channels") is not None:
        name += f"_guided{int(s.guided_channels)}"
    if str(s.get("amp", "none")) != "none":
        name += f"_{s.amp}"
    if not s.get("use_ema", True):
        name += "_raw"
    return Path(s.out) if s.out else Path(path).parent / name


def evaluate(cfg: Config) -> dict[str, Any]:
    """Samples from ``eval.checkpoint`` (a vit3 generation checkpoint or an official DiT³ file with
    ``model.name`` set) and evaluates the samples (see the module docstring); returns the report."""
    return in_process_group(cfg, _evaluate)


def _evaluate(cfg: Config, info: DistInfo) -> dict[str, Any]:
    check_generation_cfg(cfg, "eval", sampling=False)  # the model itself says whether it has the null class
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
                f"{path} was trained on {kwargs['in_channels']}-channel inputs; this config gives "
                f"{in_channels} "
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
