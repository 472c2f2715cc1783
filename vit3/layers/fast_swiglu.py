"""A hand-fused PyTorch path for the official SwiGLU inner model (dot loss, one full-batch step).

Same numbers as ``inner_loop`` + ``SwiGLUInner.apply_to``, less memory traffic. On CPUs the eager cost of an
elementwise op is dominated by writing a freshly allocated N-sized tensor (first-touch page faults: about 3x
an in-place update of the same size), so this path allocates each N-sized intermediate once and updates it in
place, accumulates matmul results inside BLAS (``baddbmm``) instead of adding tensors, and writes the backward
out (the formulas of the ViT³ note, "Outer-loop backward of the SwiGLU branch") instead of letting autograd
store a dozen intermediates. Saved for backward: contiguous q, k, v, the pre-activations Z and read-out Y,
and the small per-(sample, head) weights.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["swiglu_ttt"]


def _flat(t: Tensor) -> Tensor:
    """``[B, H, ...]`` -> ``[B*H, ...]`` (a view of a contiguous tensor)."""
    return t.reshape(-1, *t.shape[2:])


def _batched(w: Tensor, like: Tensor) -> Tensor:
    """Inner weights ``[1|B, H, d, d]`` -> contiguous ``[B*H, d, d]`` matching tokens ``like`` ``[B, H, N, d]``."""
    return _flat(w.expand(*like.shape[:2], *w.shape[2:]).contiguous())


def _silu_and_grad(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``σ(z)``, ``silu(z) = z σ`` and ``silu'(z) = σ + silu(z)(1 - σ)``, three fresh tensors."""
    sig = torch.sigmoid(z)
    act = z * sig
    grad = torch.rsub(sig, 1.0).mul_(act).add_(sig)
    return sig, act, grad


def _step(g: Tensor, w: Tensor, lr: float, grad_norm: bool) -> tuple[Tensor, Tensor]:
    """``W' = W - lr G / (||G|| + 1)`` (norm per output column) and the norms ``[BH, 1, d]``."""
    norm = torch.linalg.vector_norm(g, dim=-2, keepdim=True) if grad_norm else torch.zeros_like(g[:, :1])
    return w - lr * (g / (norm + 1.0) if grad_norm else g), norm


def _step_backward(dw_new: Tensor, g: Tensor, norm: Tensor, lr: float, grad_norm: bool) -> Tensor:
    """dL/dG from dL/dW' through ``W' = W - lr G / (||G|| + 1)``."""
    dg_hat = dw_new * (-lr)
    if not grad_norm:
        return dg_hat
    proj = (g * dg_hat).sum(-2, keepdim=True)
    # d(G/(n+1)) = dĜ/(n+1) - G (G·dĜ) / (n (n+1)^2); the second term vanishes with G where n = 0.
    return dg_hat / (norm + 1.0) - g * (proj / (norm.clamp_min(1e-30) * (norm + 1.0) ** 2))


