"""The TTT mixer's inner loop, the front door to its inner models, and how to add one.

:func:`inner_loop` trains an inner model (:mod:`vit3.layers.inner_models`) on the ``(k, v)`` pairs of each
sample with the model's closed-form gradients and returns its per-sample weights; the mixer then applies
them to q (``InnerModel.apply_to``). The shared math the models build on is :mod:`vit3.layers.inner_math`.

Adding an inner model (the generic path: every backend falls back to it) is one class::

    @register_inner_model("my_model")  # the name a TTTConfig branch gives: branches=("my_model",)
    class MyInner(InnerModel):
        grid_model = False  # True: it mixes neighbouring grid positions (no RoPE, no inner_norm wrapper)
        takes_bias = False  # True: its FC layers take TTTConfig.inner_bias (from_config passes it on)

        def __init__(self, heads: int, head_dim: int) -> None: ...  # registers the initial weights
        def initial_params(self) -> Params: ...  # {name: weight [1, G, ...]}
        def forward_train(self, p, k, grid, need_output): ...  # (v_hat [B, G, n, c] or None, cache)
        def grads(self, p, k, e, cache, grid): ...  # {name: d sum_n <e_n, v_hat_n> / dW}, written out
        def apply_to(self, p, q, grid): ...  # the trained weights p on q [B, G, n, c]

It needs nothing else: ``TTTConfig`` accepts the name (``config.INNER_MODELS``, ``GRID_MODELS`` and
``BIAS_MODELS`` read the registry), :func:`create_inner_model` builds it (override ``from_config`` to read
options such as ``cfg.mlp_ratio``; ``norm_dims`` to normalise a gradient over other dims),
:func:`inner_loop` trains it and the backend registry runs it on the generic path. Its test is a row in
``tests/test_mixer_math.py``'s ``MODELS`` (a test fails for a registered model without one) and its forward
written again in ``tests/helpers/reference.py``: its ``grads`` are checked against autograd of that forward.
A fast path (eager fused, C++, Triton) is an op folder under ``kernels/`` (``kernels/README.md``). Typed
as the registered models' methods are, it scripts with a model built scriptable (TorchScript).
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
