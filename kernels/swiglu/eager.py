"""The SwiGLU op's eager path: tiled PyTorch with a hand-written backward (dot loss, one full-batch step).

Same numbers as the op's reference (``vit3.kernels.swiglu.reference``), much less memory traffic: the tokens
are walked in tiles of about a MiB so every intermediate lives in cache, and only the small per-(sample, head)
results (G, its norms, the updated weights) are kept between the two passes of each direction. The read-out
and the input gradients are written into caller-given views (``swiglu_forward`` / ``swiglu_backward``, the
fused node's). Saved for the backward: dense q, k, v and the weights, plus ``Z = k W``, ``Y = q W'`` unless
``recompute``. The autograd node (``swiglu_ttt``) and the fused node's hooks of a pair of passes
(``Passes``) serve the C++ path's passes (``swiglu.cpp``) too.

The passes, the layouts and what is saved, in full: ``docs/design/kernels.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..common import autocast_backward, autocast_forward, grad_flows, step, step_backward, weight_grad
from ..ops import Hyper, Node, NodeCall, Whole

__all__ = [
    "NODE",
    "PASSES",
    "Passes",
    "SwiGLUSaved",
    "node",
    "swiglu_backward",
    "swiglu_forward",
    "swiglu_ttt",
]

# Bytes of one ``[heads, tokens, d]`` tile; a handful of them must fit in a core's share of cache.
TILE_BYTES = 1 << 20
# Fewer tokens per tile than this make the per-tile Python and BLAS overheads dominate.
MIN_TILE_TOKENS = 64


def block_rows(d: int, itemsize: int) -> int:
    """Rows of ``[rows, d]`` in about ``TILE_BYTES`` (at least ``MIN_TILE_TOKENS``)."""
    return max(MIN_TILE_TOKENS, TILE_BYTES // (d * itemsize))


def block_tokens(n: int, d: int, itemsize: int) -> int:
    """Tokens per tile of one head: about ``TILE_BYTES`` of ``[tokens, d]``."""
    return min(n, block_rows(d, itemsize))


class _Tiles:
    """A fixed walk over ``[B, H, N, d]`` in ``(sample, heads, tokens)`` tiles of about ``TILE_BYTES``.

    Tile ``i`` covers sample ``b``, heads ``hs`` and tokens ``ns``; buffers made by ``buffer`` hold one
    contiguous ``[heads, tokens, d]`` block per tile (``part``), so matmuls write them without strides.
    """

    def __init__(self, shape: torch.Size, itemsize: int) -> None:
        b, h, n, d = shape
        row = d * itemsize
        n_block = block_tokens(n, d, itemsize)
        h_block = min(h, max(1, TILE_BYTES // (n_block * row)))
        self.d = d
        self._views: dict[tuple, list[Tensor]] = {}
        self.index = [
            (bi, slice(h0, min(h, h0 + h_block)), slice(n0, min(n, n0 + n_block)))
            for bi in range(b)
            for h0 in range(0, h, h_block)
            for n0 in range(0, n, n_block)
        ]
        sizes = [(hs.stop - hs.start, ns.stop - ns.start) for _, hs, ns in self.index]
        self.shapes = [(hb, nb, d) for hb, nb in sizes]
        self.offsets = [0]
        for hb, nb in sizes:
            self.offsets.append(self.offsets[-1] + hb * nb * d)

    def buffer(self, like: Tensor) -> Tensor:
        """A tile-ordered buffer holding a pair ``[2, heads, tokens, d]`` per tile."""
        return torch.empty(2 * self.offsets[-1], dtype=like.dtype, device=like.device)

    def part(self, buf: Tensor, i: int) -> Tensor:
        """Tile ``i``'s pair ``[2, heads, tokens, d]`` of a ``buffer``."""
        return buf[2 * self.offsets[i] : 2 * self.offsets[i + 1]].view(2, *self.shapes[i])

    def scratch(self, like: Tensor, count: int) -> list[Tensor]:
        """``count`` buffers of the largest tile: elementwise ops write into them (``out=`` / in place), as
        fresh allocations cost a CPU twice the time of the op (page faults)."""
        size = 2 * max(hb * nb for hb, nb, _ in self.shapes) * self.d  # room for a pair
        return [torch.empty(size, dtype=like.dtype, device=like.device) for _ in range(count)]

    def views(self, bufs: list[Tensor], i: int) -> list[Tensor]:
        """Tile ``i``'s pair shape ``[2, heads, tokens, d]`` over the front of each scratch buffer.

        Cached per tile shape (all tiles but the last share one): view ops cost as much as small kernels.
        """
        key = (bufs[0].data_ptr(), self.shapes[i])
        if key not in self._views:
            numel = self.offsets[i + 1] - self.offsets[i]
            self._views[key] = [b[: 2 * numel].view(2, *self.shapes[i]) for b in bufs]
        return self._views[key]


