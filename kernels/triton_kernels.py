"""Triton kernels of the fused TTT inner loop: one full-batch step of a linear, SwiGLU or 3x3 dwconv model.

Per (sample b, head g) with tokens ``q, k, v [N, d]`` and initial weights ``W [d, d]`` (``W1, W2`` for
SwiGLU), the forward computes the inner gradient ``G = kᵀ P`` (``P = E ⊙ A`` ...), its column norms
``||G||``, the step ``W' = W - lr G / (||G|| + 1)`` and the read-out ``O = f(q; W')``. Only ``G`` and
``||G||`` are saved for the backward (fp32): every kernel that needs ``W'`` recomputes its columns from
``W``, ``G`` and the norm when it loads them (``_updated``), which costs a few element-wise operations on
a ``[d, BLOCK_C]`` tile.

Launches. Each (sample, head) may be split along N into ``S`` chunks (``triton_op.launch_config`` splits
only where ``B*G`` programs would leave the GPU idle):

- ``S == 1``, forward: one launch of ``forward_kernel`` per column block sums ``kᵀ P`` over all tokens,
  normalises, saves ``G`` and ``||G||``, takes the step and streams the queries (no partials, no step
  launch). ``S > 1``: ``grad_partial_kernel`` (a partial ``kᵀ P`` per chunk), ``step_kernel`` (sums the
  partials in a fixed order, saves ``G`` and ``||G||``) and ``readout_kernel``.
- Backward: ``readout_bwd_kernel`` (``dq`` and ``dW' = qᵀ dY``; with ``S == 1`` (``FUSED``) it owns the
  whole ``dW'`` and back-propagates the step and the normalisation itself, writing ``dG``), else
  ``step_bwd_kernel`` sums the chunk partials and writes ``dG``; ``grad_bwd_kernel`` (``dk``, ``dv`` and the
  weight-gradient partial ``kᵀ dZ``, plus ``dW'`` when ``FUSED``), and ``wgrad_reduce_kernel``, the sum of
  the partials over samples and chunks, split over enough programs to fill the GPU (two stages, each in a
  fixed order: deterministic without atomics).

Every grid is one flat axis of programs (``_prog``: the column block fastest, then the chunk, then the
sample x head), folded onto a second grid axis only beyond grid axis 0's limit (``triton_op.fold_grid``):
``B*G`` never meets CUDA's 65,535 cap on grid axes 1 and 2.

Dot operands. 16-bit inputs (``DOT`` = their dtype) go into ``tl.dot`` as they are loaded, and every
fp32 operand computed on chip (``P``, ``dY``, ``dZ``, the weights, ``W'``, ``dG``) is rounded to ``DOT``
before it meets a dot; accumulation is fp32. fp32 inputs keep fp32 operands (TF32 or IEEE dots, ``PREC``),
fp64 inputs fp64. The loss scale ``coef = s / N`` (~1e-4 at N = 3136) is kept out of the 16-bit operands
(``P``, ``dZ`` and the ``dk`` terms carry it as a factor applied to the fp32 accumulators), so small
products do not fall into fp16's subnormals. ``EMU`` (Triton's interpreter, whose bf16 ``tl.dot`` is
wrong and whose fp32 -> bf16 cast truncates): operands are rounded to bf16 to nearest even, as a GPU's
``cvt.rn.bf16.f32``, and multiplied in fp32, which equals a bf16 MMA with fp32 accumulation up to the
summation order.

Column blocks. The math is separable by output column: column j of ``Z1 = k W1``, ``Z2``, the
activations, ``P``, the gradient ``kᵀ P[:, j]``, its norm and step, ``Y = q W'``, ``dY``, ``qᵀ dY[:, j]``,
``dZ``, ``dv`` and ``kᵀ dZ[:, j]`` need only column j of the weights (and of ``v``, ``dO``, ``dG``) plus the
whole ``k`` or ``q`` row. So every program owns one block of ``BLOCK_C`` columns (``C = cdiv(d, BLOCK_C)``
blocks) and keeps only ``[BLOCK_D, BLOCK_C]`` slices of the weights, gradients and accumulators on chip.
Two quantities sum over all columns: ``dq = dY1 W1'ᵀ + dY2 W2'ᵀ`` (read-out backward) and
``dk = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ`` (gradient backward). With one block (``C == 1``) a single
launch computes everything. With ``C > 1`` each backward stage is two launches of the same kernel, chosen by
the constexpr switches ``COLS`` / ``CROSS``: the column launch writes the per-column outputs (``dv``, the
weight-gradient partials), and the cross launch walks the column blocks in order for each token tile,
recomputes their column quantities and sums ``dq`` or ``dk`` in registers. Each output element is written by
exactly one program with a fixed summation order, so the result is deterministic without atomics.

Constexpr switches: ``SWIGLU`` (else linear), ``MSE`` (linear only: ``E = s (kW - v) / N``, else the dot
loss ``E = -s v / N``), ``GRAD_NORM``, ``PREC`` (``tl.dot`` input precision for fp32 operands), ``DOT`` /
``EMU`` (above), ``COLS`` / ``CROSS`` / ``FUSED`` (above), ``WGRAD`` (the inner gradient depends on the
initial weights, so ``kᵀ dZ`` is not zero: SwiGLU and the MSE loss). Weights are read where they are, with
their strides (``W1``, ``W2`` two tensors); per-(sample, head) buffers are ``[B*G, slots, NW, R, d]``
contiguous, ``NW`` = 2 for SwiGLU and 1 otherwise, ``R`` = d (matrices) or 9 (the taps of the depthwise
conv, whose own kernels are at the end of this module and share the step, step-backward and reduction
kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "conv_grad_bwd_kernel",
    "conv_grad_partial_kernel",
    "conv_readout_bwd_kernel",
    "conv_readout_kernel",
    "forward_kernel",
    "grad_bwd_kernel",
    "grad_partial_kernel",
    "readout_bwd_kernel",
    "readout_kernel",
    "step_bwd_kernel",
    "step_kernel",
    "wgrad_reduce_kernel",
]


@triton.jit
def _prog(S, C):
    """This program on the folded grid: ``(pid, c, s, bg)``, the flat id and, from it, the column block ``c``
    (fastest, so the programs that read one chunk's tokens run side by side), the chunk ``s`` and the sample x
    head ``bg``. A program with ``pid >= B*G*S*C`` (the tail of a folded grid) must return."""
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    t = pid // C
    return pid, pid % C, t % S, t // S


@triton.jit
def _tokens_of(G, N, CHUNK, s, bg):
    """Sample ``b`` and head ``g`` (int64) of ``bg``, and the tokens ``lo .. hi`` of chunk ``s``."""
    lo = s * CHUNK
    return (bg // G).to(tl.int64), (bg % G).to(tl.int64), lo, tl.minimum(lo + CHUNK, N)


@triton.jit
def _operand(x, DOT: tl.constexpr, EMU: tl.constexpr):
    """``x`` as a ``tl.dot`` operand of dtype ``DOT``. ``EMU``: rounded to bf16 (nearest even, by its bits) but
    kept in fp32, for Triton's interpreter, which multiplies bf16 wrongly and truncates on a cast."""
    if EMU:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DOT)
    return y


