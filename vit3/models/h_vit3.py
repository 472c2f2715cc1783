"""H-ViT³: the hierarchical (four-stage) ViT³ backbone.

Paper: "ViT³: Unlocking Test-Time Training in Vision" (arXiv 2512.01643, CVPR 2026); official code
https://github.com/LeapLabTHU/ViTTT (MIT). Architecture (official): conv stem (stride 4) -> 4 stages (stages
2-4 start with a stride-2 conv downsampling) of blocks [CPE, x + TTT-with-2-D-RoPE(LN x), x + ConvFFN(LN x)]
-> BatchNorm -> mean -> Linear. Unlike the official code it takes any ``H x W`` image (``ceil`` sizes, RoPE
per grid); stage ``i`` outputs the stride ``4 * 2**i`` map (``features_only`` / ``forward_intermediates``:
four NCHW maps), and ``forward_features`` the normed map ``[B, C, ceil(H/32), ceil(W/32)]``.

What differs from the official code, and why: ``docs/design/models.md``.
"""

# No ``from __future__ import annotations`` here: torch.fx copies ``forward``'s annotations into the graph
# code TorchScript compiles (timm's FX + TorchScript path), where a string annotation names no type.
import re
from collections.abc import Sequence
from typing import Any

import torch
from timm.models import checkpoint_seq
from timm.models._input import update_model_input_size
from torch import Tensor, nn

from vit3.layers import TTTConfig, mixer_key_from_official
from vit3.layers.blocks import ConvFFN
from vit3.layers.embed import ConvDownsample, ConvStem, check_image

from ._family import FamilyBackbone, create_family_model, register_family, stochastic_depth_rates, ttt_blocks
from ._pretrained import check_state_dict, select_weights

__all__ = ["TIMM_FIXED", "HViT3", "HViT3Stage", "checkpoint_filter_fn", "official_to_ours"]

# timm kwargs for dynamic inputs: H-ViT³ always takes any size (every stride-2 convolution pads).
TIMM_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "dynamic_img_size": ((True,), "H-ViT³ always takes any image size"),
    "dynamic_img_pad": ((True,), "H-ViT³ always pads its strided convolutions (ceil sizes)"),
}


