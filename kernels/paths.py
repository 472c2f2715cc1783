"""What the fused paths of the ops share: the checks of their ``supports`` and the inner loop's dtype.

Every fused path (Triton, C++, eager) implements one full-batch step of the bare inner model at a fixed
learning rate (:func:`bare_why`, :func:`one_step_why`); the eager paths and the C++ kernel inside them run the
dot loss; traced code takes no eager path, and the C++ kernel only under ``torch.compile``, as the mixer op
(:func:`eager_supports`, :func:`cpu_supports`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpp
from .ops import Branch, Inputs, Settings

__all__ = [
    "FEW_TOKENS",
    "MIN_CPU_KERNEL_TOKENS",
    "bare_why",
    "compute_inputs",
    "cpu_supports",
    "eager_supports",
    "one_step_why",
]

# Fewer tokens per head than this and auto keeps the tiled eager path on CPUs: it folds the problems of all
# samples into one tile, where the C++ kernel groups the heads of each sample into batched matmuls and pays
# a few ATen calls per sample (the timings behind the threshold: docs/design/kernels.md).
MIN_CPU_KERNEL_TOKENS = 32
# The token-count class (``Inputs.tokens``) below it.
FEW_TOKENS = f"N<{MIN_CPU_KERNEL_TOKENS}"


def bare_why(branch: Branch) -> str:
    """Why a fused path cannot run ``branch`` (``""`` when it can): they implement the bare inner models."""
    if branch.plain:
        return ""
    return "inner_norm / inner_bias wrap the inner model: the fused paths implement the bare models"


def one_step_why(cfg: Settings) -> str:
    """Why a fused path cannot run ``cfg``'s inner loop (``""`` if it can): one full-batch step, fixed lr."""
    if cfg.steps != 1:
        return f"steps={cfg.steps}: fused paths take one inner step"
    if cfg.mini_batches != 1:
        return f"mini_batches={cfg.mini_batches}: fused paths take one full-batch step"
    if cfg.lr_mode != "fixed":
        return f"lr_mode={cfg.lr_mode!r}: per-token lr gates are not fused"
    return ""


def _eager_why(branch: Branch, cfg: Settings) -> str:
    """Why the fused eager path (and the CPU kernel inside it) cannot serve ``branch``, ``""`` when it can."""
    if why := bare_why(branch):
        return why
    if cfg.loss != "dot":
        return f"loss {cfg.loss!r} is not fused (the eager path runs the dot loss)"
    return one_step_why(cfg)


def eager_supports(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    """The ``supports`` of an op's eager path (PyTorch ops in the fused node): untraced code only."""
    why = _eager_why(branch, cfg) or ("tracing/compiling: traceable ops serve" if x.tracing else "")
    return not why, why


def cpu_supports(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    """The ``supports`` of an op's C++ path (the C++ CPU kernel in the fused node): eager code, and under
    ``torch.compile`` as the mixer op, where the kernel has been built (compiled code runs unguarded: a build
    that failed there could not step aside)."""
    if why := _eager_why(branch, cfg):
        return False, why
    if x.device.type != "cpu":
        return False, f"{x.device.type} tensors: the C++ kernel runs CPU tensors"
    if x.tracing and x.tracing != "compile":
        return False, "jit tracing, ONNX or torch.export: portable ops serve"
    if x.tracing:
        built, why = cpp.load()
        if built is None:
            return False, f"the C++ kernel could not be built ({why}); compiled code cannot step aside"
    return True, ""


def compute_inputs(
    q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor]
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """q, k, v and the weights in the inner loop's dtype: float32 at least (bf16/fp16 inner gradients are
    too coarse)."""
    ct = torch.promote_types(q.dtype, torch.float32)
    return q.to(ct), k.to(ct), v.to(ct), {name: p.to(ct) for name, p in params.items()}
