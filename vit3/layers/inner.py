"""The TTT mixer's inner loop, the front door to its inner models, and how to add one.

:func:`inner_loop` trains an inner model (:mod:`vit3.layers.inner_models`) on the ``(k, v)`` pairs of each
sample with the model's closed-form gradients and returns its per-sample weights; the mixer then applies
them to q (``InnerModel.apply_to``). The shared math the models build on is :mod:`vit3.layers.inner_math`.

Adding an inner model on the generic path (every backend falls back to it) is one class in
``inner_models.py`` under ``@register_inner_model("name")`` and its test rows: the steps are in
``kernels/README.md`` (adding an inner model), a template class in ``docs/design/models.md``.
"""

from __future__ import annotations

from torch import Tensor

from .inner_math import assert_finite, tracing
from .inner_models import InnerModel, Params, create_inner_model, register_inner_model

__all__ = [
    "InnerModel",
    "Params",
    "assert_finite",
    "create_inner_model",
    "inner_loop",
    "register_inner_model",
    "tracing",
]


def inner_loop(
    model: InnerModel,
    params: Params,
    k: Tensor,
    v: Tensor,
    grid: tuple[int, int],
    *,
    loss: str = "dot",
    scale: float = 9**-0.5,
    lr: float = 1.0,
    steps: int = 1,
    mini_batches: int = 1,
    grad_norm: bool = True,
    token_lr: Tensor | None = None,
) -> Params:
    """Trains an inner model on ``(k, v)`` and returns its per-sample weights.

    Args:
        model: the inner model (its closed-form gradients are used).
        params: initial weights (leading dim 1 or B).
        k: keys ``[B, G, N, c]``.
        v: values ``[B, G, N, c]``.
        grid: ``(h, w)`` with ``h * w == N``.
        loss: inner loss name.
        scale: loss scale s; each mini-batch loss is ``(s / n) * sum_n l_n``.
        lr: inner learning rate η.
        steps: epochs over the sequence.
        mini_batches: contiguous chunks per epoch (one step each).
        grad_norm: apply ``G / (||G|| + 1)`` before the step.
        token_lr: optional per-token gate ``[B, G, N]`` multiplying each token's gradient (η·σ(x W_η)).

    Returns:
        The updated weights, each ``[B, ...]`` (or ``[1, ...]`` where nothing depends on the sample).

    The loop is the model's :meth:`InnerModel.inner_loop` (a method: TorchScript compiles it with the model).
    """
    return model.inner_loop(params, k, v, grid, loss, scale, lr, steps, mini_batches, grad_norm, token_lr)