def _mm_pair(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
    """``out[j] = x w[:, j]`` for both weights of a pair.

    Shapes: x ``[h, n, d]``, w ``[h, 2, d, e]``, out ``[2, h, n, e]``.
    """
    if x.shape[0] == 1:  # one batched call with x broadcast over the pair (batch stride 0): faster
        torch.bmm(x.expand(2, -1, -1), w[0], out=out.view(2, *out.shape[2:]))
    else:
        for j in range(2):
            torch.bmm(x, w[:, j], out=out[j])
    return out


def _tmm_pair_acc(x: Tensor, p: Tensor, acc: Tensor) -> None:
    """``acc[:, j] += xᵀ p[j]``: x ``[h, n, d]``, p ``[2, h, n, e]``, acc ``[h, 2, d, e]``."""
    xt = x.transpose(-2, -1)
    if x.shape[0] == 1:
        acc[0].baddbmm_(xt.expand(2, -1, -1), p.view(2, *p.shape[2:]))
    else:
        for j in range(2):
            acc[:, j].baddbmm_(xt, p[j])


def _baddbmm_(c: Tensor, a: Tensor, b: Tensor, beta: float = 1.0) -> Tensor:
    """``c = beta c + a b`` in place over ``[h, n, ·]`` tiles.

    A tile of one head is done as a 2-D gemm: as a batch of one, a strided view of the qkv gradient has an odd
    batch stride, and ``baddbmm_`` then gemms into a temporary and copies it back (two extra passes).
    """
    if c.shape[0] == 1:
        c[0].addmm_(a[0], b[0], beta=beta)
    else:
        c.baddbmm_(a, b, beta=beta)
    return c


def _fold(shape: torch.Size, itemsize: int) -> bool:
    """Whether to fold ``[B, H, N, d]`` to ``[1, B*H, N, d]``: one sample fills less than half a tile."""
    b, h, n, d = shape
    return b > 1 and h * n * d * itemsize * 2 <= TILE_BYTES


def _folded(t: Tensor) -> Tensor:
    """``[B, H, ...]`` -> ``[1, B*H, ...]`` (a copy unless the two dims merge)."""
    return t.reshape(1, -1, *t.shape[2:])


_silu_out = torch.ops.aten.silu.out
_silu_backward_out = torch.ops.aten.silu_backward.grad_input


class SwiGLUSaved(NamedTuple):
    """What ``swiglu_backward`` needs from ``swiglu_forward``; weights ``[B', H', 2, d, d]`` (W1, W2 paired),
    or ``[B, H, d, 2d]`` (``[W1 | W2]``) for the kernel."""

    q: Tensor
    k: Tensor
    v: Tensor
    w: Tensor
    g: Tensor
    norm: Tensor
    w_new: Tensor
    # Z = k W and Y = q W': tile-ordered pairs (``_Tiles.buffer``) or [B, H, N, 2d] (kernel); None when the
    # backward recomputes them
    z: Tensor | None
    y: Tensor | None
    layout: str  # who wrote z and y: "tiles", "folded" (tiles over [1, B*H, N, d]) or "kernel" (C++)


def swiglu_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w1: Tensor,
    w2: Tensor,
    out: Tensor,
    *,
    scale: float,
    lr: float,
    grad_norm: bool,
    save: bool = True,
    recompute: bool = False,
) -> SwiGLUSaved | None:
    """Inner step and read-out, written into ``out``; returns what the backward needs (when ``save``).

    Args:
        q, k, v: ``[B, H, N, d]``, any strides.
        w1, w2: initial weights ``[1|B, H, d, d]``.
        out: ``[B, H, N, d]`` destination of ``(q W1') ⊙ silu(q W2')``, any strides (e.g. a view of the
            mixer's output).
        scale: loss scale s.
        lr: inner learning rate.
        grad_norm: apply ``G / (||G|| + 1)`` per output column.
        save: keep what ``swiglu_backward`` needs.
        recompute: keep only q, k, v and the weights: the backward recomputes the pre-activations Z, Y
            (4·d fewer values per token and head, four more ``[N, d] x [d, d]`` matmuls).
    """
    b, h, n, d = q.shape
    c = scale / n
    # One dense copy of each input: matmuls reading rows strided across a whole qkv tensor touch many more
    # pages and run slower on a CPU, on every one of the dozen passes that read them (docs/design/kernels.md).
    q, k, v = (t.contiguous() for t in (q, k, v))
    w = torch.stack([w1.expand(b, h, d, d), w2.expand(b, h, d, d)], dim=2)  # [B, H, 2, d, d]
    folded = _fold(q.shape, q.element_size())
    dest = out
    if folded:
        q, k, v, w = (_folded(t) for t in (q, k, v, w))
        out = torch.empty_like(q)
    tiles = _Tiles(k.shape, k.element_size())
    # Pass 1: G1 = kᵀ(E ⊙ A), G2 = kᵀ(E ⊙ Z1 ⊙ A'), E = -c v (the -c is applied to the small G).
    g = torch.zeros_like(w)
    keep = save and not recompute
    z_all, y_all = (tiles.buffer(k) if keep else None for _ in range(2))
    scratch = tiles.scratch(k, 3)
    one = k.new_ones(())
    for i, (bi, hs, ns) in enumerate(tiles.index):
        kt, vt = k[bi, hs, ns], v[bi, hs, ns]
        pz, pp, s0 = tiles.views(scratch, i)
        z1, z2 = _mm_pair(kt, w[bi, hs], tiles.part(z_all, i) if keep else pz)
        sig = torch.sigmoid(z2, out=s0[0])
        a = torch.mul(z2, sig, out=pp[0])  # A = silu(Z2)
        a_prime = sig.lerp_(one, a)  # A' = σ + A (1 - σ), one op
        a.mul_(vt)
        torch.mul(a_prime, z1, out=pp[1]).mul_(vt)
        _tmm_pair_acc(kt, pp, g[bi, hs])
    g.mul_(-c)
    w_new, norm = step(g, w, lr, grad_norm)
    # Pass 2: read-out (q W1') ⊙ silu(q W2'), straight into the destination.
    for i, (bi, hs, ns) in enumerate(tiles.index):
        py, _, s0 = tiles.views(scratch, i)
        y1, y2 = _mm_pair(q[bi, hs, ns], w_new[bi, hs], tiles.part(y_all, i) if keep else py)
        torch.mul(_silu_out(y2, out=s0[0]), y1, out=out[bi, hs, ns])
    if folded:
        dest.copy_(out.view(dest.shape))
    if not save:
        return None
    return SwiGLUSaved(q, k, v, w, g, norm, w_new, z_all, y_all, "folded" if folded else "tiles")


