"""The op references by inner-model name: one call for every op in the table (``Op.reference``)."""

from __future__ import annotations

from torch import Tensor

from .ops import OPS, Hyper

__all__ = ["reference_ttt"]


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
        name: an op of ``vit3.kernels.ops.OPS``: ``"swiglu"`` (weights ``w1, w2``), ``"linear"`` (``w``),
            ``"dwconv"`` (``weight``).
        q, k, v: ``[B, G, N, c]``.
        params: the initial weights by name.
        grid: the token grid ``(h, w)`` (read by the grid models, ``"dwconv"``).
        scale, lr, grad_norm: the step's settings.
        loss: ``"dot"`` (every op) or ``"mse"`` (``"linear"``).

    Returns:
        ``[B, G, N, c]`` in q's dtype.
    """
    if name not in OPS:
        raise ValueError(f"no op reference for the inner model {name!r} (ops: {', '.join(OPS)})")
    return OPS[name].reference(q, k, v, params, Hyper(grid, scale, lr, grad_norm, loss))
