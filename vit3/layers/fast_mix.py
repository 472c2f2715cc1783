"""The mixer's fused eager path: the inner loops of all branches, between the two projections, as one node.

The per-branch path slices q, k and v out of the qkv projection, runs each branch and concatenates the
read-outs; autograd then pays for layout copies both ways (q, k, v made contiguous, read-outs transposed and
concatenated, and the q, k, v gradients transposed and concatenated back into one qkv gradient). Here the
branches take q, k and v as views of qkv and write their read-outs straight into the output
``[B, N, sum(widths)]``, and the backward writes dq, dk and dv straight into one qkv gradient.

Branches served, one full-batch dot-loss step each (``vit3.layers.backends`` decides when this path runs):

- the official SwiGLU model, optionally with RoPE on q and k, through ``fast_swiglu`` (its passes in the C++
  CPU kernel for branches with ``MixBranch.cpu_kernel``);
- the 3x3 depthwise conv in closed form, one convolution per stage for the whole batch: with ``E = -s v / N``,
  ``G = Σ_p E[p] k[p + δ]`` (a conv weight gradient), ``W' = W - lr G / (||G|| + 1)``,
  ``out = dwconv(q; W')``; backward ``dk = dwconv_input_grad(E; dG)``, ``dv = -s/N dwconv(k; dG)``. With
  ``MixBranch.cpu_kernel`` each stage is one call of the C++ kernel's depthwise ops on the token rows
  (``_dwconv_kernel_*``: no channels-last maps, no oneDNN calls, whose fixed cost dominates small grids),
  else oneDNN convolutions over batch-folded channels-last maps.

The mixer runs branch by branch whenever a branch takes another backend.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .fast_swiglu import (
    SwiGLUSaved,
    dense_inputs,
    step,
    step_backward,
    swiglu_backward,
    swiglu_forward,
    weight_grad,
)
from .inner import DWConvInner, dwconv_backward
from .rope import apply_rope_2d

__all__ = ["KINDS", "MixBranch", "MixPlan", "fused_mix"]

KINDS = ("swiglu", "dwconv")


class MixBranch(NamedTuple):
    """One branch: its inner model, where its q, k, v start in qkv (``[q | k | v]``, ``heads * head_dim`` each),
    RoPE on q and k, and whether its SwiGLU passes run in the C++ CPU kernel."""

    kind: str
    offset: int
    heads: int
    head_dim: int
    rope: bool
    cpu_kernel: bool = False


class MixPlan(NamedTuple):
    """The branches in qkv (and output) order and the inner-loop settings they share; ``recompute``: the
    SwiGLU backward recomputes Z = k W, Y = q W' instead of saving them (memory-lean)."""

    branches: tuple[MixBranch, ...]
    grid: tuple[int, int]
    scale: float
    lr: float
    grad_norm: bool
    rope_base: float
    recompute: bool = True


def _heads(t: Tensor, heads: int) -> Tensor:
    """``[B, N, G*c]`` -> ``[B, G, N, c]`` (a view)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _to_map(t: Tensor, grid: tuple[int, int]) -> Tensor:
    """Tokens ``[B, N, C]`` (any strides) -> maps ``[B, C, h, w]``, views of one batch-folded channels-last map
    (``DWConvInner.to_map``), so every depthwise stage below is one convolution call for the whole batch."""
    return DWConvInner.to_map(t.unsqueeze(1), grid)


def _from_map(m: Tensor, dest: Tensor) -> None:
    """Writes maps ``[B, C, h, w]`` into tokens ``dest`` ``[B, N, C]`` (any strides)."""
    dest.copy_(m.flatten(2).transpose(1, 2))


def _taps(w: Tensor) -> Tensor:
    """Depthwise weights ``[B|1, C, 3, 3]`` -> the kernel's taps ``[B|1, 9, C]``."""
    return w.flatten(2).transpose(1, 2).contiguous()


def _untaps(t: Tensor) -> Tensor:
    """The kernel's taps ``[B, 9, C]`` -> depthwise weights ``[B, C, 3, 3]``."""
    return t.transpose(1, 2).unflatten(-1, (3, 3))