def swiglu_backward(
    d_out: Tensor,
    saved: SwiGLUSaved,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    *,
    scale: float,
    lr: float,
    grad_norm: bool,
) -> tuple[Tensor, Tensor]:
    """Gradients of ``swiglu_forward``: writes ``dq``, ``dk``, ``dv`` in place, returns ``dW1, dW2``.

    Args:
        d_out: gradient of the read-out ``[B, H, N, d]``, any strides.
        saved: the forward's ``SwiGLUSaved``.
        dq, dk, dv: ``[B, H, N, d]`` destinations, any strides (e.g. views of the qkv gradient).
        scale, lr, grad_norm: as in the forward.

    Returns:
        ``dW1, dW2`` per sample, ``[B, H, d, d]`` (sum over B for shared initial weights).
    """
    q, k, v, w, g, norm, w_new, z_all, y_all, layout = saved
    shape = d_out.shape
    c = scale / shape[-2]
    folded = layout == "folded"
    dests = (dq, dk, dv)
    if folded:
        d_out = _folded(d_out)
        dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    tiles = _Tiles(q.shape, q.element_size())
    scratch = tiles.scratch(q, 6)
    # Pass 1, read-out O = Y1 ⊙ silu(Y2): dY1 = dO ⊙ silu(Y2), dY2 = dO ⊙ Y1 ⊙ silu'(Y2),
    # dq = dY1 W1'ᵀ + dY2 W2'ᵀ, dW' = qᵀ dY.
    dw = torch.zeros_like(w_new)
    w_new_t = w_new.transpose(-2, -1)
    for i, (bi, hs, ns) in enumerate(tiles.index):
        dot = d_out[bi, hs, ns]
        dy, *_, recomputed = tiles.views(scratch, i)
        y1, y2 = (
            tiles.part(y_all, i) if y_all is not None else _mm_pair(q[bi, hs, ns], w_new[bi, hs], recomputed)
        )
        _silu_out(y2, out=dy[0]).mul_(dot)
        _silu_backward_out(torch.mul(dot, y1, out=dy[1]), y2, grad_input=dy[1])
        wt = w_new_t[bi, hs]  # [h, 2, d, d]
        dqt = _baddbmm_(dq[bi, hs, ns], dy[0], wt[:, 0], beta=0.0)
        _baddbmm_(dqt, dy[1], wt[:, 1])
        _tmm_pair_acc(q[bi, hs, ns], dy, dw[bi, hs])
    # The step: dG from dW' (dW' is also the W' -> W path of dW); -c folded into dG.
    dg = step_backward(dw, g, norm, lr, grad_norm).mul_(-c)
    # Pass 2, inner gradient G = -c kᵀ P, P = [v ⊙ A | v ⊙ Z1 ⊙ A'], A = silu(Z2), Z = k W:
    # dP = k dG, dv = dP1 ⊙ A + dP2 ⊙ Z1 ⊙ A', dZ1 = v ⊙ dP2 ⊙ A', dZ2 = v ⊙ (dP1 ⊙ A' + dP2 ⊙ Z1 ⊙ A''),
    # dk = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ, dW += kᵀ dZ.
    dg_t, w_t = dg.transpose(-2, -1), w.transpose(-2, -1)
    for i, (bi, hs, ns) in enumerate(tiles.index):
        kt, vt = k[bi, hs, ns], v[bi, hs, ns]
        dp, dz, s0, s1, s2, recomputed = tiles.views(scratch, i)
        z1, z2 = tiles.part(z_all, i) if z_all is not None else _mm_pair(kt, w[bi, hs], recomputed)
        sig = torch.sigmoid(z2, out=s0[0])
        a = torch.mul(z2, sig, out=s0[1])
        u = torch.addcmul(sig, sig, sig, value=-1.0, out=s1[0])  # σ (1 - σ)
        a_prime = sig.addcmul_(z2, u)  # A' = σ + Z2 σ (1 - σ)
        a_second = torch.add(z2, a, alpha=-2.0, out=s1[1]).add_(2.0).mul_(u)  # A'' = σ (1 - σ)(2 + Z2 - 2 A)
        dp1, dp2 = _mm_pair(kt, dg[bi, hs], dp)
        r = torch.mul(dp2, z1, out=s2[0])
        torch.mul(dp1, a, out=dv[bi, hs, ns]).addcmul_(r, a_prime)
        va = a_prime.mul_(vt)  # v ⊙ A'
        dz1 = torch.mul(dp2, va, out=dz[0])
        dz2 = torch.mul(dp1, va, out=dz[1]).addcmul_(r.mul_(vt), a_second)
        p1, p2 = a.mul_(vt), va.mul_(z1)
        gt, wt = dg_t[bi, hs], w_t[bi, hs]  # [h, 2, d, d]
        dkt = _baddbmm_(dk[bi, hs, ns], p1, gt[:, 0], beta=0.0)
        for lhs, rhs in ((p2, gt[:, 1]), (dz1, wt[:, 0]), (dz2, wt[:, 1])):
            _baddbmm_(dkt, lhs, rhs)
        _tmm_pair_acc(kt, dz, dw[bi, hs])
    if folded:
        for dest, grad in zip(dests, (dq, dk, dv)):
            dest.copy_(grad.view(shape))
    dw = dw.view(*shape[:2], *dw.shape[2:])  # [B, H, 2, d, d]
    return dw[:, :, 0], dw[:, :, 1]


