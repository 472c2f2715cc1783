"""Evaluation of a classifier (``eval.py`` for task ``classification``): a vit3 checkpoint or an official
ViTTT file on the val split at each of ``eval.img_sizes``, with throughput, peak memory and FLOPs."""

from __future__ import annotations

import json
import resource
import time
import warnings
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from ..data import build_datasets, build_transform, build_val_loader
from ..errors import DataError
from ..kernels.flops import fvcore_handles
from ..models.record import model_record, peek_vit3_checkpoint
from ..outputs import write_text
from .checkpoint import apply_model_record, eval_report_path, load_model_weights
from .classification_model import (
    build_model,
    data_stats,
    input_channels,
    official_eval_classes,
    resolve_data_cfg,
    validate,
)
from .config import Config, ConfigError, check_config, check_input_size, key_name
from .distributed import DistInfo, log
from .process import amp_dtype, autocast, set_threads
from .run_folder import in_process_group

__all__ = ["evaluate"]


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
        analysis = FlopCountAnalysis(model, x[:1]).set_op_handle(**fvcore_handles())
        analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        return float(analysis.total())


def evaluate(cfg: Config) -> dict[str, Any]:
    """Evaluates ``cfg.eval.checkpoint`` on the val split at each of ``cfg.eval.img_sizes``.

    Returns (and writes as JSON): params, and per resolution top-1/top-5/loss, the images counted and those
    skipped as corrupt (``data.corrupt_images=skip``), images/s, peak memory and fvcore FLOPs (per image).
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
        # The checkpoint's model (an explicit --model / model.kwargs wins, with a warning); labels by class
        # name.
        record = model_record(ckpt)
        apply_model_record(cfg, record, path)
        num_classes, classes = int(record["num_classes"]), record["classes"]
        data = build_datasets(
            cfg,
            input_channels(cfg),
            splits=("val",),
            classes=classes,
            classes_from=f"the model of {path}",
            min_classes=2,
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
            cfg,
            input_channels(cfg),
            splits=("val",),
            classes=official_eval_classes(cfg, num_classes, path),
            min_classes=2,
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
        x = next(batch for batch in loader if batch is not None)[0].to(info.device)
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
        "data": {"dataset": cfg.data.dataset, "path": str(cfg.data.path or "")},
        "model": name,
        "weights": "ema" if cfg.eval.use_ema else "model",
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "device": str(info.device),
        "amp": str(amp),
        "results": results,
    }
    out = Path(cfg.eval.json) if cfg.eval.json else eval_report_path(path, ckpt, cfg)
    if info.is_main:
        write_text(out, json.dumps(report, indent=1), "report")
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
        if results[0]["skipped"]:
            log(
                info,
                f"over {results[0]['images']} images: {results[0]['skipped']} corrupt image file(s) skipped "
                f"(data.corrupt_images=skip) are left out",
            )
        log(info, f"wrote {out}")
    report["json"] = str(out)
    return report
