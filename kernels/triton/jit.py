"""The jit helpers every TTT kernel shares: its program on the grid, tiles, dot operands and the inner step.

Every grid is one flat axis of programs (``program``), folded onto a second axis only beyond axis 0's limit
(``plan.fold_grid``). 16-bit inputs go into ``tl.dot`` as they are; every fp32 operand computed on chip is
rounded to ``DOT`` first (``operand``; ``EMU`` emulates a bf16 MMA on the interpreter). Per-(sample, head)
buffers are ``[B*G, slots, NW, R, d]`` (``slot_at``); only ``G`` and ``||G||`` are saved for the backward
(``saved``), and ``W'`` is recomputed from them where a kernel needs it (``updated``).

The grid, the dot operands and the buffers in full: ``docs/design/kernels.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "chunk_of",
    "col_norm",
    "last_to_arrive",
    "load_mat",
    "load_tile",
    "norm_at",
    "operand",
    "program",
    "saved",
    "slot_at",
    "step_bwd_cols",
    "step_bwd_tile",
    "stepped",
    "store_mat",
    "store_tile",
    "sum_slots",
    "updated",
]


@triton.jit
def program(S, C, PID0):
    """This program on the folded grid: ``(pid, c, s, bg)``, the flat id counted from ``PID0`` (0, or where a
    fused launch starts this kernel's programs: ``fuse``) and, from it, the column block ``c`` (fastest, so
    the programs that read one chunk's tokens run side by side), the chunk ``s`` and the sample x head ``bg``.
    A program with ``pid >= B*G*S*C`` (the tail of a folded grid) must return."""
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0) - PID0
    t = pid // C
    return pid, pid % C, t % S, t // S


@triton.jit
def chunk_of(BG, G, N, CHUNK, S, C, PID0):
    """This program's share when each of the ``BG`` (sample, head) pairs splits into ``S`` chunks of ``CHUNK``
    tokens and ``C`` column blocks: ``(dead, c, s, bg, b, g, lo, hi)``, the column block, the chunk, the
    sample x head with its sample ``b`` and head ``g`` (int64), and the chunk's tokens ``lo .. hi``. A
    ``dead`` program (the tail of a folded grid) must return."""
    pid, c, s, bg = program(S, C, PID0)
    lo = s * CHUNK
    b, g = (bg // G).to(tl.int64), (bg % G).to(tl.int64)
    return pid >= BG * S * C, c, s, bg, b, g, lo, tl.minimum(lo + CHUNK, N)


@triton.jit
def last_to_arrive(cnt_ptr, idx, total):
    """Whether this program is the last of the ``total`` that call this on int32 counter ``idx`` (zero before
    the first) in one launch. The last one sees every store the others made before their call, and sets the
    counter back to zero for the next launch (``plan.counters``)."""
    tl.debug_barrier()  # every thread's stores made before the release below
    old = tl.atomic_add(cnt_ptr + idx, 1, sem="acq_rel", scope="gpu")
    last = old == total - 1
    if last:
        tl.store(cnt_ptr + idx, 0)
    return last


@triton.jit
def operand(x, DOT: tl.constexpr, EMU: tl.constexpr):
    """``x`` as a ``tl.dot`` operand of dtype ``DOT``. ``EMU``: rounded to bf16 (nearest even, by its bits)
    but kept in fp32, for Triton's interpreter, which multiplies bf16 wrongly and truncates on a cast."""
    if EMU:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DOT)
    return y


@triton.jit
def load_tile(base, stride_r, stride_c, rr, rc, n_rows, n_cols):
    """A ``[len(rr), len(rc)]`` tile of an ``n_rows x n_cols`` array in its own dtype, zero outside.

    Tokens ``[N, d]`` (strides ``sn, sc``) load as ``(sn, sc, rows, cols, N, d)``: a ``[BLOCK_N, len(cols)]``
    tile; transposed, channels x tokens, as ``(sc, sn, cols, rows, d, N)``.
    """
    mask = (rr[:, None] < n_rows) & (rc[None, :] < n_cols)
    return tl.load(base + rr[:, None] * stride_r + rc[None, :] * stride_c, mask=mask, other=0.0)


