"""How a run's processes compute: threads, seeds, AMP, ``torch.compile``, DDP and the ranks' agreement.

:func:`amp_dtype` resolves ``train.amp`` (``auto``: bf16 on a CUDA device that supports it, else float32) and
:func:`autocast` enters it; :func:`wrap_ddp` compiles and wraps the model; :func:`check_ranks_agree` compares
the SHA-1 of every rank's weights at the end of a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import warnings

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import Config, ConfigError, config_value
from .distributed import DistInfo, all_gather_objects

__all__ = [
    "AMP_MODES",
    "COMPILE_MODES",
    "amp_dtype",
    "autocast",
    "check_ranks_agree",
    "compile_mode",
    "cpu_has_bf16_units",
    "param_digest",
    "seed_process",
    "set_threads",
    "wrap_ddp",
]


AMP_MODES = ("auto", "none", "bf16", "fp16")


COMPILE_MODES = ("none", "auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def set_threads(cfg: Config) -> None:
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))


def seed_process(cfg: Config, info: DistInfo) -> None:
    """Seeds python, numpy and torch with ``seed + rank``; ``deterministic`` selects deterministic kernels."""
    torch.manual_seed(cfg.seed + info.rank)
    random.seed(cfg.seed + info.rank)
    np.random.seed(cfg.seed + info.rank)  # noqa: NPY002  (timm Mixup draws on the global numpy RNG)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = not cfg.deterministic


def amp_dtype(mode: str, device: torch.device, key: str = "train.amp") -> torch.dtype | None:
    """The autocast dtype of an AMP setting (``None``: float32).

    ``auto`` is bf16 on a CUDA device that supports it and float32 elsewhere; ``fp16`` goes with a GradScaler
    (on a CPU it runs, with a warning: CPUs compute float16 many times slower than float32); ``bf16`` on a CPU
    without bfloat16 matrix instructions (:func:`cpu_has_bf16_units`) runs too, with a warning alike.

    Raises:
        ConfigError: ``mode`` is not one of :data:`AMP_MODES` (the message names ``key``).
    """
    if mode not in AMP_MODES:
        raise ConfigError(f"{key} must be one of {', '.join(AMP_MODES)}, got '{mode}'")
    if mode == "fp16" and device.type == "cpu":
        warnings.warn(
            f"{key}=fp16 on the CPU: float16 autocast runs many times slower there than float32 (CPUs have "
            f"no fast float16 matrix units); {key}=none runs float32",
            stacklevel=2,
        )
    if mode == "bf16" and device.type == "cpu" and not cpu_has_bf16_units():
        warnings.warn(
            f"{key}=bf16 on the CPU: this CPU has no bfloat16 matrix instructions (AVX512-BF16 or AMX), "
            f"where bfloat16 autocast runs many times slower than float32; {key}=none runs float32",
            stacklevel=2,
        )
    if mode == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def cpu_has_bf16_units() -> bool:
    """Whether this CPU computes bfloat16 matrix products in hardware (AVX512-BF16 or AMX tiles, as torch
    detects them), where bfloat16 autocast pays off; without them it runs many times slower than float32."""
    detectors = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in detectors)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in ``dtype``, or a no-op for float32 (``dtype=None``)."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def compile_mode(mode: str, device: torch.device) -> str | None:
    """The ``torch.compile`` mode of ``train.compile`` on ``device``, ``None`` for eager (``"none"``);
    ``"auto"`` is ``"reduce-overhead"`` (the whole step replayed as CUDA graphs) on CUDA and eager
    elsewhere: on a CPU the compiled step is slower than the eager one, which runs whole blocks as C++ ops
    (docs/training.md). A mode named explicitly is compiled on every device."""
    if mode == "none":
        return None
    if mode == "auto":
        return "reduce-overhead" if device.type == "cuda" else None
    return mode


def wrap_ddp(model: nn.Module, cfg: Config, info: DistInfo) -> nn.Module:
    """``model`` as a training step calls it: compiled whole when ``train.compile`` asks (the checkpoints keep
    saving ``model`` itself), in DistributedDataParallel when the run has several processes."""
    net = model
    if info.distributed:
        dev_ids = [info.device.index] if info.device.type == "cuda" else None
        net = DistributedDataParallel(
            model, device_ids=dev_ids, find_unused_parameters=cfg.dist.find_unused_parameters
        )
    mode = compile_mode(str(config_value(cfg, "train.compile", "none")), info.device)
    return net if mode is None else torch.compile(net, mode=mode)


def param_digest(model: nn.Module) -> str:
    """SHA-1 of all parameters, sorted by name (not buffers: DDP broadcasts rank 0's BatchNorm statistics at
    each forward, so after the last step the other ranks' running statistics legitimately differ)."""
    h = hashlib.sha1()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def check_ranks_agree(model: nn.Module) -> list[str]:
    """Every rank's :func:`param_digest` (collective), in rank order.

    Raises:
        RuntimeError: the ranks' weights differ (naming the ranks that differ from rank 0).
    """
    digests = all_gather_objects(param_digest(model))
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(f"DDP ranks {differ} disagree with rank 0 on the final weights: {digests}")
    return digests
