"""The depthwise-conv op's reference: the official ViT³ 3x3 depthwise-conv inner model and its TTT step.

The inner model (``DWConvInner``) convolves each channel of the token grid with its own 3x3 kernel (zero
padding), written here from the definition: ``v_hat[ch, p] = Σ_δ W[ch, δ] x[ch, p + δ]`` over the
``F.unfold`` windows. One dot-loss step on ``(k, v)`` (``vit3.kernels.common.ttt_reference``: the inner
gradient by autograd; the norm of ``G / (||G|| + 1)`` over each channel's 9 taps) is read out on q. Every fast
path (``vit3.kernels.dwconv.eager``, the Triton kernels, the generic inner loop) is tested against it
(``tests/kernels/test_op_dwconv.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import ttt_reference
from ..ops import Hyper

__all__ = ["dwconv", "dwconv_ttt_ref", "op_reference"]


def dwconv(x: Tensor, weight: Tensor, grid: tuple[int, int]) -> Tensor:
    """Per-sample depthwise 3x3 conv of tokens ``[B, G, N, c]`` (raster order on ``grid``) with kernels
    ``[B|1, G*c, 3, 3]`` (channel ``g*c + i`` = head g, channel i) -> ``[B, G, N, c]``."""
    b, g, n, c = x.shape
    maps = x.permute(0, 1, 3, 2).reshape(b, g * c, *grid)  # [B, G*c, h, w]
    windows = F.unfold(maps, kernel_size=3, padding=1).view(b, g * c, 9, n)  # [B, G*c, 9 taps, N]
    taps = weight.reshape(weight.shape[0], g * c, 9).expand(b, -1, -1)  # [B, G*c, 9]
    out = torch.einsum("bktn,bkt->bkn", windows, taps)  # [B, G*c, N]
    return out.view(b, g, c, n).transpose(-1, -2)


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
    """One depthwise-conv inner step (dot loss) on ``(k, v)`` applied to ``q``.

    Args:
        q, k, v: ``[B, G, N, c]`` tokens in raster order on ``grid``.
        weight: initial kernels ``[1|B, G*c, 3, 3]``.
        grid: ``(h, w)`` with ``h * w == N``.
        scale: loss scale s.
        lr: inner learning rate.
        grad_norm: normalise each channel's 3x3 gradient.

    Returns:
        ``[B, G, N, c]`` in q's dtype (computed in float32 at least).
    """

    def model(x: Tensor, w: Tensor) -> Tensor:
        return dwconv(x, w, grid)

    return ttt_reference(
        model, (weight,), q, k, v, scale=scale, lr=lr, grad_norm=grad_norm, norm_dims=(-2, -1)
    )


def op_reference(q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], h: Hyper) -> Tensor:
    """:func:`dwconv_ttt_ref` as the table of ops calls a reference (``Op.reference``; dot loss)."""
    return dwconv_ttt_ref(q, k, v, params["weight"], h.grid, scale=h.scale, lr=h.lr, grad_norm=h.grad_norm)
