"""The mixer's fused node: the inner loops of all branches, between the two projections, as one autograd node.

The branches read q, k, v as views of the qkv projection and write their read-outs straight into the output
``[B, N, sum(widths)]``; the backward writes dq, dk, dv straight into one qkv gradient: no layout copies.
All branches run at once through their path's whole-node hooks (``Node.whole``: Triton's launch program, the
C++ kernel's whole-mixer op) where they share such a path, else each through its path's node hooks
(``vit3.kernels.ops.Node``, ``MixBranch.path``; RoPE rotates q, k here). The node is the autograd kernel of
the op ``vit3::mix`` (``mix_op``), which a compiled call records; settled all-``cpu`` calls enter the C++
op's own node (``torch.ops.vit3_cpu.mix``). Why: ``docs/design/dispatch.md``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from vit3.kernels.common import autocast_off, grad_flows, weight_grad
from vit3.kernels.ops import BRANCH_ATTR, OPS, Hyper, Node, NodeCall, Whole, tag_branch

from .rope import apply_rope_2d, rope_cos_sin

__all__ = [
    "BRANCH_ATTR",
    "MixBranch",
    "MixSpec",
    "fused_mix",
    "mix_backward_op",
    "mix_op",
    "node_call",
    "op_args",
    "reference_mix",
    "spec_of",
    "takes",
    "whole_path",
]


class MixBranch(NamedTuple):
    """One branch: its inner model (an op of ``vit3.kernels.ops.OPS``), where its q, k, v start in qkv
    (``[q | k | v]``, ``heads * head_dim`` each), RoPE on q and k, and the op's path whose node hooks run it
    (``"eager"``, ``"cpu"``: the C++ CPU kernel, ``"triton"``: the Triton kernels)."""

    op: str
    offset: int
    heads: int
    head_dim: int
    rope: bool
    path: str = "eager"


class MixSpec(NamedTuple):
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


def _view(t: Tensor, geom: tuple[int, ...], offset: int, heads: int, head_dim: int, split: bool) -> Tensor:
    """Channels ``[offset, offset + heads * head_dim)`` of ``t`` ``[B, N, *]`` as tokens ``[B, N, G*c]`` or,
    with ``split``, as heads ``[B, G, N, c]``: one ``as_strided``, where slicing and ``_heads`` cost up to
    three view ops (the mixer's per-call overhead at 224 px is mostly such small calls). ``geom``:
    ``_geom(t)``."""
    b, n, sb, sn, sc, base = geom
    start = base + offset * sc
    if split:
        return t.as_strided((b, heads, n, head_dim), (sb, head_dim * sc, sn, sc), start)
    return t.as_strided((b, n, heads * head_dim), (sb, sn, sc), start)


def _geom(t: Tensor) -> tuple[int, ...]:
    """What ``_view`` reads of ``t`` ``[B, N, *]``: its sizes B, N, its strides and storage offset (read once
    per tensor, not per view)."""
    b, n, _ = t.shape
    return (b, n, *t.stride(), t.storage_offset())


def _branch_views(
    t: Tensor, geom: tuple[int, ...], br: MixBranch, heads: bool, whole: bool = False
) -> list[Tensor]:
    """Branch ``br``'s q, k, v (or their gradients) in ``t`` (the node's qkv or its gradient) as its hooks
    take them: as heads where ``heads`` (the ``Node``'s), but q and k as tokens where RoPE rotates them
    first (not for ``whole``-node hooks, which rotate them themselves)."""
    width = br.heads * br.head_dim
    return [
        _view(
            t, geom, br.offset + j * width, br.heads, br.head_dim, heads and (j == 2 or whole or not br.rope)
        )
        for j in range(3)
    ]


def _qk(t: Tensor, geom: tuple[int, ...], br: MixBranch) -> Tensor:
    """Branch ``br``'s q and k (or their gradients) in ``t`` as one ``[B, 2, N, width]`` view: RoPE rotates
    both in one call."""
    return _view(t, geom, br.offset, 2, br.heads * br.head_dim, True)


def _cos_sin(qkv: Tensor, br: MixBranch, spec: MixSpec) -> Tensor:
    """The ``rope_cos_sin`` table RoPE branch ``br``'s q, k in ``qkv`` are rotated by (float32 at least)."""
    dtype = torch.promote_types(qkv.dtype, torch.float32)
    return rope_cos_sin(spec.grid, br.heads * br.head_dim, spec.rope_base, qkv.device, dtype)


def _rotated(qkv: Tensor, geom: tuple[int, ...], br: MixBranch, spec: MixSpec) -> Tensor:
    """RoPE branch ``br``'s q and k rotated, ``[B, 2, N, width]`` in qkv's dtype (the rotation of 16-bit q, k
    is computed in float32)."""
    return apply_rope_2d(_qk(qkv, geom, br), spec.grid, spec.rope_base).to(qkv.dtype)


def _pair(t: Tensor, br: MixBranch) -> Tensor:
    """A fresh ``[B, 2, N, width]`` pair for RoPE branch ``br``'s q, k (or their gradients) out of ``t``
    ``[B, N, ...]``: where a path keeps them rotated."""
    return t.new_empty(t.shape[0], 2, t.shape[1], br.heads * br.head_dim)


def _rotate_back(dqkv: Tensor, geom: tuple[int, ...], br: MixBranch, spec: MixSpec, grads: Tensor) -> None:
    """Branch ``br``'s dq, dk ``grads`` (a ``_pair``) rotated back into place in ``dqkv``."""
    _qk(dqkv, geom, br).copy_(apply_rope_2d(grads, spec.grid, spec.rope_base, inverse=True))


def _heads_of(pair: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """q and k (or their gradients) of a ``[B, 2, N, width]`` pair as heads ``[B, G, N, c]`` views."""
    q, k = pair.unbind(1)
    return _heads(q, heads), _heads(k, heads)


class MixLayout(NamedTuple):
    """What every call of one ``MixSpec`` shares: the spec; per branch its node hooks, its op's number of
    initial weights and its width ``heads * head_dim``; the width of all, and the step's ``Hyper``."""

    spec: MixSpec
    nodes: tuple[tuple[Node, int, int], ...]
    width: int
    hyper: Hyper
    twice: bool  # every branch's backward may be differentiated (``Node.twice``)
    whole: Whole | None  # every branch's path runs the whole node (``Node.whole``), else ``None``
    programs: dict  # the cache ``whole`` keeps for this spec
    n_weights: int  # the initial weights of all branches
    stacked: tuple[bool, ...]  # per branch: its weights' gradients come as one stacked tensor (two weights)


@functools.lru_cache(maxsize=64)
def mix_layout(spec: MixSpec) -> MixLayout:
    """``spec``'s ``MixLayout``, made once per spec (a mixer calls the node with a few specs only)."""
    found = []
    for br in spec.branches:
        op = OPS.get(br.op)
        path = op.paths.get(br.path) if op is not None else None
        if path is None:
            raise ValueError(f"fused_mix serves the inner models {list(OPS)}, got {br.op!r} on {br.path!r}")
        found.append((path.node, len(op.weights), br.heads * br.head_dim))
    hyper = Hyper(spec.grid, spec.scale, spec.lr, spec.grad_norm, "dot", spec.recompute)
    twice = all(node.twice for node, *_ in found)
    whole = found[0][0].whole() if whole_path(spec) else None
    counts = [count for _, count, _ in found]
    stacked = tuple(count == 2 for count in counts)
    width = sum(w for *_, w in found)
    return MixLayout(spec, tuple(found), width, hyper, twice, whole, {}, sum(counts), stacked)


def reference_mix(qkv: Tensor, spec: MixSpec, weights: list[Tensor]) -> Tensor:
    """What the node computes, from the op references (``Op.reference``; RoPE on q and k where a branch has
    it): the read-outs ``[B, N, sum(widths)]`` of qkv ``[B, N, 3 * sum(widths)]``, differentiable."""
    geom, outs, wi, hyper = _geom(qkv), [], 0, Hyper(spec.grid, spec.scale, spec.lr, spec.grad_norm)
    for br in spec.branches:
        op = OPS[br.op]
        q, k, v = _branch_views(qkv, geom, br, True)
        if br.rope:
            q, k = (_heads(apply_rope_2d(t, spec.grid, spec.rope_base), br.heads) for t in (q, k))
        params = dict(zip(op.weights, weights[wi : wi + len(op.weights)]))
        wi += len(op.weights)
        outs.append(op.reference(q, k, v, params, hyper).transpose(1, 2).flatten(2))
    return torch.cat(outs, dim=-1)


def takes(spec: MixSpec, dtype: torch.dtype) -> bool:
    """Whether ``fused_mix`` takes a qkv of ``dtype`` on ``spec`` as it is: float32 / float64 always, float16
    / bfloat16 where every branch's hooks do (Triton's; the others' inner loop needs float32 at least). Read
    from the ops' tables, not ``mix_layout`` (traced calls ask: ``torch.compile`` would trace its cache)."""
    return dtype in (torch.float32, torch.float64) or (
        dtype in (torch.float16, torch.bfloat16)
        and all(OPS[br.op].paths[br.path].node.low_precision for br in spec.branches)
    )


def _forward(
    qkv: Tensor, layout: MixLayout, save: bool, weights: tuple[Tensor, ...]
) -> tuple[Tensor, list[Tensor], list[tuple[int, int, str]]]:
    """Every branch's step and read-out into one output ``[B, N, sum(widths)]``; returns it, what the backward
    needs (when ``save``) and, per branch, its first saved tensor, their count and its hooks' tag."""
    b, n, _ = qkv.shape
    spec = layout.spec
    out = qkv.new_empty(b, n, layout.width)
    if layout.whole is not None:
        saved, state = layout.whole.forward(
            layout.programs, spec, qkv, out, weights, save,
            lambda: _whole_calls(qkv, out, layout, weights, save),
        )  # fmt: skip
        return out, saved, state
    # Dense copies of every branch's q, k, v or none (the C++ kernel reads small problems in place, the tiled
    # path copies): saved views of qkv keep all of it alive, copies beside them would double it.
    geom, out_geom = _geom(qkv), _geom(out)
    dense = any(
        node.copies is not None and node.copies(_view(qkv, geom, br.offset, br.heads, br.head_dim, True))
        for br, (node, *_) in zip(spec.branches, layout.nodes)
    )
    saved: list[Tensor] = []
    tags: list[tuple[int, int, str]] = []
    col, wi = 0, 0
    for i, (br, (node, count, width)) in enumerate(zip(spec.branches, layout.nodes)):
        # q, k, v and the destination as the hooks take them (q, k as tokens to rotate first)
        q, k, v = _branch_views(qkv, geom, br, node.heads)
        if br.rope:  # q and k in one rotation
            pair = _rotated(qkv, geom, br, spec)
            q, k = _heads_of(pair, br.heads) if node.heads else pair.unbind(1)
        dest = _view(out, out_geom, col, br.heads, br.head_dim, node.heads)
        try:
            mine, tag = node.forward(
                NodeCall(q, k, v, weights[wi : wi + count], dest, layout.hyper, save, dense)
            )
        except Exception as exc:
            tag_branch(exc, i)
            raise
        tags.append((len(saved), len(mine), tag))
        saved += mine
        wi += count
        col += width
    return out, saved, tags


def _whole_calls(
    qkv: Tensor, out: Tensor, layout: MixLayout, weights: tuple[Tensor, ...], save: bool
) -> tuple[list[NodeCall], list[Tensor | None]]:
    """Each branch's ``NodeCall`` (q, k, v and the destination as heads views, q and k as they are in qkv)
    and RoPE table (``rope_cos_sin``; ``None`` without RoPE) for ``Whole.forward``."""
    geom, out_geom, calls, tables, col, wi = _geom(qkv), _geom(out), [], [], 0, 0
    for br, (_, count, width) in zip(layout.spec.branches, layout.nodes):
        q, k, v = _branch_views(qkv, geom, br, True, whole=True)
        tables.append(_cos_sin(qkv, br, layout.spec) if br.rope else None)
        dest = _view(out, out_geom, col, br.heads, br.head_dim, True)
        calls.append(NodeCall(q, k, v, weights[wi : wi + count], dest, layout.hyper, save, False))
        col, wi = col + width, wi + count
    return calls, tables


def _whole_grads(d_out: Tensor, dqkv: Tensor, layout: MixLayout) -> list[tuple[Tensor, ...]]:
    """Each branch's ``(dout, dq, dk, dv)`` heads views for ``Whole.backward``."""
    geom, out_geom, views, col = _geom(dqkv), _geom(d_out), [], 0
    for br, (_, _, width) in zip(layout.spec.branches, layout.nodes):
        dout = _view(d_out, out_geom, col, br.heads, br.head_dim, True)
        views.append((dout, *_branch_views(dqkv, geom, br, True, whole=True)))
        col += width
    return views


def _whole_backward(
    layout: MixLayout, d_out: Tensor, saved: tuple[Tensor, ...], state: Any, qkv_shape: torch.Size
) -> tuple[Tensor, list[Tensor]]:
    """The whole-node hooks' backward (``Whole.backward``): the qkv gradient and, per branch, its weights'
    gradients as one tensor (two weights stacked)."""
    dqkv = d_out.new_empty(qkv_shape)
    dws = layout.whole.backward(d_out, dqkv, saved, state, lambda: _whole_grads(d_out, dqkv, layout))
    return dqkv, dws


def _split_grads(layout: MixLayout, dws: list[Tensor]) -> list[Tensor]:
    """Each branch's weight gradients (``_whole_backward``: one tensor per branch) one by one."""
    grads: list[Tensor] = []
    for dw, stacked in zip(dws, layout.stacked):
        if stacked:
            grads += dw.unbind(0)
        else:
            grads.append(dw)
    return grads


def _backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
    """Every branch's backward hooks: dq, dk, dv into one qkv gradient, the weights' gradients."""
    layout, tags, qkv_shape, weight_shapes, _ = ctx.state
    spec, hyper = layout.spec, layout.hyper
    saved = ctx.saved_tensors
    if layout.whole is not None:
        dqkv, dws = _whole_backward(layout, d_out, saved, tags, qkv_shape)
        return (dqkv, None, None, *_split_grads(layout, dws))
    dqkv = d_out.new_empty(qkv_shape)
    geom, out_geom = _geom(dqkv), _geom(d_out)
    grads: list[Tensor] = []
    col, wi = 0, 0
    for i, (br, (node, count, width), (start, n_saved, tag)) in enumerate(
        zip(spec.branches, layout.nodes, tags)
    ):
        # as the hooks take them (dq, dk as tokens to rotate back)
        dq, dk, dv = _branch_views(dqkv, geom, br, node.heads)
        dout = _view(d_out, out_geom, col, br.heads, br.head_dim, node.heads)
        # RoPE'd branches get dq, dk in the rotated frame first, then rotate them back into place.
        dqh, dkh = dq, dk
        if br.rope:
            rotated = _pair(dqkv, br)
            dqh, dkh = _heads_of(rotated, br.heads) if node.heads else rotated.unbind(1)
        try:
            dws = node.backward(dout, saved[start : start + n_saved], tag, dqh, dkh, dv, hyper)
        except Exception as exc:
            tag_branch(exc, i)
            raise
        if br.rope:
            _rotate_back(dqkv, geom, br, spec, rotated)
        grads += [weight_grad(dw, shape) for dw, shape in zip(dws, weight_shapes[wi : wi + count])]
        wi += count
        col += width
    return (dqkv, None, None, *grads)


# Under create_graph=True where a branch's backward cannot be differentiated: an error if its result is.
_backward_once = once_differentiable(_backward)


def _reference_grads(spec: MixSpec, d_out: Tensor, qkv: Tensor, weights: list[Tensor]) -> list[Tensor | None]:
    """The gradients of qkv and the weights as a differentiable graph (``create_graph=True``): autograd
    through ``reference_mix``, in float32 at least (the hooks' backwards have no derivative of their own);
    ``None`` for an input that does not require one."""
    inputs = [qkv, *weights]
    wanted = [t for t in inputs if t.requires_grad]
    acc = torch.promote_types(qkv.dtype, torch.float32)
    out = reference_mix(qkv.to(acc), spec, [w.to(acc) for w in weights])
    grads = iter(torch.autograd.grad(out, wanted, d_out.to(acc), create_graph=True, allow_unused=True))
    return [next(grads) if t.requires_grad else None for t in inputs]


def _backward_twice(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
    """A backward that is itself differentiable (``create_graph=True``, ``_reference_grads``) on the saved
    qkv and weights."""
    layout = ctx.state[0]
    qkv, *weights = ctx.saved_tensors[-1 - layout.n_weights :]
    got = _reference_grads(layout.spec, d_out, qkv, weights)
    return (got[0], None, None, *got[1:])


class _FusedMix(torch.autograd.Function):
    """The node of every training call, and the mixer op's autograd kernel. ``args``: the op's arguments
    (``op_args``) where the call came through the op, else ``None``. Where the op meets traced tensors
    (``torch.compile``, a dispatch mode), forward and backward dispatch the op below autograd; else they run
    its kernels here."""

    @staticmethod
    def forward(ctx, qkv: Tensor, layout: MixLayout, args: tuple | None, *weights: Tensor) -> Tensor:
        if args is not None and _traced(qkv):
            with torch._C._AutoDispatchBelowAutograd():
                out, saved = mix_op(qkv, list(weights), *args, True)
            tags = None
        else:
            out, saved, tags = _forward(qkv, layout, True, weights)
        # qkv and the weights too where the backward is differentiable or the whole-node hooks run
        whole = layout.whole is not None
        ctx.save_for_backward(*saved, *((qkv, *weights) if layout.twice or whole else ()))
        # the weights' shapes where the branches' hooks return their gradients unshaped (``weight_grad``)
        ctx.state = (layout, tags, qkv.shape, None if whole else [w.shape for w in weights], args)
        if args is None:
            return out
        ctx.mark_non_differentiable(*saved)  # the op returns them too
        return (out, *saved)

    @staticmethod
    def backward(ctx: Any, d_out: Tensor, *_d_saved: Tensor) -> tuple[Tensor | None, ...]:
        grad = torch.is_grad_enabled()  # create_graph=True: the gradients must be differentiable themselves
        if not grad and ctx.state[1] is not None and ctx.state[0].whole is not None:
            # the usual backward of an eager call on the whole-node hooks: they allocate in explicit dtypes
            # and run no PyTorch op that autocast would change
            return _backward(ctx, d_out)
        with autocast_off(d_out.device.type):  # as the forward ran (``fused_mix``)
            return _any_backward(ctx, d_out, grad)


def _any_backward(ctx: Any, d_out: Tensor, grad: bool) -> tuple[Tensor | None, ...]:
    """``_FusedMix.backward`` of a traced op call, of the branches' hooks, or differentiable itself
    (``grad``: ``create_graph=True``)."""
    if ctx.state[1] is None:  # traced: the op's backward
        return (_backward_twice if grad else _op_backward)(ctx, d_out)
    if not grad:  # the usual backward: no wrapper to pay for
        return _backward(ctx, d_out)
    return (_backward_twice if ctx.state[0].twice else _backward_once)(ctx, d_out)


def fused_mix(qkv: Tensor, spec: MixSpec, weights: list[Tensor]) -> Tensor:
    """All branches' inner loops and read-outs as one autograd node.

    Args:
        qkv: the qkv projection ``[B, N, 3 * sum(widths)]`` (branch by branch ``[q | k | v]``), float32 or
            float64, or float16 / bfloat16 where every branch runs on Triton (``takes``).
        spec: the branches and shared settings.
        weights: the initial inner weights, branch by branch in their op's ``weights`` order: ``w1, w2
            [1, G, c, c]`` (SwiGLU) or ``weight [1, G*c, 3, 3]`` (depthwise conv), in qkv's dtype.

    Returns:
        The read-outs concatenated ``[B, N, sum(widths)]``, computed in qkv's dtype with autocast off (the
        backward too).
    """
    # Compiled: the mixer op, which the graph keeps whole. Eager: the op's autograd kernel, the node, entered
    # directly (the dispatcher's argument parsing and Python kernels cost more: docs/kernels.md).
    if torch.compiler.is_compiling() and whole_path(spec):
        return _traced_mix(qkv, spec, weights)
    layout = mix_layout(spec)
    if qkv.shape[-1] != 3 * layout.width:
        raise ValueError(f"qkv has {qkv.shape[-1]} channels, the branches need {3 * layout.width}")
    if not takes(spec, qkv.dtype):
        raise ValueError(
            f"{qkv.dtype} qkv: only branches on Triton take it as it is (float32 / float64 else)"
        )
    # Saving for the backward only when autograd will call it (not under no_grad / inference); without it
    # the node is not needed either. Autocast off: the node computes in qkv's dtype, its backward too.
    return node_call(qkv, weights, layout, grad_flows(qkv, *weights))


def node_call(qkv: Tensor, weights: list[Tensor], layout: MixLayout, grad: bool) -> Tensor:
    """``fused_mix`` of a settled call whose checks passed before (``TTTMixer``'s short path): ``layout``
    (``mix_layout``) on a whole path, ``weights`` in the dtype the node takes with ``qkv``'s, not traced;
    ``grad``: gradients flow (``grad_flows``)."""
    with autocast_off(qkv.device.type):
        if grad:
            return _FusedMix.apply(qkv, layout, None, *weights)
        return _forward(qkv, layout, False, tuple(weights))[0]


# ------------------------------------------------------------------------------------------------ the op


def whole_path(spec: MixSpec) -> bool:
    """Whether ``spec``'s branches all take one path, with whole-node hooks (``Node.whole``): what the mixer
    op runs (Triton's launch program, the C++ kernel's whole-mixer op). Read from the ops' tables, not
    ``mix_layout`` (traced calls ask)."""
    path = spec.branches[0].path
    return all(br.path == path and OPS[br.op].paths[path].node.whole is not None for br in spec.branches)


def op_args(spec: MixSpec) -> tuple:
    """``spec`` as the mixer op's plain arguments after qkv and the weights (``spec_of`` reads them back):
    the branches' path, their ops (comma-separated), per branch its offset, heads, head dim and RoPE then
    the grid, the scale, lr and RoPE base, ``grad_norm`` and ``recompute``. Traceable by ``torch.compile``."""
    ints = [v for br in spec.branches for v in (br.offset, br.heads, br.head_dim, int(br.rope))]
    return (
        spec.branches[0].path,
        ",".join(br.op for br in spec.branches),
        [*ints, *spec.grid],
        [float(spec.scale), float(spec.lr), float(spec.rope_base)],
        bool(spec.grad_norm),
        bool(spec.recompute),
    )


@functools.lru_cache(maxsize=64)
def _spec_of(
    path: str, ops: str, ints: tuple[int, ...], floats: tuple[float, ...], grad_norm: bool, recompute: bool
) -> MixSpec:
    names = ops.split(",")
    branches = tuple(
        MixBranch(name, *ints[4 * i : 4 * i + 3], bool(ints[4 * i + 3]), path) for i, name in enumerate(names)
    )
    scale, lr, rope_base = floats
    return MixSpec(branches, tuple(ints[-2:]), scale, lr, grad_norm, rope_base, recompute)


def spec_of(
    path: str, ops: str, ints: list[int], floats: list[float], grad_norm: bool, recompute: bool
) -> MixSpec:
    """The ``MixSpec`` of the mixer op's arguments (``op_args``)."""
    return _spec_of(path, ops, tuple(ints), tuple(floats), grad_norm, recompute)


def _op_layout(args: Sequence[Any]) -> MixLayout:
    """The layout of the mixer op's arguments ``args`` (``op_args``). Traced with symbolic sizes, the grid
    may be symbolic: the fakes and the autograd kernel then get a layout on a grid of zeros (they read
    shapes, not the grid; the kernels run on real sizes)."""
    path, ops, ints, *rest = args
    if not all(type(v) is int for v in ints[-2:]):
        ints = [*ints[:-2], 0, 0]
    layout = mix_layout(spec_of(path, ops, ints, *rest))
    if layout.whole is None:
        raise ValueError(f"vit3::mix runs branches on a path with whole-node hooks, got {args[:2]}")
    return layout


# The mixer op and its backward, defined here; their kernels (CPU, CUDA), fakes and autograd kernel below.
_LIB = torch.library.Library("vit3", "FRAGMENT")  # the namespace is shared with the per-branch ops
_SPEC = "str path, str ops, SymInt[] ints, float[] floats, bool grad_norm, bool recompute"
_LIB.define(f"mix(Tensor qkv, Tensor[] weights, {_SPEC}, bool save) -> (Tensor, Tensor[])")
_LIB.define(
    f"mix_backward(Tensor d_out, Tensor qkv, Tensor[] weights, Tensor[] saved, {_SPEC}) -> (Tensor, Tensor[])"
)
mix_op = torch.ops.vit3.mix.default
"""The mixer call as one op: every branch's step and read-out (``fused_mix``) through its path's whole-node
hooks; returns the read-outs ``[B, N, sum(widths)]`` and what the backward needs (empty unless ``save``).
The spec: ``op_args``."""
mix_backward_op = torch.ops.vit3.mix_backward.default
"""``mix_op``'s backward on what it saved: the qkv gradient and, per branch, its initial weights' gradients
as one tensor (two weights stacked ``[2, ...]``)."""


def _traced(qkv: Tensor) -> bool:
    """Whether an op call meets traced tensors (a tensor subclass, a dispatch mode): it then dispatches the
    op below autograd, which tracing records, where an eager call runs its kernels directly."""
    return type(qkv) is not Tensor or torch._C._len_torch_dispatch_stack() > 0


# The kernels take the op's arguments as the schema orders them: its tensors, the spec (``op_args``), and for
# ``mix`` last ``save``.


def _mix_kernel(qkv: Tensor, weights: list[Tensor], *args: Any) -> tuple[Tensor, list[Tensor]]:
    *spec, save = args
    out, saved, _ = _forward(qkv, _op_layout(spec), save, tuple(weights))
    return out, saved


def _mix_fake(qkv: Tensor, weights: list[Tensor], *args: Any) -> tuple[Tensor, list[Tensor]]:
    *spec, save = args
    layout = _op_layout(spec)
    b, n, _ = qkv.shape
    out = qkv.new_empty(b, n, layout.width)
    if not save:
        return out, []
    return out, layout.whole.saved_like(layout.spec, qkv)


def _mix_autograd(qkv: Tensor, weights: list[Tensor], *args: Any) -> tuple[Tensor, list[Tensor]]:
    """The op's autograd kernel: the node (``_FusedMix``) where gradients flow, saving inside it."""
    *spec, save = args
    spec = tuple(spec)
    if grad_flows(qkv, *weights):
        out, *saved = _FusedMix.apply(qkv, _op_layout(spec), spec, *weights)
        return out, saved if save else []
    with torch._C._AutoDispatchBelowAutograd():
        return mix_op(qkv, weights, *args)


def _mix_backward_kernel(
    d_out: Tensor, qkv: Tensor, weights: list[Tensor], saved: list[Tensor], *spec: Any
) -> tuple[Tensor, list[Tensor]]:
    layout = _op_layout(spec)

    def calls() -> tuple[Tensor, list[NodeCall], list[Tensor | None]]:
        out = qkv.new_empty(qkv.shape[0], qkv.shape[1], layout.width)
        return out, *_whole_calls(qkv, out, layout, tuple(weights), True)

    state = layout.whole.state(layout.programs, layout.spec, qkv, weights, calls)
    return _whole_backward(layout, d_out, (*saved, qkv, *weights), state, qkv.shape)


def _mix_backward_fake(
    d_out: Tensor, qkv: Tensor, weights: list[Tensor], saved: list[Tensor], *spec: Any
) -> tuple[Tensor, list[Tensor]]:
    layout = _op_layout(spec)
    dws, wi = [], 0
    for _, count, _ in layout.nodes:
        w = weights[wi]
        dws.append(w.new_empty((2, *w.shape) if count == 2 else w.shape))
        wi += count
    return d_out.new_empty(qkv.shape), dws


for _key in ("CPU", "CUDA"):
    _LIB.impl("mix", _mix_kernel, _key)
    _LIB.impl("mix_backward", _mix_backward_kernel, _key)
_LIB.impl("mix", _mix_autograd, "Autograd")
torch.library.register_fake("vit3::mix", _mix_fake, lib=_LIB)
torch.library.register_fake("vit3::mix_backward", _mix_backward_fake, lib=_LIB)


def _op_backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
    """``_FusedMix``'s backward of a traced op call: ``mix_backward_op`` on what the op saved."""
    layout, args = ctx.state[0], ctx.state[4]
    tensors = ctx.saved_tensors
    n_saved = len(tensors) - 1 - layout.n_weights
    qkv, *weights = tensors[n_saved:]
    dqkv, stacked = mix_backward_op(d_out, qkv, weights, list(tensors[:n_saved]), *args)
    return (dqkv, None, None, *_split_grads(layout, stacked))


def _traced_mix(qkv: Tensor, spec: MixSpec, weights: list[Tensor]) -> Tensor:
    """``fused_mix`` under ``torch.compile``: the mixer op, which the graph keeps whole."""
    return mix_op(qkv, list(weights), *op_args(spec), grad_flows(qkv, *weights))[0]
