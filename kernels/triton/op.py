"""The Triton path of the TTT ops: custom ``torch.library`` ops around the Triton kernels, autograd, the op.

``triton_ttt`` runs one full-batch inner step of an inner model (``"swiglu"``, ``"linear"``, ``"dwconv"``)
per (sample, head) and applies the result to the queries, forward and backward in Triton. It is registered
as the opaque custom ops ``vit3::triton_ttt_fwd`` / ``vit3::triton_ttt_bwd``, so ``torch.compile`` keeps them
in its graph; in eager mode a call runs its cached ``_Call`` through a plain autograd node. With
``backend="reference"`` it runs ``vit3.kernels.reference``. The op reads no environment variable
(``vit3.layers.backends`` decides what runs); its backward is differentiable through the reference.

Why opaque custom ops and an eager node beside them: ``docs/design/kernels.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import flops, reference
from ..common import autocast_backward, autocast_forward, grad_flows
from . import node, plan, program, tiles
from .checks import check_call, is_live, not_in_place, resolve_backend
from .device import (
    WEIGHT_NAMES,
    acc_dtype,
    fp32_uses_tf32,
    interpreting,
)
from .plan import LaunchPlan, backward_template, forward_template, plan_key, tensor_meta

__all__ = ["clear_plans", "resolve_backend", "triton_ttt"]


def clear_plans() -> None:
    """Forgets every cached plan, eager call and launch configuration (for tests that change a hook)."""
    _CALLS.clear()
    node.clear()
    program.clear()
    forward_template.cache_clear()
    backward_template.cache_clear()
    tiles.clear()


# ------------------------------------------------------------------------------------------- custom ops


def _kernel_op(name: str, fake: Any) -> Any:
    """Registers ``fn`` as the opaque custom op ``name`` with ``fake`` (output shapes only) as its fake
    implementation.

    Opaque on every device: ``torch.compile`` keeps the op in its graph (no graph break) and calls it on real
    tensors at run time, so a compiled model launches the same plans as an eager one. (A ``triton_op`` would
    have Inductor trace the body, whose plans are cached per concrete shape: symbolic sizes cannot key them.)
    """

    def register(fn: Any) -> Any:
        op = torch.library.custom_op(name, fn, mutates_args=())
        op.register_fake(fake)
        return op

    return register


def _token_major(b: Any, g: Any, n: Any, d: Any, like: Tensor) -> Tensor:
    """An empty ``[B, G, N, c]`` in token-major memory (``[B, N, G, c]`` contiguous), as plans allocate."""
    return like.new_empty((b, n, g, d)).transpose(1, 2)


def _fake_forward(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str, h: Any, wd: Any,
    scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``_fwd_op``'s outputs on fake tensors: shapes, strides and dtypes only (sizes may be symbolic)."""
    b, g, n, d = q.shape
    (nw, r), acc = plan.stat_shape(model, d), acc_dtype(q.dtype)[0]
    return (
        _token_major(b, g, n, d, q),
        q.new_empty((b * g, nw, r, d), dtype=acc),
        q.new_empty((b * g, nw, d), dtype=acc),
    )


def _fake_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, gbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: Any, wd: Any, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``_bwd_op``'s outputs on fake tensors: ``dq``, ``dk``, ``dv`` (token-major, inputs' dtypes), ``dW``."""
    b, g, n, d = q.shape
    grads = tuple(_token_major(b, g, n, d, t) for t in (q, k, v))
    return (*grads, q.new_empty(plan.weight_grad_shape(model, g, d), dtype=acc_dtype(q.dtype)[0]))


def _forward(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str, h: int, wd: int,
    scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Runs the forward: ``(out [B, G, N, c], G [B*G, NW, R, c], ||G||)``."""
    key = plan_key(q, model, loss, h, wd, scale, lr, grad_norm, chunk)
    forward = forward_template(key, True, tuple(tensor_meta(t) for t in (q, k, v, w1, w2)))
    return forward.run((q, k, v, w1, w1 if w2 is None else w2))


