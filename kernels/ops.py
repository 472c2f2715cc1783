"""The table of ops: every TTT inner-loop op with its reference and its fast paths, behind one interface.

An op (:class:`Op`) is one inner model whose TTT step has fast paths: its name (as a ``TTTConfig`` branch
names it), its pure-PyTorch reference, the names of its initial weights, whether RoPE applies to its q and k,
and its paths (:class:`Path`) keyed by the backend that runs them (``"triton"``, ``"cpu"``, ``"eager"``).
Each op's folder builds its ``Op`` and :func:`register` s it in :data:`OPS`; the backend registry
(``vit3.layers.backends``) asks it for each backend's path, the fused node for its node hooks. The types
a path reads (:class:`Branch`, :class:`Settings`, :class:`Inputs`) are defined here, below the registry that
builds them. ``kernels/README.md`` says how to add an op; ``docs/design/kernels.md`` why so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "BRANCH_ATTR",
    "OPS",
    "Branch",
    "Check",
    "Hyper",
    "Inputs",
    "Node",
    "NodeCall",
    "Op",
    "Path",
    "Settings",
    "Whole",
    "ops_with",
    "register",
    "tag_branch",
]


class Branch(NamedTuple):
    """A mixer branch as a backend sees it."""

    index: int
    name: str  # inner model
    heads: int
    head_dim: int
    plain: (
        bool  # the bare inner model: no ``inner_norm`` wrapper, no ``inner_bias`` (all the fused paths take)
    )


class Settings(NamedTuple):
    """The ``TTTConfig`` fields a backend's ``supports`` may read (all of them are in the route key)."""

    loss: str
    steps: int
    mini_batches: int
    lr_mode: str


class Inputs(NamedTuple):
    """What a backend's ``supports`` may read of the mixer input x (all of it is in the route key)."""

    device: torch.device
    dtype: torch.dtype  # of the qkv projection output, what the backends read
    tokens: str  # token-count class (``token_class``): "N<32", "N>=32", or "any N" under tracing
    grad: bool  # gradients flow through the mixer
    tracing: str  # "", "compile" (torch.compile), "export" (torch.export) or "trace" (jit.trace, ONNX export)


class Hyper(NamedTuple):
    """The settings of one inner step, as an op's ``reference`` and its node hooks take them."""

    grid: tuple[int, int]  # the token grid (h, w), read by the grid models
    scale: float  # loss scale s: the loss is (s / N) Σ_n l(v_hat_n, v_n)
    lr: float
    grad_norm: bool  # G / (||G|| + 1)
    loss: str = "dot"
    recompute: bool = True  # node hooks: the memory-lean backward recomputes what it can instead of saving it


# ``(branch, cfg, x) -> (ok, reason)``: a path's ``supports`` / ``prefers`` / ``fits``.
Check = Callable[[Branch, Settings, Inputs], tuple[bool, str]]


