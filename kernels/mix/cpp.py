"""The whole-mixer C++ op's glue: the ``cpu`` path's whole-node hooks, the mixer op's CPU kernels.

Where every branch of the fused node runs on the C++ kernel, one ``vit3_cpu::mix_forward``
(``csrc/mix.cpp``) runs them all and one ``vit3_cpu::mix_backward`` their backward: the same C++ as the
settled calls' autograd node ``vit3_cpu::mix`` and the CPU block op. ``cpp_args`` turns a mixer's spec into
that op's arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..cpp import cpu_kernel_ops
from ..ops import OPS, Whole

__all__ = ["cpp_args", "whole"]

# Layouts of qkv a spec keeps the arguments of before it starts over (a mixer sees a few sizes).
MAX_ARGS = 64


def cpp_args(spec: Any, qkv: Tensor) -> tuple:
    """The constant arguments of ``torch.ops.vit3_cpu.mix`` for ``spec`` (a ``MixSpec``) on tensors like
    ``qkv`` (its shape, strides and dtype): per branch its op, offset, heads, head dim, RoPE and token block
    (its op's ``Node.mix``), then the shared settings, and whether the SwiGLU branches take dense copies of
    q, k, v (the Python node's rule, ``Node.copies``: for N > 1 a matter of shapes alone, and the op copies a
    qkv without unit channel stride)."""
    ints: list[int] = []
    dense = False
    b, n, _ = qkv.shape
    s0, s1, s2 = qkv.stride()
    for br in spec.branches:
        node = OPS[br.op].paths["cpu"].node
        view = qkv.as_strided(
            (b, br.heads, n, br.head_dim),
            (s0, br.head_dim * s2, s1, s2),
            qkv.storage_offset() + br.offset * s2,
        )
        dense = dense or (node.copies is not None and node.copies(view))
        code, block = node.mix(br.head_dim, qkv)
        ints += [code, br.offset, br.heads, br.head_dim, int(br.rope), block]
    h, w = spec.grid
    return (ints, h, w, spec.scale, spec.lr, spec.grad_norm, spec.rope_base, spec.recompute, dense)


def _state(cache: dict, spec: Any, qkv: Tensor) -> tuple[tuple, tuple[int, ...]]:
    """``cpp_args`` of ``spec`` on ``qkv`` and each branch's number of initial weights, kept in ``cache`` per
    layout of qkv."""
    key = (qkv.shape, qkv.stride(), qkv.dtype)
    found = cache.get(key)
    if found is None:
        if len(cache) >= MAX_ARGS:
            cache.clear()
        counts = tuple(len(OPS[br.op].weights) for br in spec.branches)
        found = cache[key] = (cpp_args(spec, qkv), counts)
    return found


def forward(
    cache: dict, spec: Any, qkv: Tensor, out: Tensor, weights: Sequence[Tensor], save: bool, calls: Any
) -> tuple[list[Tensor], tuple]:
    """``Whole.forward`` of the ``cpu`` path: ``vit3_cpu::mix_forward`` into ``out``; the state is the op's
    arguments and each branch's number of weights."""
    found = _state(cache, spec, qkv)
    saved = cpu_kernel_ops(qkv).mix_forward(qkv, list(weights), *found[0], save, out)
    return saved, found


def backward(d_out: Tensor, dqkv: Tensor, saved: Sequence[Tensor], state: tuple, calls: Any) -> list[Tensor]:
    """``Whole.backward`` of the ``cpu`` path: ``vit3_cpu::mix_backward`` into ``dqkv``; the weights'
    gradients per branch (SwiGLU's two stacked)."""
    args, counts = state
    n_weights = sum(counts)
    *kept, qkv = saved[: len(saved) - n_weights]
    shapes = [size for w in saved[len(saved) - n_weights :] for size in w.shape]
    grads = cpu_kernel_ops(d_out).mix_backward(d_out, qkv, kept, shapes, *args, dqkv)
    out, at = [], 0
    for count in counts:
        out.append(torch.stack(grads[at : at + 2]) if count == 2 else grads[at])
        at += count
    return out


def state(cache: dict, spec: Any, qkv: Tensor, weights: Sequence[Tensor], calls: Any) -> tuple:
    """``Whole.state`` of the ``cpu`` path: what ``forward`` returned as its state."""
    return _state(cache, spec, qkv)


def saved_like(spec: Any, qkv: Tensor) -> list[Tensor]:
    """``Whole.saved_like`` of the ``cpu`` path: what ``mix_forward`` saves, per branch its step's statistics:
    SwiGLU's ``[W1 | W2]``, G, the column norms, W' (and Z, Y where ``spec.recompute`` is off), the depthwise
    conv's G, norms and W' (taps). A RoPE branch's rotated q, k are not saved: the backward rotates again."""
    b, n, _ = qkv.shape
    out = []
    for br in spec.branches:
        h, d = br.heads, br.head_dim
        if br.op == "swiglu":
            out += [qkv.new_empty(b, h, d, 2 * d) for _ in range(2)]
            out += [qkv.new_empty(b, h, 1, 2 * d), qkv.new_empty(b, h, d, 2 * d)]
            if not spec.recompute:
                out += [qkv.new_empty(b, h, n, 2 * d) for _ in range(2)]
        else:
            out += [qkv.new_empty(b, 9, h * d), qkv.new_empty(b, 1, h * d), qkv.new_empty(b, 9, h * d)]
    return out


def whole() -> Whole:
    """The ``cpu`` path's whole-node hooks (``Node.whole``), made per layout of the fused node (a test that
    watches them patches this module's functions before the layout is made)."""
    return Whole(forward, backward, state, saved_like)