def _backward_grads(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, gbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Runs the backward: ``dq``, ``dk``, ``dv`` ``[B, G, N, c]`` and ``dW`` (accumulator dtype)."""
    key = plan_key(q, model, loss, h, wd, scale, lr, grad_norm, chunk)
    backward = backward_template(key, tuple(tensor_meta(t) for t in (q, k, v, w1, w2)), tensor_meta(dout))
    return backward.run((dout, q, k, v, w1, w1 if w2 is None else w2, gbuf, nbuf))


@_kernel_op("vit3::triton_ttt_fwd", _fake_forward)
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str, h: int, wd: int,
    scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Forward: ``out [B, G, N, c]`` and the saved statistics ``G`` ``[B*G, NW, R, c]`` and ``||G||``.

    ``w1`` (and ``w2``, SwiGLU only) are the initial weights ``[1, G, c, c]``, or the depthwise conv's
    ``[1, G*c, 3, 3]`` on the ``h x wd`` grid (``R`` = 9 taps); ``chunk <= 0`` picks the split of N.
    """
    return _forward(q, k, v, w1, w2, model, loss, h, wd, scale, lr, grad_norm, chunk)


@_kernel_op("vit3::triton_ttt_bwd", _fake_backward)
def _bwd_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, gbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Backward: ``dq``, ``dk``, ``dv`` ``[B, G, N, c]`` and ``dW`` (``backward_plan``, accumulator dtype)."""
    return _backward_grads(dout, q, k, v, w1, w2, gbuf, nbuf, model, loss, h, wd, scale, lr, grad_norm, chunk)


def _weight_grads(dw: Tensor, two: bool) -> tuple[Tensor, Tensor | None]:
    """``dW`` of the plan as the weights' gradients: SwiGLU's ``[2, 1, G, c, c]`` in two, else as it is."""
    return dw.unbind(0) if two else (dw, None)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, w1, w2, *cfg = inputs
    ctx.save_for_backward(q, k, v, w1, w2, *output[1:])  # G and ||G||: W' is recomputed from them
    ctx.cfg = cfg
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx: Any, dout: Tensor, *_stats: Tensor) -> tuple:
    q, k, v, w1, w2, gbuf, nbuf = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable themselves
        grads = _reference_backward(dout, q, k, v, w1, w2, *ctx.cfg)
    else:
        dq, dk, dv, dw = _bwd_op(dout, q, k, v, w1, w2, gbuf, nbuf, *ctx.cfg)
        grads = (dq, dk, dv, *_weight_grads(dw, w2 is not None))
    return (*grads, *(None,) * len(ctx.cfg))


def _reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str,
    h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor | None, ...]:  # fmt: skip
    """The backward as a differentiable graph, for a double backward: autograd through the op's reference on
    the saved inputs, in the kernels' accumulator dtype (the kernels' backward has no derivative of its own).
    Gradients of ``(q, k, v, w1, w2)``, ``None`` where an input does not require one."""
    inputs = (q, k, v, w1, w2)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    if not wanted:
        return (None,) * len(inputs)
    acc = acc_dtype(q.dtype)[0]
    params = {name: t.to(acc) for name, t in zip(WEIGHT_NAMES[model], (w1, w2))}
    kw = {"grid": (h, wd), "scale": scale, "lr": lr, "grad_norm": grad_norm, "loss": loss}
    out = reference.reference_ttt(model, *(t.to(acc) for t in (q, k, v)), params, **kw)
    grads = iter(torch.autograd.grad(out, wanted, dout.to(acc), create_graph=True, allow_unused=True))
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in inputs)


torch.library.register_autograd("vit3::triton_ttt_fwd", _backward, setup_context=_setup_context)
flops.register("vit3")


# ------------------------------------------------------------------------------------------ the eager path

# The eager calls seen so far, by signature (``_signature``): at most ``MAX_CALLS``, then forgotten at once.
_CALLS: dict[tuple, _Call] = {}
MAX_CALLS = 1024


class _Call:
    """The eager path of one call signature: checked once, its plans built once, each call binds tensors.

    A signature (``_signature``) holds everything ``_validate``, the plan key and the weights' layout depend
    on, so a call that finds its ``_Call`` is valid, needs no key and allocates and launches only. The
    forward plans (with and without saved statistics) are built on first use, the backward's per upstream
    gradient layout; the autograd node (``_TritonTTT``) carries the ``_Call`` to its backward.
    """

    __slots__ = ("backwards", "cfg", "copy", "forwards", "key", "metas", "names")

    def __init__(
        self, cfg: tuple, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, copy: bool
    ):
        self.cfg = cfg  # (model, loss, h, wd, scale, lr, grad_norm, chunk): ``_fwd_op``'s settings
        self.key = plan_key(q, *cfg)
        self.metas = (tensor_meta(q), tensor_meta(k), tensor_meta(v), tensor_meta(w1), tensor_meta(w2))
        self.names = WEIGHT_NAMES[cfg[0]]
        self.copy = copy  # the weights are copied into one layout (``_weights_of``)
        self.forwards: dict[bool, LaunchPlan] = {}
        self.backwards: dict[tuple, LaunchPlan] = {}

    def forward(self, save: bool) -> LaunchPlan:
        """The forward plan, saving ``G`` and ``||G||`` for a backward or not (inference)."""
        plan = self.forwards.get(save)
        if plan is None:
            plan = self.forwards[save] = forward_template(self.key, save, self.metas)
        return plan

    def backward(self, dout: Tensor) -> LaunchPlan:
        """The backward plan for upstream gradients laid out as ``dout`` (its shape is the output's)."""
        layout = (dout.stride(), dout.dtype)
        plan = self.backwards.get(layout)
        if plan is None:
            plan = self.backwards[layout] = backward_template(self.key, self.metas, tensor_meta(dout))
        return plan

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor]) -> Tensor:
        if self.copy:
            w1, w2 = _weights_of(self.cfg[0], params)
        else:
            w1, w2 = params[self.names[0]], (params[self.names[1]] if len(self.names) == 2 else None)
        if grad_flows(q, k, v, w1, w2):
            return _TritonTTT.apply(q, k, v, w1, w2, self)
        return self.forward(False).run((q, k, v, w1, w1 if w2 is None else w2), is_live(q))[0]