def _dwconv_kernel_forward(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, dest: Tensor, plan: MixPlan, n: int, save: bool, dense: bool
) -> list[Tensor]:
    """The depthwise branch's step and read-out in the C++ kernel: q, k, v, dest ``[B, N, C]`` views; returns
    what the backward needs (when ``save``: q, k, v ``[B, N, C]``, copies when ``dense``; G, its norms,
    W' ``[B, C, 3, 3]``)."""
    from vit3.kernels.swiglu_cpu import cpu_kernel_ops

    ops, (gh, gw) = cpu_kernel_ops(q), plan.grid
    g = q.new_empty(q.shape[0], 9, q.shape[2])
    ops.dwconv_weight_grad(v, k, g, gh, gw)  # Σ_p v[p] k[p + δ]
    g = _untaps(g).mul_(-plan.scale / n)
    w_new, norm = step(g, w, plan.lr, plan.grad_norm, dims=(-2, -1))
    ops.dwconv(q, _taps(w_new), dest, gh, gw)
    if not save:
        return []
    if dense:  # as the SwiGLU branch does: views keep the whole qkv projection alive, which its views share
        q, k, v = (t.contiguous() for t in (q, k, v))
    return [q, k, v, g, norm, w_new]


def _dwconv_kernel_backward(
    d_out: Tensor, saved: tuple[Tensor, ...], dq: Tensor, dk: Tensor, dv: Tensor, plan: MixPlan, n: int
) -> Tensor:
    """Backward of ``_dwconv_kernel_forward``: writes dq, dk, dv ``[B, N, C]`` views, returns dW ``[B, C, 3, 3]``.

    The input gradient of a 3x3 correlation is the correlation with the flipped taps (tap order reversed).
    """
    from vit3.kernels.swiglu_cpu import cpu_kernel_ops

    q, k, v, g, norm, w_new = saved
    ops, (gh, gw) = cpu_kernel_ops(q), plan.grid
    d_out = d_out if d_out.stride(-1) == 1 else d_out.contiguous()
    ops.dwconv(d_out, _taps(w_new).flip(1), dq, gh, gw)
    dw_new = q.new_empty(q.shape[0], 9, q.shape[2])
    ops.dwconv_weight_grad(d_out, q, dw_new, gh, gw)
    dw_new = _untaps(dw_new)
    dg = _taps(step_backward(dw_new, g, norm, plan.lr, plan.grad_norm, dims=(-2, -1))).mul_(-plan.scale / n)
    ops.dwconv(v, dg.flip(1), dk, gh, gw)  # dk = dwconv_input_grad(E; dG), E = -c v
    ops.dwconv(k, dg, dv, gh, gw)  # dv = -c dwconv(k; dG)
    return dw_new


