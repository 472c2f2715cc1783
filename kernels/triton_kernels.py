"""Triton kernels of the fused TTT inner loop: one full-batch step of a linear, SwiGLU or 3x3 dwconv model.

Per (sample b, head g) with tokens ``q, k, v [N, d]`` and initial weights ``W [d, d]`` (``W1, W2`` for
SwiGLU), the forward is three launches:

1. ``grad_partial_kernel`` (grid ``[S, B*G, C]``): each program sums the inner gradient ``kᵀ P`` over one
   chunk of tokens (``S`` chunks split N) into a partial per weight, for one block of output columns;
2. ``step_kernel`` (grid ``[B*G, C']``): adds the partials in a fixed order (deterministic), normalises each
   output column ``G / (||G|| + 1)``, takes the step ``W' = W - lr G`` and saves ``G``, ``W'``, ``||G||``;
3. ``readout_kernel`` (grid ``[S, B*G, C]``): applies ``W'`` to the queries.

The backward (the chain rule through the step; the op references in ``vit3.kernels.<op>.reference`` define
what it differentiates) is four stages: read-out backward (``dq``
and partial ``dW'``), the step backward through the normalisation (``dG``), the gradient backward
(``dk``, ``dv``, partial ``kᵀ dZ``) recomputing ``Z``, ``σ`` and the activations from ``k`` instead of
saving ``N``-sized tensors, and a reduction of the weight gradient over chunks and samples (in a fixed
order). All tiles are upcast to the accumulator type (fp32, or fp64 for fp64 inputs) before ``tl.dot``.

Column blocks. The math is separable by output column: column j of ``Z1 = k W1``, ``Z2``, the
activations, ``P``, the gradient ``kᵀ P[:, j]``, its norm and step, ``Y = q W'``, ``dY``, ``qᵀ dY[:, j]``,
``dZ``, ``dv`` and ``kᵀ dZ[:, j]`` need only column j of the weights (and of ``v``, ``dO``, ``dG``) plus the
whole ``k`` or ``q`` row. So every program owns one block of ``BLOCK_C`` columns (the third grid axis,
``C = cdiv(d, BLOCK_C)`` blocks) and keeps only ``[BLOCK_D, BLOCK_C]`` slices of the weights, gradients and
accumulators on chip: that is what lets d = 128, and d = 64 on GPUs with 64-164 KB of shared memory per
block, fit (``triton_op.launch_config`` picks ``BLOCK_C`` per GPU). Two quantities sum over all columns:
``dq = dY1 W1'ᵀ + dY2 W2'ᵀ`` (read-out backward) and ``dk = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ``
(gradient backward). With one block (``C == 1``) a single launch computes everything. With ``C > 1`` each
backward stage is two launches of the same kernel, chosen by the constexpr switches ``COLS`` / ``CROSS``: the column launch (grid ``[S, B*G, C]``) writes the
per-column outputs (``dv``, the weight-gradient partials), and the cross launch (grid ``[S, B*G]``) walks
the column blocks in order for each token tile, recomputes their column quantities (weights re-read from
L2) and sums ``dq`` or ``dk`` in registers. Each output element is written by exactly one program with a
fixed summation order, so the result is deterministic without atomics, and no ``N``-sized intermediate goes
to memory (the alternatives: atomics into dq/dk, not deterministic; or writing dY / dZ per column block and
multiplying afterwards, extra N x d round trips through HBM). The price, paid only where the weights do not
fit on chip anyway: the column quantities are computed twice (SwiGLU backward: 22 instead of 16 N x d x d
matmuls), each column launch re-reads the full k/q tile once per block, and the cross launch re-reads
every weight block per token tile (from L2).

Constexpr switches: ``SWIGLU`` (else linear), ``MSE`` (linear only: ``E = s (kW - v) / N``, else the dot
loss ``E = -s v / N``), ``GRAD_NORM``, ``PREC`` (``tl.dot`` input precision, ``"ieee"`` or ``"tf32"``),
``COLS`` / ``CROSS`` (above). Weight buffers are ``[B*G, slots, NW, R, d]`` contiguous, ``NW`` = 2 for
SwiGLU and 1 otherwise, ``R`` = d (matrices) or 9 (the taps of the depthwise conv, whose own kernels are at
the end of this module and share the step, step-backward and weight-gradient reduction kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "conv_grad_bwd_kernel",
    "conv_grad_partial_kernel",
    "conv_readout_bwd_kernel",
    "conv_readout_kernel",
    "grad_bwd_kernel",
    "grad_partial_kernel",
    "readout_bwd_kernel",
    "readout_kernel",
    "step_bwd_kernel",
    "step_kernel",
    "wgrad_reduce_kernel",
]


@triton.jit
def _program(G, N, CHUNK):
    """Who this program is on a ``[S, B*G, ...]`` grid: ``pid_s, pid_bg``, sample ``b`` and head ``g`` (int64),
    and its tokens ``lo .. hi`` (chunk ``pid_s`` of ``CHUNK``)."""
    pid_s = tl.program_id(0)
    pid_bg = tl.program_id(1)
    lo = pid_s * CHUNK
    return pid_s, pid_bg, (pid_bg // G).to(tl.int64), (pid_bg % G).to(tl.int64), lo, tl.minimum(lo + CHUNK, N)


@triton.jit
def _load_tokens(base, stride_n, stride_c, rows, cols, n_tok, d, ACC: tl.constexpr):
    """A ``[BLOCK_N, len(cols)]`` tile of tokens, zero outside ``n_tok x d``, upcast to ``ACC``."""
    mask = (rows[:, None] < n_tok) & (cols[None, :] < d)
    ptrs = base + rows[:, None] * stride_n + cols[None, :] * stride_c
    return tl.load(ptrs, mask=mask, other=0.0).to(ACC)


@triton.jit
def _store_tokens(base, stride_n, stride_c, rows, cols, n_tok, d, x):
    mask = (rows[:, None] < n_tok) & (cols[None, :] < d)
    tl.store(
        base + rows[:, None] * stride_n + cols[None, :] * stride_c, x.to(base.dtype.element_ty), mask=mask
    )


@triton.jit
def _load_mat(base, stride_r, stride_c, rr, rc, n_rows, n_cols, ACC: tl.constexpr):
    """A ``[len(rr), len(rc)]`` tile of an ``n_rows x n_cols`` matrix, zero padded, upcast to ``ACC``."""
    mask = (rr[:, None] < n_rows) & (rc[None, :] < n_cols)
    return tl.load(base + rr[:, None] * stride_r + rc[None, :] * stride_c, mask=mask, other=0.0).to(ACC)


@triton.jit
def _store_mat(base, rr, rc, n_rows, n_cols, x):
    """Stores a tile into a contiguous ``[n_rows, n_cols]`` slot of a buffer (``rc``: absolute columns)."""
    mask = (rr[:, None] < n_rows) & (rc[None, :] < n_cols)
    tl.store(base + rr[:, None] * n_cols + rc[None, :], x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _store_partials(part_ptr, pid_bg, slot, slots, rd, cols, d, acc1, acc2, SWIGLU: tl.constexpr):
    """Stores a program's weight-gradient partial(s) ``[BLOCK_D, BLOCK_C]`` into slot ``slot`` of
    ``part_ptr`` ``[B*G, slots, NW, d, d]`` (``acc2``: the second weight, SwiGLU only)."""
    nw: tl.constexpr = 2 if SWIGLU else 1
    part = part_ptr + (pid_bg.to(tl.int64) * slots + slot) * nw * d * d
    _store_mat(part, rd, cols, d, d, acc1)
    if SWIGLU:
        _store_mat(part + d * d, rd, cols, d, d, acc2)


@triton.jit
def _load_cols(base, stride_r, stride_c, sw_next, rd, cols, d, SWIGLU: tl.constexpr, ACC: tl.constexpr):
    """Columns ``cols`` of the ``d x d`` weight(s) at ``base``: ``[BLOCK_D, BLOCK_C]`` tiles ``(M1, M2)``.

    ``M2`` (``sw_next`` elements after ``M1``) only for SwiGLU; the linear model gets ``M1`` twice.
    """
    m1 = _load_mat(base, stride_r, stride_c, rd, cols, d, d, ACC)
    if SWIGLU:
        m2 = _load_mat(base + sw_next, stride_r, stride_c, rd, cols, d, d, ACC)
    else:
        m2 = m1
    return m1, m2


@triton.jit
def _swiglu_acts(z2):
    """``σ(z2)``, ``A = silu(z2)`` and ``A' = silu'(z2) = σ (1 + z2 (1 - σ))``."""
    sig = tl.sigmoid(z2)
    return sig, z2 * sig, sig * (1.0 + z2 * (1.0 - sig))


@triton.jit
def _readout_dy(q, do, w1, w2, SWIGLU: tl.constexpr, PREC: tl.constexpr):
    """One column block of ``dY1 = dO ⊙ silu(Y2)``, ``dY2 = dO ⊙ Y1 ⊙ silu'(Y2)`` (linear: ``dO``)."""
    if SWIGLU:
        y1 = tl.dot(q, w1, input_precision=PREC)
        y2 = tl.dot(q, w2, input_precision=PREC)
        _, act, dact = _swiglu_acts(y2)
        dy1 = do * act
        dy2 = do * y1 * dact
    else:
        dy1 = do
        dy2 = do
    return dy1, dy2


