"""RoPE's 2-D rotation of a branch's q, k pair as one Triton launch, forward or back.

A RoPE branch's q and k (``[B, 2, N, C]``) are rotated before its kernels read them and their gradients back
after: by launches of the launch program (``program.py``), or by the fused node around the branch hooks
(``vit3.layers.fused_mix``); with the cos / sin tables of ``vit3.layers.rope`` this is
that rotation's arithmetic, product by product and without fused multiply-adds, so it gives the bits of
``apply_rope_2d`` in one launch instead of a dozen PyTorch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import plan
from .device import acc_dtype
from .tiles import cdiv, next_pow2

__all__ = ["rope_kernel", "rotate", "rotation"]

# Elements of ``[tokens, channel pairs]`` a program rotates (a power of two), and its warps.
BLOCK_ELEMENTS, NUM_WARPS = 2048, 4


@triton.jit
def rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr,
    N, HALF, BLOCKS, PROGRAMS,
    sxb, sxp, sxn, sob, sop, son,
    INVERSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr,
    PID0=0,
):  # fmt: skip
    """Rotates ``x_ptr`` ``[B, 2, N, 2 * HALF]`` (channel pairs ``(2j, 2j + 1)``, unit stride) into
    ``out_ptr`` by ``(cos, sin)`` ``[N, HALF]`` (``INVERSE``: by ``-sin``, the transpose); ``BLOCK_N`` tokens
    of one (sample, q or k) per program, on the folded grid."""
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0) - PID0
    if pid >= PROGRAMS:
        return
    bp = (pid // BLOCKS).to(tl.int64)
    rows = (pid % BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < N) & (cols[None, :] < HALF)
    b, p = bp // 2, bp % 2
    at = rows[:, None].to(tl.int64)
    x = x_ptr + b * sxb + p * sxp + at * sxn + 2 * cols[None, :]
    re = tl.load(x, mask=mask).to(ACC)
    im = tl.load(x + 1, mask=mask).to(ACC)
    table = at * HALF + cols[None, :]
    c = tl.load(cos_ptr + table, mask=mask).to(ACC)
    s = tl.load(sin_ptr + table, mask=mask).to(ACC)
    if INVERSE:
        s = -s
    o = out_ptr + b * sob + p * sop + at * son + 2 * cols[None, :]
    tl.store(o, (re * c - im * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o + 1, (re * s + im * c).to(out_ptr.dtype.element_ty), mask=mask)


def rotate(pair: Tensor, tables: tuple[Tensor, Tensor], inverse: bool, out: Tensor) -> None:
    """``vit3.layers.rope.apply_rope_2d`` of ``pair`` ``[B, 2, N, C]`` written into ``out`` (same shape, any
    strides but a unit last one), in ``out``'s dtype: the launch of :func:`rotation`, where there is one."""
    launch = rotation(pair, tables, inverse, out)
    if launch is not None:
        plan.debug_filled(out)  # a test hook: unwritten elements show
        launch()


def rotation(pair: Tensor, tables: tuple[Tensor, Tensor], inverse: bool, out: Tensor) -> plan.Launch | None:
    """The launch of :func:`rotate` (``None`` for an empty pair); its tensors may be meta tensors.

    Args:
        pair: q and k (or their gradients) as tokens, the last dim of unit stride.
        tables: ``rope_tables`` of the grid, C, the base and the computation's dtype (float32, or float64
            for float64 inputs): ``(cos, sin)``, ``[h, w, 2, C / 4]`` each, contiguous.
        inverse: rotate back (the transpose: the backward of the rotation).
        out: where the rotated pair goes.
    """
    b, two, n, c = pair.shape
    if two != 2 or c % 4 or pair.stride(-1) != 1 or out.stride(-1) != 1 or out.shape != pair.shape:
        raise ValueError(f"rotate takes a [B, 2, N, C] pair (C % 4 == 0, unit last stride), got {pair.shape}")
    cos, sin = tables
    want = torch.promote_types(pair.dtype, torch.float32)
    if any(not t.is_contiguous() or t.numel() != n * c // 2 or t.dtype != want for t in tables):
        raise ValueError(f"rotate takes {want} RoPE tables of {n} tokens x {c // 2} pairs, got {cos.shape}")
    half = c // 2
    block_h = next_pow2(half)
    block_n = max(1, min(next_pow2(n), BLOCK_ELEMENTS // block_h))
    blocks = cdiv(n, block_n)
    programs = b * 2 * blocks
    if not programs:
        return None
    args = (pair, out, cos, sin, n, half, blocks, programs, *pair.stride()[:3], *out.stride()[:3])
    kwargs = {"INVERSE": inverse, "BLOCK_N": block_n, "BLOCK_H": block_h, "ACC": acc_dtype(cos.dtype)[1],
              "num_warps": NUM_WARPS, "num_stages": 1, "enable_fp_fusion": False}  # fmt: skip
    label = "rope_kernel[back]" if inverse else "rope_kernel"
    return plan.Launch(label, rope_kernel, plan.fold_grid(programs), args, kwargs, programs)
