"""The SwiGLU op's reference: the official ViT³ inner model and its TTT step, in plain PyTorch.

The inner model (``SwiGLUInner``) is ``v_hat = (x W1) ⊙ silu(x W2)``; one step of the dot loss on ``(k, v)``
(``vit3.kernels.common.ttt_reference``: the inner gradient by autograd) gives per-sample ``W1', W2'``, read
out on q. Every fast path of the op (``eager``, ``cpp``, the Triton kernels) is tested against it
(``tests/kernels/test_op_swiglu.py``), and it against the official code's fixtures.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..common import ttt_reference
from ..ops import Hyper

__all__ = ["op_reference", "swiglu", "swiglu_ttt_ref"]


def swiglu(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """``(x W1) ⊙ silu(x W2)``: tokens ``[B, G, N, c]``, weights ``[B|1, G, c, h]`` -> ``[B, G, N, h]``."""
    return (x @ w1) * F.silu(x @ w2)


def swiglu_ttt_ref(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, *, scale: float, lr: float, grad_norm: bool
) -> Tensor:
    """One SwiGLU inner step (dot loss) on ``(k, v)`` applied to ``q``.

    Args:
        q, k, v: ``[B, G, N, c]`` (any strides and float dtype).
        w1, w2: initial inner weights ``[1|B, G, c, c]``.
        scale: loss scale s.
        lr: inner learning rate.
        grad_norm: apply ``G / (||G|| + 1)`` per output column.

    Returns:
        ``[B, G, N, c]`` in q's dtype (computed in float32 at least).
    """
    return ttt_reference(swiglu, (w1, w2), q, k, v, scale=scale, lr=lr, grad_norm=grad_norm)


def op_reference(q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], h: Hyper) -> Tensor:
    """:func:`swiglu_ttt_ref` as the table of ops calls a reference (``Op.reference``; dot loss, no grid)."""
    return swiglu_ttt_ref(q, k, v, params["w1"], params["w2"], scale=h.scale, lr=h.lr, grad_norm=h.grad_norm)
