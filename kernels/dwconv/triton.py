"""The Triton kernels of the 3x3 depthwise-conv op on an H x W raster grid of tokens.

Weights are ``[9 taps, channels]``; tap ``(ty, tx)`` reads the neighbour at offset ``(ty - 1, tx - 1)`` with
zero padding (PyTorch's conv2d, padding 1). The weight enters only through the read-out, so
``dW = Σ_b dW'``. No dots: the tiles are upcast to ACC as they are loaded. The step and its backward run in
the read-out and gradient-backward programs (each sums the chunks' partials: 9 taps x channels), the
weight-gradient reduction is the one every op shares (``vit3.kernels.triton.step``); each chunk of tokens is
one program (``jit.program``).

The formulas of the forward and the backward: ``docs/design/kernels.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton.jit import (
    chunk_of,
    col_norm,
    load_mat,
    load_tile,
    norm_at,
    saved,
    slot_at,
    step_bwd_cols,
    stepped,
    store_mat,
    store_tile,
    sum_slots,
    updated,
)

__all__ = [
    "conv_grad_bwd_kernel",
    "conv_grad_partial_kernel",
    "conv_readout_bwd_kernel",
    "conv_readout_kernel",
]


@triton.jit
def _taps():
    """The rows of a tile of taps: 9, padded to 16."""
    return tl.arange(0, 16)


@triton.jit
def _tap(tile, tap):
    """Row ``tap`` of a ``[16, BLOCK_D]`` tile of taps, as a ``[BLOCK_D]`` vector."""
    return tl.sum(tl.where(_taps()[:, None] == tap, tile, 0.0), axis=0)


@triton.jit
def _shifted(
    base, stride_n, stride_c, rows, cols, tap, MIRROR: tl.constexpr, n_tok, h, w, d, ACC: tl.constexpr
):
    """The tokens tap ``tap`` reads for raster tokens ``rows``: at grid offset
    ``(tap // 3 - 1, tap % 3 - 1)``, or the opposite one (``MIRROR``), zero where outside the grid."""
    if MIRROR:
        dy = 1 - tap // 3
        dx = 1 - tap % 3
    else:
        dy = tap // 3 - 1
        dx = tap % 3 - 1
    i = rows // w
    j = rows % w
    ii = i + dy
    jj = j + dx
    ok = (rows < n_tok) & (ii >= 0) & (ii < h) & (jj >= 0) & (jj < w)
    idx = tl.where(ok, ii * w + jj, 0)
    mask = ok[:, None] & (cols[None, :] < d)
    return tl.load(base + idx[:, None] * stride_n + cols[None, :] * stride_c, mask=mask, other=0.0).to(ACC)


@triton.jit
def _conv(taps, base, stride_n, stride_c, rows, cols, MIRROR: tl.constexpr, n_tok, h, w, d,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``Σ_δ taps[δ, c] x[p + δ, c]`` (``MIRROR``: ``x[p - δ, c]``) of the raster tokens ``p`` in ``rows``:
    ``[BLOCK_N, BLOCK_D]``."""
    y = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    for tap in tl.static_range(9):
        xs = _shifted(base, stride_n, stride_c, rows, cols, tap, MIRROR, n_tok, h, w, d, ACC)
        y += _tap(taps, tap)[None, :] * xs
    return y


@triton.jit
def _correlate(acc, e, base, stride_n, stride_c, rows, cols, n_tok, h, w, d, ACC: tl.constexpr):
    """``acc`` (a ``[16, BLOCK_D]`` tile of taps) plus ``Σ_p e[p, c] x[p + δ, c]`` over the raster tokens
    ``p`` in ``rows``, row ``δ`` per tap."""
    for tap in tl.static_range(9):
        xs = _shifted(base, stride_n, stride_c, rows, cols, tap, False, n_tok, h, w, d, ACC)
        acc += tl.where(_taps()[:, None] == tap, tl.sum(e * xs, axis=0)[None, :], 0.0)
    return acc


@triton.jit
def conv_grad_partial_kernel(
    k_ptr, v_ptr, part_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    skb, skg, skn, skc, svb, svg, svn, svc,
    coef: tl.float64,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """Partial ``G[δ, c]`` of one chunk of tokens into ``part_ptr`` ``[B*G, S, 9, d]``."""
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        coef = tl.cast(coef, ACC)
    dead, _c, s, bg, b, g, lo, hi = chunk_of(BG, G, N, CHUNK, S, 1, PID0)
    if dead:
        return
    rd = tl.arange(0, BLOCK_D)
    acc = tl.zeros((16, BLOCK_D), dtype=ACC)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    for start in range(lo, hi, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        e = -coef * load_tile(v_base, svn, svc, rows, rd, N, D).to(ACC)
        acc = _correlate(acc, e, k_base, skn, skc, rows, rd, N, H, W, D, ACC)
    store_mat(slot_at(part_ptr, bg, s, S, 0, 1, 9, D), _taps(), rd, 9, D, acc)


@triton.jit
def conv_readout_kernel(
    q_ptr, w_ptr, part_ptr, g_ptr, n_ptr, o_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    sqb, sqg, sqn, sqc, sob, sog, son, soc,
    swg, swr, swc,
    lr: tl.float64,
    GRAD_NORM: tl.constexpr, SAVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """The step and ``out = dwconv3x3(q; W')`` for one chunk of tokens: each program sums the ``S``
    partials of ``part_ptr`` ``[B*G, S, 9, d]`` in order into ``G`` (a few thousand numbers: no step launch)
    and takes ``W' = W - lr G / (||G|| + 1)``; with ``SAVE`` the first chunk's program stores ``G`` and
    ``||G||`` for the backward."""
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        lr = tl.cast(lr, ACC)
    dead, _c, s, bg, b, g, lo, hi = chunk_of(BG, G, N, CHUNK, S, 1, PID0)
    if dead:
        return
    rd = tl.arange(0, BLOCK_D)
    grad = sum_slots(part_ptr, bg, S, S, 0, 1, _taps(), rd, 9, D, 16, BLOCK_D, ACC)
    norm = col_norm(grad)
    if SAVE:
        if s == 0:
            store_mat(slot_at(g_ptr, bg, 0, 1, 0, 1, 9, D), _taps(), rd, 9, D, grad)
            tl.store(norm_at(n_ptr, bg, 0, 1, D, rd), norm.to(n_ptr.dtype.element_ty), mask=rd < D)
    wp = stepped(load_mat(w_ptr + g * swg, swr, swc, _taps(), rd, 9, D, ACC), grad, norm, lr, GRAD_NORM)
    q_base = q_ptr + b * sqb + g * sqg
    o_base = o_ptr + b * sob + g * sog
    for start in range(lo, hi, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        y = _conv(wp, q_base, sqn, sqc, rows, rd, False, N, H, W, D, BLOCK_N, BLOCK_D, ACC)
        store_tile(o_base, son, soc, rows, rd, N, D, y)


@triton.jit
def conv_readout_bwd_kernel(
    q_ptr, do_ptr, w_ptr, g_ptr, n_ptr, dq_ptr, part_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    sqb, sqg, sqn, sqc, sdob, sdog, sdon, sdoc, sdqb, sdqg, sdqn, sdqc,
    swg, swr, swc,
    lr: tl.float64,
    GRAD_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """Read-out backward for one chunk: ``dq`` (written) and the partial ``dW'``, into slot ``s`` of
    ``part_ptr`` ``[B*G, S + 1, 9, d]``."""
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        lr = tl.cast(lr, ACC)
    dead, _c, s, bg, b, g, lo, hi = chunk_of(BG, G, N, CHUNK, S, 1, PID0)
    if dead:
        return
    rd = tl.arange(0, BLOCK_D)
    q_base = q_ptr + b * sqb + g * sqg
    do_base = do_ptr + b * sdob + g * sdog
    dq_base = dq_ptr + b * sdqb + g * sdqg
    wp = updated(w_ptr + g * swg, swr, swc, g_ptr, n_ptr, bg, 0, 1, _taps(), rd, 9, D, lr, GRAD_NORM, ACC)
    acc = tl.zeros((16, BLOCK_D), dtype=ACC)
    for start in range(lo, hi, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        do = load_tile(do_base, sdon, sdoc, rows, rd, N, D).to(ACC)
        acc = _correlate(acc, do, q_base, sqn, sqc, rows, rd, N, H, W, D, ACC)
        dq = _conv(wp, do_base, sdon, sdoc, rows, rd, True, N, H, W, D, BLOCK_N, BLOCK_D, ACC)
        store_tile(dq_base, sdqn, sdqc, rows, rd, N, D, dq)
    store_mat(slot_at(part_ptr, bg, s, S + 1, 0, 1, 9, D), _taps(), rd, 9, D, acc)


@triton.jit
def conv_grad_bwd_kernel(
    k_ptr, v_ptr, part_ptr, g_ptr, n_ptr, dk_ptr, dv_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    skb, skg, skn, skc, svb, svg, svn, svc,
    sdkb, sdkg, sdkn, sdkc, sdvb, sdvg, sdvn, sdvc,
    coef: tl.float64, lr: tl.float64,
    GRAD_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """The step's backward and the inner-gradient backward for one chunk: each program sums the read-out
    partials (slots ``0..S-1`` of ``part_ptr`` ``[B*G, S + 1, 9, d]``) in order into ``dW'`` (the first
    chunk's program stores it in slot ``S`` for the weight gradient), takes ``dG`` through the step with the
    saved ``G`` and ``||G||`` (no step launch), and writes ``dk``, ``dv`` (the inner gradient does not depend
    on the weight: no weight-gradient partial)."""
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        coef, lr = tl.cast(coef, ACC), tl.cast(lr, ACC)
    dead, _c, s, bg, b, g, lo, hi = chunk_of(BG, G, N, CHUNK, S, 1, PID0)
    if dead:
        return
    rd = tl.arange(0, BLOCK_D)
    dwp = sum_slots(part_ptr, bg, S, S + 1, 0, 1, _taps(), rd, 9, D, 16, BLOCK_D, ACC)
    if s == 0:
        store_mat(slot_at(part_ptr, bg, S, S + 1, 0, 1, 9, D), _taps(), rd, 9, D, dwp)
    grad, norm = saved(g_ptr, n_ptr, bg, 0, 1, _taps(), rd, 9, D, ACC)
    dg = -coef * step_bwd_cols(dwp, grad, norm, lr, GRAD_NORM)  # the loss scale once, on 9 taps
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    dk_base = dk_ptr + b * sdkb + g * sdkg
    dv_base = dv_ptr + b * sdvb + g * sdvg
    for start in range(lo, hi, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        dk = _conv(dg, v_base, svn, svc, rows, rd, True, N, H, W, D, BLOCK_N, BLOCK_D, ACC)
        de = _conv(dg, k_base, skn, skc, rows, rd, False, N, H, W, D, BLOCK_N, BLOCK_D, ACC)
        store_tile(dk_base, sdkn, sdkc, rows, rd, N, D, dk)
        store_tile(dv_base, sdvn, sdvc, rows, rd, N, D, de)
