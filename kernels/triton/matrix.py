"""The Triton kernels of the inner models with ``d x d`` weights: one full-batch linear or SwiGLU step.

Per (sample b, head g) with tokens ``q, k, v [N, d]`` and initial weights ``W [d, d]`` (``W1, W2`` for
SwiGLU), the forward computes the inner gradient ``G = kᵀ P``, its column norms ``||G||``, the step
``W' = W - lr G / (||G|| + 1)`` and the read-out ``O = f(q; W')``; only ``G`` and ``||G||`` are saved for the
backward. Every program owns one block of ``BLOCK_C`` output columns; a (sample, head) may be split along N
into ``S`` chunks (``tiles.launch_config``). Constexpr switches: ``SWIGLU``, ``MSE``, ``GRAD_NORM``,
``PREC``, ``DOT`` / ``EMU``, ``COLS`` / ``CROSS`` / ``FUSED``, ``WGRAD``, ``TRANS``, ``STACK``; ``NW`` = 2
weights for SwiGLU, 1 for linear.

The launches, the dot operands, the column blocks and the switches: ``docs/design/kernels.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit import (
    chunk_of,
    col_norm,
    last_to_arrive,
    load_mat,
    load_tile,
    norm_at,
    operand,
    slot_at,
    step_bwd_tile,
    stepped,
    store_mat,
    store_tile,
    updated,
)
from .step import step_bwd_sum, step_sum

__all__ = [
    "forward_kernel",
    "grad_bwd_kernel",
    "grad_partial_kernel",
    "readout_bwd_kernel",
    "readout_kernel",
]


@triton.jit
def _chunk_columns(BG, G, N, CHUNK, S, D, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, PID0):
    """This program's chunk of tokens and block of ``BLOCK_C`` output columns (:func:`chunk_of` over
    ``cdiv(D, BLOCK_C)`` column blocks): ``(dead, c, s, bg, b, g, lo, hi, rd, cols)``, ``rd`` the weights'
    rows. A ``dead`` program (the tail of a folded grid) must return."""
    dead, c, s, bg, b, g, lo, hi = chunk_of(BG, G, N, CHUNK, S, tl.cdiv(D, BLOCK_C), PID0)
    return dead, c, s, bg, b, g, lo, hi, tl.arange(0, BLOCK_D), c * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def _store_pair(buf, bg, slot, slots, rd, cols, D, x1, x2, SWIGLU: tl.constexpr):
    """Stores the ``[BLOCK_D, BLOCK_C]`` tile(s) of one column block into a ``[B*G, slots, NW, d, d]``
    buffer (``x2``: the second weight, SwiGLU only)."""
    nw: tl.constexpr = 2 if SWIGLU else 1
    store_mat(slot_at(buf, bg, slot, slots, 0, nw, D, D), rd, cols, D, D, x1)
    if SWIGLU:
        store_mat(slot_at(buf, bg, slot, slots, 1, nw, D, D), rd, cols, D, D, x2)


@triton.jit
def _load_pair(buf, bg, slot, slots, rd, cols, D, SWIGLU: tl.constexpr, ACC: tl.constexpr):
    """The tile(s) ``_store_pair`` stores; the linear model gets its one tile twice."""
    nw: tl.constexpr = 2 if SWIGLU else 1
    x1 = load_mat(slot_at(buf, bg, slot, slots, 0, nw, D, D), D, 1, rd, cols, D, D, ACC)
    if SWIGLU:
        x2 = load_mat(slot_at(buf, bg, slot, slots, 1, nw, D, D), D, 1, rd, cols, D, D, ACC)
    else:
        x2 = x1
    return x1, x2


@triton.jit
def _weights(w1_ptr, w2_ptr, g, swg, swr, swc, rd, cols, D, SWIGLU: tl.constexpr, ACC: tl.constexpr):
    """Columns ``cols`` of the initial weights of head ``g``: ``[BLOCK_D, BLOCK_C]`` tiles ``(W1, W2)``
    (the linear model gets ``W`` twice)."""
    m1 = load_mat(w1_ptr + g * swg, swr, swc, rd, cols, D, D, ACC)
    if SWIGLU:
        m2 = load_mat(w2_ptr + g * swg, swr, swc, rd, cols, D, D, ACC)
    else:
        m2 = m1
    return m1, m2


@triton.jit
def _updated_operands(w1_ptr, w2_ptr, g, swg, swr, swc, g_buf, n_buf, bg, rd, cols, D, lr,
                      SWIGLU: tl.constexpr, GRAD_NORM: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr,
                      ACC: tl.constexpr):  # fmt: skip
    """``(W1', W2')`` columns ``cols`` of (sample, head) ``bg`` as dot operands (the linear model gets ``W'``
    twice)."""
    nw: tl.constexpr = 2 if SWIGLU else 1
    m1 = updated(w1_ptr + g * swg, swr, swc, g_buf, n_buf, bg, 0, nw, rd, cols, D, D, lr, GRAD_NORM, ACC)
    if SWIGLU:
        m2 = updated(w2_ptr + g * swg, swr, swc, g_buf, n_buf, bg, 1, nw, rd, cols, D, D, lr, GRAD_NORM, ACC)
    else:
        m2 = m1
    return operand(m1, DOT, EMU), operand(m2, DOT, EMU)


@triton.jit
def _grad_bwd_operands(w1_ptr, w2_ptr, g, swg, swr, swc, dg_buf, bg, rd, cols, D, SWIGLU: tl.constexpr,
                       DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Columns ``cols`` of the initial weights and of ``dG`` (``[B*G, NW, d, d]``) as dot operands:
    ``(W1, W2, dG1, dG2)``."""
    w1, w2 = _weights(w1_ptr, w2_ptr, g, swg, swr, swc, rd, cols, D, SWIGLU, ACC)
    dg1, dg2 = _load_pair(dg_buf, bg, 0, 1, rd, cols, D, SWIGLU, ACC)
    return operand(w1, DOT, EMU), operand(w2, DOT, EMU), operand(dg1, DOT, EMU), operand(dg2, DOT, EMU)