@triton.jit
def _readout_dq(dy1, dy2, w1, w2, SWIGLU: tl.constexpr, PREC: tl.constexpr):
    """One column block's share of ``dq = dY1 W1'ᵀ + dY2 W2'ᵀ``: ``[BLOCK_N, BLOCK_D]``."""
    dq = tl.dot(dy1, tl.trans(w1), input_precision=PREC)
    if SWIGLU:
        dq += tl.dot(dy2, tl.trans(w2), input_precision=PREC)
    return dq


@triton.jit
def _grad_bwd_cols(k, v, w1, w2, dg1, dg2, coef, SWIGLU: tl.constexpr, MSE: tl.constexpr, PREC: tl.constexpr):
    """One column block of the gradient backward: ``dv``, ``P1``, ``P2``, ``dZ1``, ``dZ2``.

    ``v``, the weights and ``dG`` hold the block's columns, ``k`` every channel. With ``dP = k dG``:
    ``dv = -coef (dP1 ⊙ A + dP2 ⊙ Z1 ⊙ A')`` (linear: ``-coef dP``), ``P1 = E ⊙ A``, ``P2 = E ⊙ Z1 ⊙ A'``
    (linear: ``P = E``), ``dZ1 = dP2 ⊙ E ⊙ A'``, ``dZ2 = dP1 ⊙ E ⊙ A' + dP2 ⊙ E ⊙ Z1 ⊙ A''`` (linear MSE:
    ``dZ = coef dP``).
    """
    dp1 = tl.dot(k, dg1, input_precision=PREC)
    if SWIGLU:
        z1 = tl.dot(k, w1, input_precision=PREC)
        z2 = tl.dot(k, w2, input_precision=PREC)
        sig, a, da = _swiglu_acts(z2)
        dda = sig * (1.0 - sig) * (2.0 + z2 * (1.0 - 2.0 * sig))  # silu''(z2)
        e = -coef * v
        dp2 = tl.dot(k, dg2, input_precision=PREC)
        dz1 = dp2 * e * da
        dz2 = dp1 * e * da + dp2 * e * z1 * dda
        dv = -coef * (dp1 * a + dp2 * z1 * da)
        p1 = e * a
        p2 = e * z1 * da
    else:
        dv = -coef * dp1
        if MSE:
            p1 = coef * (tl.dot(k, w1, input_precision=PREC) - v)  # padded rows: k = v = 0 -> 0
        else:
            p1 = -coef * v
        p2 = p1
        dz1 = coef * dp1
        dz2 = dz1
    return dv, p1, p2, dz1, dz2


