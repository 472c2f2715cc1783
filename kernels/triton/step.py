"""The kernels every op launches: the step over summed partials, its backward, the weight-gradient reduction.

Each sums in a fixed order (deterministic without atomics) and works on per-(sample, head) buffers of ``NW``
weights of ``R x D`` (``d x d`` matrices; 9 taps x channels for the depthwise conv), one block of columns per
program (``jit``: the buffers' layout).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit import (
    col_norm,
    column_block,
    norm_at,
    program,
    slot_at,
    step_bwd_tile,
    store_mat,
    sum_slots,
)

__all__ = ["step_bwd_kernel", "step_kernel", "wgrad_reduce_kernel"]


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
    dead, bg, rr, cols = column_block(BG, D, BLOCK_R, BLOCK_C)
    if dead:
        return
    for i in tl.static_range(NW):
        acc = sum_slots(part_ptr, bg, S, S, i, NW, rr, cols, R, D, BLOCK_R, BLOCK_C, ACC)
        store_mat(slot_at(g_ptr, bg, 0, 1, i, NW, R, D), rr, cols, R, D, acc)
        norm = col_norm(acc)
        tl.store(norm_at(n_ptr, bg, i, NW, D, cols), norm.to(n_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def step_bwd_kernel(
    part_ptr, g_ptr, n_ptr, dg_ptr,
    BG, R, D, S,
    lr: tl.float64,
    NW: tl.constexpr, GRAD_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """Sums the read-out partials into ``dW'`` and back-propagates the step and the normalisation (``S > 1``).

    ``part_ptr`` is ``[B*G, S + 1, NW, R, D]``: slots ``0..S-1`` hold the read-out partials, slot ``S``
    receives ``dW'`` (the direct part of the initial weights' gradient); ``dG`` goes to ``dg_ptr``.
    """
    if ACC != tl.float64:  # float arguments are declared fp64 (a Python float is typed fp32)
        lr = tl.cast(lr, ACC)
    dead, bg, rr, cols = column_block(BG, D, BLOCK_R, BLOCK_C)
    if dead:
        return
    for i in tl.static_range(NW):
        dwp = sum_slots(part_ptr, bg, S, S + 1, i, NW, rr, cols, R, D, BLOCK_R, BLOCK_C, ACC)
        store_mat(slot_at(part_ptr, bg, S, S + 1, i, NW, R, D), rr, cols, R, D, dwp)
        step_bwd_tile(dwp, g_ptr, n_ptr, dg_ptr, bg, i, NW, rr, cols, R, D, lr, GRAD_NORM, ACC)


@triton.jit
def wgrad_reduce_kernel(
    part_ptr, out_ptr,
    B, G, E, D, L, LO, NUSE, PER, SPLIT, OUT_SG, OUT_SW, R, OUT_SR, OUT_SC,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """One stage of the weight-gradient reduction ``out[g] = Σ_b Σ_slot part[b, g, slot]`` over programs.

    ``part_ptr`` is ``[B, G, L, E]`` (``E = NW * R * D`` numbers per slot), of which slots ``LO .. LO+NUSE-1``
    are summed. The ``B * NUSE`` items are cut into ``SPLIT`` runs of ``PER`` (one per program, with one
    block of ``BLOCK_E`` numbers), each summed in a fixed order, ``BLOCK_T`` items at a time; program
    ``(j, g)`` writes its run's sum ``OUT_SG`` elements apart per ``(j, g)``, element ``e`` (row ``e // D``,
    column ``e % D``; rows ``R`` to a weight) at ``(row // R) * OUT_SW + (row % R) * OUT_SR + (e % D) *
    OUT_SC``: the runs ``[SPLIT, G, E]``; a second stage with ``SPLIT = 1`` sums the runs and writes SwiGLU's
    two weights apart (``[2, 1, G, c, c]``: each gradient contiguous, which autograd keeps as it is) and the
    depthwise conv's ``[taps, channels]`` as its weight's ``[channels, taps]``.
    """
    n_eb = tl.cdiv(E, BLOCK_E)
    pid, eb, j, g = program(SPLIT, n_eb)
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
    row = e // D
    dst = (
        out_ptr
        + (j * G + g).to(tl.int64) * OUT_SG
        + (row // R) * OUT_SW
        + (row % R) * OUT_SR
        + (e % D) * OUT_SC
    )
    tl.store(dst, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=e < E)
