"""The backend interface: what a backend sees of a branch and its call, and ``Backend``.

``Branch``, ``Settings`` and ``Inputs`` are all that a backend's ``supports`` may read (every field is in the
route key, ``routes.BranchKey``; defined with the table of ops, ``vit3.kernels.ops``, whose paths read them);
``token_class`` is the token-count rule the key holds.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from vit3.kernels.ops import Branch, Inputs, Settings, ops_with
from vit3.kernels.paths import FEW_TOKENS, MIN_CPU_KERNEL_TOKENS

from ..inner_math import legacy_onnx_export

__all__ = [
    "MIN_CPU_KERNEL_TOKENS",
    "Backend",
    "Branch",
    "Inputs",
    "Settings",
    "legacy_onnx_dynamic_axes",
    "token_class",
]

_ANY_TOKENS = "any N"


def token_class(n: int, tracing: str = "") -> str:
    """The token-count class of ``n`` tokens per head: the CPU kernel's rule (``MIN_CPU_KERNEL_TOKENS``).

    Under tracing (``inner_math.tracing_kind()``) only the traceable paths and the mixer op serve, and they
    take any count: one class, decided without reading ``n``, so the rule becomes no guard on the traced
    program's size.
    """
    if tracing:
        return _ANY_TOKENS
    return FEW_TOKENS if n < MIN_CPU_KERNEL_TOKENS else f"N>={MIN_CPU_KERNEL_TOKENS}"


def legacy_onnx_dynamic_axes() -> bool:
    """Whether this call runs under an ONNX export by ``torch.jit.trace``
    (``torch.onnx.export(dynamo=False)``) that declares ``dynamic_axes``. That exporter keeps them only in its
    own frames while it traces (the argument of ``torch.onnx.export`` and of the functions it hands them to),
    so they are read there; a trace records the sizes it sees as constants, which such a graph then reads as
    dynamic."""
    if torch.compiler.is_compiling() or not legacy_onnx_export():
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("torch.onnx"):
            axes = frame.f_locals.get("dynamic_axes")
            if isinstance(axes, Mapping) and any(axes.values()):
                return True
        frame = frame.f_back
    return False


@dataclass(frozen=True)
class Backend:
    """One implementation of a branch's inner loop + read-out: a fast path in the mixer op, or the generic
    inner loop.

    Attributes:
        name: what ``TTTConfig.backend`` / ``$VIT3_TTT_BACKEND`` call it.
        what: a noun phrase for messages ("the Triton kernels").
        path: the ops' fast path it runs (``vit3.kernels.ops.Op.paths[path]``); ``None``: the generic inner
            loop, which runs every inner model.
        priority: rank per device type (higher first; ``"*"``: other device types); absent: only when named.
        supports: ``(branch, cfg, x) -> (ok, reason)``; may read only ``Settings`` / ``Inputs`` fields.
        prefers: auto only: ``(branch, cfg, x) -> (ok, reason)``, where auto passes a serving backend over.
        native: compiled code (kernels), the likeliest culprit when a fused node of several fails.
        fits: ``(branch, cfg, x) -> (ok, reason)``, asked once ``supports`` passed: whether the hardware at
            hand can run it. A refusal steps aside with a warning, in auto too (``routes.resolve``).
        specialises: compiled per input specialisation (Triton's JIT: shapes, strides, alignment), which the
            route key does not hold: the first call of each new one runs guarded and verified
            (``guard.guarded``).
    """

    name: str
    what: str
    path: str | None
    priority: Mapping[str, int]
    supports: Callable[[Branch, Settings, Inputs], tuple[bool, str]]
    prefers: Callable[[Branch, Settings, Inputs], tuple[bool, str]] | None = None
    native: bool = False
    fits: Callable[[Branch, Settings, Inputs], tuple[bool, str]] | None = None
    specialises: bool = False

    @property
    def models(self) -> tuple[str, ...] | None:
        """The inner models it implements: the ops with its path, as registered now (``None``: all)."""
        return None if self.path is None else ops_with(self.path)

    def rank(self, device_type: str) -> int | None:
        return self.priority.get(device_type, self.priority.get("*"))