@triton.jit
def _zero_pair(BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """Two ``[BLOCK_D, BLOCK_C]`` accumulators, one per weight (the second is dead code for linear)."""
    return tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC), tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)


@triton.jit
def _swiglu_acts(z2):
    """``σ(z2)``, ``A = silu(z2)`` and ``A' = silu'(z2) = σ (1 + z2 (1 - σ))``."""
    sig = tl.sigmoid(z2)
    return sig, z2 * sig, sig * (1.0 + z2 * (1.0 - sig))


# ------------------------------------------------------------------------------------------ per-tile math
# A stage may hold its token tiles transposed, channels x tokens (``TRANS``): every dot then has ``BLOCK_D``
# or ``BLOCK_C`` rows whatever the token tile (sm_90's ``wgmma`` takes 64), and short token tiles keep to
# one warp group's registers. The stages' three products, in either orientation:


@triton.jit
def _xw(x, w, TRANS: tl.constexpr, PREC: tl.constexpr):
    """``x w``, tokens through weight columns: ``[BLOCK_N, BLOCK_C]`` (``TRANS``: ``wᵀ xᵀ`` from ``xᵀ``)."""
    if TRANS:
        y = tl.dot(tl.trans(w), x, input_precision=PREC)
    else:
        y = tl.dot(x, w, input_precision=PREC)
    return y


@triton.jit
def _channels_first(x, TRANS: tl.constexpr):
    """A token tile as ``xᵀ`` ``[BLOCK_D, BLOCK_N]``, the left operand of ``_xtp``."""
    if TRANS:
        y = x
    else:
        y = tl.trans(x)
    return y


@triton.jit
def _xtp(xt, p, TRANS: tl.constexpr, PREC: tl.constexpr):
    """``xᵀ p``, a token tile's share of a weight gradient: ``[BLOCK_D, BLOCK_C]``, from ``xᵀ``
    (``_channels_first``) and ``p`` (``TRANS``: ``pᵀ``)."""
    if TRANS:
        y = tl.dot(xt, tl.trans(p), input_precision=PREC)
    else:
        y = tl.dot(xt, p, input_precision=PREC)
    return y


@triton.jit
def _pwt(p, w, TRANS: tl.constexpr, PREC: tl.constexpr):
    """``p wᵀ``, back through weight columns to every channel: ``[BLOCK_N, BLOCK_D]`` (``TRANS``: ``w pᵀ``
    from ``pᵀ``)."""
    if TRANS:
        y = tl.dot(w, p, input_precision=PREC)
    else:
        y = tl.dot(p, tl.trans(w), input_precision=PREC)
    return y


@triton.jit
def _zero_wgrad(BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, STACK: tl.constexpr, ACC: tl.constexpr):
    """The weight-gradient accumulators of a token loop: ``_zero_pair``, or (``STACK``) one
    ``[2 * BLOCK_C, BLOCK_D]`` accumulator of ``_xtp_stacked`` (the second is unused)."""
    if STACK:
        acc = tl.zeros((2 * BLOCK_C, BLOCK_D), dtype=ACC)
        pair = acc, acc
    else:
        pair = _zero_pair(BLOCK_D, BLOCK_C, ACC)
    return pair


@triton.jit
def _xtp_stacked(x, p1, p2, TRANS: tl.constexpr, PREC: tl.constexpr):
    """``xᵀ p1`` and ``xᵀ p2`` as one product ``[p1 | p2]ᵀ x``, ``[2 * BLOCK_C, BLOCK_D]`` (``STACK``: the
    64 rows sm_90's ``wgmma`` needs at d = 32), from the token tile ``x`` as loaded and the operands ``p*``
    (``TRANS``: ``xᵀ`` and ``p*ᵀ``)."""
    if TRANS:
        pt = tl.reshape(tl.permute(tl.join(p1, p2), (2, 0, 1)), (2 * p1.shape[0], p1.shape[1]))
        y = tl.dot(pt, tl.trans(x), input_precision=PREC)
    else:
        pt = tl.reshape(tl.permute(tl.join(p1, p2), (2, 1, 0)), (2 * p1.shape[1], p1.shape[0]))
        y = tl.dot(pt, x, input_precision=PREC)
    return y


@triton.jit
def _wgrad_pair(acc1, acc2, STACK: tl.constexpr):
    """``_zero_wgrad``'s accumulators after the token loop as ``[BLOCK_D, BLOCK_C]`` tiles, one per
    weight."""
    if STACK:
        d: tl.constexpr = acc1.shape[1]
        c: tl.constexpr = acc1.shape[0] // 2
        pair = tl.split(tl.permute(tl.reshape(acc1, (2, c, d)), (2, 1, 0)))
    else:
        pair = acc1, acc2
    return pair


