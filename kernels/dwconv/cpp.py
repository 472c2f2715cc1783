"""The depthwise-conv op's C++ path: the closed-form TTT step on token rows, in the C++ CPU kernel
(``csrc/dwconv.cpp`` in the extension ``vit3.kernels.cpp`` builds: ``dwconv_ttt_forward`` /
``dwconv_ttt_backward``, one call each, built on its 3x3 depthwise ops ``dwconv`` and ``dwconv_weight_grad``;
the step between them in C++ too).

The same stages as ``vit3.kernels.dwconv.eager`` (``G = Σ_p E[p] k[p + δ]`` with ``E = -s v / N``, the step,
``out = dwconv(q; W')``, and the backward ``dk = dwconv_input_grad(E; dG)``, ``dv = -s/N dwconv(k; dG)``), but
on the tokens ``[B, N, C]`` themselves (views of the mixer's qkv projection, output and gradient): no
channels-last maps and no oneDNN calls, whose fixed cost (docs/design/kernels.md) dominates small
grids. The input gradient of a 3x3 correlation is the correlation with the flipped taps (tap order reversed).
Tested against the op's reference ``vit3.kernels.dwconv.reference`` (``tests/kernels/test_op_dwconv.py``).
"""

from __future__ import annotations

from torch import Tensor

from ..cpp import cpu_kernel_ops
from ..mix.cpp import whole
from ..ops import Hyper, Node, NodeCall

__all__ = ["NODE", "ttt_backward", "ttt_forward", "untaps"]


def untaps(t: Tensor) -> Tensor:
    """The kernel's taps ``[B, 9, C]`` -> depthwise weights ``[B, C, 3, 3]``."""
    return t.transpose(1, 2).unflatten(-1, (3, 3))


def ttt_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weight: Tensor,
    dest: Tensor,
    *,
    grid: tuple[int, int],
    c: float,
    lr: float,
    grad_norm: bool,
    save: bool,
    dense: bool,
) -> list[Tensor]:
    """One dot-loss step on tokens ``[B, N, C]`` (views, unit stride along C; ``c = s / N``), read out on q
    into ``dest``, in one kernel call; returns what :func:`ttt_backward` needs (when ``save``: q, k, v, copies
    when ``dense``; G, its norms ``[B, 1, C]``, W', as taps ``[B, 9, C]``)."""
    ops, (gh, gw) = cpu_kernel_ops(q), grid
    g, norm, w_new = ops.dwconv_ttt_forward(q, k, v, weight, dest, gh, gw, c, lr, grad_norm)
    if not save:
        return []
    if dense:  # views keep the whole qkv projection alive: copies only where the other branches copy too
        q, k, v = (t.contiguous() for t in (q, k, v))
    return [q, k, v, g, norm, w_new]


def ttt_backward(
    d_out: Tensor,
    saved: tuple[Tensor, ...],
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    *,
    grid: tuple[int, int],
    c: float,
    lr: float,
    grad_norm: bool,
) -> Tensor:
    """Gradients of :func:`ttt_forward` in one kernel call: writes dq, dk, dv ``[B, N, C]`` views, returns the
    per-sample weight gradient ``[B, C, 3, 3]``."""
    q, k, v, g, norm, w_new = saved
    ops, (gh, gw) = cpu_kernel_ops(q), grid
    d_out = d_out if d_out.stride(-1) == 1 else d_out.contiguous()
    dw_new = ops.dwconv_ttt_backward(d_out, q, k, v, g, norm, w_new, dq, dk, dv, gh, gw, c, lr, grad_norm)
    return untaps(dw_new)


def _node_forward(x: NodeCall) -> tuple[list[Tensor], str]:
    h = x.hyper
    c = h.scale / x.q.shape[1]
    q, k, v, (weight,) = x.q, x.k, x.v, x.weights
    kw = {"grid": h.grid, "c": c, "lr": h.lr, "grad_norm": h.grad_norm, "save": x.save, "dense": x.dense}
    return ttt_forward(q, k, v, weight, x.dest, **kw), "kernel"


def _node_backward(
    d_out: Tensor, saved: tuple[Tensor, ...], tag: str, dq: Tensor, dk: Tensor, dv: Tensor, h: Hyper
) -> tuple[Tensor]:
    c = h.scale / d_out.shape[1]
    return (ttt_backward(d_out, saved, dq, dk, dv, grid=h.grid, c=c, lr=h.lr, grad_norm=h.grad_norm),)


# The C++ path in the fused node: the kernel reads and writes the token rows in place.
# The depthwise op's code in the whole-mixer C++ op (``kernels/mix/csrc/mix.cpp``: ``kDwconv``); its step
# walks the token rows in C++, no block to choose.
MIX_CODE = 1


def _stored(parameter: Tensor, initial: Tensor) -> bool:
    """The model hands its ``[C, 1, 3, 3]`` weight as the view ``[1, C, 3, 3]``: the op takes either one."""
    return initial._base is parameter and initial.shape == (1, parameter.shape[0], 3, 3)


NODE = Node(
    heads=False,
    forward=_node_forward,
    backward=_node_backward,
    mix=lambda d, qkv: (MIX_CODE, 1),
    stored=_stored,
    whole=whole,
)
