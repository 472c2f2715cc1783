"""The linear op's reference: one TTT step of ``v_hat = x W`` (non-causal linear attention), in plain PyTorch.

With the dot loss one step is ``q (W + lr (s/N) kᵀ v)`` (unnormalised), linear attention with a learnt
initial state. The inner gradient comes from autograd (``vit3.kernels.common.ttt_reference``); the Triton
kernels and the generic inner loop are tested against it (``tests/kernels/test_op_linear.py``).
"""

from __future__ import annotations

from torch import Tensor

from ..common import ttt_reference
from ..ops import Hyper

__all__ = ["linear", "linear_ttt_ref", "op_reference"]


def linear(x: Tensor, w: Tensor) -> Tensor:
    """``x W``: tokens ``[B, G, N, c]``, weight ``[B|1, G, c, e]`` -> ``[B, G, N, e]``."""
    return x @ w


def linear_ttt_ref(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, *, scale: float, lr: float, grad_norm: bool, loss: str = "dot"
) -> Tensor:
    """One linear inner step on ``(k, v)`` applied to ``q``.

    Args:
        q, k, v: ``[B, G, N, c]`` (any strides and float dtype).
        w: initial inner weight ``[1|B, G, c, c]``.
        scale: loss scale s.
        lr: inner learning rate.
        grad_norm: apply ``G / (||G|| + 1)`` per output column.
        loss: ``"dot"`` or ``"mse"``.

    Returns:
        ``[B, G, N, c]`` in q's dtype (computed in float32 at least).
    """
    if loss not in ("dot", "mse"):
        raise ValueError(f"linear_ttt_ref supports the 'dot' and 'mse' losses, got {loss!r}")
    return ttt_reference(linear, (w,), q, k, v, scale=scale, lr=lr, grad_norm=grad_norm, loss=loss)


def op_reference(q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], h: Hyper) -> Tensor:
    """:func:`linear_ttt_ref` as the table of ops calls a reference (``Op.reference``; token-wise)."""
    return linear_ttt_ref(q, k, v, params["w"], scale=h.scale, lr=h.lr, grad_norm=h.grad_norm, loss=h.loss)