def _signature(
    name: str, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], *settings: Any
) -> tuple:
    """What a ``triton_ttt`` call's checks, plan and weight layout depend on: the settings (with the module
    hooks ``table_hooks`` and ``GRID_X_MAX``), every tensor's shape, strides, dtype and device, the weights'
    names."""
    sig = [name, *settings, tiles.table_hooks(), plan.GRID_X_MAX]
    for t in (q, k, v, *params.values()):
        sig += (t.shape, t.stride(), t.dtype, t.device)
    return (*sig, *params)


class _TritonTTT(torch.autograd.Function):
    """The eager path's autograd node: a ``_Call``'s plans, without the dispatcher's custom-op machinery (tens
    of microseconds a call in eager mode; ``torch.compile`` traces the custom ops instead). The backward takes
    its plan from the forward's ``_Call``: no second look at the settings; it runs under the forward's
    autocast state (``autocast_backward``), and through the reference where it must be differentiable itself
    (``create_graph=True``: ``_reference_backward``)."""

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, call: _Call
    ) -> Tensor:
        out, gbuf, nbuf = call.forward(True).run((q, k, v, w1, w1 if w2 is None else w2), is_live(q))
        ctx.save_for_backward(q, k, v, w1, w2, gbuf, nbuf)  # G and ||G||: W' is recomputed from them
        ctx.call = call
        return out

    @staticmethod
    @autocast_backward
    def backward(ctx: Any, dout: Tensor) -> tuple:
        q, k, v, w1, w2, gbuf, nbuf = ctx.saved_tensors
        call = ctx.call
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable themselves
            return (*_reference_backward(dout, q, k, v, w1, w2, *call.cfg), None)
        inputs = (dout, q, k, v, w1, w1 if w2 is None else w2, gbuf, nbuf)
        dq, dk, dv, dw = call.backward(dout).run(inputs, is_live(q))
        return dq, dk, dv, *_weight_grads(dw, w2 is not None), None


