"""Pure-PyTorch reference of the fused SwiGLU-branch TTT step (an independent, literal formulation).

Per (sample b, head g): ``Z1 = k W1``, ``Z2 = k W2``, ``E = -s v / N`` (dot loss),
``G1 = kᵀ(E ⊙ silu(Z2))``, ``G2 = kᵀ(E ⊙ Z1 ⊙ silu'(Z2))``, optionally ``G <- G / (||G||_col + 1)``,
``W' = W - lr G``, output ``(q W1') ⊙ silu(q W2')``. Autograd provides the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["column_normalize", "swiglu_ttt_ref"]


def column_normalize(grad: Tensor) -> Tensor:
    """``G / (||G[:, j]|| + 1)`` for ``G [..., d_in, d_out]`` (norm over the input dim of each column)."""
    return grad / (grad.pow(2).sum(dim=-2, keepdim=True).sqrt() + 1.0)


def swiglu_ttt_ref(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, *, scale: float, lr: float, grad_norm: bool
) -> Tensor:
    """One SwiGLU inner step on ``(k, v)`` applied to ``q``.

    Args:
        q, k, v: ``[B, G, N, c]`` (any strides and float dtype).
        w1, w2: initial inner weights ``[1, G, c, c]``.
        scale: loss scale s.
        lr: inner learning rate.
        grad_norm: apply the column normalisation.

    Returns:
        ``[B, G, N, c]`` in q's dtype (computed in float32 at least).
    """
    out_dtype, ct = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, w1, w2 = (t.to(ct) for t in (q, k, v, w1, w2))
    n_tok = k.shape[-2]
    z1 = torch.einsum("bgnc,gcd->bgnd", k, w1[0])
    z2 = torch.einsum("bgnc,gcd->bgnd", k, w2[0])
    sig = torch.sigmoid(z2)
    e = v * (-scale / n_tok)
    g1 = torch.einsum("bgnc,bgnd->bgcd", k, e * z2 * sig)
    g2 = torch.einsum("bgnc,bgnd->bgcd", k, e * z1 * sig * (1 + z2 * (1 - sig)))
    if grad_norm:
        g1, g2 = column_normalize(g1), column_normalize(g2)
    w1n, w2n = w1 - lr * g1, w2 - lr * g2  # [B, G, c, c]
    out = torch.einsum("bgnc,bgcd->bgnd", q, w1n) * F.silu(torch.einsum("bgnc,bgcd->bgnd", q, w2n))
    return out.to(out_dtype)
