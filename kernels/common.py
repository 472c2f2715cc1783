"""What every TTT op shares: the gradient normalisation, the inner step, the reference inner step, and the
autocast contract of the hand-written autograd nodes (:func:`autocast_forward` / :func:`autocast_backward`).

The official ViT³ step (Han et al., "ViT³: Unlocking Test-Time Training in Vision", CVPR 2026, and its code,
github.com/LeapLabTHU/ViTTT) trains an inner model f on ``(k, v)`` with one full-batch gradient step of the
loss ``(s / N) Σ_n l(f(k_n), v_n)`` and reads it out on q. Its gradient normalisation
``G / (||G|| + 1)`` is written here once (:func:`normalize_grad`); every path — the references, the generic
inner loop of ``vit3.layers``, the eager tiled paths, the official baseline of the benchmarks — calls it or
:func:`step` (the compiled kernels, C++ and Triton, are checked against it in the tests).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .losses import loss_value

__all__ = [
    "NO_CONTEXT",
    "autocast_backward",
    "autocast_forward",
    "autocast_off",
    "autocast_on",
    "grad_flows",
    "normalize_grad",
    "normalized",
    "step",
    "step_backward",
    "ttt_reference",
    "weight_grad",
]


def grad_flows(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on ``tensors``: grad mode is on and one of them requires grad (``None``
    entries are skipped). The fast paths save for the backward, or build a node at all, only then."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def autocast_on(device: str) -> bool:
    """Whether autocast is on for ``device`` (a type without autocast, such as ``meta``: off)."""
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


NO_CONTEXT = contextlib.nullcontext()
"""A context that does nothing, one instance for every call that needs none (a hot path's ``with``)."""


def autocast_off(device: str) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``device`` (a device type); where it is off already, one that does
    nothing (entering ``torch.autocast`` costs more than the check)."""
    return torch.autocast(device, enabled=False) if autocast_on(device) else NO_CONTEXT


def autocast_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates an autograd node's ``forward``: records the autocast state of its tensors' device (the first
    tensor argument's), for :func:`autocast_backward`.

    ``torch.amp.custom_fwd`` / ``custom_bwd`` for a node that runs on any device: those take the device type
    when the class is defined, our nodes see it in their arguments.
    """

    @functools.wraps(forward)
    def wrapper(ctx: Any, *args: Any) -> Any:
        first = args[0]  # the nodes take a tensor first: no search (a per-call cost of every node)
        device = (
            first if isinstance(first, Tensor) else next(a for a in args if isinstance(a, Tensor))
        ).device.type
        enabled = autocast_on(device)
        ctx.autocast = (device, enabled, torch.get_autocast_dtype(device) if enabled else None)
        return forward(ctx, *args)

    return wrapper


def autocast_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates the ``backward`` of a node whose ``forward`` has :func:`autocast_forward`: it runs under the
    forward's autocast state, wherever ``backward()`` is called (inside an autocast region or after it, the
    usual pattern). Each input's gradient comes back in that input's dtype by the autograd engine's rule (it
    casts a node's gradients to its inputs' dtypes).

    Without it a backward meets the caller's state: fp32 weights saved by a forward under autocast against
    16-bit gradients outside it, or fp32 math of a node that turned autocast off downcast inside it.
    """

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        device, enabled, dtype = ctx.autocast
        now = autocast_on(device)
        if now == enabled and (not now or torch.get_autocast_dtype(device) == dtype):
            return backward(ctx, *grads)
        with torch.autocast(device, dtype=dtype) if enabled else torch.autocast(device, enabled=False):
            return backward(ctx, *grads)

    return wrapper


def normalized(g: Tensor, dims: list[int] = (-2,)) -> tuple[Tensor, Tensor]:  # type: ignore[assignment]
    """The official gradient normalisation ``G / (||G|| + 1)`` and the norm ``||G||`` (over ``dims``, kept).

    For a ``d_in x d_out`` weight the norm is over the input dim of each output column (``dims=(-2,)``); for a
    depthwise-conv kernel over its 3x3 taps (``dims=(-2, -1)``). ``dims`` is any sequence of ints (typed a
    list: TorchScript compiles this, for the inner loop of a model built scriptable).
    """
    # autograd through the norm: vector_norm's backward is 0 where G = 0 (sqrt's is NaN); a trace records it
    # whatever the grad mode (torch.jit.trace checks its graph again under no_grad)
    if g.requires_grad or torch.jit.is_tracing():
        norm = torch.linalg.vector_norm(g, dim=dims, keepdim=True)
    else:  # the fast paths' steps: over a non-innermost dim of these small tensors vector_norm is slower
        norm = g.square().sum(dims, keepdim=True).sqrt_()
    return g / (norm + 1.0), norm


def normalize_grad(g: Tensor, dims: list[int] = (-2,)) -> Tensor:  # type: ignore[assignment]
    """``G / (||G|| + 1)``, the norm over ``dims`` (:func:`normalized` without the norm)."""
    return normalized(g, dims)[0]


def step(
    g: Tensor, w: Tensor, lr: float, grad_norm: bool, dims: tuple[int, ...] = (-2,)
) -> tuple[Tensor, Tensor]:
    """The inner step ``W' = W - lr G / (||G|| + 1)`` (or ``W - lr G``) and the norm its backward needs."""
    if not grad_norm:
        return w - lr * g, g.new_zeros(())
    g_hat, norm = normalized(g, dims)
    return w - lr * g_hat, norm


