"""2-D rotary position embedding (RoPE) for any grid, its tables made per grid (eager) or in the traced graph.

Matches the official ViT³ tables (``RoPE(shape=(h, w, C))``): the C channels form C/2 complex pairs
``(2i, 2i + 1)``; with ``k_max = C / 4`` frequencies ``θ_j = base^(-j / k_max)``, the first C/2 channels
rotate by ``row · θ`` and the last C/2 by ``col · θ``. The angles are formed by broadcasting and the
rotation applied to a ``[..., h, w, 2, C/4, 2]`` view, so no table is expanded to ``[N, C/2]``;
:func:`rope_tables` lets q and k share one table. TorchScript compiles these functions.

Why so few ops (``torch.export`` with a dynamic image size): ``docs/design/models.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .inner_math import static_shape, tracing

__all__ = ["apply_rope_2d", "rope_angles", "rope_cos_sin", "rope_tables"]


def _frequencies(dim: int, base: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``[2, 2, dim / 4]``: the row (``[0]``) and column (``[1]``) frequencies of the two channel halves,
    ``[[θ, 0], [0, θ]]``."""
    if dim % 4:
        raise ValueError(f"2-D RoPE needs channels divisible by 4, got {dim}")
    k_max = dim // 4
    theta = base ** -(torch.arange(k_max, device=device, dtype=dtype) / k_max)  # [k_max]
    zero = torch.zeros_like(theta)
    return torch.stack([torch.stack([theta, zero]), torch.stack([zero, theta])])


def _grid_angles(
    grid: tuple[int, int], dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Rotation angles ``[h, w, 2, dim / 4]`` (channel half, frequency)."""
    h, w = grid
    freq = _frequencies(dim, base, device, dtype)
    rows = torch.arange(h, device=device, dtype=dtype).view(h, 1, 1, 1) * freq[0]  # [h, 1, 2, k_max]
    cols = torch.arange(w, device=device, dtype=dtype).view(1, w, 1, 1) * freq[1]  # [1, w, 2, k_max]
    return rows + cols


def rope_angles(
    grid: tuple[int, int], dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Rotation angles ``[h * w, dim / 2]`` for a ``dim``-channel RoPE on an ``h x w`` grid (raster order)."""
    h, w = grid
    return _grid_angles(grid, dim, base, device, dtype).reshape(h * w, dim // 2)


# Eager calls' tables, per (grid, dim, base, device, dtype): made once (a dozen small ops, more than the
# rotation costs at 224 px), forgotten all at once past ``MAX_TABLES``. Traced calls make theirs (sizes may be
# symbolic).
_TABLES: dict[tuple, tuple[Tensor, Tensor]] = {}
MAX_TABLES = 64


def _tables(
    grid: tuple[int, int], dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    angles = _grid_angles(grid, dim, base, device, dtype)
    return angles.cos(), angles.sin()


def rope_tables(
    grid: tuple[int, int], dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of the rotation angles, ``[h, w, 2, dim / 4]`` each, for :func:`apply_rope_2d`; in eager
    mode kept per grid, size, base, device and dtype (read only: the callers never write them)."""
    if torch.jit.is_scripting():
        return _tables(grid, dim, base, device, dtype)
    device = torch.device(device)
    if tracing() or device.type == "meta":
        return _tables(grid, dim, base, device, dtype)
    key = (tuple(grid), dim, float(base), device, dtype)
    found = _TABLES.get(key)
    if found is None:
        # normal tensors even under inference_mode: autograd saves them where later calls need gradients
        with torch.inference_mode(False), torch.no_grad():
            found = _tables(grid, dim, base, device, dtype)
        if len(_TABLES) >= MAX_TABLES:
            _TABLES.clear()
        _TABLES[key] = found
    return found


_COS_SIN: dict[tuple, Tensor] = {}


def rope_cos_sin(
    grid: tuple[int, int], dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """``[h * w, dim / 2, 2]``: each channel pair's cos and sin side by side, :func:`rope_tables` interleaved
    as kernels that rotate q, k on load read them; kept as those are."""
    device = torch.device(device)
    key = (tuple(grid), dim, float(base), device, dtype)
    found = _COS_SIN.get(key)
    if found is not None and not tracing():
        return found
    cos, sin = rope_tables(grid, dim, base, device, dtype)
    if tracing() or device.type == "meta":
        return torch.stack([cos, sin], dim=-1).reshape(-1, dim // 2, 2)
    with torch.inference_mode(False), torch.no_grad():
        found = torch.stack([cos, sin], dim=-1).reshape(-1, dim // 2, 2)
        if len(_COS_SIN) >= MAX_TABLES:
            _COS_SIN.clear()
        _COS_SIN[key] = found
    return found


def apply_rope_2d(
    x: Tensor,
    grid: tuple[int, int],
    base: float = 10000.0,
    inverse: bool = False,
    tables: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Rotates tokens ``[B, N, C]`` (``N = h * w``, raster order) by their 2-D position.

    Computed in float32 at least (float64 inputs stay float64); the result has the computation's dtype.
    ``inverse=True`` rotates back, which is also the transpose (the backward) of the rotation. ``tables``:
    :func:`rope_tables` of this grid, channel count, base and dtype, when several tensors share them.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    c = static_shape(x)[-1]
    cos, sin = tables if tables is not None else rope_tables(grid, c, base, x.device, dtype)
    if inverse:
        sin = -sin
    x = x if x.dtype == dtype else x.to(dtype)
    shape = list(x.shape[:-2])  # a list extended, not starred arguments: TorchScript compiles this
    shape.extend([grid[0], grid[1], 2, c // 4, 2])
    xp = x.reshape(shape)  # [B, N, C] -> [B, h, w, 2, C/4, 2]
    re, im = xp[..., 0], xp[..., 1]  # [B, h, w, 2, C/4] each
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1)  # [B, h, w, 2, C/4, 2]
    return out.reshape(x.shape)  # [B, N, C]