@triton.jit
def _load_rows(base, sn, sc, rows, cols, N, D, TRANS: tl.constexpr):
    """Tokens ``rows``, channels ``cols`` of an ``[N, D]`` tensor (strides ``sn, sc``): a
    ``[len(rows), len(cols)]`` tile, or its transpose (``TRANS``)."""
    if TRANS:
        x = load_tile(base, sc, sn, cols, rows, D, N)
    else:
        x = load_tile(base, sn, sc, rows, cols, N, D)
    return x


@triton.jit
def _store_rows(base, sn, sc, rows, cols, N, D, x, TRANS: tl.constexpr):
    """Stores ``x`` where ``_load_rows`` loads its tile."""
    if TRANS:
        store_tile(base, sc, sn, cols, rows, D, N, x)
    else:
        store_tile(base, sn, sc, rows, cols, N, D, x)


@triton.jit
def _pairs(x):
    """``x`` ``[R, C]`` as its even and odd columns (channel pairs ``(2j, 2j + 1)``), ``[R, C / 2]`` each."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


@triton.jit
def _unpairs(even, odd):
    """The ``[R, C]`` tile of ``_pairs`` ``(even, odd)``."""
    return tl.reshape(tl.join(even, odd), (even.shape[0], 2 * even.shape[1]))


@triton.jit
def _rope_cs(cs_h, HALF, rows, cols, N, D):
    """RoPE's cos and sin at tokens ``rows`` for the channel pairs of ``cols`` (``[len(rows), len(cols) / 2]``
    each): from ``cs_h``, the ``[N, HALF, 2]`` table of (cos, sin) from this head's first pair on."""
    return _pairs(load_tile(cs_h, 2 * HALF, 1, rows, cols, N, D))


@triton.jit
def _qk_rows(base, sn, sc, rows, cols, N, D, cs_h, HALF, TRANS: tl.constexpr, ROPE: tl.constexpr,
             ACC: tl.constexpr):  # fmt: skip
    """Tokens ``rows`` of q or k, every channel (``cols``: the head's, from 0): ``_load_rows``'s tile, rotated
    by RoPE on the way in (``ROPE``: ``(re, im) -> (re cos - im sin, re sin + im cos)`` per channel pair, in
    ``ACC``, the table's dtype)."""
    if ROPE:
        re, im = _pairs(load_tile(base, sn, sc, rows, cols, N, D).to(ACC))
        c, s = _rope_cs(cs_h, HALF, rows, cols, N, D)
        x = _unpairs(re * c - im * s, re * s + im * c)
        if TRANS:
            x = tl.trans(x)
    else:
        x = _load_rows(base, sn, sc, rows, cols, N, D, TRANS)
    return x


@triton.jit
def _qk_store(base, sn, sc, rows, cols, N, D, x, cs_h, HALF, TRANS: tl.constexpr, ROPE: tl.constexpr):
    """Stores dq or dk ``x`` (in the accumulation dtype) where ``_qk_rows`` loads q or k, rotated back first
    (``ROPE``: by the transpose of the rotation, from the rotated frame to the inputs')."""
    if ROPE:
        if TRANS:
            x = tl.trans(x)
        re, im = _pairs(x)
        c, s = _rope_cs(cs_h, HALF, rows, cols, N, D)
        store_tile(base, sn, sc, rows, cols, N, D, _unpairs(re * c + im * s, im * c - re * s))
    else:
        _store_rows(base, sn, sc, rows, cols, N, D, x, TRANS)


@triton.jit
def _rope_heads(cs_ptr, g, G, D):
    """Head ``g``'s RoPE table for ``_rope_cs``: the ``[N, G d / 2, 2]`` (cos, sin) table from its first
    channel pair on, and the table's pairs per token."""
    return cs_ptr + g * D, G * D // 2


@triton.jit
def _token_tiles(x_base, y_base, sxn, sxc, syn, syc, rows, rd, cols, N, D, cs_h, HALF,
                 TRANS: tl.constexpr, ROPE: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr,
                 ACC: tl.constexpr):  # fmt: skip
    """Tokens ``rows`` of ``x`` (q or k: every channel, rotated where ``ROPE``, as a dot operand) and of
    ``y`` (the block's columns ``cols``, in ``ACC``): the ``(k, v)`` or ``(q, dO)`` tiles of a token loop
    (``TRANS``: transposed)."""
    x = operand(_qk_rows(x_base, sxn, sxc, rows, rd, N, D, cs_h, HALF, TRANS, ROPE, ACC), DOT, EMU)
    y = _load_rows(y_base, syn, syc, rows, cols, N, D, TRANS).to(ACC)
    return x, y


