"""The SwiGLU op's C++ path: the tiled passes of ``swiglu.eager`` in the C++ CPU kernel (``csrc/swiglu.cpp``
in the extension ``vit3.kernels.cpp`` builds: ``ttt_forward`` / ``ttt_backward``, one call each, the step
between the passes in C++ too). The weights side by side, ``[W1 | W2]`` ``[B, H, d, 2d]`` (the step's column
norms are those of W1 and W2). Float32 / float64 CPU tensors; tested against the op's reference
(``tests/kernels/test_op_swiglu.py``).
"""

from __future__ import annotations

from torch import Tensor

from ..cpp import cpu_kernel_ops
from ..mix.cpp import whole
from ..ops import Branch, Inputs, Settings
from ..paths import FEW_TOKENS, MIN_CPU_KERNEL_TOKENS
from . import eager
from .eager import Passes, SwiGLUSaved, node

__all__ = [
    "MIX_CODE",
    "NODE",
    "PASSES",
    "dense_inputs",
    "kernel_block",
    "prefers",
    "ttt_backward",
    "ttt_forward",
]

# SwiGLU's op code in the whole-mixer C++ op (``kernels/mix/csrc/mix.cpp``: ``kSwiGLU``).
MIX_CODE = 0


def kernel_block(d: int, like: Tensor) -> int:
    """The C++ kernel's block: rows of ``[rows, 2d]`` (Z, Y) in about ``eager.TILE_BYTES``, not capped by
    N, so that the heads of a sample whose tokens fit together form one group of batched matmuls."""
    return eager.block_rows(2 * d, like.element_size())


def dense_inputs(q: Tensor) -> bool:
    """Whether the kernel gets dense copies of q, k, v ``[B, H, N, d]`` views (else it reads them in place;
    the branch's own hooks then save the views, the qkv projection they view, instead of copies of the same
    size, and the whole-mixer call copies again in its backward).

    Copies pay where one sample's heads exceed a tile: its strided rows then no longer stay in cache between
    the passes; below, the copies cost more than the strided reads (docs/design/kernels.md).
    """
    _, h, n, d = q.shape
    return q.stride(-1) != 1 or (not q.is_contiguous() and h * n * d * q.element_size() > eager.TILE_BYTES)


def _unit_stride(t: Tensor) -> Tensor:
    """``t`` itself when its last dim has unit stride (the kernel's need), else a dense copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def ttt_forward(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, out: Tensor, *, scale: float, lr: float,
    grad_norm: bool, save: bool = True, recompute: bool = False,
) -> SwiGLUSaved | None:  # fmt: skip
    """``swiglu.eager.swiglu_forward`` in the kernel, one call: the step and the read-out written into
    ``out``; q, k, v ``[B, H, N, d]`` read in place unless ``dense_inputs``. Raises where the kernel cannot
    be built."""
    ops = cpu_kernel_ops(q)
    if dense_inputs(q):
        q, k, v = (t.contiguous() for t in (q, k, v))
    b, h, n, d = q.shape
    z, y = (q.new_empty(b, h, n, 2 * d) if save and not recompute else None for _ in range(2))
    dest = _unit_stride(out)
    step = (scale / n, lr, grad_norm)
    w, g, norm, w_new = ops.ttt_forward(q, k, v, w1, w2, dest, z, y, *step, kernel_block(d, q))
    if dest is not out:
        out.copy_(dest)
    return SwiGLUSaved(q, k, v, w, g, norm, w_new, z, y, "kernel") if save else None


def ttt_backward(
    d_out: Tensor, saved: SwiGLUSaved, dq: Tensor, dk: Tensor, dv: Tensor, *, scale: float, lr: float,
    grad_norm: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``swiglu.eager.swiglu_backward`` in the kernel (its forward ran there), one call."""
    q, k, v, w, g, norm, w_new, z, y, _ = saved
    n, d = q.shape[2:]
    dests = [_unit_stride(t) for t in (dq, dk, dv)]
    dw = cpu_kernel_ops(q).ttt_backward(
        _unit_stride(d_out), q, k, v, z, y, w, g, norm, w_new, *dests, scale / n, lr, grad_norm,
        kernel_block(d, q),
    )  # fmt: skip
    for dest, t in zip(dests, (dq, dk, dv)):
        if dest is not t:
            t.copy_(dest)
    return dw[..., :d], dw[..., d:]  # [B, H, d, 2d] -> dW1, dW2


def prefers(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    """The path's ``prefers``: auto keeps the tiled path below ``MIN_CPU_KERNEL_TOKENS`` tokens a head."""
    if x.tokens == FEW_TOKENS:
        return False, (
            f"fewer than {MIN_CPU_KERNEL_TOKENS} tokens per head: the tiled path, which folds every sample's "
            "problems into one tile, is faster"
        )
    return True, ""


PASSES = Passes(ttt_forward, ttt_backward)
NODE = node(PASSES, copies=dense_inputs, mix=lambda d, qkv: (MIX_CODE, kernel_block(d, qkv)), whole=whole)