class NodeCall(NamedTuple):
    """What a path's ``Node.forward`` gets for one branch of the fused node.

    Attributes:
        q, k, v: the branch's inputs, views of the node's qkv (heads ``[B, G, N, c]`` or tokens
            ``[B, N, G*c]``, as ``Node.heads`` says; any strides).
        weights: the initial weights, in ``Op.weights`` order.
        dest: where the read-out goes: a view of the node's output, laid out as q.
        hyper: the step's settings.
        save: keep what the backward needs (autograd will call it).
        dense: save dense copies of q, k, v (another branch copies too: views would keep all of qkv alive).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    weights: tuple[Tensor, ...]
    dest: Tensor
    hyper: Hyper
    save: bool
    dense: bool


# The attribute a branch's failing hooks set on their exception: the branch's index in the fused node (the
# backends' guard demotes that branch's backend alone).
BRANCH_ATTR = "vit3_branch"


def tag_branch(exc: BaseException, branch: int) -> None:
    """Sets ``branch`` on ``exc`` (``BRANCH_ATTR``) unless a deeper frame named the branch already."""
    if getattr(exc, BRANCH_ATTR, None) is None:
        setattr(exc, BRANCH_ATTR, branch)


class Whole(NamedTuple):
    """A path's hooks for a whole fused node whose branches all take that path: one call for every branch
    (the Triton path's launch program, the C++ kernel's whole-mixer op), instead of each branch's ``Node``
    hooks. They rotate the RoPE branches' q, k themselves, and their gradients back. ``spec``: the node's
    ``MixSpec`` (``vit3.layers.fused_mix``: per branch its op, offset, heads, head dim and RoPE, then the
    grid and the step's settings).

    Attributes:
        forward: ``(cache, spec, qkv, out, weights, save, calls) -> (saved, state)``: every branch's
            read-out written into ``out`` ``[B, N, sum(widths)]``; ``cache`` a dict the node keeps per spec,
            ``calls()`` makes each branch's ``NodeCall`` (views of qkv and out, q and k not rotated) and per
            branch its RoPE table (``vit3.layers.rope.rope_cos_sin`` of the grid and its C channels, float32
            at least, ``[N, C / 2, 2]``; ``None`` without RoPE), asked only where the hooks need them (e.g.
            the first call of a layout); ``saved`` the tensors the backward needs
            besides qkv and the weights, none a view of qkv (the node saves qkv and the weights after them;
            empty unless ``save``), ``state`` what the backward gets back. An exception names its branch
            (``BRANCH_ATTR``) where the hooks know it.
        backward: ``(d_out, dqkv, saved, state, calls) -> grads``: writes dq, dk, dv of every branch into
            ``dqkv`` (qkv's shape; a RoPE branch's dq, dk rotated back); ``saved``: the forward's, then qkv
            and the weights; ``calls()`` makes each branch's ``(dout, dq, dk, dv)`` heads views of ``d_out``
            and ``dqkv``; returns per branch its initial weights' gradients, summed over the batch, as one
            tensor (the weights' shape; two weights stacked ``[2, ...]``).
        state: ``(cache, spec, qkv, weights, calls) -> state``: the ``state`` a training ``forward`` of
            ``(qkv, weights)`` returned, found again (the mixer op's backward, which gets tensors only);
            ``calls()`` makes an output, the ``NodeCall`` s and the RoPE tables, as for ``forward``.
        saved_like: ``(spec, qkv) -> saved``: empty tensors laid out as a training ``forward`` saves them
            (the mixer op's fake; sizes may be symbolic).
    """

    forward: Callable[..., tuple[list[Tensor], Any]]
    backward: Callable[..., list[Tensor]]
    state: Callable[..., Any]
    saved_like: Callable[..., list[Tensor]]


class Node(NamedTuple):
    """A path's hooks in the fused node (``vit3.layers.fused_mix``), which runs every branch between the
    mixer's two projections as one autograd node.

    Attributes:
        heads: the hooks take q, k, v, the destination and the gradients as heads ``[B, G, N, c]`` (else as
            tokens ``[B, N, G*c]``); views of the node's qkv, output and qkv gradient, any strides.
        forward: ``(call: NodeCall) -> (saved, tag)``: the step (``call.hyper``) and the read-out written
            into ``call.dest``; ``saved`` the tensors the backward needs (empty unless ``call.save``; dense
            copies of q, k, v when ``call.dense``), ``tag`` a string the backward gets back.
        backward: ``(d_out, saved, tag, dq, dk, dv, hyper) -> weight grads``: writes dq, dk, dv, returns the
            per-sample gradient ``[B, ...]`` of each initial weight, in ``Op.weights`` order.
        copies: ``(q) -> bool`` for the heads view q ``[B, G, N, c]``: whether this path copies q, k, v dense
            (then every branch's hooks save dense copies: saved views would keep all of qkv alive beside them;
            the ``cpu`` path's whole call saves qkv and copies again in the backward); ``None``: never.
        low_precision: the hooks take float16 / bfloat16 q, k, v as they are (accumulating in float32);
            else float32 / float64 only.
        twice: the node may differentiate this path's backward (``create_graph=True``) through the op's
            reference on the saved qkv (where every branch's path allows it).
        mix: ``(head_dim, qkv) -> (code, block)``: the op's branch in the whole-mixer C++ op
            (``kernels/mix/csrc/mix.cpp``, ``cpu`` paths): its op code there and the token block of its step
            on tensors like qkv; ``None``: no branch there (mixers with such a branch run each branch's hooks
            in the Python node; the ``cpu`` path's ``whole`` needs ``mix``).
        whole: a zero-argument callable making the path's hooks for a whole node of its branches
            (``Whole``), called by ``fused_mix.mix_layout`` when it builds a layout of them (the hooks' module
            may import what a path's table must not, such as Triton); ``None``: branch by branch.
        stored: ``(parameter, initial) -> bool``: whether the whole-mixer C++ op (``mix``) takes the inner
            model's ``parameter`` as stored where the model hands ``initial``, a view of it (the op reads the
            module's parameters on every call); ``None``: only an initial weight that is the parameter itself.
    """

    heads: bool
    forward: Callable[[NodeCall], tuple[list[Tensor], str]]
    backward: Callable[..., tuple[Tensor, ...]]
    copies: Callable[[Tensor], bool] | None = None
    low_precision: bool = False
    twice: bool = False
    mix: Callable[[int, Tensor], tuple[int, int]] | None = None
    whole: Callable[[], Whole] | None = None
    stored: Callable[[Tensor, Tensor], bool] | None = None


@dataclass(frozen=True)
class Path:
    """One fast path of an op: what a backend runs for a branch of that op.

    Attributes:
        supports: whether it can serve the branch, and why not; may read only ``Settings`` / ``Inputs``
            fields.
        prefers: auto only: where auto passes a serving path over (another is faster there).
        fits: asked once ``supports`` passed: whether the hardware at hand can run it (a refusal steps aside
            with a warning).
        node: its hooks in the fused node, the mixer op, which is where a fast path runs (compiled, Triton's
            and the C++ kernel's, as the op ``vit3::mix``).
    """

    supports: Check
    node: Node
    prefers: Check | None = None
    fits: Check | None = None


@dataclass(frozen=True)
class Op:
    """One inner model with fast paths.

    Attributes:
        name: the inner model (``TTTConfig.branches`` names it).
        reference: ``(q, k, v, params, hyper) -> [B, G, N, c]``: one full-batch inner step (``Hyper``) on
            ``(k, v)`` read out on q, the definition every path is tested against; q, k, v ``[B, G, N, c]``,
            ``params`` the initial weights by name.
        weights: the initial weights' names, in the order the paths take them.
        rope: RoPE applies to its q and k (a token-wise model; the grid models see positions themselves).
        paths: its fast paths by backend name (``"triton"``, ``"cpu"``, ``"eager"``).
    """

    name: str
    reference: Callable[..., Tensor]
    weights: tuple[str, ...]
    rope: bool
    paths: Mapping[str, Path]


# The ops by name, in registration order (``vit3.kernels`` registers swiglu, linear, dwconv).
OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    """Adds ``op`` to :data:`OPS` (replacing one of the same name) and returns it."""
    OPS[op.name] = op
    return op


def ops_with(path: str) -> tuple[str, ...]:
    """The ops that have fast path ``path`` (``"triton"``, ``"cpu"``, ``"eager"``), in ``OPS`` order."""
    return tuple(name for name, op in OPS.items() if path in op.paths)
