"""Pure-PyTorch reference of the fused linear-inner-model TTT step (non-causal linear attention).

Per (sample b, head g): ``E = -s v / N`` (dot loss) or ``E = s (k W - v) / N`` (MSE), ``G = kᵀE``,
optionally ``G <- G / (||G||_col + 1)``, ``W' = W - lr G``, output ``q W'``. Autograd provides the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .swiglu_ttt_ref import column_normalize

__all__ = ["linear_ttt_ref"]


def linear_ttt_ref(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, *, scale: float, lr: float, grad_norm: bool, loss: str = "dot"
) -> Tensor:
    """One linear inner step on ``(k, v)`` applied to ``q``.

    Args:
        q, k, v: ``[B, G, N, c]`` (any strides and float dtype).
        w: initial inner weight ``[1, G, c, c]``.
        scale: loss scale s.
        lr: inner learning rate.
        grad_norm: apply the column normalisation.
        loss: ``"dot"`` or ``"mse"``.

    Returns:
        ``[B, G, N, c]`` in q's dtype (computed in float32 at least).
    """
    if loss not in ("dot", "mse"):
        raise ValueError(f"linear_ttt_ref supports the 'dot' and 'mse' losses, got {loss!r}")
    out_dtype, ct = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, w = (t.to(ct) for t in (q, k, v, w))
    coef = scale / k.shape[-2]
    if loss == "dot":
        e = -coef * v
    else:
        e = coef * (torch.einsum("bgnc,gcd->bgnd", k, w[0]) - v)
    grad = torch.einsum("bgnc,bgnd->bgcd", k, e)
    if grad_norm:
        grad = column_normalize(grad)
    return torch.einsum("bgnc,bgcd->bgnd", q, w - lr * grad).to(out_dtype)
