"""2-D rotary position embedding (RoPE) for any grid, computed on the fly.

Matches the official ViT³ tables (``RoPE(shape=(h, w, C))``): the C channels form C/2 complex pairs
``(2i, 2i + 1)``; with ``k_max = C / 4`` frequencies ``θ_j = base^(-j / k_max)``, the first C/2 channels rotate
by ``row · θ`` and the last C/2 by ``col · θ``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rope_2d", "rope_angles"]


def rope_angles(
    grid: tuple[int, int], dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Rotation angles ``[h * w, dim / 2]`` for a ``dim``-channel RoPE on an ``h x w`` grid (raster order)."""
    if dim % 4:
        raise ValueError(f"2-D RoPE needs channels divisible by 4, got {dim}")
    h, w = grid
    k_max = dim // 4
    theta = base ** -(torch.arange(k_max, device=device, dtype=dtype) / k_max)  # [k_max]
    rows = torch.arange(h, device=device, dtype=dtype)[:, None, None] * theta  # [h, 1, k_max]
    cols = torch.arange(w, device=device, dtype=dtype)[None, :, None] * theta  # [1, w, k_max]
    angles = torch.cat([rows.expand(h, w, k_max), cols.expand(h, w, k_max)], dim=-1)  # [h, w, dim/2]
    return angles.reshape(h * w, dim // 2)


def apply_rope_2d(x: Tensor, grid: tuple[int, int], base: float = 10000.0, inverse: bool = False) -> Tensor:
    """Rotates tokens ``[B, N, C]`` (``N = h * w``, raster order) by their 2-D position.

    Computed in float32 at least (float64 inputs stay float64); the result has the computation's dtype.
    ``inverse=True`` rotates back, which is also the transpose (the backward) of the rotation.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    ang = rope_angles(grid, x.shape[-1], base, x.device, dtype)  # [N, C/2]
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    xp = x.to(dtype).unflatten(-1, (-1, 2))  # [B, N, C/2, 2]
    re, im = xp[..., 0], xp[..., 1]
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1)
    return out.flatten(-2)
