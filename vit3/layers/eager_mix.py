"""The mixer's eager node: the inner loops of all branches, between the two projections, as one autograd node.

The per-branch path slices q, k and v out of the qkv projection, runs each branch and concatenates the
read-outs; autograd then pays for layout copies both ways (q, k, v made contiguous, read-outs transposed and
concatenated, and the q, k, v gradients transposed and concatenated back into one qkv gradient). Here the
branches take q, k and v as views of qkv and write their read-outs straight into the output
``[B, N, sum(widths)]``, and the backward writes dq, dk and dv straight into one qkv gradient.

Branches served, one full-batch dot-loss step each (``vit3.layers.backends`` decides when this path runs):

- the official SwiGLU model, optionally with RoPE on q and k, through ``vit3.kernels.swiglu.eager`` (its
  passes in the C++ CPU kernel ``vit3.kernels.swiglu.cpp`` for branches with ``MixBranch.cpp``);
- the 3x3 depthwise conv through ``vit3.kernels.dwconv.eager`` (the closed form, one convolution per stage
  for the whole batch), or with ``MixBranch.cpp`` through ``vit3.kernels.dwconv.cpp`` (the same stages on
  the token rows in the C++ kernel's depthwise ops).

The mixer runs branch by branch whenever a branch takes another backend.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from vit3.kernels import ops_with
from vit3.kernels.common import autocast_backward, autocast_forward, grad_flows, weight_grad
from vit3.kernels.dwconv import cpp as dwconv_cpp
from vit3.kernels.dwconv import eager as dwconv_eager
from vit3.kernels.swiglu.eager import SwiGLUSaved, dense_inputs, swiglu_backward, swiglu_forward

from .rope import apply_rope_2d

__all__ = ["KINDS", "MixBranch", "MixPlan", "eager_mix"]

KINDS = ops_with("eager")  # ("swiglu", "dwconv"): the ops that declare an eager path


class MixBranch(NamedTuple):
    """One branch: its inner model, where its q, k, v start in qkv (``[q | k | v]``, ``heads * head_dim`` each),
    RoPE on q and k, and whether its SwiGLU passes run in the C++ CPU kernel (``cpp``)."""

    kind: str
    offset: int
    heads: int
    head_dim: int
    rope: bool
    cpp: bool = False


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


def _view(t: Tensor, offset: int, heads: int, head_dim: int, split: bool) -> Tensor:
    """Channels ``[offset, offset + heads * head_dim)`` of ``t`` ``[B, N, *]`` as tokens ``[B, N, G*c]`` or, with
    ``split``, as heads ``[B, G, N, c]``: one ``as_strided``, where slicing and ``_heads`` cost up to three
    view ops (the mixer's per-call overhead at 224 px is mostly such small calls)."""
    (sb, sn, sc), base = t.stride(), t.storage_offset() + offset * t.stride(-1)
    b, n, _ = t.shape
    if split:
        return t.as_strided((b, heads, n, head_dim), (sb, head_dim * sc, sn, sc), base)
    return t.as_strided((b, n, heads * head_dim), (sb, sn, sc), base)


def _to_map(t: Tensor, grid: tuple[int, int]) -> Tensor:
    """Tokens ``[B, N, C]`` (any strides) -> maps ``[B, C, h, w]``, views of one batch-folded channels-last map
    (``dwconv.eager.to_map``), so every depthwise stage below is one convolution call for the whole batch."""
    return dwconv_eager.to_map(t.unsqueeze(1), grid)


def _from_map(m: Tensor, dest: Tensor) -> None:
    """Writes maps ``[B, C, h, w]`` into tokens ``dest`` ``[B, N, C]`` (any strides)."""
    dest.copy_(m.flatten(2).transpose(1, 2))


def _forward(
    qkv: Tensor, plan: MixPlan, save: bool, weights: tuple[Tensor, ...]
) -> tuple[Tensor, list[Tensor], list[tuple[int, int, str]]]:
    """Every branch's step and read-out into one output ``[B, N, sum(widths)]``; returns it, what the backward
    needs (when ``save``) and, per branch, its first saved tensor, their count and ``SwiGLUSaved.layout``."""
    b, n, _ = qkv.shape
    widths = [br.heads * br.head_dim for br in plan.branches]
    out = qkv.new_empty(b, n, sum(widths))
    hyper = {"scale": plan.scale, "lr": plan.lr, "grad_norm": plan.grad_norm}
    dw_hyper = {"lr": plan.lr, "grad_norm": plan.grad_norm}
    # Dense copies of every branch's q, k, v or none (the C++ kernel reads small problems in place, the tiled
    # path copies): saved views of qkv keep all of it alive, copies beside them would double it.
    dense = any(
        not br.cpp or dense_inputs(_view(qkv, br.offset, br.heads, br.head_dim, True))
        for br in plan.branches
        if br.kind == "swiglu"
    )
    saved: list[Tensor] = []
    layout: list[tuple[int, int, str]] = []
    col, wi = 0, 0
    for br, width in zip(plan.branches, widths):
        start = len(saved)
        swiglu = br.kind == "swiglu"
        # q, k, v and the destination: heads [B, G, N, c] for SwiGLU (q, k as tokens to rotate first), else
        # tokens [B, N, width]
        q, k, v = (
            _view(qkv, br.offset + j * width, br.heads, br.head_dim, swiglu and (j == 2 or not br.rope))
            for j in range(3)
        )
        dest = _view(out, col, br.heads, br.head_dim, swiglu)
        if swiglu:
            w1, w2 = weights[wi : wi + 2]
            if br.rope:
                q, k = (_heads(apply_rope_2d(t, plan.grid, plan.rope_base), br.heads) for t in (q, k))
            st = swiglu_forward(
                q,
                k,
                v,
                w1,
                w2,
                dest,
                save=save,
                recompute=plan.recompute,
                cpp=br.cpp,
                dense=dense if br.cpp else None,
                **hyper,
            )
            kind = st.layout if st is not None else ""
            saved += list(st[:-1]) if st is not None else []
        elif br.cpp:
            kind = "kernel"
            saved += dwconv_cpp.ttt_forward(
                q,
                k,
                v,
                weights[wi],
                dest,
                grid=plan.grid,
                c=plan.scale / n,
                save=save,
                dense=dense,
                **dw_hyper,
            )
        else:
            kind = ""
            maps = (_to_map(t, plan.grid) for t in (q, k, v))
            om, st = dwconv_eager.ttt_forward(*maps, weights[wi], c=plan.scale / n, **dw_hyper)
            _from_map(om, dest)
            saved += list(st)
        layout.append((start, len(saved) - start, kind))
        wi += 2 if swiglu else 1
        col += width
    return out, saved, layout


class _EagerMix(torch.autograd.Function):
    @staticmethod
    @autocast_forward
    def forward(ctx, qkv: Tensor, plan: MixPlan, save: bool, *weights: Tensor) -> Tensor:
        out, saved, layout = _forward(qkv, plan, save, weights)
        if save:
            ctx.save_for_backward(*saved)
        ctx.plan, ctx.layout = plan, layout
        ctx.shapes = (qkv.shape, [w.shape for w in weights])
        return out

    @staticmethod
    @autocast_backward  # the forward runs with autocast off (the mixer's inner loops): so does this
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        plan = ctx.plan
        qkv_shape, weight_shapes = ctx.shapes
        n = qkv_shape[1]
        hyper = {"c": plan.scale / n, "lr": plan.lr, "grad_norm": plan.grad_norm}
        saved = ctx.saved_tensors
        dqkv = d_out.new_empty(qkv_shape)
        grads: list[Tensor] = []
        col, wi = 0, 0
        for br, (start, count, kind) in zip(plan.branches, ctx.layout):
            width, swiglu = br.heads * br.head_dim, br.kind == "swiglu"
            # tokens [B, N, width]; SwiGLU's as heads [B, G, N, c] (dq, dk as tokens to rotate back)
            dq, dk, dv = (
                _view(dqkv, br.offset + j * width, br.heads, br.head_dim, swiglu and (j == 2 or not br.rope))
                for j in range(3)
            )
            dout = _view(d_out, col, br.heads, br.head_dim, swiglu)
            mine = saved[start : start + count]
            if swiglu:
                # RoPE'd branches get dq, dk in the rotated frame first, then rotate them back into place.
                dqh, dkh = dq, dk
                if br.rope:
                    rq, rk = (torch.empty_like(dq) for _ in range(2))
                    dqh, dkh = _heads(rq, br.heads), _heads(rk, br.heads)
                dws = swiglu_backward(
                    dout,
                    SwiGLUSaved(*mine, kind),
                    dqh,
                    dkh,
                    dv,
                    scale=plan.scale,
                    lr=plan.lr,
                    grad_norm=plan.grad_norm,
                )
                if br.rope:
                    dq.copy_(apply_rope_2d(rq, plan.grid, plan.rope_base, inverse=True))
                    dk.copy_(apply_rope_2d(rk, plan.grid, plan.rope_base, inverse=True))
                grads += [weight_grad(dw, shape) for dw, shape in zip(dws, weight_shapes[wi : wi + 2])]
                wi += 2
            elif kind == "kernel":
                dw = dwconv_cpp.ttt_backward(dout, mine, dq, dk, dv, grid=plan.grid, **hyper)
                grads.append(weight_grad(dw, weight_shapes[wi]))
                wi += 1
            else:
                *maps, dw = dwconv_eager.ttt_backward(_to_map(dout, plan.grid), mine, **hyper)
                for m, dest in zip(maps, (dq, dk, dv)):
                    _from_map(m, dest)
                grads.append(weight_grad(dw, weight_shapes[wi]))
                wi += 1
            col += width
        return (dqkv, None, None, *grads)


def eager_mix(qkv: Tensor, plan: MixPlan, weights: list[Tensor]) -> Tensor:
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
            f"eager_mix serves the inner models {KINDS}, got {[br.kind for br in plan.branches]}"
        )
    # Saving for the backward only when autograd will call it (not under no_grad / inference); without it
    # the node is not needed either.
    if grad_flows(qkv, *weights):
        return _EagerMix.apply(qkv, plan, True, *weights)
    return _forward(qkv, plan, False, tuple(weights))[0]
