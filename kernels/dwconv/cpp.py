"""The depthwise-conv op's C++ path: the closed-form TTT step on token rows, in the C++ CPU kernel's 3x3
depthwise ops (``vit3.kernels.swiglu.cpp``'s extension: ``dwconv``, ``dwconv_weight_grad``).

The same stages as ``vit3.kernels.dwconv.eager`` (``G = Σ_p E[p] k[p + δ]`` with ``E = -s v / N``, the step,
``out = dwconv(q; W')``, and the backward ``dk = dwconv_input_grad(E; dG)``, ``dv = -s/N dwconv(k; dG)``), but
on the tokens ``[B, N, C]`` themselves (views of the mixer's qkv projection, output and gradient): no
channels-last maps and no oneDNN calls, whose fixed cost (~60-100 µs each at 14x14 here) dominates small
grids. The input gradient of a 3x3 correlation is the correlation with the flipped taps (tap order reversed).
Tested against the op's reference ``vit3.kernels.dwconv.reference`` (``tests/test_op_dwconv.py``).
"""

from __future__ import annotations

from torch import Tensor

from ..common import step, step_backward
from ..swiglu.cpp import cpu_kernel_ops

__all__ = ["taps", "ttt_backward", "ttt_forward", "untaps"]


def taps(w: Tensor) -> Tensor:
    """Depthwise weights ``[B|1, C, 3, 3]`` -> the kernel's taps ``[B|1, 9, C]``."""
    return w.flatten(2).transpose(1, 2).contiguous()


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
    into ``dest``; returns what :func:`ttt_backward` needs (when ``save``: q, k, v, copies when ``dense``;
    G, its norms, W' ``[B, C, 3, 3]``)."""
    ops, (gh, gw) = cpu_kernel_ops(q), grid
    g = q.new_empty(q.shape[0], 9, q.shape[2])
    ops.dwconv_weight_grad(v, k, g, gh, gw)  # Σ_p v[p] k[p + δ]
    g = untaps(g).mul_(-c)
    w_new, norm = step(g, weight, lr, grad_norm, dims=(-2, -1))
    ops.dwconv(q, taps(w_new), dest, gh, gw)
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
    """Gradients of :func:`ttt_forward`: writes dq, dk, dv ``[B, N, C]`` views, returns the per-sample weight
    gradient ``[B, C, 3, 3]``."""
    q, k, v, g, norm, w_new = saved
    ops, (gh, gw) = cpu_kernel_ops(q), grid
    d_out = d_out if d_out.stride(-1) == 1 else d_out.contiguous()
    ops.dwconv(d_out, taps(w_new).flip(1), dq, gh, gw)
    dw_new = q.new_empty(q.shape[0], 9, q.shape[2])
    ops.dwconv_weight_grad(d_out, q, dw_new, gh, gw)
    dw_new = untaps(dw_new)
    dg = taps(step_backward(dw_new, g, norm, lr, grad_norm, dims=(-2, -1))).mul_(-c)
    ops.dwconv(v, dg.flip(1), dk, gh, gw)  # dk = dwconv_input_grad(E; dG), E = -c v
    ops.dwconv(k, dg, dv, gh, gw)  # dv = -c dwconv(k; dG)
    return dw_new
