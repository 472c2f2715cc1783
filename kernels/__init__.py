"""Fused Triton kernels for the TTT inner loop (installed as ``vit3.kernels``).

``fused_ttt`` runs the one-step inner loop and read-out of an inner model (SwiGLU, linear, 3x3 depthwise
conv), forward and backward, in Triton; ``fused_supports`` tells the mixer (``vit3.layers.TTTMixer``) when it may dispatch to it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .dwconv_ttt_ref import dwconv_ttt_ref
from .linear_ttt_ref import linear_ttt_ref
from .swiglu_ttt_ref import swiglu_ttt_ref
from .ttt_fused import (
    BACKEND_ENV,
    FUSED_LOSSES,
    IO_DTYPES,
    MAX_HEAD_DIM,
    MAX_HEAD_DIM_DWCONV,
    MIN_HEAD_DIM,
    fused_ttt,
    head_dim_supported,
    max_head_dim,
    resolve_backend,
    triton_runs_on,
)

__all__ = [
    "BACKEND_ENV",
    "FUSED_LOSSES",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_DWCONV",
    "MIN_HEAD_DIM",
    "dwconv_ttt_ref",
    "fused_supports",
    "fused_ttt",
    "head_dim_supported",
    "linear_ttt_ref",
    "max_head_dim",
    "resolve_backend",
    "swiglu_ttt_ref",
    "triton_runs_on",
]


def fused_supports(name: str, cfg: Any, x: Tensor, head_dim: int | None = None) -> bool:
    """Whether the fused op can run branch ``name`` of a mixer with config ``cfg`` on input ``x [B, N, C]``.

    Args:
        name: inner model name (``"swiglu"``, ``"linear"``, ``"dwconv"``; others are not fused).
        cfg: the mixer's ``TTTConfig``.
        x: the mixer input (its device and dtype decide).
        head_dim: the branch's head dim when known (see ``head_dim_supported``).
    """
    losses = FUSED_LOSSES.get(name, ())
    return (
        name in FUSED_LOSSES
        and cfg.plain_branch(name)  # no LayerNorm wrapper, no biases
        and cfg.loss in losses
        and cfg.steps == 1
        and cfg.mini_batches == 1
        and cfg.lr_mode == "fixed"
        and x.dtype in IO_DTYPES
        and triton_runs_on(x.device)
        and (head_dim is None or head_dim_supported(name, head_dim, x.dtype))
    )
