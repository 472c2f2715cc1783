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
A fast path (eager fused, C++, Triton) is an op folder under ``kernels/`` (``kernels/README.md``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vit3.kernels.common import normalize_grad

from .inner_math import assert_finite, tracing
from .inner_models import InnerModel, Params, create_inner_model, register_inner_model
from .losses import loss_grad, loss_needs_prediction

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
    """
    n_tok = k.shape[-2]
    if mini_batches > n_tok:
        raise ValueError(f"mini_batches={mini_batches} is larger than the sequence length N={n_tok}")
    # Chunk bounds as torch.tensor_split cuts them (the first N % m chunks one longer), in plain integer
    # arithmetic so that tracing / ONNX export sees no data-dependent values.
    size, extra = n_tok // mini_batches, n_tok % mini_batches
    ends = [(i + 1) * size + min(i + 1, extra) for i in range(mini_batches)]
    bounds = list(zip([0, *ends[:-1]], ends))
    need_pred = loss_needs_prediction(loss)
    for _ in range(steps):
        for start, end in bounds:
            full = start == 0 and end == n_tok
            if full or not model.grid_model:
                kc, vc = (k, v) if full else (k[..., start:end, :], v[..., start:end, :])
            else:
                kc, vc = k, v  # grid models see the whole grid; the error is masked to the chunk below
            v_hat, cache = model.forward_train(params, kc, grid, need_pred)
            # a traced chunk size is a 0-dim integer tensor: divided in float64, not the default float32
            count = end - start
            coef = scale / (count.double() if isinstance(count, Tensor) else count)
            e = loss_grad(loss, v_hat, vc) * coef
            if token_lr is not None:
                gate = token_lr if (full or model.grid_model) else token_lr[..., start:end]
                e = e * gate.unsqueeze(-1)
            if model.grid_model and not full:
                mask = torch.zeros(n_tok, 1, dtype=e.dtype, device=e.device)
                mask[start:end] = 1.0
                e = e * mask
            grads = model.grads(params, kc, e, cache, grid)
            if grad_norm:
                grads = {name: normalize_grad(g, model.norm_dims(name)) for name, g in grads.items()}
            params = {name: params[name] - lr * grads[name] for name in params}
    return params
