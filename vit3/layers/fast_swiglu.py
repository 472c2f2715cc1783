"""A hand-fused, tiled PyTorch path for the official SwiGLU inner model (dot loss, one full-batch step).

Same numbers as ``inner_loop`` + ``SwiGLUInner.apply_to``, much less memory traffic. Eager elementwise ops
over N-sized tensors are bound by DRAM bandwidth and by first-touch page faults of freshly allocated outputs;
this path instead walks the tokens in tiles of a few MiB (``[bh_block, n_block, d]``), so every intermediate
lives in cache, and keeps only the small per-(sample, head) results (the inner gradients G, their norms, the
updated weights) between passes, as the Triton kernel does:

- forward: pass 1 accumulates ``G = kᵀ P`` tile by tile (``baddbmm`` into G), the step updates the weights,
  pass 2 writes the read-out ``(q W1') ⊙ silu(q W2')``;
- backward (the formulas of the ViT³ note, "Outer-loop backward of the SwiGLU branch"): pass 1 writes ``dq``
  and accumulates ``dW'``, the step's backward gives ``dG``, pass 2 recomputes the cheap elementwise inner
  terms from the saved pre-activations and writes ``dk``, ``dv`` and accumulates ``dW``.

Saved for backward: contiguous q, k, v, the pre-activations ``Z = k W`` and ``Y = q W'`` (four N-sized
tensors, saving four matmuls) and the ``[B*H, d, d]`` weights; autograd through the official formulation
keeps about three times as much.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["swiglu_ttt"]

# Bytes of one ``[bh_block, n_block, d]`` tile; a handful of them must fit in a core's share of cache.
TILE_BYTES = 1 << 20
# Fewer tokens per tile than this make the per-tile Python and BLAS overheads dominate.
MIN_TILE_TOKENS = 64


def _tiles(bh: int, n: int, d: int, itemsize: int) -> Iterator[tuple[slice, slice]]:
    """``(rows of B*H, tokens)`` slices covering ``[bh, n]`` in tiles of about ``TILE_BYTES``."""
    row = d * itemsize
    n_block = min(n, max(MIN_TILE_TOKENS, TILE_BYTES // row))
    bh_block = max(1, TILE_BYTES // (n_block * row))
    for b0 in range(0, bh, bh_block):
        for n0 in range(0, n, n_block):
            yield slice(b0, b0 + bh_block), slice(n0, n0 + n_block)


def _flat(t: Tensor) -> Tensor:
    """``[B, H, ...]`` -> ``[B*H, ...]`` (a view of a contiguous tensor)."""
    return t.reshape(-1, *t.shape[2:])


def _batched(w: Tensor, shape: torch.Size) -> Tensor:
    """Inner weights ``[1|B, H, d, d]`` -> contiguous ``[B*H, d, d]`` for tokens of ``shape`` ``[B, H, N, d]``."""
    return _flat(w.expand(*shape[:2], *w.shape[2:]).contiguous())


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
        q, k, v = (_flat(t.contiguous()) for t in (q, k, v))  # [B*H, N, d]
        w1b, w2b = _batched(w1, shape), _batched(w2, shape)
        # Pass 1: G1 = kᵀ(E ⊙ A), G2 = kᵀ(E ⊙ Z1 ⊙ A'), E = -c v (the -c is applied to the small G).
        g1, g2 = torch.zeros_like(w1b), torch.zeros_like(w2b)
        z1_all, z2_all = torch.empty_like(k), torch.empty_like(k)  # Z = k W, kept for the backward
        for rows, toks in _tiles(*k.shape, k.element_size()):
            kt, vt = k[rows, toks], v[rows, toks]
            z1 = torch.bmm(kt, w1b[rows], out=z1_all[rows, toks])
            _, a, a_prime = _silu_and_grad(torch.bmm(kt, w2b[rows], out=z2_all[rows, toks]))
            ktt = kt.transpose(-2, -1)
            g1[rows].baddbmm_(ktt, a.mul_(vt))
            g2[rows].baddbmm_(ktt, a_prime.mul_(z1).mul_(vt))
        g1.mul_(-c)
        g2.mul_(-c)
        w1n, n1 = _step(g1, w1b, lr, grad_norm)
        w2n, n2 = _step(g2, w2b, lr, grad_norm)
        # Pass 2: read-out (q W1') ⊙ silu(q W2').
        out, y1_all, y2_all = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
        for rows, toks in _tiles(*q.shape, q.element_size()):
            qt = q[rows, toks]
            y1 = torch.bmm(qt, w1n[rows], out=y1_all[rows, toks])
            y2 = torch.bmm(qt, w2n[rows], out=y2_all[rows, toks])
            torch.mul(torch.nn.functional.silu(y2), y1, out=out[rows, toks])
        ctx.save_for_backward(q, k, v, w1b, w2b, g1, g2, n1, n2, w1n, w2n, z1_all, z2_all, y1_all, y2_all)
        ctx.scale, ctx.lr, ctx.grad_norm = scale, lr, grad_norm
        ctx.shapes = (shape, w1.shape, w2.shape)
        return out.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, w1b, w2b, g1, g2, n1, n2, w1n, w2n, z1_all, z2_all, y1_all, y2_all = ctx.saved_tensors
        shape, w1_shape, w2_shape = ctx.shapes
        c = ctx.scale / shape[-2]
        d_out = _flat(d_out.contiguous())
        tiles = list(_tiles(*q.shape, q.element_size()))
        # Pass 1, read-out O = Y1 ⊙ silu(Y2): dY1 = dO ⊙ silu(Y2), dY2 = dO ⊙ Y1 ⊙ silu'(Y2),
        # dq = dY1 W1'ᵀ + dY2 W2'ᵀ, dW' = qᵀ dY.
        dq = torch.empty_like(q)
        dw1, dw2 = torch.zeros_like(w1n), torch.zeros_like(w2n)
        w1nt, w2nt = w1n.transpose(-2, -1), w2n.transpose(-2, -1)
        for rows, toks in tiles:
            qt, dot, y1 = q[rows, toks], d_out[rows, toks], y1_all[rows, toks]
            _, dy1, dy2 = _silu_and_grad(y2_all[rows, toks])
            dy1.mul_(dot)
            dy2.mul_(y1).mul_(dot)
            dq[rows, toks] = torch.bmm(dy1, w1nt[rows]).baddbmm_(dy2, w2nt[rows])
            qtt = qt.transpose(-2, -1)
            dw1[rows].baddbmm_(qtt, dy1)
            dw2[rows].baddbmm_(qtt, dy2)
        # The step: dG from dW' (dW' is also the W' -> W path of dW); -c folded into dG.
        dg1 = _step_backward(dw1, g1, n1, ctx.lr, ctx.grad_norm).mul_(-c)
        dg2 = _step_backward(dw2, g2, n2, ctx.lr, ctx.grad_norm).mul_(-c)
        # Pass 2, inner gradient G = -c kᵀ P, P = [v ⊙ A | v ⊙ Z1 ⊙ A'], A = silu(Z2), Z = k W:
        # dP = k dG, dv = dP1 ⊙ A + dP2 ⊙ Z1 ⊙ A', dZ1 = v ⊙ dP2 ⊙ A', dZ2 = v ⊙ (dP1 ⊙ A' + dP2 ⊙ Z1 ⊙ A''),
        # dk = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ, dW += kᵀ dZ.
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dg1t, dg2t = dg1.transpose(-2, -1), dg2.transpose(-2, -1)
        w1t, w2t = w1b.transpose(-2, -1), w2b.transpose(-2, -1)
        for rows, toks in tiles:
            kt, vt, z1, z2 = k[rows, toks], v[rows, toks], z1_all[rows, toks], z2_all[rows, toks]
            sig, a, a_prime = _silu_and_grad(z2)
            # A'' = σ(1-σ)(2 + Z2 (1 - 2σ))
            a_second = (
                torch.mul(sig, -2.0).add_(1.0).mul_(z2).add_(2.0).mul_(sig.addcmul_(sig, sig, value=-1.0))
            )
            dp1, dp2 = torch.bmm(kt, dg1[rows]), torch.bmm(kt, dg2[rows])
            r = dp2 * z1
            torch.addcmul(dp1 * a, r, a_prime, out=dv[rows, toks])
            dz1 = dp2.mul_(a_prime).mul_(vt)
            dz2 = dp1.mul_(a_prime).addcmul_(r, a_second).mul_(vt)
            p1, p2 = a.mul_(vt), a_prime.mul_(z1).mul_(vt)
            dkt = torch.bmm(p1, dg1t[rows]).baddbmm_(p2, dg2t[rows])
            dk[rows, toks] = dkt.baddbmm_(dz1, w1t[rows]).baddbmm_(dz2, w2t[rows])
            ktt = kt.transpose(-2, -1)
            dw1[rows].baddbmm_(ktt, dz1)
            dw2[rows].baddbmm_(ktt, dz2)

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
