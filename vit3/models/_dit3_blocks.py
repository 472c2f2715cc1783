"""The layers of DiT³ (:mod:`vit3.models.dit3`): the DiT block with the TTT mixer, its adaLN-Zero
conditioning (timestep and label embedders, the final layer) and the fixed 2-D sin-cos position table.

Plain ``nn.Module`` s with the official parameter names (``dittt/models.py``); only the model that stacks them
is a diffusers model.
"""

from __future__ import annotations

import functools
import math
from functools import partial
from typing import Any

import torch
from timm.layers import Attention, Mlp
from torch import Tensor, nn

from vit3.layers import TTTConfig, TTTMixer
from vit3.layers.blocks import ConvPosEnc
from vit3.layers.inner_math import untraced

__all__ = [
    "DiT3Block",
    "FinalLayer",
    "LabelEmbedder",
    "TimestepEmbedder",
    "modulate",
    "sincos_pos_embed_2d",
]


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: ``x * (1 + scale) + shift`` (shift and scale broadcast over the token grid)."""
    return x * (1 + scale) + shift


def _sincos_table(dim: int, h: int, w: int) -> Tensor:
    """The table of :func:`sincos_pos_embed_2d` on CPU (compiled or exported, ``h`` and ``w`` may be
    symbolic)."""
    if dim % 4:
        raise ValueError(f"the 2-D sin-cos position table needs hidden_size divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)  # [D/4]
    rows = torch.arange(h, dtype=torch.float64).repeat_interleave(w)  # token i*w+j -> row i
    cols = torch.arange(w, dtype=torch.float64).repeat(h)  # -> column j
    parts = []
    for pos in (cols, rows):  # first half encodes the column (x), second half the row (y), as MAE/DiT
        angle = pos[:, None] * omega[None]  # [N, D/4]
        parts += [angle.sin(), angle.cos()]
    # Rounded to float32 as the official model stores it (its table is a float32 parameter, upcast with the
    # model): a float64 model then reproduces the official numbers exactly.
    return torch.cat(parts, dim=1).float()  # [N, D]


# Eager calls and torch.jit.trace keep the tables (a pure function of the grid; made out of a trace's sight,
# a constant of it in both passes of its check). Compiled and exported code makes them in the graph: a table
# made there is a fake tensor, from sizes that may be symbolic.
_cached_sincos_table = functools.lru_cache(maxsize=32)(_sincos_table)


def sincos_pos_embed_2d(dim: int, grid: tuple[int, int]) -> Tensor:
    """The fixed 2-D sin-cos position embedding of DiT (MAE's table) for an ``h x w`` token grid.

    Token ``i * w + j`` (row i, column j) gets ``[sin(j ω), cos(j ω), sin(i ω), cos(i ω)]`` with
    ``ω_k = 10000^(-k / (D/4))``, ``k < D/4``; on a square grid this is the official table.

    Returns:
        ``[h * w, dim]`` float32 (computed in float64, rounded as the official table).
    """
    if torch.compiler.is_compiling():  # torch.export's dynamic latent size: symbolic sides
        return _sincos_table(int(dim), grid[0], grid[1])
    return untraced(_cached_sincos_table, int(dim), int(grid[0]), int(grid[1]))


class TimestepEmbedder(nn.Module):
    """Diffusion timesteps ``[B]`` -> vectors ``[B, D]``: a 256-wide sinusoid through a 2-layer SiLU MLP.

    The sinusoid is ``[cos(t f), sin(t f)]`` with ``f_k = 10000^(-k / 128)`` (GLIDE/DiT), computed in
    float32, or in float64 for a float64 model (the official code hard-codes float32), then cast to the MLP's
    dtype (a bfloat16 / float16 model runs without autocast, as diffusers' ``TimestepEmbedding``).
    """

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0, dtype=torch.float32) -> Tensor:
        """Sinusoidal embedding ``[B, dim]`` of (possibly fractional) timesteps ``t`` ``[B]``."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=dtype, device=t.device) / half)
        args = t[:, None].to(dtype) * freqs[None]  # [B, half]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: Tensor) -> Tensor:
        """``[B] -> [B, D]``."""
        dtype = self.mlp[0].weight.dtype
        emb = self.timestep_embedding(
            t, self.frequency_embedding_size, dtype=torch.promote_types(dtype, torch.float32)
        )
        return self.mlp(emb.to(dtype))


class LabelEmbedder(nn.Module):
    """Class labels ``[B]`` -> vectors ``[B, D]``, with label dropout for classifier-free guidance.

    With ``dropout_prob > 0`` the table has one extra row, the null (unconditional) class ``num_classes``;
    during training each label is replaced by it with probability ``dropout_prob``.
    """

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.has_null = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + int(self.has_null), hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels: Tensor, force_drop_ids: Tensor | None = None) -> Tensor:
        """Labels with the dropped ones (random, or where ``force_drop_ids == 1``) set to the null class."""
        if force_drop_ids is None:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop = force_drop_ids == 1
        return torch.where(drop, self.num_classes, labels)

    def forward(self, labels: Tensor, train: bool, force_drop_ids: Tensor | None = None) -> Tensor:
        """``[B] -> [B, D]``."""
        if (train and self.has_null) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class DiT3Block(nn.Module):
    """A DiT³ block on a channels-last token map ``[B, h, w, C]`` with adaLN-Zero conditioning.

    Parameter names follow the official code (``cpe``, ``norm1``, ``attn``, ``norm2``, ``mlp``,
    ``adaLN_modulation``).

    Args:
        hidden_size: width C.
        num_heads: mixer heads.
        mlp_ratio: MLP hidden width / C.
        mixer: ``"ttt"`` (vit3 ``TTTMixer``) or ``"attention"`` (timm ``Attention``, SDPA).
        ttt_cfg: the TTT mixer's configuration (default: the official one, no RoPE).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        mixer: str = "ttt",
        ttt_cfg: TTTConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.mixer = mixer
        ttt_cfg = TTTConfig.create(ttt_cfg)
        self.cpe = ConvPosEnc(hidden_size, backend=ttt_cfg.backend)  # the block's backend, as its mixer's
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        if mixer == "ttt":
            # The model validates its input once; per-block finiteness checks would re-read every activation.
            self.attn = TTTMixer(hidden_size, num_heads, ttt_cfg, check_finite=False)
        else:
            self.attn = Attention(hidden_size, num_heads=num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(
            hidden_size, int(hidden_size * mlp_ratio), act_layer=partial(nn.GELU, approximate="tanh")
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        """Tokens ``[B, h, w, C]`` and conditioning ``[B, C]`` -> ``[B, h, w, C]``."""
        b, h, w, ch = x.shape
        x = self.cpe(x)
        mod = self.adaLN_modulation(c)[:, None, None, :]  # [B, 1, 1, 6C]: broadcast over the grid
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)
        y = modulate(self.norm1(x), shift1, scale1).reshape(b, h * w, ch)  # [B, N, C]
        y = self.attn(y, grid=(h, w)) if self.mixer == "ttt" else self.attn(y)
        x = x + gate1 * y.reshape(b, h, w, ch)
        return x + gate2 * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm and a linear map to ``p * p * out_channels`` values per token."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        """``[B, h, w, C]``, ``[B, C]`` -> ``[B, h, w, p * p * out_channels]``."""
        shift, scale = self.adaLN_modulation(c)[:, None, None, :].chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))