@triton.jit
def _grad_tiles(k_base, v_base, lo, hi, w1_ptr, w2_ptr, g, skn, skc, svn, svc, swg, swr, swc, N, D, rd, cols,
                cs_h, HALF, SWIGLU: tl.constexpr, MSE: tl.constexpr, TRANS: tl.constexpr,
                STACK: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr,
                ACC: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """The initial weights' columns ``cols`` (``_weights``) and ``kᵀ P / coef`` of tokens ``lo .. hi`` for
    that column block: ``(w1, w2, acc1, acc2)``, ``[BLOCK_D, BLOCK_C]`` each.

    ``P / coef`` is ``-v ⊙ A`` and ``-v ⊙ Z1 ⊙ A'`` (SwiGLU), ``kW - v`` (MSE) or ``-v`` (dot loss). Padded
    rows load ``k = v = 0``, so they add nothing.
    """
    w1, w2 = _weights(w1_ptr, w2_ptr, g, swg, swr, swc, rd, cols, D, SWIGLU, ACC)
    o1 = operand(w1, DOT, EMU)
    o2 = operand(w2, DOT, EMU)
    acc1, acc2 = _zero_wgrad(BLOCK_D, BLOCK_C, STACK, ACC)
    for start in range(lo, hi, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        k, v = _token_tiles(k_base, v_base, skn, skc, svn, svc, rows, rd, cols, N, D, cs_h, HALF,
                            TRANS, ROPE, DOT, EMU, ACC)  # fmt: skip
        kt = _channels_first(k, TRANS)
        if SWIGLU:
            z1 = _xw(k, o1, TRANS, PREC)
            z2 = _xw(k, o2, TRANS, PREC)
            _, a, da = _swiglu_acts(z2)
            if STACK:
                p2 = operand(-v * z1 * da, DOT, EMU)
                acc1 += _xtp_stacked(k, operand(-v * a, DOT, EMU), p2, TRANS, PREC)
            else:
                acc1 += _xtp(kt, operand(-v * a, DOT, EMU), TRANS, PREC)
                acc2 += _xtp(kt, operand(-v * z1 * da, DOT, EMU), TRANS, PREC)
        else:
            if MSE:
                e = _xw(k, o1, TRANS, PREC) - v
            else:
                e = -v
            acc1 += _xtp(kt, operand(e, DOT, EMU), TRANS, PREC)
    acc1, acc2 = _wgrad_pair(acc1, acc2, STACK)
    return w1, w2, acc1, acc2


@triton.jit
def _readout_tiles(q_base, o_base, sqn, sqc, son, soc, lo, hi, N, D, rd, cols, o1, o2, cs_h, HALF,
                   SWIGLU: tl.constexpr, TRANS: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``O = q W'`` (linear) or ``(q W1') ⊙ silu(q W2')`` of tokens ``lo .. hi``, one column block (``o1``,
    ``o2``: ``W'`` columns as dot operands)."""
    for start in range(lo, hi, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        q = _qk_rows(q_base, sqn, sqc, rows, rd, N, D, cs_h, HALF, TRANS, ROPE, ACC)
        q = operand(q, DOT, EMU)
        y = _xw(q, o1, TRANS, PREC)
        if SWIGLU:
            y2 = _xw(q, o2, TRANS, PREC)
            y = y * y2 * tl.sigmoid(y2)
        _store_rows(o_base, son, soc, rows, cols, N, D, y, TRANS)


@triton.jit
def _readout_dy(q, do, o1, o2, SWIGLU: tl.constexpr, TRANS: tl.constexpr, PREC: tl.constexpr):
    """One column block of ``dY1 = dO ⊙ silu(Y2)``, ``dY2 = dO ⊙ Y1 ⊙ silu'(Y2)`` (linear: ``dO``;
    ``TRANS``: transposed)."""
    if SWIGLU:
        y1 = _xw(q, o1, TRANS, PREC)
        y2 = _xw(q, o2, TRANS, PREC)
        _, act, dact = _swiglu_acts(y2)
        dy1 = do * act
        dy2 = do * y1 * dact
    else:
        dy1 = do
        dy2 = do
    return dy1, dy2


@triton.jit
def _readout_dq(dy1, dy2, o1, o2, SWIGLU: tl.constexpr, TRANS: tl.constexpr, DOT: tl.constexpr,
                EMU: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """One column block's share of ``dq = dY1 W1'ᵀ + dY2 W2'ᵀ``: ``[BLOCK_N, BLOCK_D]`` (``TRANS``:
    transposed)."""
    dq = _pwt(operand(dy1, DOT, EMU), o1, TRANS, PREC)
    if SWIGLU:
        dq += _pwt(operand(dy2, DOT, EMU), o2, TRANS, PREC)
    return dq


@triton.jit
def _grad_bwd_cols(k, v, o1, o2, og1, og2, coef, SWIGLU: tl.constexpr, MSE: tl.constexpr,
                   TRANS: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """One column block of the gradient backward: ``dv``, and ``P1``, ``P2``, ``dZ1``, ``dZ2`` over ``coef``.

    ``k`` (every channel) and the weight / ``dG`` columns ``o*``, ``og*`` are dot operands, ``v`` fp32. With
    ``dP = k dG`` and ``E = -coef v``: ``dv = -coef (dP1 ⊙ A + dP2 ⊙ Z1 ⊙ A')`` (linear: ``-coef dP``),
    ``P1 = E ⊙ A``, ``P2 = E ⊙ Z1 ⊙ A'`` (linear: ``P = E``), ``dZ1 = dP2 ⊙ E ⊙ A'``,
    ``dZ2 = dP1 ⊙ E ⊙ A' + dP2 ⊙ E ⊙ Z1 ⊙ A''`` (linear MSE: ``E = coef (kW - v)``, ``dZ = coef dP``).
    ``TRANS``: every tile transposed.
    """
    dp1 = _xw(k, og1, TRANS, PREC)
    if SWIGLU:
        z1 = _xw(k, o1, TRANS, PREC)
        z2 = _xw(k, o2, TRANS, PREC)
        sig, a, da = _swiglu_acts(z2)
        dda = sig * (1.0 - sig) * (2.0 + z2 * (1.0 - 2.0 * sig))  # silu''(z2)
        dp2 = _xw(k, og2, TRANS, PREC)
        dz1 = -v * dp2 * da
        dz2 = -v * (dp1 * da + dp2 * z1 * dda)
        dv = -coef * (dp1 * a + dp2 * z1 * da)
        p1 = -v * a
        p2 = -v * z1 * da
    else:
        dv = -coef * dp1
        if MSE:
            p1 = _xw(k, o1, TRANS, PREC) - v  # padded rows: k = v = 0 -> 0
        else:
            p1 = -v
        p2 = p1
        dz1 = dp1
        dz2 = dz1
    return dv, p1, p2, dz1, dz2


@triton.jit
def _grad_bwd_dk(p1, p2, dz1, dz2, o1, o2, og1, og2, SWIGLU: tl.constexpr, MSE: tl.constexpr,
                 TRANS: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """One column block's share of ``dk / coef = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ`` (``P``, ``dZ`` over
    ``coef``): ``[BLOCK_N, BLOCK_D]`` (``TRANS``: transposed). Linear: ``P dGᵀ``, plus ``dZ Wᵀ`` for the MSE
    loss (the dot loss does not depend on W)."""
    dk = _pwt(operand(p1, DOT, EMU), og1, TRANS, PREC)
    if SWIGLU:
        dk += _pwt(operand(p2, DOT, EMU), og2, TRANS, PREC)
        dk += _pwt(operand(dz1, DOT, EMU), o1, TRANS, PREC)
        dk += _pwt(operand(dz2, DOT, EMU), o2, TRANS, PREC)
    else:
        if MSE:
            dk += _pwt(operand(dz1, DOT, EMU), o1, TRANS, PREC)
    return dk


@triton.jit
def _swiglu_bwd_tile(k, v, o1, o2, og1, og2, coef, TRANS: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr,
                     PREC: tl.constexpr):  # fmt: skip
    """The SwiGLU gradient backward of one token tile holding every column (``_grad_bwd_cols`` then
    ``_grad_bwd_dk``, interleaved so that each tile dies soon after it is made): ``dk / coef``,
    ``dZ1 / coef``, ``dZ2 / coef`` and ``dv`` (``TRANS``: transposed)."""
    dp1 = _xw(k, og1, TRANS, PREC)
    dp2 = _xw(k, og2, TRANS, PREC)
    z1 = _xw(k, o1, TRANS, PREC)
    z2 = _xw(k, o2, TRANS, PREC)
    sig, a, da = _swiglu_acts(z2)
    dda = sig * (1.0 - sig) * (2.0 + z2 * (1.0 - 2.0 * sig))  # silu''(z2)
    dv = -coef * (dp1 * a + dp2 * z1 * da)
    dk = _pwt(operand(-v * a, DOT, EMU), og1, TRANS, PREC)
    vda = -v * da
    dk += _pwt(operand(vda * z1, DOT, EMU), og2, TRANS, PREC)
    dz1 = vda * dp2
    dk += _pwt(operand(dz1, DOT, EMU), o1, TRANS, PREC)
    dz2 = vda * dp1 - v * dp2 * z1 * dda
    dk += _pwt(operand(dz2, DOT, EMU), o2, TRANS, PREC)
    return dk, dz1, dz2, dv


# ------------------------------------------------------------------------------------------------ forward


@triton.jit
def forward_kernel(
    q_ptr, k_ptr, v_ptr, w1_ptr, w2_ptr, o_ptr, g_ptr, n_ptr, cs_ptr,
    BG, G, N, D,
    sqb, sqg, sqn, sqc, skb, skg, skn, skc, svb, svg, svn, svc, sob, sog, son, soc,
    swg, swr, swc,
    coef: tl.float64, lr: tl.float64,
    SWIGLU: tl.constexpr, MSE: tl.constexpr, NW: tl.constexpr, GRAD_NORM: tl.constexpr, SAVE: tl.constexpr,
    TRANS: tl.constexpr, STACK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """The whole forward of one (sample, head) and column block, all N tokens in one program (``S == 1``).

    Sums ``G = kᵀ P``, takes the step and writes the read-out ``O`` of the block's columns; ``SAVE`` (for a
    backward) also stores ``G`` and its column norms (``g_ptr`` ``[B*G, NW, d, d]``, ``n_ptr``
    ``[B*G, NW, d]``).
    """
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        coef, lr = tl.cast(coef, ACC), tl.cast(lr, ACC)
    dead, _c, _s, bg, b, g, _lo, _hi, rd, cols = _chunk_columns(BG, G, N, N, 1, D, BLOCK_D, BLOCK_C, PID0)
    if dead:
        return
    cs_h, half = _rope_heads(cs_ptr, g, G, D)
    w1, w2, acc1, acc2 = _grad_tiles(
        k_ptr + b * skb + g * skg, v_ptr + b * svb + g * svg, 0, N, w1_ptr, w2_ptr, g, skn, skc, svn, svc,
        swg, swr, swc, N, D, rd, cols, cs_h, half, SWIGLU, MSE, TRANS, STACK, ROPE, BLOCK_N, BLOCK_D,
        BLOCK_C, DOT, EMU, ACC, PREC,
    )  # fmt: skip
    g1 = coef * acc1
    n1 = col_norm(g1)
    wp1 = stepped(w1, g1, n1, lr, GRAD_NORM)
    if SAVE:
        _store_pair(g_ptr, bg, 0, 1, rd, cols, D, g1, coef * acc2, SWIGLU)
        tl.store(norm_at(n_ptr, bg, 0, NW, D, cols), n1.to(n_ptr.dtype.element_ty), mask=cols < D)
    if SWIGLU:
        g2 = coef * acc2
        n2 = col_norm(g2)
        wp2 = stepped(w2, g2, n2, lr, GRAD_NORM)
        if SAVE:
            tl.store(norm_at(n_ptr, bg, 1, NW, D, cols), n2.to(n_ptr.dtype.element_ty), mask=cols < D)
    else:
        wp2 = wp1
    _readout_tiles(
        q_ptr + b * sqb + g * sqg, o_ptr + b * sob + g * sog, sqn, sqc, son, soc, 0, N, N, D, rd, cols,
        operand(wp1, DOT, EMU), operand(wp2, DOT, EMU), cs_h, half, SWIGLU, TRANS, ROPE, BLOCK_N, DOT,
        EMU, ACC, PREC,
    )  # fmt: skip


@triton.jit
def grad_partial_kernel(
    k_ptr, v_ptr, w1_ptr, w2_ptr, part_ptr, g_ptr, n_ptr, cnt_ptr, cs_ptr,
    BG, G, N, D, CHUNK, S,
    skb, skg, skn, skc, svb, svg, svn, svc,
    swg, swr, swc,
    coef: tl.float64,
    SWIGLU: tl.constexpr, MSE: tl.constexpr, NW: tl.constexpr, TRANS: tl.constexpr, STACK: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """Partial inner gradients ``kᵀ P`` of one chunk of tokens and one column block (``S > 1``) into
    ``part_ptr`` ``[B*G, S, NW, d, d]``; the last of a column block's ``S`` programs to finish (``cnt_ptr``:
    ``B*G x blocks`` counters) sums them: ``G`` and ``||G||`` (``g_ptr`` ``[B*G, NW, d, d]``, ``n_ptr``
    ``[B*G, NW, d]``)."""
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        coef = tl.cast(coef, ACC)
    dead, c, s, bg, b, g, lo, hi, rd, cols = _chunk_columns(BG, G, N, CHUNK, S, D, BLOCK_D, BLOCK_C, PID0)
    if dead:
        return
    cs_h, half = _rope_heads(cs_ptr, g, G, D)
    _w1, _w2, acc1, acc2 = _grad_tiles(
        k_ptr + b * skb + g * skg, v_ptr + b * svb + g * svg, lo, hi, w1_ptr, w2_ptr, g, skn, skc, svn, svc,
        swg, swr, swc, N, D, rd, cols, cs_h, half, SWIGLU, MSE, TRANS, STACK, ROPE, BLOCK_N, BLOCK_D,
        BLOCK_C, DOT, EMU, ACC, PREC,
    )  # fmt: skip
    _store_pair(part_ptr, bg, s, S, rd, cols, D, coef * acc1, coef * acc2, SWIGLU)
    if last_to_arrive(cnt_ptr, bg * tl.cdiv(D, BLOCK_C) + c, S):
        step_sum(part_ptr, g_ptr, n_ptr, bg, S, rd, cols, D, D, NW, BLOCK_D, BLOCK_C, ACC)


@triton.jit
def readout_kernel(
    q_ptr, w1_ptr, w2_ptr, g_ptr, n_ptr, o_ptr, cs_ptr,
    BG, G, N, D, CHUNK, S,
    sqb, sqg, sqn, sqc, sob, sog, son, soc,
    swg, swr, swc, lr: tl.float64,
    SWIGLU: tl.constexpr, NW: tl.constexpr, GRAD_NORM: tl.constexpr, TRANS: tl.constexpr, STACK: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """The read-out of one chunk of queries and one column block, ``W'`` recomputed from ``W``, ``G`` and
    ``||G||`` (no weight-gradient dot: ``STACK`` changes nothing here)."""
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        lr = tl.cast(lr, ACC)
    dead, _c, _s, bg, b, g, lo, hi, rd, cols = _chunk_columns(BG, G, N, CHUNK, S, D, BLOCK_D, BLOCK_C, PID0)
    if dead:
        return
    o1, o2 = _updated_operands(w1_ptr, w2_ptr, g, swg, swr, swc, g_ptr, n_ptr, bg, rd, cols, D, lr, SWIGLU,
                               GRAD_NORM, DOT, EMU, ACC)  # fmt: skip
    cs_h, half = _rope_heads(cs_ptr, g, G, D)
    _readout_tiles(
        q_ptr + b * sqb + g * sqg, o_ptr + b * sob + g * sog, sqn, sqc, son, soc, lo, hi, N, D, rd, cols,
        o1, o2, cs_h, half, SWIGLU, TRANS, ROPE, BLOCK_N, DOT, EMU, ACC, PREC,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------- backward


@triton.jit
def readout_bwd_kernel(
    q_ptr, do_ptr, w1_ptr, w2_ptr, g_ptr, n_ptr, dq_ptr, part_ptr, dg_ptr, cnt_ptr, cs_ptr,
    BG, G, N, D, CHUNK, S,
    sqb, sqg, sqn, sqc, sdob, sdog, sdon, sdoc, sdqb, sdqg, sdqn, sdqc,
    swg, swr, swc,
    lr: tl.float64,
    SWIGLU: tl.constexpr, NW: tl.constexpr, GRAD_NORM: tl.constexpr,
    COLS: tl.constexpr, CROSS: tl.constexpr, FUSED: tl.constexpr, TRANS: tl.constexpr, STACK: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """Read-out backward for one chunk: ``dW' = qᵀ dY`` of the program's column block and/or ``dq``.

    ``COLS``: ``dW'`` of the block; ``FUSED`` (``S == 1``: the program holds all of it) stores it in slot 1
    of ``part_ptr`` ``[B*G, 2, NW, d, d]`` and back-propagates the step into ``dg_ptr`` ``[B*G, NW, d, d]``;
    otherwise it stores the chunk's partial in slot ``s`` of ``part_ptr`` ``[B*G, S + 1, NW, d, d]``, and
    the last of the block's ``S`` programs to finish (``cnt_ptr``: ``B*G x blocks`` counters) sums them into
    slot ``S`` and back-propagates the step.
    ``CROSS``: ``dq``, summed over every column block (with ``COLS``, the grid must have one block,
    ``C == 1``; without, the launch has one program per chunk and each walks the blocks in order).
    ``TRANS`` (``COLS`` only): the token tiles transposed, channels x tokens.
    """
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        lr = tl.cast(lr, ACC)
    dead, c, s, bg, b, g, lo, hi = chunk_of(BG, G, N, CHUNK, S, tl.cdiv(D, BLOCK_C) if COLS else 1, PID0)
    if dead:
        return
    q_base = q_ptr + b * sqb + g * sqg
    do_base = do_ptr + b * sdob + g * sdog
    dq_base = dq_ptr + b * sdqb + g * sdqg
    cs_h, half = _rope_heads(cs_ptr, g, G, D)
    rd = tl.arange(0, BLOCK_D)
    rc = tl.arange(0, BLOCK_C)
    if COLS:
        cols = c * BLOCK_C + rc
        o1, o2 = _updated_operands(w1_ptr, w2_ptr, g, swg, swr, swc, g_ptr, n_ptr, bg, rd, cols, D, lr,
                                   SWIGLU, GRAD_NORM, DOT, EMU, ACC)  # fmt: skip
        acc1, acc2 = _zero_wgrad(BLOCK_D, BLOCK_C, STACK, ACC)
        for start in range(lo, hi, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            q, do = _token_tiles(q_base, do_base, sqn, sqc, sdon, sdoc, rows, rd, cols, N, D, cs_h, half,
                                 TRANS, ROPE, DOT, EMU, ACC)  # fmt: skip
            dy1, dy2 = _readout_dy(q, do, o1, o2, SWIGLU, TRANS, PREC)
            if STACK:
                acc1 += _xtp_stacked(q, operand(dy1, DOT, EMU), operand(dy2, DOT, EMU), TRANS, PREC)
            else:
                qt = _channels_first(q, TRANS)
                acc1 += _xtp(qt, operand(dy1, DOT, EMU), TRANS, PREC)
                if SWIGLU:
                    acc2 += _xtp(qt, operand(dy2, DOT, EMU), TRANS, PREC)
            if CROSS:
                dq = _readout_dq(dy1, dy2, o1, o2, SWIGLU, TRANS, DOT, EMU, PREC)
                _qk_store(dq_base, sdqn, sdqc, rows, rd, N, D, dq, cs_h, half, TRANS, ROPE)
        acc1, acc2 = _wgrad_pair(acc1, acc2, STACK)
        if FUSED:  # dW' into slot 1 of [B*G, 2, NW, d, d], and dG
            store_mat(slot_at(part_ptr, bg, 1, 2, 0, NW, D, D), rd, cols, D, D, acc1)
            step_bwd_tile(acc1, g_ptr, n_ptr, dg_ptr, bg, 0, NW, rd, cols, D, D, lr, GRAD_NORM, ACC)
            if SWIGLU:
                store_mat(slot_at(part_ptr, bg, 1, 2, 1, NW, D, D), rd, cols, D, D, acc2)
                step_bwd_tile(acc2, g_ptr, n_ptr, dg_ptr, bg, 1, NW, rd, cols, D, D, lr, GRAD_NORM, ACC)
        else:
            _store_pair(part_ptr, bg, s, S + 1, rd, cols, D, acc1, acc2, SWIGLU)
            if last_to_arrive(cnt_ptr, bg * tl.cdiv(D, BLOCK_C) + c, S):
                step_bwd_sum(part_ptr, g_ptr, n_ptr, dg_ptr, bg, S, rd, cols, D, D, lr, NW, GRAD_NORM,
                             BLOCK_D, BLOCK_C, ACC)  # fmt: skip
    else:
        for start in range(lo, hi, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            dq = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
            q = operand(_qk_rows(q_base, sqn, sqc, rows, rd, N, D, cs_h, half, False, ROPE, ACC), DOT,
                        EMU)  # fmt: skip
            for c0 in range(0, D, BLOCK_C):
                cj = c0 + rc
                oj1, oj2 = _updated_operands(w1_ptr, w2_ptr, g, swg, swr, swc, g_ptr, n_ptr, bg, rd, cj, D,
                                             lr, SWIGLU, GRAD_NORM, DOT, EMU, ACC)  # fmt: skip
                do = load_tile(do_base, sdon, sdoc, rows, cj, N, D).to(ACC)
                dy1, dy2 = _readout_dy(q, do, oj1, oj2, SWIGLU, False, PREC)
                dq += _readout_dq(dy1, dy2, oj1, oj2, SWIGLU, False, DOT, EMU, PREC)
            _qk_store(dq_base, sdqn, sdqc, rows, rd, N, D, dq, cs_h, half, False, ROPE)


@triton.jit
def grad_bwd_kernel(
    k_ptr, v_ptr, w1_ptr, w2_ptr, dg_ptr, dk_ptr, dv_ptr, part_ptr, cs_ptr,
    BG, G, N, D, CHUNK, S,
    skb, skg, skn, skc, svb, svg, svn, svc, sdkb, sdkg, sdkn, sdkc, sdvb, sdvg, sdvn, sdvc,
    swg, swr, swc,
    coef: tl.float64,
    SWIGLU: tl.constexpr, MSE: tl.constexpr, NW: tl.constexpr,
    COLS: tl.constexpr, CROSS: tl.constexpr, FUSED: tl.constexpr, WGRAD: tl.constexpr, TRANS: tl.constexpr,
    STACK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """Inner-gradient backward for one chunk: ``dv`` and the partial ``kᵀ dZ`` per weight and/or ``dk``.

    Recomputes ``Z1 = k W1``, ``Z2 = k W2`` and the activations; ``dP = k dG`` (``_grad_bwd_cols``).
    ``COLS``: ``dv`` and, where the inner gradient depends on the weights (``WGRAD``), the block's partial
    ``kᵀ dZ`` into slot ``s`` of ``part_ptr`` ``[B*G, S + 1, NW, d, d]``; ``FUSED`` (``S == 1``) adds the
    ``dW'`` of slot 1 to it, so slot 0 holds the sample's whole weight gradient. ``CROSS``: ``dk``, summed
    over every column block (as in ``readout_bwd_kernel``: with ``COLS`` only for ``C == 1``). ``TRANS``
    (``COLS`` only): the token tiles transposed, channels x tokens.
    """
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        coef = tl.cast(coef, ACC)
    dead, c, s, bg, b, g, lo, hi = chunk_of(BG, G, N, CHUNK, S, tl.cdiv(D, BLOCK_C) if COLS else 1, PID0)
    if dead:
        return
    rd = tl.arange(0, BLOCK_D)
    rc = tl.arange(0, BLOCK_C)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    dk_base = dk_ptr + b * sdkb + g * sdkg
    dv_base = dv_ptr + b * sdvb + g * sdvg
    cs_h, half = _rope_heads(cs_ptr, g, G, D)
    if COLS:
        cols = c * BLOCK_C + rc
        o1, o2, og1, og2 = _grad_bwd_operands(w1_ptr, w2_ptr, g, swg, swr, swc, dg_ptr, bg, rd, cols, D,
                                              SWIGLU, DOT, EMU, ACC)  # fmt: skip
        acc1, acc2 = _zero_wgrad(BLOCK_D, BLOCK_C, STACK, ACC)
        for start in range(lo, hi, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            k, v = _token_tiles(k_base, v_base, skn, skc, svn, svc, rows, rd, cols, N, D, cs_h, half,
                                TRANS, ROPE, DOT, EMU, ACC)  # fmt: skip
            if CROSS and SWIGLU:
                dk, dz1, dz2, dv = _swiglu_bwd_tile(k, v, o1, o2, og1, og2, coef, TRANS, DOT, EMU, PREC)
                _qk_store(dk_base, sdkn, sdkc, rows, rd, N, D, coef * dk, cs_h, half, TRANS, ROPE)
            else:
                dv, p1, p2, dz1, dz2 = _grad_bwd_cols(k, v, o1, o2, og1, og2, coef, SWIGLU, MSE, TRANS, PREC)
                if CROSS:
                    dk = _grad_bwd_dk(p1, p2, dz1, dz2, o1, o2, og1, og2, SWIGLU, MSE, TRANS, DOT, EMU, PREC)
                    _qk_store(dk_base, sdkn, sdkc, rows, rd, N, D, coef * dk, cs_h, half, TRANS, ROPE)
            _store_rows(dv_base, sdvn, sdvc, rows, cols, N, D, dv, TRANS)
            if WGRAD and STACK:
                acc1 += _xtp_stacked(k, operand(dz1, DOT, EMU), operand(dz2, DOT, EMU), TRANS, PREC)
            elif WGRAD:
                kt = _channels_first(k, TRANS)
                acc1 += _xtp(kt, operand(dz1, DOT, EMU), TRANS, PREC)
                if SWIGLU:
                    acc2 += _xtp(kt, operand(dz2, DOT, EMU), TRANS, PREC)
        if WGRAD:
            acc1, acc2 = _wgrad_pair(acc1, acc2, STACK)
            acc1 = coef * acc1
            acc2 = coef * acc2
            if FUSED:
                dwp1, dwp2 = _load_pair(part_ptr, bg, 1, 2, rd, cols, D, SWIGLU, ACC)
                acc1 += dwp1
                acc2 += dwp2
            _store_pair(part_ptr, bg, s, S + 1, rd, cols, D, acc1, acc2, SWIGLU)
    else:
        for start in range(lo, hi, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            k = operand(_qk_rows(k_base, skn, skc, rows, rd, N, D, cs_h, half, False, ROPE, ACC), DOT,
                        EMU)  # fmt: skip
            dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
            for c0 in range(0, D, BLOCK_C):
                cj = c0 + rc
                oj1, oj2, ogj1, ogj2 = _grad_bwd_operands(w1_ptr, w2_ptr, g, swg, swr, swc, dg_ptr, bg, rd,
                                                          cj, D, SWIGLU, DOT, EMU, ACC)  # fmt: skip
                v = load_tile(v_base, svn, svc, rows, cj, N, D).to(ACC)
                _, p1, p2, dz1, dz2 = _grad_bwd_cols(k, v, oj1, oj2, ogj1, ogj2, coef, SWIGLU, MSE, False,
                                                     PREC)  # fmt: skip
                dk += _grad_bwd_dk(p1, p2, dz1, dz2, oj1, oj2, ogj1, ogj2, SWIGLU, MSE, False, DOT, EMU, PREC)
            _qk_store(dk_base, sdkn, sdkc, rows, rd, N, D, coef * dk, cs_h, half, False, ROPE)