class HViT3Stage(nn.Module):
    """One H-ViT³ stage: optional stride-2 downsampling, then ``depth`` TTT blocks with ConvFFN.

    Args:
        in_dim: input width.
        dim: stage width C.
        depth: blocks.
        num_heads: mixer heads.
        downsample: start with ``ConvDownsample(in_dim, dim)`` (stages 2-4).
        mlp_ratio: ConvFFN hidden width / C.
        ttt_cfg: mixer configuration.
        proj_drop: dropout in the ConvFFN.
        drop_path: stochastic depth rate of each block.
    """

    def __init__(
        self,
        in_dim: int,
        dim: int,
        depth: int,
        num_heads: int,
        downsample: bool,
        mlp_ratio: float = 4.0,
        ttt_cfg: TTTConfig | None = None,
        proj_drop: float = 0.0,
        drop_path: Sequence[float] = (),
    ) -> None:
        super().__init__()
        self.grad_checkpointing = False
        recompute = ttt_cfg.recompute if ttt_cfg is not None else "auto"
        self.downsample = ConvDownsample(in_dim, dim, recompute=recompute) if downsample else nn.Identity()
        mlp = dict(mlp_ratio=mlp_ratio, proj_drop=proj_drop, mlp_layer=ConvFFN)
        rates = list(drop_path) or [0.0] * depth
        self.blocks = ttt_blocks(dim, num_heads, rates, ttt_cfg=ttt_cfg, norm_layer=nn.LayerNorm, **mlp)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, in_dim, H, W] -> [B, dim, H', W']`` (``H' = ceil(H / 2)`` with downsampling)."""
        x = self.downsample(x).permute(0, 2, 3, 1)  # [B, C, H, W] -> [B, H, W, C]: blocks are channels-last
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return x.permute(0, 3, 1, 2)  # [B, H, W, C] -> [B, C, H, W]


class HViT3(FamilyBackbone):
    """Hierarchical ViT³ (H-ViT³).

    Args:
        img_size: nominal input size (the model runs on any size of at least 32 pixels a side).
        in_chans: image channels.
        num_classes: classes of the linear head (0: no head).
        global_pool: ``'avg'`` (official), ``'max'``, ``'avgmax'`` or ``''`` (no pooling).
        dims: width of each stage.
        depths: blocks of each stage.
        num_heads: mixer heads of each stage (official head dim 32).
        mlp_ratio: ConvFFN hidden width / C.
        qkv_bias: bias of the mixers' qkv projections (``None``: ``ttt_cfg``'s, default ``True``); giving it
            and ``ttt_cfg``'s ``qkv_bias`` with different values is an error.
        drop_rate: dropout before the classifier.
        pos_drop_rate: dropout after the stem (the official ``drop_rate`` also acts here).
        proj_drop_rate: dropout inside the ConvFFNs (the official ``drop_rate``).
        drop_path_rate: stochastic depth, linearly increasing over all blocks (official training: T 0.2,
            S 0.4, B 0.6).
        ttt_cfg: mixer configuration (``TTTConfig`` or dict); a dict is applied over the H-ViT³ default
            ``rope=True``, a ``TTTConfig`` is used as given.
        device, dtype: where and in which dtype to create the parameters (timm's factory kwargs).
        **timm_kwargs: ``dynamic_img_size=True`` / ``dynamic_img_pad=True`` (what H-ViT³ always does) are
            accepted, as timm's ViTs take them; other values are refused by name (:data:`TIMM_FIXED`).
    """

    stack_name = "stages"
    intermediate_fmts = ("NCHW", "NHWC")

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        dims: Sequence[int] = (64, 128, 320, 512),
        depths: Sequence[int] = (1, 3, 9, 4),
        num_heads: Sequence[int] = (2, 4, 10, 16),
        mlp_ratio: float = 4.0,
        qkv_bias: bool | None = None,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        ttt_cfg: TTTConfig | dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **timm_kwargs: Any,
    ) -> None:
        if not len(dims) == len(depths) == len(num_heads):
            raise ValueError(
                f"dims, depths and num_heads must have equal lengths, got {dims}, {depths}, {num_heads}"
            )
        super().__init__(
            timm_kwargs,
            TIMM_FIXED,
            num_classes,
            global_pool,
            in_chans,
            dims[-1],
            ttt_cfg,
            qkv_bias,
            rope=True,
        )
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.spatial_dims = (2, 3)  # forward_features: [B, C, h, w]
        self.output_fmt = "NCHW"
        self.reduction = 4 * 2 ** (len(dims) - 1)
        cfg = self.ttt_cfg

        self.stem = ConvStem(in_chans, dims[0], recompute=cfg.recompute)
        self.pos_drop = nn.Dropout(pos_drop_rate)
        dpr = stochastic_depth_rates(drop_path_rate, sum(depths))
        self.stages = nn.Sequential(
            *[
                HViT3Stage(
                    dims[max(i - 1, 0)],
                    dims[i],
                    depths[i],
                    num_heads[i],
                    downsample=i > 0,
                    mlp_ratio=mlp_ratio,
                    ttt_cfg=cfg,
                    proj_drop=proj_drop_rate,
                    drop_path=dpr[sum(depths[:i]) : sum(depths[: i + 1])],
                )
                for i in range(len(dims))
            ]
        )
        self.feature_info = [
            dict(module=f"stages.{i}", num_chs=dims[i], reduction=4 * 2**i) for i in range(len(dims))
        ]
        self.norm = nn.BatchNorm2d(dims[-1])  # official BatchNorm1d over tokens: same statistics and keys
        self._finish(drop_rate, official_to_ours, device, dtype)

    # --- timm model API -------------------------------------------------------------------------------

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for layer-wise lr decay: stem, then stages (coarse) or blocks, final norm last."""
        blocks = (
            r"^stages\.(\d+)"
            if coarse
            else [
                (r"^stages\.(\d+)\.downsample", (0,)),
                (r"^stages\.(\d+)\.blocks\.(\d+)", None),
                (r"^norm", (99999,)),
            ]
        )
        return dict(stem=r"^stem", blocks=blocks)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass."""
        self.grad_checkpointing = enable
        for stage in self.stages:
            stage.grad_checkpointing = enable

    def set_input_size(self, img_size: int | tuple[int, int] | None = None) -> None:
        """Records a new nominal input size; the model itself runs on any size (nothing is resized)."""
        if img_size is not None:
            self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        update_model_input_size(self, self.img_size)

    # --- forward --------------------------------------------------------------------------------------

    def _embed(self, x: Tensor) -> Tensor:
        """Images ``[B, C_in, H, W]`` -> stem map ``[B, C_0, ceil(H/4), ceil(W/4)]``."""
        x = check_image(x, self.in_chans, self.reduction, self.check_finite)
        return self.pos_drop(self.stem(x))

    def _run_stack(self, x: Tensor) -> Tensor:
        return self.stages(x)

    def forward(self, x: Tensor) -> Tensor:
        """Images ``[B, C_in, H, W]`` -> logits ``[B, num_classes]``."""
        return self.forward_head(self.forward_features(x))

    def _norm_fits(self, index: int) -> bool:
        return index == len(self.stages) - 1  # the final norm is sized for the last stage only

    def _as_features(self, x: Tensor) -> Tensor:
        return x  # forward_features: the map [B, C, h, w]

    def _as_fmt(self, x: Tensor, output_fmt: str) -> Tensor:
        return x if output_fmt == "NCHW" else x.permute(0, 2, 3, 1)