# ---------------------------------------------------------------------------------------------- public op


def _weights_of(name: str, params: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    """The initial weights as the kernels read them, in place: ``(W1, W2)`` of SwiGLU (one layout: copied
    only if their strides differ), ``(W, None)`` of the linear model, the conv weight (copied only if its
    3 x 3 taps are not one stride apart)."""
    weights = [params[n] for n in WEIGHT_NAMES[name]]
    if not_in_place(name, weights):  # copied into the layout the kernels read
        weights = [w.to(weights[0].dtype).contiguous() for w in weights]
    return weights[0], (weights[1] if len(weights) == 2 else None)


def triton_ttt(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: dict[str, Tensor],
    *,
    grid: tuple[int, int] | None = None,
    scale: float,
    lr: float = 1.0,
    grad_norm: bool = True,
    loss: str = "dot",
    backend: str = "auto",
    chunk: int | None = None,
) -> Tensor:
    """One full-batch inner step of inner model ``name`` on ``(k, v)``, applied to ``q``, fused.

    Equals ``vit3.layers.inner_loop`` (one step, one mini-batch, fixed lr) followed by ``apply_to``.

    Args:
        name: ``"swiglu"``, ``"linear"`` or ``"dwconv"`` (3x3 depthwise conv over the grid).
        q, k, v: ``[B, G, N, c]``, any strides (e.g. views of one qkv projection; read in place), float16,
            bfloat16, float32 or float64; accumulation in float32 (float64 for float64).
        params: initial weights ``{"w1", "w2"}`` (SwiGLU) or ``{"w"}`` (linear), each ``[1, G, c, c]``, or
            ``{"weight": [1, G*c, 3, 3]}`` (depthwise conv, channel ``g*c + i`` = head g, channel i); read
            where they are, in their own dtype.
        grid: the raster token grid ``(h, w)``, ``h * w == N`` (needed by ``"dwconv"``, else only checked).
        scale: loss scale s (the loss is ``(s / N) Σ_n l_n``).
        lr: inner learning rate.
        grad_norm: the official ``G / (||G||_col + 1)``.
        loss: ``"dot"`` (both models) or ``"mse"`` (linear only).
        backend: ``"triton"``, ``"reference"`` or ``"auto"`` (Triton where it runs and takes the head dim,
            16..128, else the reference).
        chunk: tokens per program (tests force a split of N with it); ``None`` chooses.

    Returns:
        ``[B, G, N, c]`` in q's dtype (token-major memory, so ``transpose(1, 2)`` to ``[B, N, G*c]`` is free).
    """
    compiling = torch.compiler.is_compiling()
    if not compiling:  # eager: a signature seen before runs its cached ``_Call`` (checked, planned) at once
        grid = None if grid is None else tuple(grid)
        interpret = interpreting()
        tf32 = q.dtype is torch.float32 and not interpret and fp32_uses_tf32()
        sig = _signature(
            name, q, k, v, params, grid, scale, lr, grad_norm, loss, backend, chunk, interpret, tf32
        )
        call = _CALLS.get(sig)
        if call is not None:
            return call(q, k, v, params)
    which, grid = check_call(name, q, k, v, params, grid, loss, backend, chunk)
    if which == "reference":
        return reference.reference_ttt(
            name, q, k, v, params, grid=grid, scale=scale, lr=lr, grad_norm=grad_norm, loss=loss
        )
    w1, w2 = _weights_of(name, params)
    cfg = (name, loss, grid[0], grid[1], float(scale), float(lr), bool(grad_norm), chunk or 0)
    if compiling:
        return _fwd_op(q, k, v, w1, w2, *cfg)[0]
    if len(_CALLS) >= MAX_CALLS:
        _CALLS.clear()
    copy = w1 is not params[WEIGHT_NAMES[name][0]]
    call = _CALLS[sig] = _Call(cfg, q, k, v, w1, w2, copy)
    return call(q, k, v, params)
