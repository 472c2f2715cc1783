"""The Triton path's hooks in the fused node (``vit3.layers.fused_mix``): one branch's forward and
backward launch plans on views of the node's qkv, output and qkv gradient.

A mixer call on Triton is then one autograd node for all its branches (no per-branch custom op, autograd node
or layout copy), on q, k, v in their own dtype (float16 / bfloat16 read as they are, fp32 accumulation in
the kernels). The plans write straight into the node's views: the read-out into its output
(``NodeCall.dest``), dq, dk, dv into its qkv gradient. Each branch signature (``_signature``: the settings and
every tensor's shape, strides and dtype) is checked and planned once (``_Entry``); a call then only looks its
entry up, allocates the plan's buffers and launches.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from ..ops import Hyper, NodeCall
from . import plan, tiles
from .checks import check_call, is_live, not_in_place
from .device import WEIGHT_NAMES, fp32_uses_tf32, interpreting
from .plan import LaunchPlan, backward_template, forward_template, plan_key, tensor_meta

__all__ = ["backward", "checked_entry", "clear", "forward", "state_of"]

# The branch signatures seen so far (at most ``MAX_ENTRIES``, then forgotten at once), and their entries by
# tag.
_ENTRIES: dict[tuple, _Entry] = {}
_BY_TAG: dict[str, _Entry] = {}
MAX_ENTRIES = 1024
_TAGS = itertools.count()  # never reused: a backward pending across a ``clear`` finds no other entry


def clear() -> None:
    """Forgets every branch signature (``op.clear_plans``)."""
    _ENTRIES.clear()
    _BY_TAG.clear()


class _Entry:
    """One branch signature of the node: its plan key, its forward plans (saving ``G`` and ``||G||`` or not),
    its backward plans by the layout of the upstream gradient and of dq, dk, dv, and the tag the node hands
    its backward (which finds the entry by it, with no second look at the settings)."""

    __slots__ = ("backwards", "forwards", "key", "metas", "tag", "two")

    def __init__(self, key: Any, metas: tuple, tag: str) -> None:
        self.key, self.metas, self.tag = key, metas, tag
        self.two = metas[4] is not None  # SwiGLU: two weights, dW [2, 1, G, c, c]
        self.forwards: dict[bool, LaunchPlan] = {}
        self.backwards: dict[tuple, LaunchPlan] = {}

    def forward(self, save: bool) -> LaunchPlan:
        found = self.forwards.get(save)
        if found is None:
            found = self.forwards[save] = forward_template(self.key, save, self.metas[:5], self.metas[5])
        return found

    def backward(self, saved: tuple[Tensor, ...], dout: Tensor, grads: tuple[Tensor, ...]) -> LaunchPlan:
        layout = (dout.stride(), *(t.stride() for t in (*saved[:3], *grads)))
        found = self.backwards.get(layout)
        if found is None:
            # the saved q, k, v (dense copies have strides of their own) and the weights
            metas = (*map(tensor_meta, saved[:3]), *self.metas[3:5])
            found = self.backwards[layout] = backward_template(
                self.key, metas, tensor_meta(dout), tuple(map(tensor_meta, grads))
            )
        return found


def state_of(dtype: torch.dtype, device: torch.device) -> tuple:
    """The module state a plan key of a ``dtype`` call on ``device`` reads besides the call's tensors: the
    interpreter, TF32 (float32 on a GPU) and the test hooks (``tiles.table_hooks``, ``plan.GRID_X_MAX``,
    ``plan.launcher``)."""
    tf32 = dtype is torch.float32 and device.type == "cuda" and fp32_uses_tf32()
    return interpreting(), tf32, tiles.table_hooks(), plan.GRID_X_MAX, plan.launcher


def _signature(name: str, call: NodeCall) -> tuple:
    """What a branch's checks and plans depend on: its op and settings, every tensor's shape, strides and
    dtype, the device, and the module state the plan key reads (``state_of``)."""
    q, k, v, dest = call.q, call.k, call.v, call.dest
    device = q.device
    sig = [name, call.hyper, device, *state_of(q.dtype, device)]
    for t in (q, k, v, dest, *call.weights):
        sig += (t.shape, t.stride(), t.dtype)
    return tuple(sig)


def checked_entry(name: str, call: NodeCall, rope: Tensor | None = None) -> tuple[Any, tuple]:
    """A branch call checked as ``triton_ttt`` checks it (a ``ValueError`` naming what is wrong) and its
    weights as the kernels read them in place: its plan key and the metas of q, k, v, W1, W2 (``None`` but
    for SwiGLU) and the read-out view. ``rope``: the RoPE table its kernels rotate q, k by (the launch
    program's RoPE branches: ``vit3.layers.rope.rope_cos_sin``)."""
    q, k, v, weights, h = call.q, call.k, call.v, call.weights, call.hyper
    if rope is not None:
        d = q.shape[-1]
        if d % 2:  # a channel pair would straddle two heads
            raise ValueError(f"RoPE in the Triton kernels needs an even head dim, got {d}")
        want = plan.rope_table_like(q)
        if (rope.shape, rope.dtype) != (want.shape, want.dtype) or not rope.is_contiguous():
            raise ValueError(
                f"RoPE takes a contiguous {want.dtype} table {tuple(want.shape)}, got {tuple(rope.shape)}"
            )
    params = dict(zip(WEIGHT_NAMES[name], weights))
    check_call(name, q, k, v, params, h.grid, h.loss, "triton", None)
    why = not_in_place(name, list(weights))  # the node reads them in place (``triton_ttt`` copies them)
    if why:
        raise ValueError(f"the Triton node reads {why}")
    if call.dest.shape != q.shape or call.dest.dtype != q.dtype:
        raise ValueError(
            f"the read-out view must be {tuple(q.shape)} {q.dtype}, got {tuple(call.dest.shape)}"
        )
    key = plan_key(q, name, h.loss, h.grid[0], h.grid[1], float(h.scale), float(h.lr), bool(h.grad_norm), 0,
                   rope=rope is not None)  # fmt: skip
    w2 = weights[1] if len(weights) == 2 else None
    return key, (*map(tensor_meta, (q, k, v, weights[0], w2)), tensor_meta(call.dest))


def _entry(name: str, call: NodeCall, sig: tuple) -> _Entry:
    """The entry of a new signature (``checked_entry``), remembered under ``sig`` and a new tag."""
    key, metas = checked_entry(name, call)
    if len(_ENTRIES) >= MAX_ENTRIES:
        clear()
    tag = str(next(_TAGS))
    entry = _ENTRIES[sig] = _BY_TAG[tag] = _Entry(key, metas, tag)
    return entry


def forward(name: str, call: NodeCall) -> tuple[list[Tensor], str]:
    """``Node.forward`` of op ``name``: q, k, v, the read-out view ``dest`` as heads ``[B, G, N, c]`` (views
    of the node's qkv and output, any strides, float16 / bfloat16 / float32 / float64). Saves q, k, v (dense
    copies when ``call.dense``), the weights, ``G`` and ``||G||``; the tag names the entry."""
    sig = _signature(name, call)
    entry = _ENTRIES.get(sig)
    if entry is None:
        entry = _entry(name, call, sig)
    q, k, v, weights = call.q, call.k, call.v, call.weights
    w1 = weights[0]
    inputs = (q, k, v, w1, weights[1] if entry.two else w1, call.dest)
    if plan.DEBUG_FILL is not None:
        plan.debug_filled(call.dest)
    _, gbuf, nbuf = entry.forward(call.save).run(inputs, is_live(q))
    if not call.save:
        return [], entry.tag
    if call.dense:
        q, k, v = (t.contiguous() for t in (q, k, v))
    return [q, k, v, *weights, gbuf, nbuf], entry.tag


def backward(
    d_out: Tensor, saved: tuple[Tensor, ...], tag: str, dq: Tensor, dk: Tensor, dv: Tensor, hyper: Hyper
) -> tuple[Tensor, ...]:
    """``Node.backward``: the backward plan writes dq, dk, dv (heads views of the node's qkv gradient);
    returns the initial weights' gradients ``[1, ...]`` in the accumulator dtype."""
    entry = _BY_TAG[tag]
    q, k, v, w1, *rest = saved
    gbuf, nbuf = rest[-2:]
    w2 = rest[0] if entry.two else w1
    grads = (dq, dk, dv)
    if plan.DEBUG_FILL is not None:
        for t in grads:
            plan.debug_filled(t)
    dw = entry.backward(saved, d_out, grads).run((d_out, q, k, v, w1, w2, gbuf, nbuf, *grads), is_live(q))[3]
    return tuple(dw.unbind(0)) if entry.two else (dw,)
