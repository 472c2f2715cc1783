"""The TTT inner-loop ops of ViT³ (installed as ``vit3.kernels``), one folder per op.

Each op — ``swiglu`` (the official inner model), ``linear`` (non-causal linear attention), ``dwconv`` (the
official 3x3 depthwise-conv branch) — has one pure-PyTorch ``reference`` (the definition every fast path is
tested against) and beside it its fast paths: ``swiglu.eager`` (tiled PyTorch, hand-written backward),
``swiglu.cpp`` (the C++ CPU kernel of its passes, and the 3x3 depthwise op on token rows that the
``dwconv`` op's C++ path and ``ConvPosEnc`` use), ``dwconv.eager`` (the closed form in native convolution
calls). The Triton kernels of all three are shared: ``triton_op`` (custom ops, autograd, launch set-up) over
``triton_kernels``. ``common`` holds what all ops share (the gradient normalisation, the step, the reference
step). Each op declares its fast paths (``<op>.PATHS``); the mixer's backend registry
(``vit3.layers.backends``) builds its backends' inner-model lists from them and decides which path runs.

Triton is imported only when a Triton name is used (``vit3.kernels.triton_ttt``, ``fits_device`` ...), so
the references and the C++ kernel load without it.
"""

from __future__ import annotations

from typing import Any

from . import dwconv, linear, swiglu
from .dwconv.reference import dwconv_ttt_ref
from .linear.reference import linear_ttt_ref
from .swiglu.reference import swiglu_ttt_ref

# The ops, each with its reference and the fast paths it declares (``<op>.PATHS``).
OPS = {"swiglu": swiglu, "linear": linear, "dwconv": dwconv}


def ops_with(path: str) -> tuple[str, ...]:
    """The ops that declare fast path ``path`` (``"triton"``, ``"cpp"``, ``"eager"``), in ``OPS`` order."""
    return tuple(name for name, op in OPS.items() if path in op.PATHS)


# Names of ``triton_op`` re-exported here, imported (with Triton) on first use.
_TRITON_NAMES = (
    "IO_DTYPES",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_DWCONV",
    "MIN_HEAD_DIM",
    "TRITON_LOSSES",
    "fits_device",
    "head_dim_supported",
    "max_head_dim",
    "resolve_backend",
    "triton_runs_on",
    "triton_ttt",
)

__all__ = ["OPS", "dwconv_ttt_ref", "linear_ttt_ref", "ops_with", "swiglu_ttt_ref", *_TRITON_NAMES]


def __getattr__(name: str) -> Any:
    if name in _TRITON_NAMES:
        from . import triton_op

        return getattr(triton_op, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