@dataclass
class Passes:
    """A path's two passes: ``forward`` with ``swiglu_forward``'s signature, ``backward`` with
    ``swiglu_backward``'s (read on every call: a test may put a spy in either)."""

    forward: Callable[..., SwiGLUSaved | None]
    backward: Callable[..., tuple[Tensor, Tensor]]


PASSES = Passes(swiglu_forward, swiglu_backward)


class _SwiGLUTTT(torch.autograd.Function):
    @staticmethod
    @autocast_forward
    def forward(
        ctx,
        q,
        k,
        v,
        w1,
        w2,
        scale: float,
        lr: float,
        grad_norm: bool,
        save: bool,
        recompute: bool,
        passes: Passes,
    ):
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        hyper = {"scale": scale, "lr": lr, "grad_norm": grad_norm}
        saved = passes.forward(q, k, v, w1, w2, out, save=save, recompute=recompute, **hyper)
        if saved is not None:  # through save_for_backward, so saved-tensor hooks (checkpointing) see them
            ctx.save_for_backward(*saved[:-1])
            ctx.layout = saved.layout
        ctx.hyper, ctx.weight_shapes, ctx.passes = hyper, (w1.shape, w2.shape), passes
        return out

    @staticmethod
    @autocast_backward
    @once_differentiable
    def backward(ctx, d_out):
        dq, dk, dv = (torch.empty(d_out.shape, dtype=d_out.dtype, device=d_out.device) for _ in range(3))
        dw1, dw2 = ctx.passes.backward(
            d_out, SwiGLUSaved(*ctx.saved_tensors, ctx.layout), dq, dk, dv, **ctx.hyper
        )
        s1, s2 = ctx.weight_shapes
        return dq, dk, dv, weight_grad(dw1, s1), weight_grad(dw2, s2), *([None] * 6)


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
    recompute: bool = False,
    passes: Passes = PASSES,
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
        recompute: memory-lean backward: recompute the pre-activations Z, Y instead of saving them.
        passes: the tiled PyTorch passes (``PASSES``) or the C++ kernel's (``swiglu.cpp.PASSES``).

    Returns:
        ``(q W1') ⊙ silu(q W2')`` ``[B, H, N, d]``, W' the per-sample weights after the step.
    """
    save = grad_flows(q, k, v, w1, w2)
    return _SwiGLUTTT.apply(q, k, v, w1, w2, scale, lr, grad_norm, save, recompute, passes)


def node(
    passes: Passes,
    copies: Callable[[Tensor], bool],
    mix: Callable[..., tuple[int, int]] | None = None,
    whole: Callable[[], Whole] | None = None,
) -> Node:
    """The fused node's hooks of a path's ``passes``; ``copies``, ``mix`` and ``whole`` as ``Node`` has
    them."""

    def forward(x: NodeCall) -> tuple[list[Tensor], str]:
        h = x.hyper
        q, k, v = (t.contiguous() for t in (x.q, x.k, x.v)) if x.dense else (x.q, x.k, x.v)
        saved = passes.forward(
            q, k, v, *x.weights, x.dest, scale=h.scale, lr=h.lr, grad_norm=h.grad_norm, save=x.save,
            recompute=h.recompute,
        )  # fmt: skip
        return ([], "") if saved is None else (list(saved[:-1]), saved.layout)

    def backward(
        d_out: Tensor, saved: tuple[Tensor, ...], tag: str, dq: Tensor, dk: Tensor, dv: Tensor, h: Hyper
    ) -> tuple[Tensor, Tensor]:
        hyper = {"scale": h.scale, "lr": h.lr, "grad_norm": h.grad_norm}
        return passes.backward(d_out, SwiGLUSaved(*saved, tag), dq, dk, dv, **hyper)

    return Node(heads=True, forward=forward, backward=backward, copies=copies, mix=mix, whole=whole)


# The tiled path copies q, k, v dense.
NODE = node(PASSES, copies=lambda q: True)
