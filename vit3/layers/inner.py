"""The TTT mixer's inner loop, the front door to its inner models, and how to add one.

:func:`inner_loop` trains an inner model (:mod:`vit3.layers.inner_models`) on the ``(k, v)`` pairs of each
sample with the model's closed-form gradients and returns its per-sample weights; the mixer then applies
them to q (``InnerModel.apply_to``). The shared math the models build on is :mod:`vit3.layers.inner_math`.

Adding an inner model on the generic path (every backend falls back to it) is one class in
``inner_models.py`` under ``@register_inner_model("name", formula=...)``, then ``python docs/generate.py``:
the checklist and a complete example are in ``docs/layout.md`` ("Adding an inner model").
"""

from __future__ import annotations

from typing import Any

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
    model: InnerModel, params: Params, k: Tensor, v: Tensor, grid: tuple[int, int], **hyper: Any
) -> Params:
    """Trains an inner model on ``(k, v)`` and returns its per-sample weights.

    The loop is the model's :meth:`InnerModel.inner_loop` (a method: TorchScript compiles it with the model),
    which holds the arguments, their defaults and what it returns; the hyper-parameters are keyword-only here.

    Args:
        model: the inner model (its closed-form gradients are used).
        params: initial weights (leading dim 1 or B).
        k: keys ``[B, G, N, c]``.
        v: values ``[B, G, N, c]``.
        grid: ``(h, w)`` with ``h * w == N``.
        **hyper: ``loss``, ``scale``, ``lr``, ``steps``, ``mini_batches``, ``grad_norm``, ``token_lr``.

    Returns:
        The updated weights, each ``[B, ...]`` (or ``[1, ...]`` where nothing depends on the sample).
    """
    return model.inner_loop(params, k, v, grid, **hyper)
