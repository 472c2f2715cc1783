"""The FLOP formulas of vit3's custom ops, one function per op, for ``FlopCounterMode`` and fvcore alike.

Each formula counts the multiply-adds (MACs) of an op's products (matmuls, convolutions) from its arguments'
shapes; element-wise work (activations, norms, the inner step's normalisation, RoPE) counts nothing, as both
counters count ATen's ops. :func:`register` hands the formulas of one op namespace to
``torch.utils.flop_counter`` (2 FLOPs per MAC, as it counts ``aten.mm``; ``vit3.kernels.cpp`` calls it when
the C++ ops load, the Triton op's module for its ops); :func:`fvcore_handles` gives fvcore's handles (1 per
MAC, as it counts ``aten::linear``) for ``FlopCountAnalysis.set_op_handle``. A traced model runs plain ATen
ops (``vit3.layers.inner_math.tracing``), so fvcore meets these ops only in code that calls them itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "FORMULAS",
    "depthwise_pass",
    "fvcore_handles",
    "linear_step",
    "mix_macs",
    "register",
    "swiglu_step",
]

Shape = Sequence[int]


def swiglu_step(b: int, h: int, n: int, d: int, backward: bool = False, recomputed: int = 2) -> int:
    """MACs of the SwiGLU branch's inner step and read-out on q, k, v ``[b, h, n, d]``.

    Forward ``6 b h n d²``: ``Z = k [W1 | W2]``, ``G = kᵀ P``, ``Y = q [W1' | W2']``. Backward ``12 b h n d²``
    (``dq``, ``dW'``, ``dP = k dG``, ``dk`` from ``[P | dZ] [dG | W]ᵀ``, ``dW``) plus ``2 b h n d²`` for each
    of ``Z`` and ``Y`` that it recomputes (``recomputed``: 0, 1 or 2)."""
    per = b * h * n * d * d
    return (12 + 2 * recomputed) * per if backward else 6 * per


def depthwise_pass(b: int, n: int, c: int) -> int:
    """MACs of one 3x3 depthwise pass over tokens ``[b, n, c]``: a convolution or its weight gradient."""
    return 9 * b * n * c


def linear_step(b: int, h: int, n: int, d: int, loss: str, backward: bool = False) -> int:
    """MACs of the linear inner model's step and read-out on ``[b, h, n, d]`` (the Triton op only).

    Forward: ``G = kᵀ E`` and ``q W'``, plus ``k W`` for the MSE loss's ``E``; backward: ``dq``, ``dW'``,
    ``dk``, ``dv`` (dot), or ``dq``, ``dW'``, ``k W`` recomputed, ``dE``, ``dk`` (two products) and ``dW``
    (MSE)."""
    mse = loss == "mse"
    return b * h * n * d * d * ((7 if mse else 4) if backward else (3 if mse else 2))


def mix_macs(spec: Sequence[int], b: int, n: int, backward: bool = False, recompute: bool = True) -> int:
    """MACs of the whole-mixer op (``vit3_cpu::mix``) on ``b`` samples of ``n`` tokens: each branch of
    ``spec`` (6 ints per branch: op 0 SwiGLU / 1 depthwise, qkv offset, heads, head dim, RoPE, token block),
    its step forward or backward (a SwiGLU backward recomputes ``Z`` and ``Y`` when ``recompute``)."""
    total = 0
    for i in range(0, len(spec), 6):
        code, heads, d = spec[i], spec[i + 2], spec[i + 3]
        if code == 0:
            total += swiglu_step(b, heads, n, d, backward, 2 if recompute else 0)
        else:
            total += (4 if backward else 2) * depthwise_pass(b, n, heads * d)
    return total


def _tokens(shape: Shape) -> int:
    """Rows of a ``[..., C]`` tensor."""
    return math.prod(shape[:-1])


# One formula per op: the op's arguments, tensors as their shapes (``None`` for an absent one, lists of shapes
# for ``Tensor[]``), -> MACs.


def _ttt_forward(q: Shape, *_: Any) -> int:
    return swiglu_step(*q)


def _ttt_backward(
    d_out: Shape, q: Shape, k: Shape, v: Shape, z: Shape | None, y: Shape | None, *_: Any
) -> int:
    return swiglu_step(*q, backward=True, recomputed=(z is None) + (y is None))


def _dwconv(x: Shape, *_: Any) -> int:
    return depthwise_pass(*x)


def _dwconv_weight_grad(g: Shape, x: Shape, *_: Any) -> int:
    return depthwise_pass(*x)


def _dwconv_ttt_forward(q: Shape, *_: Any) -> int:
    return 2 * depthwise_pass(*q)  # G = Σ v k[p + δ], out = dwconv(q; W')


def _dwconv_ttt_backward(d_out: Shape, q: Shape, *_: Any) -> int:
    return 4 * depthwise_pass(*q)  # dq, dW', dk, dv


def _cpe(x: Shape, *_: Any) -> int:
    return depthwise_pass(x[0], x[1] * x[2], x[3])  # a channels-last map [B, H, W, C]


def _lean_mlp(x: Shape, ln_w: Any, ln_b: Any, eps: Any, w1: Shape, b1: Any, w2: Shape, *_: Any) -> int:
    return _tokens(x) * (math.prod(w1) + math.prod(w2))


def _mix(qkv: Shape, weights: Any, spec: Sequence[int], *_: Any) -> int:
    return mix_macs(spec, qkv[0], qkv[1])


def _mix_backward(
    d_out: Shape, qkv: Shape, saved: Any, shapes: Any, spec: Sequence[int], gh: int, gw: int, scale: float,
    lr: float, grad_norm: bool, rope_base: float, recompute: bool, *_: Any,
) -> int:  # fmt: skip
    return mix_macs(spec, d_out[0], d_out[1], backward=True, recompute=recompute)


def _ttt_block(
    x: Shape, lean: bool, cpe_w: Shape, cpe_b: Any, n1_w: Any, n1_b: Any, eps1: float, qkv_w: Shape,
    qkv_b: Any, weights: Any, spec: Sequence[int], gh: int, gw: int, scale: float, lr: float, grad_norm: bool,
    rope_base: float, recompute: bool, dense: bool, proj_w: Shape, proj_b: Any, n2_w: Any, n2_b: Any,
    eps2: float, fc1_w: Shape, fc1_b: Any, fc2_w: Shape, *_: Any,
) -> int:  # fmt: skip
    tokens = _tokens(x)
    linears = math.prod(qkv_w) + math.prod(proj_w) + math.prod(fc1_w) + math.prod(fc2_w)
    return _cpe(x) + tokens * linears + mix_macs(spec, x[0], x[1] * x[2])


def _triton_forward(q: Shape, k: Shape, v: Shape, w1: Shape, w2: Any, model: str, loss: str, *_: Any) -> int:
    b, g, n, d = q
    if model == "swiglu":
        return swiglu_step(b, g, n, d)
    if model == "linear":
        return linear_step(b, g, n, d, loss)
    return 2 * depthwise_pass(b, n, g * d)


def _triton_backward(
    dout: Shape, q: Shape, k: Shape, v: Shape, w1: Shape, w2: Any, gbuf: Shape, nbuf: Shape, model: str,
    loss: str, *_: Any,
) -> int:  # fmt: skip
    b, g, n, d = q
    if model == "swiglu":
        return swiglu_step(b, g, n, d, backward=True)  # the kernels recompute Z and Y
    if model == "linear":
        return linear_step(b, g, n, d, loss, backward=True)
    return 4 * depthwise_pass(b, n, g * d)


def _no_products(*_: Any) -> int:
    return 0


# Every op that a model's forward or backward can dispatch, by its qualified name.
FORMULAS: dict[str, Callable[..., int]] = {
    "vit3_cpu::ttt_forward": _ttt_forward,
    "vit3_cpu::ttt_backward": _ttt_backward,
    "vit3_cpu::dwconv": _dwconv,
    "vit3_cpu::dwconv_weight_grad": _dwconv_weight_grad,
    "vit3_cpu::dwconv_ttt_forward": _dwconv_ttt_forward,
    "vit3_cpu::dwconv_ttt_backward": _dwconv_ttt_backward,
    "vit3_cpu::cpe": _cpe,
    "vit3_cpu::cpe_norm": _cpe,
    "vit3_cpu::lean_mlp": _lean_mlp,
    "vit3_cpu::mix": _mix,
    "vit3_cpu::mix_forward": _mix,
    "vit3_cpu::mix_backward": _mix_backward,
    "vit3_cpu::rope_2d": _no_products,
    "vit3_cpu::ttt_block": _ttt_block,
    "vit3::triton_ttt_fwd": _triton_forward,
    "vit3::triton_ttt_bwd": _triton_backward,
}

# ATen ops of the traced inner loops that only move or view data (fvcore's own list ignores such ops).
_SHAPE_ONLY_ATEN = ("aten::pad", "aten::unfold", "aten::unflatten")


def _flop_formula(formula: Callable[..., int]) -> Callable[..., int]:
    """``formula`` as ``torch.utils.flop_counter`` calls it (tensors as shapes, the output's shape as
    ``out_shape``), in FLOPs: 2 per multiply-add."""

    def flops(*args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * formula(*args)  # the ops take no keyword-only arguments: the formulas read leading ones

    return flops


def register(namespace: str) -> None:
    """Registers the formulas of the ops of ``torch.ops.<namespace>`` that exist with
    ``torch.utils.flop_counter`` (once), and adds them to every ``FlopCounterMode`` now active: one entered
    before the ops loaded (the first forward builds or loads the C++ kernel) counts them too."""
    from torch.utils import flop_counter
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    ops = getattr(torch.ops, namespace)
    counters = [
        mode.counter
        for mode in _get_current_dispatch_mode_stack()
        if isinstance(getattr(mode, "counter", None), flop_counter.FlopCounterMode)
    ]
    for name, formula in FORMULAS.items():
        space, op_name = name.split("::")
        if space != namespace or not hasattr(ops, op_name):
            continue
        target = getattr(ops, op_name)
        if target not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(target)(_flop_formula(formula))
        for counter in counters:
            counter.flop_registry.setdefault(target, flop_counter.flop_registry[target])


def _jit_argument(value: Any) -> Any:
    """A traced op's argument as the formulas take it: a tensor's shape (``None`` if the trace has none), a
    list's items, a constant's value."""
    node = value.node()
    if node.kind() == "prim::ListConstruct":
        return [_jit_argument(item) for item in node.inputs()]
    if isinstance(value.type(), torch._C.TensorType):
        return tuple(value.type().sizes())
    return value.toIValue()


def _fvcore_handle(formula: Callable[..., int]) -> Callable[[list, list], int]:
    def handle(inputs: list, outputs: list) -> int:
        return formula(*(_jit_argument(v) for v in inputs))

    return handle


def fvcore_handles() -> dict[str, Callable[[list, list], int] | None]:
    """fvcore's handles of every vit3 op (MACs by :data:`FORMULAS`) and, ignored (``None``), the shape-only
    ATen ops of the traced inner loops: ``FlopCountAnalysis(model, x).set_op_handle(**fvcore_handles())``."""
    handles: dict[str, Callable[[list, list], int] | None] = {
        name: _fvcore_handle(formula) for name, formula in FORMULAS.items()
    }
    handles.update(dict.fromkeys(_SHAPE_ONLY_ATEN))
    return handles