# --- checkpoints -------------------------------------------------------------------------------------

_STAGE_RULES = (
    (re.compile(r"^patch_embed\.conv\."), lambda m: "stem."),
    (
        re.compile(r"^layers\.(\d+)\.downsample\.conv\."),
        lambda m: f"stages.{int(m.group(1)) + 1}.downsample.",
    ),
    (re.compile(r"^layers\.(\d+)\.blocks\."), lambda m: f"stages.{m.group(1)}.blocks."),
)


def key_from_official(key: str) -> str | None:
    """Maps one official H-ViT³ key to ours (``None`` for the RoPE tables, recomputed per grid).

    ``patch_embed.conv.i`` -> ``stem.i``; ``layers.i.blocks`` -> ``stages.i.blocks``;
    ``layers.i.downsample.conv.j`` (end of stage i) -> ``stages.{i+1}.downsample.j`` (start of stage i+1);
    mixer inner weights as in ``mixer_key_from_official``.
    """
    if key.endswith(".rope.rotations"):
        return None
    key = mixer_key_from_official(key)
    for pattern, repl in _STAGE_RULES:
        m = pattern.match(key)
        if m:
            return repl(m) + key[m.end() :]
    return key


def official_to_ours(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Official ViTTT weights (``h_vittt_*``) in this family's names (``key_from_official``; the RoPE
    tables dropped); weights already in our names pass through."""
    if any(k.startswith("stages.") for k in state_dict):
        return dict(state_dict)
    return {new: v for k, v in state_dict.items() if (new := key_from_official(k)) is not None}


def checkpoint_filter_fn(
    state_dict: dict[str, Tensor], model: HViT3, strict: bool = True
) -> dict[str, Tensor]:
    """Converts official ViTTT weights (``h_vittt_*``) to this model and checks they fit.

    See ``key_from_official``; weights already in our names pass through. Raises ``ValueError`` listing
    missing, unexpected and mis-shaped keys when the checkpoint belongs to another model or size; with
    ``strict=False`` (timm's ``pretrained_strict``) missing and unexpected keys pass.
    """
    out = official_to_ours(select_weights(state_dict))  # a training checkpoint's "model" / "state_dict"
    check_state_dict(
        out, model, ignore_prefixes=("head.",), in_chans_keys=("stem.0.conv.weight",), strict=strict
    )
    return out


def _create(variant: str, pretrained: bool = False, **kwargs: Any) -> HViT3:
    return create_family_model(HViT3, variant, pretrained, checkpoint_filter_fn, (0, 1, 2, 3), **kwargs)


# timm name -> architecture: H-ViT³-T/S/B (28.70M / 54.36M / 94.37M params, 4.92 / 8.76 / 16.72 GFLOPs,
# top-1 84.0 / 84.9 / 85.5 with MESA) and a tiny H-ViT³ for tests (one block per stage, head dim 16)
VARIANTS: dict[str, dict[str, Any]] = {
    "h_vit3_tiny": dict(dims=(64, 128, 320, 512), depths=(1, 3, 9, 4), num_heads=(2, 4, 10, 16)),
    "h_vit3_small": dict(dims=(64, 128, 320, 512), depths=(2, 6, 18, 8), num_heads=(2, 4, 10, 16)),
    "h_vit3_base": dict(dims=(96, 192, 448, 640), depths=(2, 6, 18, 8), num_heads=(3, 6, 14, 20)),
    "test_h_vit3": dict(
        img_size=64, dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 3, 4), mlp_ratio=2.0
    ),
}
default_cfgs = register_family(__name__, _create, VARIANTS, stride=32, first_conv="stem.0.conv")