@triton.jit
def _load_tokens(base, stride_n, stride_c, rows, cols, n_tok, d):
    """A ``[BLOCK_N, len(cols)]`` tile of tokens in their own dtype, zero outside ``n_tok x d``."""
    mask = (rows[:, None] < n_tok) & (cols[None, :] < d)
    return tl.load(base + rows[:, None] * stride_n + cols[None, :] * stride_c, mask=mask, other=0.0)


@triton.jit
def _store_tokens(base, stride_n, stride_c, rows, cols, n_tok, d, x):
    mask = (rows[:, None] < n_tok) & (cols[None, :] < d)
    tl.store(
        base + rows[:, None] * stride_n + cols[None, :] * stride_c, x.to(base.dtype.element_ty), mask=mask
    )


@triton.jit
def _load_tokens_t(base, stride_n, stride_c, rows, cols, n_tok, d):
    """``_load_tokens`` transposed: a ``[len(cols), BLOCK_N]`` tile (channels x tokens)."""
    mask = (cols[:, None] < d) & (rows[None, :] < n_tok)
    return tl.load(base + cols[:, None] * stride_c + rows[None, :] * stride_n, mask=mask, other=0.0)


@triton.jit
def _store_tokens_t(base, stride_n, stride_c, rows, cols, n_tok, d, x):
    """``_store_tokens`` of a transposed ``[len(cols), BLOCK_N]`` tile."""
    mask = (cols[:, None] < d) & (rows[None, :] < n_tok)
    tl.store(
        base + cols[:, None] * stride_c + rows[None, :] * stride_n, x.to(base.dtype.element_ty), mask=mask
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
def _slot(buf, bg, slot, slots, i, NW: tl.constexpr, R, D):
    """Weight ``i`` of slot ``slot`` of (sample, head) ``bg`` in a ``[B*G, slots, NW, R, D]`` buffer."""
    return buf + ((bg.to(tl.int64) * slots + slot) * NW + i) * R * D


@triton.jit
def _store_pair(buf, bg, slot, slots, rd, cols, D, x1, x2, SWIGLU: tl.constexpr):
    """Stores the ``[BLOCK_D, BLOCK_C]`` tile(s) of one column block into a ``[B*G, slots, NW, d, d]``
    buffer (``x2``: the second weight, SwiGLU only)."""
    nw: tl.constexpr = 2 if SWIGLU else 1
    _store_mat(_slot(buf, bg, slot, slots, 0, nw, D, D), rd, cols, D, D, x1)
    if SWIGLU:
        _store_mat(_slot(buf, bg, slot, slots, 1, nw, D, D), rd, cols, D, D, x2)


@triton.jit
def _load_pair(buf, bg, slot, slots, rd, cols, D, SWIGLU: tl.constexpr, ACC: tl.constexpr):
    """The tile(s) ``_store_pair`` stores; the linear model gets its one tile twice."""
    nw: tl.constexpr = 2 if SWIGLU else 1
    x1 = _load_mat(_slot(buf, bg, slot, slots, 0, nw, D, D), D, 1, rd, cols, D, D, ACC)
    if SWIGLU:
        x2 = _load_mat(_slot(buf, bg, slot, slots, 1, nw, D, D), D, 1, rd, cols, D, D, ACC)
    else:
        x2 = x1
    return x1, x2


@triton.jit
def _weights(w1_ptr, w2_ptr, g, swg, swr, swc, rd, cols, D, SWIGLU: tl.constexpr, ACC: tl.constexpr):
    """Columns ``cols`` of the initial weights of head ``g``: ``[BLOCK_D, BLOCK_C]`` tiles ``(W1, W2)``
    (the linear model gets ``W`` twice)."""
    m1 = _load_mat(w1_ptr + g * swg, swr, swc, rd, cols, D, D, ACC)
    if SWIGLU:
        m2 = _load_mat(w2_ptr + g * swg, swr, swc, rd, cols, D, D, ACC)
    else:
        m2 = m1
    return m1, m2


@triton.jit
def _col_norm(grad):
    """``||G[:, j]||`` of a ``[R, BLOCK_C]`` tile holding whole columns: ``[BLOCK_C]``."""
    return tl.sqrt(tl.sum(grad * grad, axis=0))


@triton.jit
def _stepped(w, grad, norm, lr, GRAD_NORM: tl.constexpr):
    """The step: ``W' = W - lr G / (||G||_col + 1)``, or ``W - lr G`` without the normalisation."""
    if GRAD_NORM:
        wp = w - lr * grad / (norm[None, :] + 1.0)
    else:
        wp = w - lr * grad
    return wp


@triton.jit
def _updated(w_ptr, swr, swc, g_buf, n_buf, bg, i, NW: tl.constexpr, rr, cols, R, D, lr,
             GRAD_NORM: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Columns ``cols`` of ``W'`` of weight ``i``, recomputed from ``W`` (at ``w_ptr``, head offset applied)
    and the saved ``G`` ``[B*G, NW, R, D]`` and ``||G||`` ``[B*G, NW, D]``."""
    w = _load_mat(w_ptr, swr, swc, rr, cols, R, D, ACC)
    grad = _load_mat(_slot(g_buf, bg, 0, 1, i, NW, R, D), D, 1, rr, cols, R, D, ACC)
    norm = tl.load(n_buf + (bg.to(tl.int64) * NW + i) * D + cols, mask=cols < D, other=0.0).to(ACC)
    return _stepped(w, grad, norm, lr, GRAD_NORM)


@triton.jit
def _updated_pair(w1_ptr, w2_ptr, g, swg, swr, swc, g_buf, n_buf, bg, rd, cols, D, lr,
                  SWIGLU: tl.constexpr, GRAD_NORM: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``(W1', W2')`` columns ``cols`` of (sample, head) ``bg`` (the linear model gets ``W'`` twice)."""
    nw: tl.constexpr = 2 if SWIGLU else 1
    m1 = _updated(w1_ptr + g * swg, swr, swc, g_buf, n_buf, bg, 0, nw, rd, cols, D, D, lr, GRAD_NORM, ACC)
    if SWIGLU:
        m2 = _updated(w2_ptr + g * swg, swr, swc, g_buf, n_buf, bg, 1, nw, rd, cols, D, D, lr, GRAD_NORM, ACC)
    else:
        m2 = m1
    return m1, m2


@triton.jit
def _step_bwd_cols(dwp, grad, norm, lr, GRAD_NORM: tl.constexpr):
    """``dG`` from ``dW'`` through the step and the normalisation: with ``Ĝ = G / (n + 1)``, ``dĜ = -lr dW'``
    and ``dG = dĜ / (n + 1) - G (G·dĜ)_col / (n (n + 1)²)`` (0 where ``n = 0``)."""
    dgh = -lr * dwp
    if GRAD_NORM:
        proj = tl.sum(grad * dgh, axis=0)  # [BLOCK_C]: G[:, j]·dĜ[:, j]
        denom = norm * (norm + 1.0) * (norm + 1.0)
        coef = tl.where(norm > 0.0, proj / tl.where(norm > 0.0, denom, 1.0), 0.0)
        dg = dgh / (norm[None, :] + 1.0) - grad * coef[None, :]
    else:
        dg = dgh
    return dg


@triton.jit
def _step_bwd_tile(dwp, g_buf, n_buf, dg_buf, bg, i, NW: tl.constexpr, rr, cols, R, D, lr,
                   GRAD_NORM: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``dG`` of weight ``i``'s columns ``cols`` from their whole ``dW'`` (``_step_bwd_cols``), with the saved
    ``G`` and ``||G||``, into ``dg_buf`` ``[B*G, NW, R, D]``."""
    grad = _load_mat(_slot(g_buf, bg, 0, 1, i, NW, R, D), D, 1, rr, cols, R, D, ACC)
    norm = tl.load(n_buf + (bg.to(tl.int64) * NW + i) * D + cols, mask=cols < D, other=0.0).to(ACC)
    _store_mat(
        _slot(dg_buf, bg, 0, 1, i, NW, R, D), rr, cols, R, D, _step_bwd_cols(dwp, grad, norm, lr, GRAD_NORM)
    )


@triton.jit
def _swiglu_acts(z2):
    """``σ(z2)``, ``A = silu(z2)`` and ``A' = silu'(z2) = σ (1 + z2 (1 - σ))``."""
    sig = tl.sigmoid(z2)
    return sig, z2 * sig, sig * (1.0 + z2 * (1.0 - sig))


# ------------------------------------------------------------------------------------------ per-tile math


@triton.jit
def _grad_tiles(k_base, v_base, skn, skc, svn, svc, lo, hi, N, D, rd, cols, o1, o2,
                SWIGLU: tl.constexpr, MSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_C: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr,
                PREC: tl.constexpr):  # fmt: skip
    """``kᵀ P / coef`` of tokens ``lo .. hi`` for one column block: ``(acc1, acc2)`` ``[BLOCK_D, BLOCK_C]``.

    ``o1, o2``: the weight columns as dot operands. ``P / coef`` is ``-v ⊙ A`` and ``-v ⊙ Z1 ⊙ A'``
    (SwiGLU), ``kW - v`` (MSE) or ``-v`` (dot loss). Padded rows load ``k = v = 0``, so they add nothing.
    """
    rn = tl.arange(0, BLOCK_N)
    acc1 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)
    acc2 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)  # SwiGLU's second weight (dead code for linear)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        k = _operand(_load_tokens(k_base, skn, skc, rows, rd, N, D), DOT, EMU)
        v = _load_tokens(v_base, svn, svc, rows, cols, N, D).to(ACC)
        kt = tl.trans(k)
        if SWIGLU:
            z1 = tl.dot(k, o1, input_precision=PREC)
            z2 = tl.dot(k, o2, input_precision=PREC)
            _, a, da = _swiglu_acts(z2)
            acc1 += tl.dot(kt, _operand(-v * a, DOT, EMU), input_precision=PREC)
            acc2 += tl.dot(kt, _operand(-v * z1 * da, DOT, EMU), input_precision=PREC)
        else:
            if MSE:
                e = tl.dot(k, o1, input_precision=PREC) - v
            else:
                e = -v
            acc1 += tl.dot(kt, _operand(e, DOT, EMU), input_precision=PREC)
    return acc1, acc2


@triton.jit
def _readout_tiles(q_base, o_base, sqn, sqc, son, soc, lo, hi, N, D, rd, cols, o1, o2,
                   SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr,
                   PREC: tl.constexpr):  # fmt: skip
    """``O = q W'`` (linear) or ``(q W1') ⊙ silu(q W2')`` of tokens ``lo .. hi``, one column block (``o1``,
    ``o2``: ``W'`` columns as dot operands)."""
    rn = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        q = _operand(_load_tokens(q_base, sqn, sqc, rows, rd, N, D), DOT, EMU)
        y = tl.dot(q, o1, input_precision=PREC)
        if SWIGLU:
            y2 = tl.dot(q, o2, input_precision=PREC)
            y = y * y2 * tl.sigmoid(y2)
        _store_tokens(o_base, son, soc, rows, cols, N, D, y)


@triton.jit
def _readout_dy(q, do, o1, o2, SWIGLU: tl.constexpr, PREC: tl.constexpr):
    """One column block of ``dY1 = dO ⊙ silu(Y2)``, ``dY2 = dO ⊙ Y1 ⊙ silu'(Y2)`` (linear: ``dO``)."""
    if SWIGLU:
        y1 = tl.dot(q, o1, input_precision=PREC)
        y2 = tl.dot(q, o2, input_precision=PREC)
        _, act, dact = _swiglu_acts(y2)
        dy1 = do * act
        dy2 = do * y1 * dact
    else:
        dy1 = do
        dy2 = do
    return dy1, dy2


@triton.jit
def _readout_dq(dy1, dy2, o1, o2, SWIGLU: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr,
                PREC: tl.constexpr):  # fmt: skip
    """One column block's share of ``dq = dY1 W1'ᵀ + dY2 W2'ᵀ``: ``[BLOCK_N, BLOCK_D]``."""
    dq = tl.dot(_operand(dy1, DOT, EMU), tl.trans(o1), input_precision=PREC)
    if SWIGLU:
        dq += tl.dot(_operand(dy2, DOT, EMU), tl.trans(o2), input_precision=PREC)
    return dq


@triton.jit
def _grad_bwd_cols(k, v, o1, o2, og1, og2, coef, SWIGLU: tl.constexpr, MSE: tl.constexpr,
                   PREC: tl.constexpr):  # fmt: skip
    """One column block of the gradient backward: ``dv``, and ``P1``, ``P2``, ``dZ1``, ``dZ2`` over ``coef``.

    ``k`` (every channel) and the weight / ``dG`` columns ``o*``, ``og*`` are dot operands, ``v`` fp32. With
    ``dP = k dG`` and ``E = -coef v``: ``dv = -coef (dP1 ⊙ A + dP2 ⊙ Z1 ⊙ A')`` (linear: ``-coef dP``),
    ``P1 = E ⊙ A``, ``P2 = E ⊙ Z1 ⊙ A'`` (linear: ``P = E``), ``dZ1 = dP2 ⊙ E ⊙ A'``,
    ``dZ2 = dP1 ⊙ E ⊙ A' + dP2 ⊙ E ⊙ Z1 ⊙ A''`` (linear MSE: ``E = coef (kW - v)``, ``dZ = coef dP``).
    """
    dp1 = tl.dot(k, og1, input_precision=PREC)
    if SWIGLU:
        z1 = tl.dot(k, o1, input_precision=PREC)
        z2 = tl.dot(k, o2, input_precision=PREC)
        sig, a, da = _swiglu_acts(z2)
        dda = sig * (1.0 - sig) * (2.0 + z2 * (1.0 - 2.0 * sig))  # silu''(z2)
        dp2 = tl.dot(k, og2, input_precision=PREC)
        dz1 = -v * dp2 * da
        dz2 = -v * (dp1 * da + dp2 * z1 * dda)
        dv = -coef * (dp1 * a + dp2 * z1 * da)
        p1 = -v * a
        p2 = -v * z1 * da
    else:
        dv = -coef * dp1
        if MSE:
            p1 = tl.dot(k, o1, input_precision=PREC) - v  # padded rows: k = v = 0 -> 0
        else:
            p1 = -v
        p2 = p1
        dz1 = dp1
        dz2 = dz1
    return dv, p1, p2, dz1, dz2


@triton.jit
def _grad_bwd_dk(p1, p2, dz1, dz2, o1, o2, og1, og2, SWIGLU: tl.constexpr, MSE: tl.constexpr,
                 DOT: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """One column block's share of ``dk / coef = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ`` (``P``, ``dZ`` over
    ``coef``): ``[BLOCK_N, BLOCK_D]``. Linear: ``P dGᵀ``, plus ``dZ Wᵀ`` for the MSE loss (the dot loss does
    not depend on W)."""
    dk = tl.dot(_operand(p1, DOT, EMU), tl.trans(og1), input_precision=PREC)
    if SWIGLU:
        dk += tl.dot(_operand(p2, DOT, EMU), tl.trans(og2), input_precision=PREC)
        dk += tl.dot(_operand(dz1, DOT, EMU), tl.trans(o1), input_precision=PREC)
        dk += tl.dot(_operand(dz2, DOT, EMU), tl.trans(o2), input_precision=PREC)
    else:
        if MSE:
            dk += tl.dot(_operand(dz1, DOT, EMU), tl.trans(o1), input_precision=PREC)
    return dk


@triton.jit
def _swiglu_bwd_tile(k, v, o1, o2, og1, og2, coef, DOT: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr):
    """The SwiGLU gradient backward of one token tile holding every column (``_grad_bwd_cols`` then
    ``_grad_bwd_dk``, interleaved): ``dk / coef``, ``dZ1 / coef``, ``dZ2 / coef`` and ``dv``."""
    dp1 = tl.dot(k, og1, input_precision=PREC)
    dp2 = tl.dot(k, og2, input_precision=PREC)
    z1 = tl.dot(k, o1, input_precision=PREC)
    z2 = tl.dot(k, o2, input_precision=PREC)
    sig, a, da = _swiglu_acts(z2)
    dda = sig * (1.0 - sig) * (2.0 + z2 * (1.0 - 2.0 * sig))  # silu''(z2)
    dv = -coef * (dp1 * a + dp2 * z1 * da)
    dk = tl.dot(_operand(-v * a, DOT, EMU), tl.trans(og1), input_precision=PREC)
    vda = -v * da
    dk += tl.dot(_operand(vda * z1, DOT, EMU), tl.trans(og2), input_precision=PREC)
    dz1 = vda * dp2
    dk += tl.dot(_operand(dz1, DOT, EMU), tl.trans(o1), input_precision=PREC)
    dz2 = vda * dp1 - v * dp2 * z1 * dda
    dk += tl.dot(_operand(dz2, DOT, EMU), tl.trans(o2), input_precision=PREC)
    return dk, dz1, dz2, dv


@triton.jit
def _swiglu_bwd_tile_t(kt, vt, o1, o2, og1, og2, coef, DOT: tl.constexpr, EMU: tl.constexpr,
                       PREC: tl.constexpr):  # fmt: skip
    """``_swiglu_bwd_tile`` on transposed tiles (``kᵀ`` ``[BLOCK_D, BLOCK_N]``, ``vᵀ`` ``[BLOCK_C, BLOCK_N]``):
    ``dkᵀ / coef``, ``dZ1ᵀ / coef``, ``dZ2ᵀ / coef``, ``dvᵀ``. Every dot then has ``BLOCK_C`` or ``BLOCK_D``
    rows, whatever the token tile: ``Z1ᵀ = W1ᵀ kᵀ``, ``dP1ᵀ = dG1ᵀ kᵀ``, ``dkᵀ = dG1 P1ᵀ + ... + W2 dZ2ᵀ``."""
    dp1 = tl.dot(tl.trans(og1), kt, input_precision=PREC)
    dp2 = tl.dot(tl.trans(og2), kt, input_precision=PREC)
    z1 = tl.dot(tl.trans(o1), kt, input_precision=PREC)
    z2 = tl.dot(tl.trans(o2), kt, input_precision=PREC)
    sig, a, da = _swiglu_acts(z2)
    dda = sig * (1.0 - sig) * (2.0 + z2 * (1.0 - 2.0 * sig))  # silu''(z2)
    dv = -coef * (dp1 * a + dp2 * z1 * da)
    dk = tl.dot(og1, _operand(-vt * a, DOT, EMU), input_precision=PREC)
    vda = -vt * da
    dk += tl.dot(og2, _operand(vda * z1, DOT, EMU), input_precision=PREC)
    dz1 = vda * dp2
    dk += tl.dot(o1, _operand(dz1, DOT, EMU), input_precision=PREC)
    dz2 = vda * dp1 - vt * dp2 * z1 * dda
    dk += tl.dot(o2, _operand(dz2, DOT, EMU), input_precision=PREC)
    return dk, dz1, dz2, dv


# ------------------------------------------------------------------------------------------------ forward


@triton.jit
def forward_kernel(
    q_ptr, k_ptr, v_ptr, w1_ptr, w2_ptr, o_ptr, g_ptr, n_ptr,
    BG, G, N, D,
    sqb, sqg, sqn, sqc, skb, skg, skn, skc, svb, svg, svn, svc, sob, sog, son, soc,
    swg, swr, swc,
    coef, lr,
    SWIGLU: tl.constexpr, MSE: tl.constexpr, NW: tl.constexpr, GRAD_NORM: tl.constexpr, SAVE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The whole forward of one (sample, head) and column block, all N tokens in one program (``S == 1``).

    Sums ``G = kᵀ P``, takes the step and writes the read-out ``O`` of the block's columns; ``SAVE`` (for a
    backward) also stores ``G`` and its column norms (``g_ptr`` ``[B*G, NW, d, d]``, ``n_ptr``
    ``[B*G, NW, d]``).
    """
    pid, c, _s, bg = _prog(1, tl.cdiv(D, BLOCK_C))
    if pid >= BG * tl.cdiv(D, BLOCK_C):
        return
    b, g, _lo, _hi = _tokens_of(G, N, N, 0, bg)
    rd = tl.arange(0, BLOCK_D)
    cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
    w1, w2 = _weights(w1_ptr, w2_ptr, g, swg, swr, swc, rd, cols, D, SWIGLU, ACC)
    acc1, acc2 = _grad_tiles(
        k_ptr + b * skb + g * skg, v_ptr + b * svb + g * svg, skn, skc, svn, svc, 0, N, N, D, rd, cols,
        _operand(w1, DOT, EMU), _operand(w2, DOT, EMU), SWIGLU, MSE, BLOCK_N, BLOCK_D, BLOCK_C, DOT, EMU, ACC,
        PREC,
    )  # fmt: skip
    g1 = coef * acc1
    n1 = _col_norm(g1)
    wp1 = _stepped(w1, g1, n1, lr, GRAD_NORM)
    if SAVE:
        _store_pair(g_ptr, bg, 0, 1, rd, cols, D, g1, coef * acc2, SWIGLU)
        tl.store(n_ptr + bg.to(tl.int64) * NW * D + cols, n1.to(n_ptr.dtype.element_ty), mask=cols < D)
    if SWIGLU:
        g2 = coef * acc2
        n2 = _col_norm(g2)
        wp2 = _stepped(w2, g2, n2, lr, GRAD_NORM)
        if SAVE:
            n_at = n_ptr + (bg.to(tl.int64) * NW + 1) * D + cols
            tl.store(n_at, n2.to(n_ptr.dtype.element_ty), mask=cols < D)
    else:
        wp2 = wp1
    _readout_tiles(
        q_ptr + b * sqb + g * sqg, o_ptr + b * sob + g * sog, sqn, sqc, son, soc, 0, N, N, D, rd, cols,
        _operand(wp1, DOT, EMU), _operand(wp2, DOT, EMU), SWIGLU, BLOCK_N, DOT, EMU, PREC,
    )  # fmt: skip


@triton.jit
def grad_partial_kernel(
    k_ptr, v_ptr, w1_ptr, w2_ptr, part_ptr,
    BG, G, N, D, CHUNK, S,
    skb, skg, skn, skc, svb, svg, svn, svc,
    swg, swr, swc,
    coef,
    SWIGLU: tl.constexpr, MSE: tl.constexpr, NW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Partial inner gradients ``kᵀ P`` of one chunk of tokens and one column block (``S > 1``) into
    ``part_ptr`` ``[B*G, S, NW, d, d]``."""
    pid, c, s, bg = _prog(S, tl.cdiv(D, BLOCK_C))
    if pid >= BG * S * tl.cdiv(D, BLOCK_C):
        return
    b, g, lo, hi = _tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
    w1, w2 = _weights(w1_ptr, w2_ptr, g, swg, swr, swc, rd, cols, D, SWIGLU, ACC)
    acc1, acc2 = _grad_tiles(
        k_ptr + b * skb + g * skg, v_ptr + b * svb + g * svg, skn, skc, svn, svc, lo, hi, N, D, rd, cols,
        _operand(w1, DOT, EMU), _operand(w2, DOT, EMU), SWIGLU, MSE, BLOCK_N, BLOCK_D, BLOCK_C, DOT, EMU, ACC,
        PREC,
    )  # fmt: skip
    _store_pair(part_ptr, bg, s, S, rd, cols, D, coef * acc1, coef * acc2, SWIGLU)


@triton.jit
def step_kernel(
    part_ptr, g_ptr, n_ptr,
    BG, R, D, S,
    NW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Sums the ``S`` partials of ``part_ptr`` ``[B*G, S, NW, R, D]`` in order: the saved gradient ``G``
    (``[B*G, NW, R, D]``) and its column norms (``[B*G, NW, D]``, the norm over the ``R`` rows).

    One block of columns per program. Weights are ``R x D`` (``d x d``; 9 taps x channels for the
    depthwise conv).
    """
    pid, c, _s, bg = _prog(1, tl.cdiv(D, BLOCK_C))
    if pid >= BG * tl.cdiv(D, BLOCK_C):
        return
    rr = tl.arange(0, BLOCK_R)
    cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
    for i in tl.static_range(NW):
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
        for s in range(S):
            acc += _load_mat(_slot(part_ptr, bg, s, S, i, NW, R, D), D, 1, rr, cols, R, D, ACC)
        _store_mat(_slot(g_ptr, bg, 0, 1, i, NW, R, D), rr, cols, R, D, acc)
        norm = _col_norm(acc)
        tl.store(
            n_ptr + (bg.to(tl.int64) * NW + i) * D + cols, norm.to(n_ptr.dtype.element_ty), mask=cols < D
        )


@triton.jit
def readout_kernel(
    q_ptr, w1_ptr, w2_ptr, g_ptr, n_ptr, o_ptr,
    BG, G, N, D, CHUNK, S,
    sqb, sqg, sqn, sqc, sob, sog, son, soc,
    swg, swr, swc,
    lr,
    SWIGLU: tl.constexpr, NW: tl.constexpr, GRAD_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The read-out of one chunk of queries and one column block, ``W'`` recomputed from ``W``, ``G``, ``||G||``."""
    pid, c, s, bg = _prog(S, tl.cdiv(D, BLOCK_C))
    if pid >= BG * S * tl.cdiv(D, BLOCK_C):
        return
    b, g, lo, hi = _tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
    wp1, wp2 = _updated_pair(w1_ptr, w2_ptr, g, swg, swr, swc, g_ptr, n_ptr, bg, rd, cols, D, lr, SWIGLU,
                             GRAD_NORM, ACC)  # fmt: skip
    _readout_tiles(
        q_ptr + b * sqb + g * sqg, o_ptr + b * sob + g * sog, sqn, sqc, son, soc, lo, hi, N, D, rd, cols,
        _operand(wp1, DOT, EMU), _operand(wp2, DOT, EMU), SWIGLU, BLOCK_N, DOT, EMU, PREC,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------- backward


@triton.jit
def readout_bwd_kernel(
    q_ptr, do_ptr, w1_ptr, w2_ptr, g_ptr, n_ptr, dq_ptr, part_ptr, dg_ptr,
    BG, G, N, D, CHUNK, S,
    sqb, sqg, sqn, sqc, sdob, sdog, sdon, sdoc, sdqb, sdqg, sdqn, sdqc,
    swg, swr, swc,
    lr,
    SWIGLU: tl.constexpr, NW: tl.constexpr, GRAD_NORM: tl.constexpr,
    COLS: tl.constexpr, CROSS: tl.constexpr, FUSED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Read-out backward for one chunk: ``dW' = qᵀ dY`` of the program's column block and/or ``dq``.

    ``COLS``: ``dW'`` of the block; ``FUSED`` (``S == 1``: the program holds all of it) stores it in slot 1
    of ``part_ptr`` ``[B*G, 2, NW, d, d]`` and back-propagates the step into ``dg_ptr`` ``[B*G, NW, d, d]``;
    otherwise it stores the chunk's partial in slot ``s`` of ``part_ptr`` ``[B*G, S + 1, NW, d, d]``.
    ``CROSS``: ``dq``, summed over every column block (with ``COLS``, the grid must have one block,
    ``C == 1``; without, the launch has one program per chunk and each walks the blocks in order).
    """
    n_cols = tl.cdiv(D, BLOCK_C) if COLS else 1
    pid, c, s, bg = _prog(S, n_cols)
    if pid >= BG * S * n_cols:
        return
    b, g, lo, hi = _tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rc = tl.arange(0, BLOCK_C)
    rn = tl.arange(0, BLOCK_N)
    q_base = q_ptr + b * sqb + g * sqg
    do_base = do_ptr + b * sdob + g * sdog
    dq_base = dq_ptr + b * sdqb + g * sdqg
    if COLS:
        cols = c * BLOCK_C + rc
        wp1, wp2 = _updated_pair(w1_ptr, w2_ptr, g, swg, swr, swc, g_ptr, n_ptr, bg, rd, cols, D, lr, SWIGLU,
                                 GRAD_NORM, ACC)  # fmt: skip
        o1 = _operand(wp1, DOT, EMU)
        o2 = _operand(wp2, DOT, EMU)
        acc1 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)
        acc2 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)  # SwiGLU's second weight (dead code for linear)
        for start in range(lo, hi, BLOCK_N):
            rows = start + rn
            q = _operand(_load_tokens(q_base, sqn, sqc, rows, rd, N, D), DOT, EMU)
            do = _load_tokens(do_base, sdon, sdoc, rows, cols, N, D).to(ACC)
            dy1, dy2 = _readout_dy(q, do, o1, o2, SWIGLU, PREC)
            qt = tl.trans(q)
            acc1 += tl.dot(qt, _operand(dy1, DOT, EMU), input_precision=PREC)
            if SWIGLU:
                acc2 += tl.dot(qt, _operand(dy2, DOT, EMU), input_precision=PREC)
            if CROSS:
                dq = _readout_dq(dy1, dy2, o1, o2, SWIGLU, DOT, EMU, PREC)
                _store_tokens(dq_base, sdqn, sdqc, rows, rd, N, D, dq)
        if FUSED:  # dW' into slot 1 of [B*G, 2, NW, d, d], and dG
            _store_mat(_slot(part_ptr, bg, 1, 2, 0, NW, D, D), rd, cols, D, D, acc1)
            _step_bwd_tile(acc1, g_ptr, n_ptr, dg_ptr, bg, 0, NW, rd, cols, D, D, lr, GRAD_NORM, ACC)
            if SWIGLU:
                _store_mat(_slot(part_ptr, bg, 1, 2, 1, NW, D, D), rd, cols, D, D, acc2)
                _step_bwd_tile(acc2, g_ptr, n_ptr, dg_ptr, bg, 1, NW, rd, cols, D, D, lr, GRAD_NORM, ACC)
        else:
            _store_pair(part_ptr, bg, s, S + 1, rd, cols, D, acc1, acc2, SWIGLU)
    else:
        for start in range(lo, hi, BLOCK_N):
            rows = start + rn
            q = _operand(_load_tokens(q_base, sqn, sqc, rows, rd, N, D), DOT, EMU)
            dq = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
            for c0 in range(0, D, BLOCK_C):
                cj = c0 + rc
                wj1, wj2 = _updated_pair(w1_ptr, w2_ptr, g, swg, swr, swc, g_ptr, n_ptr, bg, rd, cj, D, lr,
                                         SWIGLU, GRAD_NORM, ACC)  # fmt: skip
                oj1 = _operand(wj1, DOT, EMU)
                oj2 = _operand(wj2, DOT, EMU)
                do = _load_tokens(do_base, sdon, sdoc, rows, cj, N, D).to(ACC)
                dy1, dy2 = _readout_dy(q, do, oj1, oj2, SWIGLU, PREC)
                dq += _readout_dq(dy1, dy2, oj1, oj2, SWIGLU, DOT, EMU, PREC)
            _store_tokens(dq_base, sdqn, sdqc, rows, rd, N, D, dq)


@triton.jit
def step_bwd_kernel(
    part_ptr, g_ptr, n_ptr, dg_ptr,
    BG, R, D, S,
    lr,
    NW: tl.constexpr, GRAD_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Sums the read-out partials into ``dW'`` and back-propagates the step and the normalisation (``S > 1``).

    ``part_ptr`` is ``[B*G, S + 1, NW, R, D]``: slots ``0..S-1`` hold the read-out partials, slot ``S``
    receives ``dW'`` (the direct part of the initial weights' gradient); ``dG`` goes to ``dg_ptr``.
    """
    pid, c, _s, bg = _prog(1, tl.cdiv(D, BLOCK_C))
    if pid >= BG * tl.cdiv(D, BLOCK_C):
        return
    rr = tl.arange(0, BLOCK_R)
    cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
    for i in tl.static_range(NW):
        dwp = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
        for s in range(S):
            dwp += _load_mat(_slot(part_ptr, bg, s, S + 1, i, NW, R, D), D, 1, rr, cols, R, D, ACC)
        _store_mat(_slot(part_ptr, bg, S, S + 1, i, NW, R, D), rr, cols, R, D, dwp)
        _step_bwd_tile(dwp, g_ptr, n_ptr, dg_ptr, bg, i, NW, rr, cols, R, D, lr, GRAD_NORM, ACC)


@triton.jit
def grad_bwd_kernel(
    k_ptr, v_ptr, w1_ptr, w2_ptr, dg_ptr, dk_ptr, dv_ptr, part_ptr,
    BG, G, N, D, CHUNK, S,
    skb, skg, skn, skc, svb, svg, svn, svc, sdkb, sdkg, sdkn, sdkc, sdvb, sdvg, sdvn, sdvc,
    swg, swr, swc,
    coef,
    SWIGLU: tl.constexpr, MSE: tl.constexpr, NW: tl.constexpr,
    COLS: tl.constexpr, CROSS: tl.constexpr, FUSED: tl.constexpr, WGRAD: tl.constexpr, TRANS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Inner-gradient backward for one chunk: ``dv`` and the partial ``kᵀ dZ`` per weight and/or ``dk``.

    Recomputes ``Z1 = k W1``, ``Z2 = k W2`` and the activations; ``dP = k dG`` (``_grad_bwd_cols``).
    ``COLS``: ``dv`` and, where the inner gradient depends on the weights (``WGRAD``), the block's partial
    ``kᵀ dZ`` into slot ``s`` of ``part_ptr`` ``[B*G, S + 1, NW, d, d]``; ``FUSED`` (``S == 1``) adds the
    ``dW'`` of slot 1 to it, so slot 0 holds the sample's whole weight gradient. ``CROSS``: ``dk``, summed
    over every column block (as in ``readout_bwd_kernel``: with ``COLS`` only for ``C == 1``). ``TRANS``
    (SwiGLU, ``COLS`` and ``CROSS``): the tiles transposed, channels x tokens (``_swiglu_bwd_tile_t``), so that
    every dot has d rows (sm_90's ``wgmma`` takes 64) with token tiles short enough for the registers.
    """
    n_cols = tl.cdiv(D, BLOCK_C) if COLS else 1
    pid, c, s, bg = _prog(S, n_cols)
    if pid >= BG * S * n_cols:
        return
    b, g, lo, hi = _tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rc = tl.arange(0, BLOCK_C)
    rn = tl.arange(0, BLOCK_N)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    dk_base = dk_ptr + b * sdkb + g * sdkg
    dv_base = dv_ptr + b * sdvb + g * sdvg
    if COLS:
        cols = c * BLOCK_C + rc
        w1, w2 = _weights(w1_ptr, w2_ptr, g, swg, swr, swc, rd, cols, D, SWIGLU, ACC)
        dg1, dg2 = _load_pair(dg_ptr, bg, 0, 1, rd, cols, D, SWIGLU, ACC)
        o1 = _operand(w1, DOT, EMU)
        o2 = _operand(w2, DOT, EMU)
        og1 = _operand(dg1, DOT, EMU)
        og2 = _operand(dg2, DOT, EMU)
        acc1 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)
        acc2 = tl.zeros((BLOCK_D, BLOCK_C), dtype=ACC)  # SwiGLU's second weight (dead code for linear)
        for start in range(lo, hi, BLOCK_N):
            rows = start + rn
            if TRANS:
                kt = _operand(_load_tokens_t(k_base, skn, skc, rows, rd, N, D), DOT, EMU)
                vt = _load_tokens_t(v_base, svn, svc, rows, cols, N, D).to(ACC)
                dkt, dz1t, dz2t, dvt = _swiglu_bwd_tile_t(kt, vt, o1, o2, og1, og2, coef, DOT, EMU, PREC)
                _store_tokens_t(dk_base, sdkn, sdkc, rows, rd, N, D, coef * dkt)
                _store_tokens_t(dv_base, sdvn, sdvc, rows, cols, N, D, dvt)
                acc1 += tl.dot(kt, tl.trans(_operand(dz1t, DOT, EMU)), input_precision=PREC)
                acc2 += tl.dot(kt, tl.trans(_operand(dz2t, DOT, EMU)), input_precision=PREC)
            else:
                k = _operand(_load_tokens(k_base, skn, skc, rows, rd, N, D), DOT, EMU)
                v = _load_tokens(v_base, svn, svc, rows, cols, N, D).to(ACC)
                if CROSS and SWIGLU:
                    # The whole stage for one block of all columns, ordered so that each N x d tile dies soon
                    # after it is made (the fewest live tiles).
                    dk, dz1, dz2, dv = _swiglu_bwd_tile(k, v, o1, o2, og1, og2, coef, DOT, EMU, PREC)
                    _store_tokens(dk_base, sdkn, sdkc, rows, rd, N, D, coef * dk)
                else:
                    dv, p1, p2, dz1, dz2 = _grad_bwd_cols(k, v, o1, o2, og1, og2, coef, SWIGLU, MSE, PREC)
                    if CROSS:
                        dk = _grad_bwd_dk(p1, p2, dz1, dz2, o1, o2, og1, og2, SWIGLU, MSE, DOT, EMU, PREC)
                        _store_tokens(dk_base, sdkn, sdkc, rows, rd, N, D, coef * dk)
                _store_tokens(dv_base, sdvn, sdvc, rows, cols, N, D, dv)
                if WGRAD:
                    kt = tl.trans(k)
                    acc1 += tl.dot(kt, _operand(dz1, DOT, EMU), input_precision=PREC)
                    if SWIGLU:
                        acc2 += tl.dot(kt, _operand(dz2, DOT, EMU), input_precision=PREC)
        if WGRAD:
            acc1 = coef * acc1
            acc2 = coef * acc2
            if FUSED:
                dwp1, dwp2 = _load_pair(part_ptr, bg, 1, 2, rd, cols, D, SWIGLU, ACC)
                acc1 += dwp1
                acc2 += dwp2
            _store_pair(part_ptr, bg, s, S + 1, rd, cols, D, acc1, acc2, SWIGLU)
    else:
        for start in range(lo, hi, BLOCK_N):
            rows = start + rn
            k = _operand(_load_tokens(k_base, skn, skc, rows, rd, N, D), DOT, EMU)
            dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
            for c0 in range(0, D, BLOCK_C):
                cj = c0 + rc
                wj1, wj2 = _weights(w1_ptr, w2_ptr, g, swg, swr, swc, rd, cj, D, SWIGLU, ACC)
                dgj1, dgj2 = _load_pair(dg_ptr, bg, 0, 1, rd, cj, D, SWIGLU, ACC)
                oj1 = _operand(wj1, DOT, EMU)
                oj2 = _operand(wj2, DOT, EMU)
                ogj1 = _operand(dgj1, DOT, EMU)
                ogj2 = _operand(dgj2, DOT, EMU)
                v = _load_tokens(v_base, svn, svc, rows, cj, N, D).to(ACC)
                _, p1, p2, dz1, dz2 = _grad_bwd_cols(k, v, oj1, oj2, ogj1, ogj2, coef, SWIGLU, MSE, PREC)
                dk += _grad_bwd_dk(p1, p2, dz1, dz2, oj1, oj2, ogj1, ogj2, SWIGLU, MSE, DOT, EMU, PREC)
            _store_tokens(dk_base, sdkn, sdkc, rows, rd, N, D, coef * dk)


@triton.jit
def wgrad_reduce_kernel(
    part_ptr, out_ptr,
    B, G, E, D, L, LO, NUSE, PER, SPLIT, OUT_SR, OUT_SC,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """One stage of the weight-gradient reduction ``out[g] = Σ_b Σ_slot part[b, g, slot]``, split over programs.

    ``part_ptr`` is ``[B, G, L, E]`` (``E = NW * R * D`` numbers per slot), of which slots ``LO .. LO+NUSE-1``
    are summed. The ``B * NUSE`` items are cut into ``SPLIT`` runs of ``PER`` (one per program, with one
    block of ``BLOCK_E`` numbers), each summed in a fixed order, ``BLOCK_T`` items at a time; program
    ``(j, g)`` writes its run's sum to ``out_ptr`` ``[SPLIT, G, ...]``, element ``e`` (row ``e // D``,
    column ``e % D``) at ``(e // D) * OUT_SR + (e % D) * OUT_SC``: a second stage with ``SPLIT = 1`` sums the
    runs, and writes the depthwise conv's ``[taps, channels]`` as its weight's ``[channels, taps]``.
    """
    n_eb = tl.cdiv(E, BLOCK_E)
    pid, eb, j, g = _prog(SPLIT, n_eb)
    if pid >= G * SPLIT * n_eb:
        return
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    rt = tl.arange(0, BLOCK_T)
    t0 = j * PER
    t1 = tl.minimum(t0 + PER, B * NUSE)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=ACC)
    for t in range(t0, t1, BLOCK_T):
        item = t + rt
        row = (item // NUSE * G + g) * L + LO + item % NUSE
        mask = (item[:, None] < t1) & (e[None, :] < E)
        acc += tl.load(part_ptr + row.to(tl.int64)[:, None] * E + e[None, :], mask=mask, other=0.0).to(ACC)
    dst = out_ptr + (j * G + g).to(tl.int64) * E + (e // D) * OUT_SR + (e % D) * OUT_SC
    tl.store(dst, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=e < E)


# ------------------------------------------------------------------------------------------------------------
# The 3x3 depthwise-conv inner model on an H x W raster grid of tokens. Weights are [9 taps, channels]; tap
# (ty, tx) reads the neighbour at offset (ty - 1, tx - 1) with zero padding (PyTorch's conv2d, padding 1).
#   G[δ, c] = Σ_p E[p, c] k[p + δ, c]      out[p, c] = Σ_δ W'[δ, c] q[p + δ, c]
#   dW'[δ, c] = Σ_p dO[p, c] q[p + δ, c]   dq[p, c] = Σ_δ W'[δ, c] dO[p - δ, c]
#   dv[p, c] = -coef Σ_δ dG[δ, c] k[p + δ, c]   dk[p, c] = Σ_δ dG[δ, c] E[p - δ, c]
# The weight enters only through the read-out (E does not depend on it), so dW = Σ_b dW'. No dots: the
# tiles are upcast to ACC as they are loaded.


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
    pid, _c, s, bg = _prog(S, 1)
    if pid >= BG * S:
        return
    b, g, lo, hi = _tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    acc = tl.zeros((16, BLOCK_D), dtype=ACC)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        e = -coef * _load_tokens(v_base, svn, svc, rows, rd, N, D).to(ACC)
        for tap in tl.static_range(9):
            ks = _load_shifted(k_base, skn, skc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            acc += tl.where(rr[:, None] == tap, tl.sum(e * ks, axis=0)[None, :], 0.0)
    _store_mat(_slot(part_ptr, bg, s, S, 0, 1, 9, D), rr, rd, 9, D, acc)


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
    pid, _c, s, bg = _prog(S, 1)
    if pid >= BG * S:
        return
    b, g, lo, hi = _tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    wp = _updated(w_ptr + g * swg, swr, swc, g_ptr, n_ptr, bg, 0, 1, rr, rd, 9, D, lr, GRAD_NORM, ACC)
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
    q_ptr, do_ptr, w_ptr, g_ptr, n_ptr, dq_ptr, part_ptr,
    BG, G, N, D, CHUNK, S, H, W,
    sqb, sqg, sqn, sqc, sdob, sdog, sdon, sdoc, sdqb, sdqg, sdqn, sdqc,
    swg, swr, swc,
    lr,
    GRAD_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Read-out backward for one chunk: ``dq`` (written) and the partial ``dW'`` (slots of ``[B*G, S+1, 9, d]``)."""
    pid, _c, s, bg = _prog(S, 1)
    if pid >= BG * S:
        return
    b, g, lo, hi = _tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    wp = _updated(w_ptr + g * swg, swr, swc, g_ptr, n_ptr, bg, 0, 1, rr, rd, 9, D, lr, GRAD_NORM, ACC)
    q_base = q_ptr + b * sqb + g * sqg
    do_base = do_ptr + b * sdob + g * sdog
    dq_base = dq_ptr + b * sdqb + g * sdqg
    acc = tl.zeros((16, BLOCK_D), dtype=ACC)
    for start in range(lo, hi, BLOCK_N):
        rows = start + rn
        do = _load_tokens(do_base, sdon, sdoc, rows, rd, N, D).to(ACC)
        dq = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
        for tap in tl.static_range(9):
            qs = _load_shifted(q_base, sqn, sqc, rows, rd, tap // 3 - 1, tap % 3 - 1, N, H, W, D, ACC)
            acc += tl.where(rr[:, None] == tap, tl.sum(do * qs, axis=0)[None, :], 0.0)
            dos = _load_shifted(do_base, sdon, sdoc, rows, rd, 1 - tap // 3, 1 - tap % 3, N, H, W, D, ACC)
            dq += _tap(wp, rr, tap)[None, :] * dos
        _store_tokens(dq_base, sdqn, sdqc, rows, rd, N, D, dq)
    _store_mat(_slot(part_ptr, bg, s, S + 1, 0, 1, 9, D), rr, rd, 9, D, acc)


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
    pid, _c, s, bg = _prog(S, 1)
    if pid >= BG * S:
        return
    b, g, lo, hi = _tokens_of(G, N, CHUNK, s, bg)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 16)
    dg = _load_mat(_slot(dg_ptr, bg, 0, 1, 0, 1, 9, D), D, 1, rr, rd, 9, D, ACC)
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
