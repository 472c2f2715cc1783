"""The backend interface: what a backend sees of a branch and its call, what it computes, and ``Backend``.

``Branch``, ``Settings`` and ``Inputs`` are all that a backend's ``supports`` may read (every field is in the
plan key, ``plan.BranchKey``); ``Step`` is what its ``run`` computes; ``token_class`` is the token-count rule
the key holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..inner import InnerModel

# Fewer tokens per head than this and auto keeps the tiled eager path on CPUs: it folds the problems of all
# samples into one tile, where the C++ kernel groups the heads of each sample into batched matmuls and pays
# a few ATen calls per sample (measured fwd+bwd, one thread: the kernel is 0.58x / 0.72x the tiled path at
# 4 / 16 tokens with B*H = 256, on par at 49 tokens with B*H = 1024, 1.1-1.6x at 16-64 tokens with
# B*H = 32 and from 196 tokens on).
MIN_CPU_KERNEL_TOKENS = 32


class Branch(NamedTuple):
    """A mixer branch as a backend sees it."""

    index: int
    name: str  # inner model
    heads: int
    head_dim: int
    plain: (
        bool  # the bare inner model: no ``inner_norm`` wrapper, no ``inner_bias`` (all the fused paths take)
    )


class Settings(NamedTuple):
    """The ``TTTConfig`` fields a backend's ``supports`` may read (all of them are in the plan key)."""

    loss: str
    steps: int
    mini_batches: int
    lr_mode: str


class Inputs(NamedTuple):
    """What a backend's ``supports`` may read of the mixer input x (all of it is in the plan key)."""

    device: torch.device
    dtype: torch.dtype  # of the qkv projection output, what the backends read
    tokens: str  # token-count class (``token_class``): "N<32", "N>=32", or "any N" under tracing
    grad: bool  # gradients flow through the mixer
    tracing: str  # "", "compile" (torch.compile / torch.export) or "trace" (jit.trace, ONNX export)


class Step(NamedTuple):
    """What a backend's ``run`` computes: one branch's inner loop and read-out."""

    name: str
    model: InnerModel
    grid: tuple[int, int]
    scale: float
    cfg: Any  # the mixer's TTTConfig
    recompute: bool = True  # the plan's memory-lean backward (``Plan.recompute``)


_FEW_TOKENS = f"N<{MIN_CPU_KERNEL_TOKENS}"
_ANY_TOKENS = "any N"


def token_class(n: int, tracing: str = "") -> str:
    """The token-count class of ``n`` tokens per head: the CPU kernel's rule (``MIN_CPU_KERNEL_TOKENS``).

    Under tracing (``tracing_kind()``) only the traceable paths serve, and they take any count: one class,
    decided without reading ``n``, so the rule becomes no guard on the traced program's size.
    """
    if tracing:
        return _ANY_TOKENS
    return _FEW_TOKENS if n < MIN_CPU_KERNEL_TOKENS else f"N>={MIN_CPU_KERNEL_TOKENS}"


def tracing_kind() -> str:
    """``"trace"`` under ``torch.jit.trace`` / ONNX export, ``"compile"`` under torch.compile / export, else ``""``."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return "trace"
    return "compile" if torch.compiler.is_compiling() else ""


@dataclass(frozen=True)
class Backend:
    """One implementation of a branch's inner loop + read-out.

    Attributes:
        name: what ``TTTConfig.backend`` / ``$VIT3_TTT_BACKEND`` call it.
        what: a noun phrase for messages ("the Triton kernels").
        models: the inner models it implements (``None``: all).
        priority: rank per device type (higher first; ``"*"``: other device types); absent: only when named.
        supports: ``(branch, cfg, x) -> (ok, reason)``; may read only ``Settings`` / ``Inputs`` fields.
        run: ``(step, q, k, v, params, gate) -> out``, q, k, v ``[B, G, N, c]`` in the io dtype, the
            initial weights by name, the token lr gate ``[B, G, N]`` or ``None``; returns ``[B, G, N, c]``.
        prefers: auto only: ``(branch, cfg, x) -> (ok, reason)``, where auto passes a serving backend over.
        native: compiled code (kernels), the likeliest culprit when a fused node of several fails.
        fits: ``(branch, cfg, x) -> (ok, reason)``, asked once ``supports`` passed: whether the hardware at
            hand can run it. A refusal steps aside with a warning, in auto too (``_resolve``).
        specialises: compiled per input specialisation (Triton's JIT: shapes, strides, alignment), which the
            plan key does not hold: the first call of each new one runs guarded and verified (``run``).
    """

    name: str
    what: str
    models: tuple[str, ...] | None
    priority: Mapping[str, int]
    supports: Callable[[Branch, Settings, Inputs], tuple[bool, str]]
    run: Callable[..., Tensor]
    prefers: Callable[[Branch, Settings, Inputs], tuple[bool, str]] | None = None
    native: bool = False
    fits: Callable[[Branch, Settings, Inputs], tuple[bool, str]] | None = None
    specialises: bool = False

    def rank(self, device_type: str) -> int | None:
        return self.priority.get(device_type, self.priority.get("*"))
