"""Fused Triton kernels for the TTT inner loop (installed as ``vit3.kernels``).

``fused_ttt`` runs the one-step inner loop and read-out of an inner model (SwiGLU, linear, 3x3 depthwise
conv), forward and backward, in Triton; the mixer's backend registry (``vit3.layers.backends``) decides when
it runs. ``swiglu_cpu`` is the C++ CPU kernel of the SwiGLU passes and the 3x3 depthwise op.
"""

from __future__ import annotations

from .dwconv_ttt_ref import dwconv_ttt_ref
from .linear_ttt_ref import linear_ttt_ref
from .swiglu_ttt_ref import swiglu_ttt_ref
from .ttt_fused import (
    FUSED_LOSSES,
    IO_DTYPES,
    MAX_HEAD_DIM,
    MAX_HEAD_DIM_DWCONV,
    MIN_HEAD_DIM,
    fits_device,
    fused_ttt,
    head_dim_supported,
    max_head_dim,
    resolve_backend,
    triton_runs_on,
)

__all__ = [
    "FUSED_LOSSES",
    "IO_DTYPES",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_DWCONV",
    "MIN_HEAD_DIM",
    "dwconv_ttt_ref",
    "fits_device",
    "fused_ttt",
    "head_dim_supported",
    "linear_ttt_ref",
    "max_head_dim",
    "resolve_backend",
    "swiglu_ttt_ref",
    "triton_runs_on",
]
