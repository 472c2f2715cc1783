"""Inner (test-time) losses with their closed-form gradients (``vit3.layers.losses`` re-exports them).

Every loss is a sum over tokens of a per-token loss ``l(v_hat_n, v_n)`` (``r = v_hat - v``): ``dot``
``-<v_hat, v>`` (the official ViT³ loss), ``mse`` ``0.5 * ||r||^2``, ``rmse`` ``||r||`` (its gradient
guarded where ``r = 0``), ``mae`` ``||r||_1``, ``smooth_l1`` ``sum_c huber(r_c)`` with ``beta = 1``. The
mixer scales the sum by ``s / n`` (``n`` tokens in the inner batch); the gradient functions here return
``dl/dv_hat`` per token, unscaled, so the inner loop never calls autograd. TorchScript compiles them (the
inner loop of a model built scriptable calls them).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["loss_grad", "loss_needs_prediction", "loss_value"]


def loss_needs_prediction(name: str) -> bool:
    """Whether the gradient of loss ``name`` depends on the prediction (all but the dot product)."""
    return name != "dot"


def loss_value(name: str, v_hat: Tensor, v: Tensor) -> Tensor:
    """Per-token loss ``[..., n]`` of predictions and targets ``[..., n, c]``."""
    if name == "dot":
        return -(v_hat * v).sum(-1)
    r = v_hat - v
    if name == "mse":
        return 0.5 * r.pow(2).sum(-1)
    if name == "rmse":
        return r.pow(2).sum(-1).sqrt()
    if name == "mae":
        return r.abs().sum(-1)
    if name == "smooth_l1":
        a = r.abs()
        return torch.where(a < 1.0, 0.5 * r * r, a - 0.5).sum(-1)
    raise ValueError(f"unknown inner loss {name!r}")


def loss_grad(name: str, v_hat: Tensor | None, v: Tensor) -> Tensor:
    """Closed-form ``dl/dv_hat`` per token, shaped like ``v`` (``[..., n, c]``).

    Args:
        name: loss name.
        v_hat: inner-model prediction ``[..., n, c]`` (may be ``None`` for ``dot``).
        v: target values ``[..., n, c]``.
    """
    if name == "dot":
        return -v
    if v_hat is None:
        raise ValueError("inner loss '" + name + "' needs the prediction")
    r = v_hat - v
    if name == "mse":
        return r
    if name == "rmse":  # guarded where r = 0 (a local bound: TorchScript reads no global numbers)
        return r / r.pow(2).sum(-1, keepdim=True).sqrt().clamp_min(1e-12)
    if name == "mae":
        return torch.sign(r)
    if name == "smooth_l1":
        return r.clamp(-1.0, 1.0)
    raise ValueError("unknown inner loss '" + name + "'")
