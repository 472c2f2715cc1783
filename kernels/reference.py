"""The op references by inner-model name: one call for every op that has one (``vit3.kernels.<op>.reference``)."""

from __future__ import annotations

from torch import Tensor

from .dwconv.reference import dwconv_ttt_ref
from .linear.reference import linear_ttt_ref
from .swiglu.reference import swiglu_ttt_ref

__all__ = ["OPS", "reference_ttt"]

OPS = ("swiglu", "linear", "dwconv")


def reference_ttt(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: dict[str, Tensor],
    *,
    grid: tuple[int, int],
    scale: float,
    lr: float,
    grad_norm: bool,
    loss: str = "dot",
) -> Tensor:
    """One full-batch inner step of op ``name`` on ``(k, v)`` applied to q, by its reference.

    Args:
        name: ``"swiglu"`` (weights ``w1, w2``), ``"linear"`` (``w``) or ``"dwconv"`` (``weight``).
        q, k, v: ``[B, G, N, c]``.
        params: the initial weights by name.
        grid: the token grid ``(h, w)`` (read by ``"dwconv"``).
        scale, lr, grad_norm: the step's settings.
        loss: ``"dot"`` (every op) or ``"mse"`` (``"linear"``).

    Returns:
        ``[B, G, N, c]`` in q's dtype.
    """
    hyper = {"scale": scale, "lr": lr, "grad_norm": grad_norm}
    if name == "swiglu":
        return swiglu_ttt_ref(q, k, v, params["w1"], params["w2"], **hyper)
    if name == "dwconv":
        return dwconv_ttt_ref(q, k, v, params["weight"], grid, **hyper)
    if name == "linear":
        return linear_ttt_ref(q, k, v, params["w"], loss=loss, **hyper)
    raise ValueError(f"no op reference for the inner model {name!r} (ops: {', '.join(OPS)})")