class _SwiGLUTTT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w1, w2, scale: float, lr: float, grad_norm: bool):
        shape = q.shape  # [B, H, N, d]
        c = scale / shape[-2]
        # One contiguous copy each ([B*H, N, d]); every matmul below then reads them in place.
        q, k, v = (_flat(t.contiguous()) for t in (q, k, v))
        w1b, w2b = _batched(w1, q.view(shape)), _batched(w2, q.view(shape))
        kt = k.transpose(-2, -1)
        z1, z2 = torch.bmm(k, w1b), torch.bmm(k, w2b)  # [BH, N, d]
        _, a, a_prime = _silu_and_grad(z2)
        # G1 = kᵀ(E ⊙ A), G2 = kᵀ(E ⊙ Z1 ⊙ A') with E = -c v (the -c is applied to the small G).
        g1 = torch.bmm(kt, a.mul_(v)).mul_(-c)
        g2 = torch.bmm(kt, a_prime.mul_(z1).mul_(v)).mul_(-c)
        w1n, n1 = _step(g1, w1b, lr, grad_norm)
        w2n, n2 = _step(g2, w2b, lr, grad_norm)
        y1, y2 = torch.bmm(q, w1n), torch.bmm(q, w2n)
        out = torch.nn.functional.silu(y2).mul_(y1)
        ctx.save_for_backward(q, k, v, w1b, w2b, z1, z2, g1, g2, n1, n2, w1n, w2n, y1, y2)
        ctx.scale, ctx.lr, ctx.grad_norm = scale, lr, grad_norm
        ctx.shapes = (shape, w1.shape, w2.shape)
        return out.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, w1b, w2b, z1, z2, g1, g2, n1, n2, w1n, w2n, y1, y2 = ctx.saved_tensors
        shape, w1_shape, w2_shape = ctx.shapes
        c = ctx.scale / shape[-2]
        d_out = _flat(d_out.contiguous())
        # Read-out O = Y1 ⊙ silu(Y2), Y = q W': dY1 = dO ⊙ silu(Y2), dY2 = dO ⊙ Y1 ⊙ silu'(Y2).
        _, dy1, dy2 = _silu_and_grad(y2)
        dy1.mul_(d_out)
        dy2.mul_(y1).mul_(d_out)
        dq = torch.bmm(dy1, w1n.transpose(-2, -1)).baddbmm_(dy2, w2n.transpose(-2, -1))
        qt = q.transpose(-2, -1)
        dw1, dw2 = torch.bmm(qt, dy1), torch.bmm(qt, dy2)  # dL/dW', also the W' -> W path of dL/dW
        dg1 = _step_backward(dw1, g1, n1, ctx.lr, ctx.grad_norm).mul_(-c)
        dg2 = _step_backward(dw2, g2, n2, ctx.lr, ctx.grad_norm).mul_(-c)
        del dy1, dy2
        # Inner terms again from the saved Z: A = silu(Z2), A', A'' = σ(1-σ)(2 + Z2 (1 - 2σ)).
        sig, a, a_prime = _silu_and_grad(z2)
        a_second = torch.mul(sig, -2.0).add_(1.0).mul_(z2).add_(2.0)
        a_second.mul_(sig.addcmul_(sig, sig, value=-1.0))
        del sig
        # dP = k dG (with -c folded in), P1 = v ⊙ A, P2 = v ⊙ Z1 ⊙ A'.
        dp1, dp2 = torch.bmm(k, dg1), torch.bmm(k, dg2)
        r = dp2 * z1
        dv = torch.mul(dp1, a).addcmul_(r, a_prime)
        dz1 = torch.mul(v, a_prime).mul_(dp2)
        del dp2
        dz2 = dp1.mul_(a_prime).addcmul_(r, a_second).mul_(v)  # v ⊙ (dP1 ⊙ A' + dP2 ⊙ Z1 ⊙ A'')
        del r, a_second
        p1, p2 = a.mul_(v), a_prime.mul_(z1).mul_(v)
        # dk = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ, accumulated inside BLAS.
        dk = torch.bmm(p1, dg1.transpose(-2, -1)).baddbmm_(p2, dg2.transpose(-2, -1))
        dk.baddbmm_(dz1, w1b.transpose(-2, -1)).baddbmm_(dz2, w2b.transpose(-2, -1))
        kt = k.transpose(-2, -1)
        dw1.baddbmm_(kt, dz1)
        dw2.baddbmm_(kt, dz2)

        def weight_grad(dw: Tensor, w_shape: torch.Size) -> Tensor:
            dw = dw.view(*shape[:2], *dw.shape[1:])  # [B, H, d, d]
            return dw.sum(0, keepdim=True) if w_shape[0] == 1 and shape[0] != 1 else dw

        return (
            dq.view(shape),
            dk.view(shape),
            dv.view(shape),
            weight_grad(dw1, w1_shape),
            weight_grad(dw2, w2_shape),
            None,
            None,
            None,
        )


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
        q: queries ``[B, H, N, d]`` (any strides).
        k: keys ``[B, H, N, d]`` (any strides).
        v: values ``[B, H, N, d]`` (any strides).
        w1: initial inner weight of the linear factor ``[1|B, H, d, d]``.
        w2: initial inner weight of the gate ``[1|B, H, d, d]``.
        scale: loss scale s (the official 1/3).
        lr: inner learning rate.
        grad_norm: apply ``G / (||G|| + 1)`` per output column.

    Returns:
        ``(q W1') ⊙ silu(q W2')`` ``[B, H, N, d]``, W' the per-sample weights after the step.
    """
    return _SwiGLUTTT.apply(q, k, v, w1, w2, scale, lr, grad_norm)