class _FusedMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, plan: MixPlan, save: bool, *weights: Tensor) -> Tensor:
        b, n, _ = qkv.shape
        widths = [br.heads * br.head_dim for br in plan.branches]
        out = qkv.new_empty(b, n, sum(widths))
        hyper = {"scale": plan.scale, "lr": plan.lr, "grad_norm": plan.grad_norm}
        saved: list[Tensor] = []
        # Dense copies of every branch's q, k, v or none (the C++ kernel reads small problems in place, the tiled
        # path copies): saved views of qkv keep all of it alive, copies beside them would double it.
        dense = any(
            not br.cpu_kernel or dense_inputs(_heads(qkv[..., br.offset : br.offset + width], br.heads))
            for br, width in zip(plan.branches, widths)
            if br.kind == "swiglu"
        )
        layout: list[tuple[int, int, str]] = []  # per branch: first saved tensor, count, SwiGLUSaved.layout
        col, wi = 0, 0
        for br, width in zip(plan.branches, widths):
            q, k, v = (qkv[..., br.offset + j * width : br.offset + (j + 1) * width] for j in range(3))
            dest = out[..., col : col + width]
            start = len(saved)
            if br.kind == "swiglu":
                w1, w2 = weights[wi : wi + 2]
                if br.rope:
                    q, k = (apply_rope_2d(t, plan.grid, plan.rope_base) for t in (q, k))
                q, k, v, dest = (_heads(t, br.heads) for t in (q, k, v, dest))  # [B, G, N, c] views
                st = swiglu_forward(
                    q,
                    k,
                    v,
                    w1,
                    w2,
                    dest,
                    save=save,
                    recompute=plan.recompute,
                    cpu_kernel=br.cpu_kernel,
                    dense=dense if br.cpu_kernel else None,
                    **hyper,
                )
                kind = st.layout if st is not None else ""
                saved += list(st[:-1]) if st is not None else []
            elif br.cpu_kernel:
                w, kind = weights[wi], "kernel"
                saved += _dwconv_kernel_forward(q, k, v, w, dest, plan, n, save, dense)
            else:
                w, kind = weights[wi], ""
                c = plan.scale / n
                qm, km, vm = (_to_map(t, plan.grid) for t in (q, k, v))
                g = dwconv_backward(vm, km, None, need_input=False)[1].mul_(-c)  # [B, C, 3, 3]
                w_new, norm = step(g, w, plan.lr, plan.grad_norm, dims=(-2, -1))
                _from_map(DWConvInner.conv(qm, w_new), dest)
                saved += [qm, km, vm, g, norm, w_new]
            layout.append((start, len(saved) - start, kind))
            wi += 2 if br.kind == "swiglu" else 1
            col += width
        if save:
            ctx.save_for_backward(*saved)
        ctx.plan, ctx.layout, ctx.hyper = plan, layout, hyper
        ctx.shapes = (qkv.shape, [w.shape for w in weights])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        plan, hyper = ctx.plan, ctx.hyper
        qkv_shape, weight_shapes = ctx.shapes
        n = qkv_shape[1]
        saved = ctx.saved_tensors
        dqkv = d_out.new_empty(qkv_shape)
        grads: list[Tensor] = []
        col, wi = 0, 0
        for br, (start, count, kind) in zip(plan.branches, ctx.layout):
            width = br.heads * br.head_dim
            dq, dk, dv = (dqkv[..., br.offset + j * width : br.offset + (j + 1) * width] for j in range(3))
            dout = d_out[..., col : col + width]
            mine = saved[start : start + count]
            if br.kind == "swiglu":
                # RoPE'd branches get dq, dk in the rotated frame first, then rotate them back into place.
                rq, rk = (torch.empty_like(dout) for _ in range(2)) if br.rope else (dq, dk)
                dws = swiglu_backward(
                    _heads(dout, br.heads),
                    SwiGLUSaved(*mine, kind),
                    _heads(rq, br.heads),
                    _heads(rk, br.heads),
                    _heads(dv, br.heads),
                    **hyper,
                )
                if br.rope:
                    dq.copy_(apply_rope_2d(rq, plan.grid, plan.rope_base, inverse=True))
                    dk.copy_(apply_rope_2d(rk, plan.grid, plan.rope_base, inverse=True))
                grads += [weight_grad(dw, shape) for dw, shape in zip(dws, weight_shapes[wi : wi + 2])]
                wi += 2
            elif kind == "kernel":
                grads.append(
                    weight_grad(_dwconv_kernel_backward(dout, mine, dq, dk, dv, plan, n), weight_shapes[wi])
                )
                wi += 1
            else:
                c = plan.scale / n
                qm, km, vm, g, norm, w_new = mine
                dqm, dw_new = dwconv_backward(_to_map(dout, plan.grid), qm, w_new)
                dg = step_backward(dw_new, g, norm, plan.lr, plan.grad_norm, dims=(-2, -1))
                _from_map(dqm, dq)
                _from_map(dwconv_backward(vm, km, dg, need_weight=False)[0].mul_(-c), dk)
                _from_map(DWConvInner.conv(km, dg).mul_(-c), dv)
                grads.append(weight_grad(dw_new, weight_shapes[wi]))
                wi += 1
            col += width
        return (dqkv, None, None, *grads)


def fused_mix(qkv: Tensor, plan: MixPlan, weights: list[Tensor]) -> Tensor:
    """All branches' inner loops and read-outs as one autograd node.

    Args:
        qkv: the qkv projection ``[B, N, 3 * sum(widths)]`` (branch by branch ``[q | k | v]``), float32 or
            float64.
        plan: the branches and shared settings.
        weights: the initial inner weights, branch by branch: ``w1, w2 [1, G, c, c]`` (SwiGLU) or
            ``weight [1, G*c, 3, 3]`` (depthwise conv), in qkv's dtype.

    Returns:
        The read-outs concatenated ``[B, N, sum(widths)]``.
    """
    widths = sum(br.heads * br.head_dim for br in plan.branches)
    if qkv.shape[-1] != 3 * widths:
        raise ValueError(f"qkv has {qkv.shape[-1]} channels, the branches need {3 * widths}")
    if any(br.kind not in KINDS for br in plan.branches):
        raise ValueError(
            f"fused_mix serves the inner models {KINDS}, got {[br.kind for br in plan.branches]}"
        )
    # Saving for the backward only when autograd will call it (not under no_grad / inference).
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (qkv, *weights))
    return _FusedMix.apply(qkv, plan, save, *weights)