@triton.jit
def _grad_bwd_dk(
    p1, p2, dz1, dz2, w1, w2, dg1, dg2, SWIGLU: tl.constexpr, MSE: tl.constexpr, PREC: tl.constexpr
):
    """One column block's share of ``dk = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ``: ``[BLOCK_N, BLOCK_D]``.

    Linear: ``P dGᵀ``, plus ``dZ Wᵀ`` for the MSE loss (the dot loss does not depend on W).
    """
    dk = tl.dot(p1, tl.trans(dg1), input_precision=PREC)
    if SWIGLU:
        dk += tl.dot(p2, tl.trans(dg2), input_precision=PREC)
        dk += tl.dot(dz1, tl.trans(w1), input_precision=PREC)
        dk += tl.dot(dz2, tl.trans(w2), input_precision=PREC)
    else:
        if MSE:
            dk += tl.dot(dz1, tl.trans(w1), input_precision=PREC)
    return dk


@triton.jit
def grad_partial_kernel(
    k_ptr, v_ptr, w_ptr, part_ptr,
    G, N, D, CHUNK,
    skb, skg, skn, skc, svb, svg, svn, svc,
    swg, swr, swc, sw_next,
    coef,
    SWIGLU: tl.constexpr, MSE: tl.constexpr, NW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Partial inner gradients ``kᵀ P`` of one chunk of tokens and one column block; ``coef = s / N``.

    ``w_ptr`` is W (or W1) at head 0, ``sw_next`` the offset from W1 to W2; ``part_ptr`` is
    ``[B*G, S, NW, d, d]``.
    """
    pid_s, pid_bg, b, g, lo, hi = _program(G, N, CHUNK)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    w1, w2 = _load_cols(w_ptr + g * swg, swr, swc, sw_next, rd, cols, D, SWIGLU, ACC)
    acc1 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)
    acc2 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)  # SwiGLU's second weight (dead code for linear)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        k = _load_tokens(k_base, skn, skc, rows, rd, N, D, ACC)
        v = _load_tokens(v_base, svn, svc, rows, cols, N, D, ACC)
        kt = tl.trans(k)
        if SWIGLU:
            z1 = tl.dot(k, w1, input_precision=PREC)
            z2 = tl.dot(k, w2, input_precision=PREC)
            _, a, da = _swiglu_acts(z2)
            e = -coef * v
            acc1 += tl.dot(kt, e * a, input_precision=PREC)
            acc2 += tl.dot(kt, e * z1 * da, input_precision=PREC)
        else:
            if MSE:
                e = coef * (tl.dot(k, w1, input_precision=PREC) - v)  # padded rows: k = v = 0 -> e = 0
            else:
                e = -coef * v
            acc1 += tl.dot(kt, e, input_precision=PREC)
    _store_partials(part_ptr, pid_bg, pid_s, tl.num_programs(0), rd, cols, D, acc1, acc2, SWIGLU)


@triton.jit
def step_kernel(
    w_ptr, part_ptr, g_ptr, wp_ptr, n_ptr,
    G, R, D, S,
    swg, swr, swc, sw_next,
    lr,
    NW: tl.constexpr, GRAD_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Sums the ``S`` partials, normalises and steps: ``W' = W - lr G / (||G||_col + 1)``.

    Grid ``[B*G, cdiv(D, BLOCK_C)]``: one block of columns per program. Weights are ``R x D`` (``d x d``;
    9 taps x channels for the depthwise conv), the norm over the ``R`` rows of each column. Writes the raw
    gradient ``G`` and ``W'`` (``[B*G, NW, R, D]``) and the column norms (``[B*G, NW, D]``).
    """
    pid_bg = tl.program_id(0).to(tl.int64)
    g = pid_bg % G
    rr = tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    for i in tl.static_range(NW):
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
        for s in range(S):
            acc += _load_mat(part_ptr + ((pid_bg * S + s) * NW + i) * R * D, D, 1, rr, cols, R, D, ACC)
        w = _load_mat(w_ptr + i * sw_next + g * swg, swr, swc, rr, cols, R, D, ACC)
        norm = tl.sqrt(tl.sum(acc * acc, axis=0))  # [BLOCK_C], one per output column
        if GRAD_NORM:
            step = acc / (norm[None, :] + 1.0)
        else:
            step = acc
        slot = (pid_bg * NW + i) * R * D
        _store_mat(g_ptr + slot, rr, cols, R, D, acc)
        _store_mat(wp_ptr + slot, rr, cols, R, D, w - lr * step)
        tl.store(n_ptr + (pid_bg * NW + i) * D + cols, norm.to(n_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def readout_kernel(
    q_ptr, wp_ptr, o_ptr,
    G, N, D, CHUNK,
    sqb, sqg, sqn, sqc, sob, sog, son, soc,
    SWIGLU: tl.constexpr, NW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """``O = q W'`` (linear) or ``(q W1') ⊙ silu(q W2')`` (SwiGLU) for one chunk of queries, one column block."""
    _pid_s, pid_bg, b, g, lo, hi = _program(G, N, CHUNK)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    wp = wp_ptr + pid_bg.to(tl.int64) * NW * D * D
    w1, w2 = _load_cols(wp, D, 1, D * D, rd, cols, D, SWIGLU, ACC)
    q_base = q_ptr + b * sqb + g * sqg
    o_base = o_ptr + b * sob + g * sog
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        q = _load_tokens(q_base, sqn, sqc, rows, rd, N, D, ACC)
        y = tl.dot(q, w1, input_precision=PREC)
        if SWIGLU:
            y2 = tl.dot(q, w2, input_precision=PREC)
            y = y * y2 * tl.sigmoid(y2)
        _store_tokens(o_base, son, soc, rows, cols, N, D, y)


@triton.jit
def readout_bwd_kernel(
    q_ptr, do_ptr, wp_ptr, dq_ptr, part_ptr,
    G, N, D, CHUNK,
    sqb, sqg, sqn, sqc, sdob, sdog, sdon, sdoc, sdqb, sdqg, sdqn, sdqc,
    SWIGLU: tl.constexpr, NW: tl.constexpr, COLS: tl.constexpr, CROSS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Read-out backward for one chunk: the partial ``dW' = qᵀ dY`` per weight and/or ``dq``.

    ``COLS``: the partial of this program's column block (grid ``[S, B*G, C]``) into slots ``0..S-1`` of
    ``part_ptr`` ``[B*G, S + 1, NW, d, d]``. ``CROSS``: ``dq``, summed over every column block (with
    ``COLS``, the grid must have one block, ``C == 1``; without, the grid is ``[S, B*G, 1]`` and each program
    walks the blocks in order, re-reading ``W'``).
    """
    pid_s, pid_bg, b, g, lo, hi = _program(G, N, CHUNK)
    rd = tl.arange(0, BLOCK_D)
    rc = tl.arange(0, BLOCK_C)
    rn = tl.arange(0, BLOCK_N)
    wp = wp_ptr + pid_bg.to(tl.int64) * NW * D * D
    if COLS:
        cols = tl.program_id(2) * BLOCK_C + rc
        w1, w2 = _load_cols(wp, D, 1, D * D, rd, cols, D, SWIGLU, ACC)
        acc1 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)
        acc2 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)  # SwiGLU's second weight (dead code for linear)
    q_base = q_ptr + b * sqb + g * sqg
    do_base = do_ptr + b * sdob + g * sdog
    dq_base = dq_ptr + b * sdqb + g * sdqg
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        q = _load_tokens(q_base, sqn, sqc, rows, rd, N, D, ACC)
        if COLS:
            do = _load_tokens(do_base, sdon, sdoc, rows, cols, N, D, ACC)
            dy1, dy2 = _readout_dy(q, do, w1, w2, SWIGLU, PREC)
            qt = tl.trans(q)
            acc1 += tl.dot(qt, dy1, input_precision=PREC)
            if SWIGLU:
                acc2 += tl.dot(qt, dy2, input_precision=PREC)
            if CROSS:
                dq = _readout_dq(dy1, dy2, w1, w2, SWIGLU, PREC)
                _store_tokens(dq_base, sdqn, sdqc, rows, rd, N, D, dq)
        else:
            dq = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
            for c0 in range(0, D, BLOCK_C):
                cj = c0 + rc
                wj1, wj2 = _load_cols(wp, D, 1, D * D, rd, cj, D, SWIGLU, ACC)
                do = _load_tokens(do_base, sdon, sdoc, rows, cj, N, D, ACC)
                dy1, dy2 = _readout_dy(q, do, wj1, wj2, SWIGLU, PREC)
                dq += _readout_dq(dy1, dy2, wj1, wj2, SWIGLU, PREC)
            _store_tokens(dq_base, sdqn, sdqc, rows, rd, N, D, dq)
    if COLS:
        _store_partials(part_ptr, pid_bg, pid_s, tl.num_programs(0) + 1, rd, cols, D, acc1, acc2, SWIGLU)


@triton.jit
def step_bwd_kernel(
    part_ptr, g_ptr, n_ptr, dg_ptr,
    R, D, S,
    lr,
    NW: tl.constexpr, GRAD_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Sums the read-out partials into ``dW'`` and back-propagates the step and the normalisation.

    Grid ``[B*G, cdiv(D, BLOCK_C)]``. ``part_ptr`` is ``[B*G, S + 1, NW, R, D]``: slots ``0..S-1`` hold the
    read-out partials, slot ``S`` receives ``dW'`` (the direct part of the initial weights' gradient). With
    ``Ĝ = G / (n + 1)``, ``dĜ = -lr dW'`` and ``dG = dĜ / (n + 1) - G (G·dĜ)_col / (n (n + 1)²)`` (0 where
    ``n = 0``).
    """
    pid_bg = tl.program_id(0).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    for i in tl.static_range(NW):
        dwp = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
        for s in range(S):
            dwp += _load_mat(part_ptr + ((pid_bg * (S + 1) + s) * NW + i) * R * D, D, 1, rr, cols, R, D, ACC)
        _store_mat(part_ptr + ((pid_bg * (S + 1) + S) * NW + i) * R * D, rr, cols, R, D, dwp)
        dgh = -lr * dwp
        slot = (pid_bg * NW + i) * R * D
        if GRAD_NORM:
            grad = _load_mat(g_ptr + slot, D, 1, rr, cols, R, D, ACC)
            n = tl.load(n_ptr + (pid_bg * NW + i) * D + cols, mask=cols < D, other=0.0).to(ACC)
            proj = tl.sum(grad * dgh, axis=0)  # [BLOCK_C]: G[:, j]·dĜ[:, j]
            denom = n * (n + 1.0) * (n + 1.0)
            coef = tl.where(n > 0.0, proj / tl.where(n > 0.0, denom, 1.0), 0.0)
            dg = dgh / (n[None, :] + 1.0) - grad * coef[None, :]
        else:
            dg = dgh
        _store_mat(dg_ptr + slot, rr, cols, R, D, dg)


@triton.jit
def grad_bwd_kernel(
    k_ptr, v_ptr, w_ptr, dg_ptr, dk_ptr, dv_ptr, part_ptr,
    G, N, D, CHUNK,
    skb, skg, skn, skc, svb, svg, svn, svc,
    sdkb, sdkg, sdkn, sdkc, sdvb, sdvg, sdvn, sdvc,
    swg, swr, swc, sw_next,
    coef,
    SWIGLU: tl.constexpr, MSE: tl.constexpr, NW: tl.constexpr, COLS: tl.constexpr, CROSS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Inner-gradient backward for one chunk: ``dv`` and partial ``kᵀ dZ`` per weight and/or ``dk``.

    Recomputes ``Z1 = k W1``, ``Z2 = k W2`` and the activations; ``dP = k dG`` (``_grad_bwd_cols``).
    ``COLS``: ``dv`` and the partials of this program's column block (grid ``[S, B*G, C]``; slots
    ``0..S-1`` of ``part_ptr`` ``[B*G, S + 1, NW, d, d]``). ``CROSS``: ``dk``, summed over every column
    block (as in ``readout_bwd_kernel``: with ``COLS`` only for ``C == 1``).
    """
    pid_s, pid_bg, b, g, lo, hi = _program(G, N, CHUNK)
    rd = tl.arange(0, BLOCK_D)
    rc = tl.arange(0, BLOCK_C)
    rn = tl.arange(0, BLOCK_N)
    ws = w_ptr + g * swg
    dgs = dg_ptr + pid_bg.to(tl.int64) * NW * D * D
    if COLS:
        cols = tl.program_id(2) * BLOCK_C + rc
        w1, w2 = _load_cols(ws, swr, swc, sw_next, rd, cols, D, SWIGLU, ACC)
        dg1, dg2 = _load_cols(dgs, D, 1, D * D, rd, cols, D, SWIGLU, ACC)
        acc1 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)
        acc2 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)  # SwiGLU's second weight (dead code for linear)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    dk_base = dk_ptr + b * sdkb + g * sdkg
    dv_base = dv_ptr + b * sdvb + g * sdvg
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        k = _load_tokens(k_base, skn, skc, rows, rd, N, D, ACC)
        if COLS:
            v = _load_tokens(v_base, svn, svc, rows, cols, N, D, ACC)
            kt = tl.trans(k)
            dv, p1, p2, dz1, dz2 = _grad_bwd_cols(k, v, w1, w2, dg1, dg2, coef, SWIGLU, MSE, PREC)
            if CROSS:
                dk = _grad_bwd_dk(p1, p2, dz1, dz2, w1, w2, dg1, dg2, SWIGLU, MSE, PREC)
            if SWIGLU:
                acc1 += tl.dot(kt, dz1, input_precision=PREC)
                acc2 += tl.dot(kt, dz2, input_precision=PREC)
            else:
                if MSE:
                    acc1 += tl.dot(kt, dz1, input_precision=PREC)
            if CROSS:
                _store_tokens(dk_base, sdkn, sdkc, rows, rd, N, D, dk)
            _store_tokens(dv_base, sdvn, sdvc, rows, cols, N, D, dv)
        else:
            dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
            for c0 in range(0, D, BLOCK_C):
                cj = c0 + rc
                wj1, wj2 = _load_cols(ws, swr, swc, sw_next, rd, cj, D, SWIGLU, ACC)
                dgj1, dgj2 = _load_cols(dgs, D, 1, D * D, rd, cj, D, SWIGLU, ACC)
                v = _load_tokens(v_base, svn, svc, rows, cj, N, D, ACC)
                _, p1, p2, dz1, dz2 = _grad_bwd_cols(k, v, wj1, wj2, dgj1, dgj2, coef, SWIGLU, MSE, PREC)
                dk += _grad_bwd_dk(p1, p2, dz1, dz2, wj1, wj2, dgj1, dgj2, SWIGLU, MSE, PREC)
            _store_tokens(dk_base, sdkn, sdkc, rows, rd, N, D, dk)
    if COLS:
        _store_partials(part_ptr, pid_bg, pid_s, tl.num_programs(0) + 1, rd, cols, D, acc1, acc2, SWIGLU)


@triton.jit
def wgrad_reduce_kernel(
    part_ptr, dw_ptr,
    B, G, R, D, SLOTS,
    NW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """``dW[g] = Σ_b Σ_slot part[b, g, slot]``, in a fixed order; ``dw_ptr`` is ``[G, NW, R, D]``.

    Grid ``[G, cdiv(D, BLOCK_C)]``.
    """
    g = tl.program_id(0).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    for i in tl.static_range(NW):
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
        for b in range(B):
            for s in range(SLOTS):
                acc += _load_mat(
                    part_ptr + (((b * G + g) * SLOTS + s) * NW + i) * R * D, D, 1, rr, cols, R, D, ACC
                )
        _store_mat(dw_ptr + (g * NW + i) * R * D, rr, cols, R, D, acc)


# ------------------------------------------------------------------------------------------------------------
# The 3x3 depthwise-conv inner model on an H x W raster grid of tokens. Weights are [9 taps, channels]; tap
# (ty, tx) reads the neighbour at offset (ty - 1, tx - 1) with zero padding (PyTorch's conv2d, padding 1).
#   G[δ, c] = Σ_p E[p, c] k[p + δ, c]      out[p, c] = Σ_δ W'[δ, c] q[p + δ, c]
#   dW'[δ, c] = Σ_p dO[p, c] q[p + δ, c]   dq[p, c] = Σ_δ W'[δ, c] dO[p - δ, c]
#   dv[p, c] = -coef Σ_δ dG[δ, c] k[p + δ, c]   dk[p, c] = Σ_δ dG[δ, c] E[p - δ, c]
# The weight enters only through the read-out (E does not depend on it), so dW = Σ_b dW'.


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
    G, N, D, CHUNK, H, W,
    skb, skg, skn, skc, svb, svg, svn, svc,
    coef,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Partial ``G[δ, c]`` of one chunk of tokens into ``part_ptr`` ``[B*G, S, 9, d]``."""
    pid_s, pid_bg, b, g, lo, hi = _program(G, N, CHUNK)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    acc = tl.zeros((16, BLOCK_D), dtype=ACC)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        e = -coef * _load_tokens(v_base, svn, svc, rows, rd, N, D, ACC)
        for tap in tl.static_range(9):
            ks = _load_shifted(k_base, skn, skc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            acc += tl.where(rr[:, None] == tap, tl.sum(e * ks, axis=0)[None, :], 0.0)
    _store_mat(part_ptr + (pid_bg.to(tl.int64) * tl.num_programs(0) + pid_s) * 9 * D, rr, rd, 9, D, acc)


@triton.jit
def conv_readout_kernel(
    q_ptr, wp_ptr, o_ptr,
    G, N, D, CHUNK, H, W,
    sqb, sqg, sqn, sqc, sob, sog, son, soc,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """``out = dwconv3x3(q; W')`` for one chunk of tokens."""
    _pid_s, pid_bg, b, g, lo, hi = _program(G, N, CHUNK)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    wp = _load_mat(wp_ptr + pid_bg.to(tl.int64) * 9 * D, D, 1, rr, rd, 9, D, ACC)
    q_base = q_ptr + b * sqb + g * sqg
    o_base = o_ptr + b * sob + g * sog
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        y = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
        for tap in tl.static_range(9):
            qs = _load_shifted(q_base, sqn, sqc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            y += _tap(wp, rr, tap)[None, :] * qs
        _store_tokens(o_base, son, soc, rows, rd, N, D, y)


@triton.jit
def conv_readout_bwd_kernel(
    q_ptr, do_ptr, wp_ptr, dq_ptr, part_ptr,
    G, N, D, CHUNK, H, W,
    sqb, sqg, sqn, sqc, sdob, sdog, sdon, sdoc, sdqb, sdqg, sdqn, sdqc,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Read-out backward for one chunk: ``dq`` (written) and the partial ``dW'`` (slots of ``[B*G, S+1, 9, d]``)."""
    pid_s, pid_bg, b, g, lo, hi = _program(G, N, CHUNK)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    wp = _load_mat(wp_ptr + pid_bg.to(tl.int64) * 9 * D, D, 1, rr, rd, 9, D, ACC)
    q_base = q_ptr + b * sqb + g * sqg
    do_base = do_ptr + b * sdob + g * sdog
    dq_base = dq_ptr + b * sdqb + g * sdqg
    acc = tl.zeros((16, BLOCK_D), dtype=ACC)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        do = _load_tokens(do_base, sdon, sdoc, rows, rd, N, D, ACC)
        dq = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
        for tap in tl.static_range(9):
            qs = _load_shifted(q_base, sqn, sqc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            acc += tl.where(rr[:, None] == tap, tl.sum(do * qs, axis=0)[None, :], 0.0)
            dos = _load_shifted(do_base, sdon, sdoc, rows, rd, 1 - tap // 3, 1 - tap % 3, N, H, W, D, ACC)
            dq += _tap(wp, rr, tap)[None, :] * dos
        _store_tokens(dq_base, sdqn, sdqc, rows, rd, N, D, dq)
    part = part_ptr + (pid_bg.to(tl.int64) * (tl.num_programs(0) + 1) + pid_s) * 9 * D
    _store_mat(part, rr, rd, 9, D, acc)


@triton.jit
def conv_grad_bwd_kernel(
    k_ptr, v_ptr, dg_ptr, dk_ptr, dv_ptr, part_ptr,
    G, N, D, CHUNK, H, W,
    skb, skg, skn, skc, svb, svg, svn, svc,
    sdkb, sdkg, sdkn, sdkc, sdvb, sdvg, sdvn, sdvc,
    coef,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Inner-gradient backward for one chunk: ``dk``, ``dv``; its weight-gradient partial is zero."""
    pid_s, pid_bg, b, g, lo, hi = _program(G, N, CHUNK)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    dg = _load_mat(dg_ptr + pid_bg.to(tl.int64) * 9 * D, D, 1, rr, rd, 9, D, ACC)
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
        _store_tokens(dk_base, sdkn, sdkc, rows, rd, N, D, -coef * dk)
        _store_tokens(dv_base, sdvn, sdvc, rows, rd, N, D, -coef * de)
    part = part_ptr + (pid_bg.to(tl.int64) * (tl.num_programs(0) + 1) + pid_s) * 9 * D
    _store_mat(part, rr, rd, 9, D, tl.zeros((16, BLOCK_D), dtype=ACC))
