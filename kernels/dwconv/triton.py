"""The Triton kernels of the 3x3 depthwise-conv op on an H x W raster grid of tokens.

Weights are ``[9 taps, channels]``; tap ``(ty, tx)`` reads the neighbour at offset ``(ty - 1, tx - 1)`` with
zero padding (PyTorch's conv2d, padding 1)::

    G[δ, c] = Σ_p E[p, c] k[p + δ, c]           out[p, c] = Σ_δ W'[δ, c] q[p + δ, c]
    dW'[δ, c] = Σ_p dO[p, c] q[p + δ, c]        dq[p, c] = Σ_δ W'[δ, c] dO[p - δ, c]
    dv[p, c] = -coef Σ_δ dG[δ, c] k[p + δ, c]   dk[p, c] = Σ_δ dG[δ, c] E[p - δ, c]

The weight enters only through the read-out (E does not depend on it), so dW = Σ_b dW'. No dots: the tiles
are upcast to ACC as they are loaded. The step, its backward and the weight-gradient reduction are the
kernels every op shares (``vit3.kernels.triton.step``, with ``R`` = 9 rows); each chunk of tokens is one
program (``jit.program``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton.jit import load_mat, load_tile, program, slot_at, store_mat, store_tile, tokens_of, updated

__all__ = [
    "conv_grad_bwd_kernel",
    "conv_grad_partial_kernel",
    "conv_readout_bwd_kernel",
    "conv_readout_kernel",
]


@triton.jit
def _load_shifted(base, stride_n, stride_c, rows, cols, dy, dx, n_tok, h, w, d, ACC: tl.constexpr):
    """Tokens at grid offset ``(dy, dx)`` from raster tokens ``rows`` (zero where outside the grid)."""
    i = rows // w
    j = rows % w
    ii = i + dy
    jj = j + dx
    ok = (rows < n_tok) & (ii >= 0) & (ii < h) & (jj >= 0) & (jj < w)
    idx = tl.where(ok, ii * w + jj, 0)
    mask = ok[:, None] & (cols[None, :] < d)
    return tl.load(base + idx[:, None] * stride_n + cols[None, :] * stride_c, mask=mask, other=0.0).to(ACC)


@triton.jit
def _tap(tile, rr, tap):
    """Row ``tap`` of a ``[BLOCK_R, BLOCK_D]`` tile, as a ``[BLOCK_D]`` vector."""
    return tl.sum(tl.where(rr[:, None] == tap, tile, 0.0), axis=0)


@triton.jit
def conv_grad_partial_kernel(
    k_ptr, v_ptr, part_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    skb, skg, skn, skc, svb, svg, svn, svc,
    coef,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Partial ``G[δ, c]`` of one chunk of tokens into ``part_ptr`` ``[B*G, S, 9, d]``."""
    pid, _c, s, bg = program(S, 1)
    if pid >= BG * S:
        return
    b, g, lo, hi = tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    acc = tl.zeros((16, BLOCK_D), dtype=ACC)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        e = -coef * load_tile(v_base, svn, svc, rows, rd, N, D).to(ACC)
        for tap in tl.static_range(9):
            ks = _load_shifted(k_base, skn, skc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            acc += tl.where(rr[:, None] == tap, tl.sum(e * ks, axis=0)[None, :], 0.0)
    store_mat(slot_at(part_ptr, bg, s, S, 0, 1, 9, D), rr, rd, 9, D, acc)


@triton.jit
def conv_readout_kernel(
    q_ptr, w_ptr, g_ptr, n_ptr, o_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    sqb, sqg, sqn, sqc, sob, sog, son, soc,
    swg, swr, swc,
    lr,
    GRAD_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """``out = dwconv3x3(q; W')`` for one chunk of tokens (``W'`` recomputed from the weight, ``G``, ``||G||``)."""
    pid, _c, s, bg = program(S, 1)
    if pid >= BG * S:
        return
    b, g, lo, hi = tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    wp = updated(w_ptr + g * swg, swr, swc, g_ptr, n_ptr, bg, 0, 1, rr, rd, 9, D, lr, GRAD_NORM, ACC)
    q_base = q_ptr + b * sqb + g * sqg
    o_base = o_ptr + b * sob + g * sog
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        y = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
        for tap in tl.static_range(9):
            qs = _load_shifted(q_base, sqn, sqc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            y += _tap(wp, rr, tap)[None, :] * qs
        store_tile(o_base, son, soc, rows, rd, N, D, y)


@triton.jit
def conv_readout_bwd_kernel(
    q_ptr, do_ptr, w_ptr, g_ptr, n_ptr, dq_ptr, part_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    sqb, sqg, sqn, sqc, sdob, sdog, sdon, sdoc, sdqb, sdqg, sdqn, sdqc,
    swg, swr, swc,
    lr,
    GRAD_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Read-out backward for one chunk: ``dq`` (written) and the partial ``dW'`` (slots of ``[B*G, S+1, 9, d]``)."""
    pid, _c, s, bg = program(S, 1)
    if pid >= BG * S:
        return
    b, g, lo, hi = tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    wp = updated(w_ptr + g * swg, swr, swc, g_ptr, n_ptr, bg, 0, 1, rr, rd, 9, D, lr, GRAD_NORM, ACC)
    q_base = q_ptr + b * sqb + g * sqg
    do_base = do_ptr + b * sdob + g * sdog
    dq_base = dq_ptr + b * sdqb + g * sdqg
    acc = tl.zeros((16, BLOCK_D), dtype=ACC)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        do = load_tile(do_base, sdon, sdoc, rows, rd, N, D).to(ACC)
        dq = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
        for tap in tl.static_range(9):
            qs = _load_shifted(q_base, sqn, sqc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            acc += tl.where(rr[:, None] == tap, tl.sum(do * qs, axis=0)[None, :], 0.0)
            dos = _load_shifted(do_base, sdon, sdoc, rows, rd, 1 - tap // 3, 1 - tap % 3, N, H, W, D, ACC)
            dq += _tap(wp, rr, tap)[None, :] * dos
        store_tile(dq_base, sdqn, sdqc, rows, rd, N, D, dq)
    store_mat(slot_at(part_ptr, bg, s, S + 1, 0, 1, 9, D), rr, rd, 9, D, acc)


@triton.jit
def conv_grad_bwd_kernel(
    k_ptr, v_ptr, dg_ptr, dk_ptr, dv_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    skb, skg, skn, skc, svb, svg, svn, svc,
    sdkb, sdkg, sdkn, sdkc, sdvb, sdvg, sdvn, sdvc,
    coef,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Inner-gradient backward for one chunk: ``dk``, ``dv`` (the inner gradient does not depend on the weight,
    so there is no weight-gradient partial)."""
    pid, _c, s, bg = program(S, 1)
    if pid >= BG * S:
        return
    b, g, lo, hi = tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    dg = load_mat(slot_at(dg_ptr, bg, 0, 1, 0, 1, 9, D), D, 1, rr, rd, 9, D, ACC)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    dk_base = dk_ptr + b * sdkb + g * sdkg
    dv_base = dv_ptr + b * sdvb + g * sdvg
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
        de = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
        for tap in tl.static_range(9):
            row = _tap(dg, rr, tap)[None, :]
            de += row * _load_shifted(k_base, skn, skc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            dk += row * _load_shifted(v_base, svn, svc, rows, rd, 1 - tap // 3, 1 - tap % 3, N, H, W, D, ACC)
        store_tile(dk_base, sdkn, sdkc, rows, rd, N, D, -coef * dk)
        store_tile(dv_base, sdvn, sdvc, rows, rd, N, D, -coef * de)
