"""A hand-fused PyTorch path for the official SwiGLU inner model (dot loss, one full-batch step).

Same numbers as ``inner_loop`` + ``SwiGLUInner.apply_to``, fewer passes over memory: W1 and W2 are applied
as one ``[d, 2d]`` matmul, both inner gradients come from one ``kᵀ [P1 | P2]`` matmul, and the backward is
written out (the formulas of the ViT³ note, "Outer-loop backward of the SwiGLU branch") so autograd does
not store a dozen N-sized intermediates: only q, k, v and the small per-(sample, head) weights are saved,
and the cheap elementwise work is recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["swiglu_ttt"]


def _silu_terms(z2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``σ(z)``, ``t = σ(1 - σ)``, ``silu(z) = z σ`` and ``silu'(z) = σ + z t`` of ``z2`` ``[..., N, d]``."""
    sig = torch.sigmoid(z2)
    t = torch.addcmul(sig, sig, sig, value=-1.0)
    return sig, t, z2 * sig, torch.addcmul(sig, z2, t)


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Sums a per-sample weight gradient ``[B, ...]`` over the batch when the weight is shared (``[1, ...]``)."""
    return t.sum(0, keepdim=True) if shape[0] == 1 and t.shape[0] != 1 else t


def _write_p(p: Tensor, v: Tensor, z1: Tensor, a: Tensor, a_prime: Tensor) -> None:
    """``p <- [v ⊙ A | v ⊙ Z1 ⊙ A']`` in place (``p`` ``[..., N, 2d]``, possibly a strided slice)."""
    d = v.shape[-1]
    torch.mul(v, a, out=p[..., :d])
    torch.mul(torch.mul(v, z1), a_prime, out=p[..., d:])


class _SwiGLUTTT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w1, w2, scale: float, lr: float, grad_norm: bool):
        q, k, v = (
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
        )  # one copy each; every matmul then reads them in place
        d = q.shape[-1]
        c = scale / k.shape[-2]
        w = torch.cat([w1, w2], dim=-1)  # [1|B, H, d, 2d]
        z = k @ w  # [B, H, N, 2d] = [Z1 | Z2]
        z1, z2 = z[..., :d], z[..., d:]
        _, _, a, a_prime = _silu_terms(z2)
        p = z.new_empty(z.shape)
        _write_p(p, v, z1, a, a_prime)  # E = -c v is folded into g below
        g = (k.transpose(-2, -1) @ p).mul_(-c)  # [B, H, d, 2d] = [G1 | G2]
        if grad_norm:
            norm = torch.linalg.vector_norm(g, dim=-2, keepdim=True)  # [B, H, 1, 2d]: per output column
            w_new = w - lr * (g / (norm + 1.0))
        else:
            norm = g.new_zeros(())
            w_new = w - lr * g
        y = q @ w_new  # [B, H, N, 2d] = [Y1 | Y2]
        out = y[..., :d] * torch.nn.functional.silu(y[..., d:])
        ctx.save_for_backward(q, k, v, w, z, g, norm, w_new, y)
        ctx.scale, ctx.lr, ctx.grad_norm = scale, lr, grad_norm
        ctx.w_shapes = (w1.shape, w2.shape)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, w, z, g, norm, w_new, y = ctx.saved_tensors
        d = q.shape[-1]
        c = ctx.scale / k.shape[-2]
        # Read-out O = Y1 ⊙ silu(Y2), Y = q W':  dY = [dO ⊙ silu(Y2) | dO ⊙ Y1 ⊙ silu'(Y2)].
        y1, y2 = y[..., :d], y[..., d:]
        _, _, silu2, dsilu2 = _silu_terms(y2)
        dy = y.new_empty(y.shape)
        torch.mul(d_out, silu2, out=dy[..., :d])
        torch.mul(torch.mul(d_out, y1), dsilu2, out=dy[..., d:])
        dq = dy @ w_new.transpose(-2, -1)
        dw_new = q.transpose(-2, -1) @ dy  # [B, H, d, 2d]
        # Step and normalisation: W' = W - lr Ĝ, Ĝ = G / (n + 1).
        dg = dw_new * (-ctx.lr)
        if ctx.grad_norm:
            proj = (g * dg).sum(-2, keepdim=True)
            # d(G/(n+1)) = dĜ/(n+1) - G (G·dĜ) / (n (n+1)^2); the second term vanishes with G where n = 0.
            dg = dg / (norm + 1.0) - g * (proj / (norm.clamp_min(1e-30) * (norm + 1.0) ** 2))
        dg = dg * (-c)  # G = -c kᵀ P, P = [v ⊙ A | v ⊙ Z1 ⊙ A']: fold -c once
        # Inner terms of Z = k W (saved), A = silu(Z2), A'' = σ(1-σ)(2 + Z2 (1 - 2σ)).
        z1, z2 = z[..., :d], z[..., d:]
        sig, t, a, a_prime = _silu_terms(z2)
        a_second = torch.mul(sig, -2.0).add_(1.0).mul_(z2).add_(2.0).mul_(t)
        dp = k @ dg  # [B, H, N, 2d] = dP
        dp1, dp2 = dp[..., :d], dp[..., d:]
        dv = torch.mul(dp1, a).addcmul_(torch.mul(dp2, z1), a_prime)
        # One buffer [P | dZ1 | dZ2] so dk = P dGᵀ + dZ Wᵀ is a single matmul.
        pdz = z.new_empty((*z.shape[:-1], 4 * d))
        _write_p(pdz[..., : 2 * d], v, z1, a, a_prime)
        vdp2 = v * dp2
        torch.mul(vdp2, a_prime, out=pdz[..., 2 * d : 3 * d])
        torch.addcmul(torch.mul(dp1, v).mul_(a_prime), torch.mul(vdp2, z1), a_second, out=pdz[..., 3 * d :])
        dk = pdz @ torch.cat([dg, w.expand_as(dg)], dim=-1).transpose(-2, -1)
        dw = dw_new + k.transpose(-2, -1) @ pdz[..., 2 * d :]  # [B, H, d, 2d]
        s1, s2 = ctx.w_shapes
        return dq, dk, dv, _sum_to(dw[..., :d], s1), _sum_to(dw[..., d:], s2), None, None, None


def swiglu_ttt(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w1: Tensor,
    w2: Tensor,
    *,
    scale: float,
    lr: float = 1.0,
    grad_norm: bool = True,
) -> Tensor:
    """One full-batch dot-loss TTT step of the SwiGLU inner model, then its read-out on q.

    Args:
        q, k, v: ``[B, H, N, d]`` (any strides).
        w1, w2: initial inner weights ``[1|B, H, d, d]``.
        scale: loss scale s (the official 1/3).
        lr: inner learning rate.
        grad_norm: apply ``G / (||G|| + 1)`` per output column.

    Returns:
        ``(q W1') ⊙ silu(q W2')`` ``[B, H, N, d]``.
    """
    return _SwiGLUTTT.apply(q, k, v, w1, w2, scale, lr, grad_norm)
