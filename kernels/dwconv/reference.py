"""Pure-PyTorch reference of the fused 3x3 depthwise-conv TTT step (an independent, literal formulation).

Per sample, channel ch and tap δ of the 3x3 window (zero padding): ``E = -s v / N`` (dot loss),
``G[ch, δ] = Σ_p E[ch, p] k[ch, p + δ]``, optionally ``G <- G / (||G[ch]|| + 1)`` (norm over the 9 taps),
``W' = W - lr G``, output ``Σ_δ W'[ch, δ] q[ch, p + δ]``. Windows come from ``F.unfold``; autograd
provides the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .swiglu_ttt_ref import column_normalize

__all__ = ["dwconv_ttt_ref"]


def _windows(x: Tensor, grid: tuple[int, int]) -> Tensor:
    """Tokens ``[B, G, N, c]`` -> 3x3 neighbourhoods ``[B, G*c, 9, N]`` (zero padded)."""
    b, g, n, c = x.shape
    maps = x.permute(0, 1, 3, 2).reshape(b, g * c, *grid)  # [B, G*c, h, w]; channel g*c + i
    return F.unfold(maps, kernel_size=3, padding=1).view(b, g * c, 9, n)


def dwconv_ttt_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weight: Tensor,
    grid: tuple[int, int],
    *,
    scale: float,
    lr: float,
    grad_norm: bool,
) -> Tensor:
    """One depthwise-conv inner step on ``(k, v)`` applied to ``q``.

    Args:
        q, k, v: ``[B, G, N, c]`` tokens in raster order on ``grid``.
        weight: initial kernels ``[1, G*c, 3, 3]``.
        grid: ``(h, w)`` with ``h * w == N``.
        scale: loss scale s.
        lr: inner learning rate.
        grad_norm: normalise each channel's 3x3 gradient.

    Returns:
        ``[B, G, N, c]`` in q's dtype (computed in float32 at least).
    """
    out_dtype, ct = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, weight = (t.to(ct) for t in (q, k, v, weight))
    b, g, n, c = q.shape
    e = (v * (-scale / n)).permute(0, 1, 3, 2).reshape(b, g * c, n)  # [B, G*c, N]
    grad = torch.einsum("bktn,bkn->bkt", _windows(k, grid), e)  # [B, G*c, 9]
    if grad_norm:
        grad = column_normalize(grad.unsqueeze(-1)).squeeze(-1)
    w_new = weight.reshape(1, g * c, 9) - lr * grad
    out = torch.einsum("bktn,bkt->bkn", _windows(q, grid), w_new)  # [B, G*c, N]
    return out.view(b, g, c, n).transpose(-1, -2).to(out_dtype)
