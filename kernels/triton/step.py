"""The step over summed partials, its backward, and the weight-gradient reduction every op shares.

Each sums in a fixed order (deterministic) and works on per-(sample, head) buffers of ``NW`` weights of
``R x D`` (``d x d`` matrices; 9 taps x channels for the depthwise conv), one block of whole columns at a
time (``jit``: the buffers' layout). The step and its backward run in the program that finishes a
(sample, head)'s partials last (``jit.last_to_arrive``), the reduction's second stage likewise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit import (
    col_norm,
    last_to_arrive,
    norm_at,
    program,
    slot_at,
    step_bwd_tile,
    store_mat,
    sum_slots,
)

__all__ = ["step_bwd_sum", "step_sum", "wgrad_reduce_kernel"]


@triton.jit
def step_sum(part_ptr, g_ptr, n_ptr, bg, S, rr, cols, R, D, NW: tl.constexpr, BLOCK_R: tl.constexpr,
             BLOCK_C: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Sums the ``S`` partials of ``part_ptr`` ``[B*G, S, NW, R, D]`` in order, columns ``cols`` of (sample,
    head) ``bg``: the saved gradient ``G`` (``[B*G, NW, R, D]``) and its column norms (``[B*G, NW, D]``, the
    norm over the ``R`` rows)."""
    for i in tl.static_range(NW):
        acc = sum_slots(part_ptr, bg, S, S, i, NW, rr, cols, R, D, BLOCK_R, BLOCK_C, ACC)
        store_mat(slot_at(g_ptr, bg, 0, 1, i, NW, R, D), rr, cols, R, D, acc)
        norm = col_norm(acc)
        tl.store(norm_at(n_ptr, bg, i, NW, D, cols), norm.to(n_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def step_bwd_sum(part_ptr, g_ptr, n_ptr, dg_ptr, bg, S, rr, cols, R, D, lr, NW: tl.constexpr,
                 GRAD_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 ACC: tl.constexpr):  # fmt: skip
    """Sums the read-out partials into ``dW'`` and back-propagates the step and the normalisation, columns
    ``cols`` of (sample, head) ``bg``: ``part_ptr`` is ``[B*G, S + 1, NW, R, D]``, slots ``0..S-1`` hold the
    partials, slot ``S`` receives ``dW'`` (the direct part of the initial weights' gradient); ``dG`` goes to
    ``dg_ptr`` ``[B*G, NW, R, D]``."""
    for i in tl.static_range(NW):
        dwp = sum_slots(part_ptr, bg, S, S + 1, i, NW, rr, cols, R, D, BLOCK_R, BLOCK_C, ACC)
        store_mat(slot_at(part_ptr, bg, S, S + 1, i, NW, R, D), rr, cols, R, D, dwp)
        step_bwd_tile(dwp, g_ptr, n_ptr, dg_ptr, bg, i, NW, rr, cols, R, D, lr, GRAD_NORM, ACC)


@triton.jit
def _reduce_run(part_ptr, out_ptr, B, G, E, D, L, LO, NUSE, PER, j, g, e, OUT_SG, OUT_SW, R, OUT_SR, OUT_SC,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Run ``j`` of head ``g``'s items (``PER`` of the ``B * NUSE``), numbers ``e``, summed in order and
    stored at ``out_ptr`` as ``wgrad_reduce_kernel`` lays out a stage's output."""
    rt = tl.arange(0, BLOCK_T)
    t0 = j * PER
    t1 = tl.minimum(t0 + PER, B * NUSE)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=ACC)
    for t in range(t0, t1, BLOCK_T):
        item = t + rt
        row = (item // NUSE * G + g) * L + LO + item % NUSE
        mask = (item[:, None] < t1) & (e[None, :] < E)
        acc += tl.load(part_ptr + row.to(tl.int64)[:, None] * E + e[None, :], mask=mask, other=0.0).to(ACC)
    row = e // D
    dst = (
        out_ptr
        + (j * G + g).to(tl.int64) * OUT_SG
        + (row // R) * OUT_SW
        + (row % R) * OUT_SR
        + (e % D) * OUT_SC
    )
    tl.store(dst, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=e < E)


@triton.jit
def wgrad_reduce_kernel(
    part_ptr, runs_ptr, out_ptr, cnt_ptr,
    B, G, E, D, L, LO, NUSE, PER, SPLIT, OUT_SG, OUT_SW, R, OUT_SR, OUT_SC,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """The weight-gradient reduction ``out[g] = Σ_b Σ_slot part[b, g, slot]``, in a fixed order.

    ``part_ptr`` is ``[B, G, L, E]`` (``E = NW * R * D`` numbers per slot), of which slots ``LO .. LO+NUSE-1``
    are summed. The ``B * NUSE`` items are cut into ``SPLIT`` runs of ``PER`` (one per program, with one
    block of ``BLOCK_E`` numbers), each summed ``BLOCK_T`` items at a time. ``SPLIT == 1``: the run is the
    sum, written to ``out_ptr``; else run ``j`` goes to ``runs_ptr`` ``[SPLIT, G, E]`` and the last program
    of a block of numbers to finish (``cnt_ptr``: ``G x blocks`` counters) sums the runs in order into
    ``out_ptr``. Element ``e`` of the sum (row ``e // D``, column ``e % D``; rows ``R`` to a weight) lies at
    ``g * OUT_SG + (row // R) * OUT_SW + (row % R) * OUT_SR + (e % D) * OUT_SC``: SwiGLU's two weights apart
    (``[2, 1, G, c, c]``: each gradient contiguous, which autograd keeps as it is) and the depthwise conv's
    ``[taps, channels]`` as its weight's ``[channels, taps]``.
    """
    n_eb = tl.cdiv(E, BLOCK_E)
    pid, eb, j, g = program(SPLIT, n_eb, PID0)
    if pid >= G * SPLIT * n_eb:
        return
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    if SPLIT == 1:
        _reduce_run(part_ptr, out_ptr, B, G, E, D, L, LO, NUSE, PER, j, g, e, OUT_SG, OUT_SW, R, OUT_SR,
                    OUT_SC, BLOCK_T, BLOCK_E, ACC)  # fmt: skip
    else:
        _reduce_run(part_ptr, runs_ptr, B, G, E, D, L, LO, NUSE, PER, j, g, e, E, 0, E // D, D, 1, BLOCK_T,
                    BLOCK_E, ACC)  # fmt: skip
        if last_to_arrive(cnt_ptr, g * n_eb + eb, SPLIT):
            _reduce_run(runs_ptr, out_ptr, SPLIT, G, E, D, 1, 0, 1, SPLIT, 0, g, e, OUT_SG, OUT_SW, R, OUT_SR,
                        OUT_SC, BLOCK_T, BLOCK_E, ACC)  # fmt: skip