def step_backward(
    dw_new: Tensor, g: Tensor, norm: Tensor, lr: float, grad_norm: bool, dims: tuple[int, ...] = (-2,)
) -> Tensor:
    """dL/dG from dL/dW' through :func:`step` (for the fast paths' hand-written backward)."""
    dg_hat = dw_new * (-lr)
    if not grad_norm:
        return dg_hat
    proj = (g * dg_hat).sum(dims, keepdim=True)
    # d(G/(n+1)) = dĜ/(n+1) - G (G·dĜ) / (n (n+1)^2); the second term vanishes with G where n = 0.
    return dg_hat / (norm + 1.0) - g * (proj / (norm.clamp_min(1e-30) * (norm + 1.0) ** 2))


def weight_grad(dw: Tensor, shape: torch.Size) -> Tensor:
    """Per-sample weight gradient ``[B, ...]`` -> the initial weight's ``shape`` ``[1|B, ...]``."""
    return dw.sum(0, keepdim=True) if shape[0] == 1 and dw.shape[0] != 1 else dw


def ttt_reference(
    model: Callable[..., Tensor],
    weights: tuple[Tensor, ...],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    lr: float,
    grad_norm: bool,
    loss: str = "dot",
    norm_dims: tuple[int, ...] = (-2,),
) -> Tensor:
    """One full-batch inner step of ``model`` on ``(k, v)``, read out on q, written from the definition.

    The inner gradient is taken by autograd (``create_graph`` when the caller's graph needs it), so the
    closed forms of every fast path are checked against the loss itself, and the outer gradients come from
    autograd through the whole step.

    Args:
        model: the inner model ``model(x, *weights) -> v_hat`` on tokens ``[B, G, N, c]``.
        weights: its initial weights, leading dim 1 or B.
        q, k, v: ``[B, G, N, c]`` (any strides and float dtype).
        scale: loss scale s; the loss is ``(s / N) Σ_n l(v_hat_n, v_n)`` per sample.
        lr: inner learning rate.
        grad_norm: apply :func:`normalize_grad` to each gradient.
        loss: ``"dot"`` (``-<v_hat, v>``) or ``"mse"`` (``0.5 ||v_hat - v||²``),
            ``vit3.kernels.losses.loss_value``.
        norm_dims: dims of a weight over which the normalisation takes its norm.

    Returns:
        ``model(q, *W')`` ``[B, G, N, c]`` in q's dtype (computed in float32 at least).
    """
    out_dtype, ct = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v = (t.to(ct) for t in (q, k, v))
    outer = grad_flows(q, k, v, *weights)
    with torch.enable_grad():
        # Per-sample copies: the gradient of the summed loss w.r.t. them is each sample's own gradient.
        per_sample = [w.to(ct).expand(k.shape[0], *w.shape[1:]).clone() for w in weights]
        for w in per_sample:
            if not w.requires_grad:
                w.requires_grad_()
        total = loss_value(loss, model(k, *per_sample), v).sum() * (scale / k.shape[-2])
        grads = torch.autograd.grad(total, per_sample, create_graph=outer)
    with torch.set_grad_enabled(outer):
        new = [w - lr * (normalize_grad(g, norm_dims) if grad_norm else g) for w, g in zip(per_sample, grads)]
        return model(q, *new).to(out_dtype)