@triton.jit
def store_tile(base, stride_r, stride_c, rr, rc, n_rows, n_cols, x):
    """Stores ``x`` where ``load_tile`` loads the tile, in the buffer's dtype."""
    mask = (rr[:, None] < n_rows) & (rc[None, :] < n_cols)
    tl.store(base + rr[:, None] * stride_r + rc[None, :] * stride_c, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def load_mat(base, stride_r, stride_c, rr, rc, n_rows, n_cols, ACC: tl.constexpr):
    """``load_tile`` upcast to ``ACC``."""
    return load_tile(base, stride_r, stride_c, rr, rc, n_rows, n_cols).to(ACC)


@triton.jit
def store_mat(base, rr, rc, n_rows, n_cols, x):
    """Stores a tile into a contiguous ``[n_rows, n_cols]`` slot of a buffer (``rc``: absolute columns)."""
    store_tile(base, n_cols, 1, rr, rc, n_rows, n_cols, x)


@triton.jit
def slot_at(buf, bg, slot, slots, i, NW: tl.constexpr, R, D):
    """Weight ``i`` of slot ``slot`` of (sample, head) ``bg`` in a ``[B*G, slots, NW, R, D]`` buffer."""
    return buf + ((bg.to(tl.int64) * slots + slot) * NW + i) * R * D


@triton.jit
def norm_at(n_buf, bg, i, NW: tl.constexpr, D, cols):
    """Where ``||G||`` of weight ``i``'s columns ``cols`` of (sample, head) ``bg`` is in ``[B*G, NW, D]``."""
    return n_buf + (bg.to(tl.int64) * NW + i) * D + cols


@triton.jit
def saved(g_buf, n_buf, bg, i, NW: tl.constexpr, rr, cols, R, D, ACC: tl.constexpr):
    """The saved ``G`` ``[B*G, NW, R, D]`` and ``||G||`` ``[B*G, NW, D]``, weight ``i``'s columns ``cols``."""
    grad = load_mat(slot_at(g_buf, bg, 0, 1, i, NW, R, D), D, 1, rr, cols, R, D, ACC)
    norm = tl.load(norm_at(n_buf, bg, i, NW, D, cols), mask=cols < D, other=0.0).to(ACC)
    return grad, norm


@triton.jit
def sum_slots(buf, bg, S, slots, i, NW: tl.constexpr, rr, cols, R, D, BLOCK_R: tl.constexpr,
              BLOCK_C: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Weight ``i``'s columns ``cols`` summed over slots ``0 .. S-1`` of a ``[B*G, slots, NW, R, D]`` buffer,
    in order."""
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=ACC)
    for s in range(S):
        acc += load_mat(slot_at(buf, bg, s, slots, i, NW, R, D), D, 1, rr, cols, R, D, ACC)
    return acc


@triton.jit
def col_norm(grad):
    """``||G[:, j]||`` of a ``[R, BLOCK_C]`` tile holding whole columns: ``[BLOCK_C]``."""
    return tl.sqrt(tl.sum(grad * grad, axis=0))


@triton.jit
def stepped(w, grad, norm, lr, GRAD_NORM: tl.constexpr):
    """The step: ``W' = W - lr G / (||G||_col + 1)``, or ``W - lr G`` without the normalisation."""
    if GRAD_NORM:
        wp = w - lr * grad / (norm[None, :] + 1.0)
    else:
        wp = w - lr * grad
    return wp


@triton.jit
def updated(w_ptr, swr, swc, g_buf, n_buf, bg, i, NW: tl.constexpr, rr, cols, R, D, lr,
            GRAD_NORM: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Columns ``cols`` of ``W'`` of weight ``i``, recomputed from ``W`` (at ``w_ptr``, head offset applied)
    and the saved ``G`` and ``||G||``."""
    w = load_mat(w_ptr, swr, swc, rr, cols, R, D, ACC)
    grad, norm = saved(g_buf, n_buf, bg, i, NW, rr, cols, R, D, ACC)
    return stepped(w, grad, norm, lr, GRAD_NORM)


@triton.jit
def step_bwd_cols(dwp, grad, norm, lr, GRAD_NORM: tl.constexpr):
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
def step_bwd_tile(dwp, g_buf, n_buf, dg_buf, bg, i, NW: tl.constexpr, rr, cols, R, D, lr,
                  GRAD_NORM: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``dG`` of weight ``i``'s columns ``cols`` from their whole ``dW'`` (``step_bwd_cols``), with the saved
    ``G`` and ``||G||``, into ``dg_buf`` ``[B*G, NW, R, D]``."""
    grad, norm = saved(g_buf, n_buf, bg, i, NW, rr, cols, R, D, ACC)
    store_mat(
        slot_at(dg_buf, bg, 0, 1, i, NW, R, D), rr, cols, R, D, step_bwd_cols(dwp, grad, norm, lr, GRAD_NORM)
    )
