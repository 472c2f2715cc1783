"""Plain ViT³: a DeiT-style isotropic backbone whose attention is the TTT mixer.

Paper: "ViT³: Unlocking Test-Time Training in Vision" (arXiv 2512.01643, CVPR 2026); official code
https://github.com/LeapLabTHU/ViTTT (MIT). Architecture (official): patch embedding (conv, stride p) ->
``depth`` x [CPE (x + dwconv3x3 x), x + TTT(LN x), x + MLP(LN x)] -> LN -> mean over tokens -> Linear; no
class token, no absolute position embedding. Unlike the official code it takes any ``H x W`` image
(zero-padded to the patch size). A spatial model in timm's sense, as timm's Swin: ``forward_features``
returns the normed map ``[B, h, w, C]`` (``output_fmt='NHWC'``; no prefix tokens), ``forward_intermediates``
and ``features_only=True`` take timm's ``VisionTransformer`` options.

The timm interface in full: ``docs/design/models.md``.
"""

# No ``from __future__ import annotations`` here: torch.fx copies ``forward``'s annotations into the graph
# code TorchScript compiles (timm's FX + TorchScript path), where a string annotation names no type.
from functools import partial
from typing import Any

import torch
from timm.layers import PatchEmbed, get_act_layer, resample_patch_embed
from timm.models._input import update_model_input_size
from torch import Tensor, nn

from vit3.layers import TTTConfig, mixer_key_from_official
from vit3.layers.embed import check_image, check_image_size

from ._family import FamilyBackbone, create_family_model, register_family, stochastic_depth_rates, ttt_blocks
from ._pretrained import check_state_dict, select_weights

__all__ = ["TIMM_VIT_FIXED", "ViT3", "checkpoint_filter_fn", "official_to_ours"]

# timm VisionTransformer kwargs ViT³ has no parameter for: the values that describe ViT³ (accepted, no effect)
# and why another value makes no sense here. dynamic_img_size / dynamic_img_pad / pos_drop_rate / final_norm
# / device / dtype are real parameters of ViT3.
TIMM_VIT_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "qk_norm": ((False,), "the TTT mixer has no attention logits to normalise"),
    "scale_attn_norm": ((False,), "the TTT mixer has no attention output norm"),
    "scale_mlp_norm": ((False,), "the MLP has no inner norm"),
    "proj_bias": ((True,), "the mixer and MLP projections always have a bias"),
    "init_values": ((None, 0, 0.0), "ViT³ blocks have no LayerScale"),
    "class_token": ((False,), "ViT³ has no class token (the head pools the tokens)"),
    "pos_embed": (("", "none"), "ViT³ encodes positions with a convolution (CPE), not an embedding"),
    "no_embed_class": ((False, True), ""),
    "reg_tokens": ((0,), "ViT³ has no register tokens"),
    "pre_norm": ((False,), "ViT³ has no norm before the blocks"),
    "fc_norm": ((None, False), "ViT³ normalises before pooling (the final norm), not after"),
    "pool_include_prefix": ((False, True), ""),
    "patch_drop_rate": ((0, 0.0), "the TTT mixer needs the whole token grid"),
    "attn_drop_rate": ((0, 0.0), "the TTT mixer has no attention probabilities to drop"),
    "weight_init": (("",), "ViT³ uses the official initialisation"),
    "fix_init": ((False,), "ViT³ uses the official initialisation"),
    "embed_layer": ((None, PatchEmbed), "ViT³'s patch embedding is fixed"),
    "embed_norm_layer": ((None,), "ViT³'s patch embedding has no norm"),
    "norm_layer": ((None,), "ViT³'s norms are LayerNorm(eps=1e-6), as official"),
    "block_fn": ((None,), "ViT³'s blocks are TTT blocks"),
    "mlp_layer": ((None,), "ViT³'s MLP is fixed"),
    "attn_layer": (
        (None,),
        "the token mixer of ViT³ is TTT (vit3.swap_attention_for_ttt puts it into timm's ViT)",
    ),
}


class ViT3(FamilyBackbone):
    """Plain (isotropic) ViT³.

    Args:
        img_size: nominal input size (the model runs on any size; used for ``pretrained_cfg``/feature sizes).
        patch_size: patch size p (the stride of every feature map).
        in_chans: image channels.
        num_classes: classes of the linear head (0: no head).
        global_pool: ``'avg'`` (official), ``'max'``, ``'avgmax'`` or ``''`` (no pooling).
        embed_dim: width C.
        depth: number of blocks.
        num_heads: TTT heads per block.
        mlp_ratio: MLP hidden width / C.
        qkv_bias: bias of the mixer's qkv projection (``None``: ``ttt_cfg``'s, default ``True``); giving it
            and ``ttt_cfg``'s ``qkv_bias`` with different values is an error.
        drop_rate: dropout before the classifier.
        proj_drop_rate: dropout inside the MLPs (the official ``drop_rate``).
        drop_path_rate: stochastic depth, linearly increasing over the blocks (official training: T 0.0,
            S 0.1, B 0.4).
        ttt_cfg: mixer configuration (``TTTConfig`` or dict of its fields), used by every block.
        act_layer: MLP activation: a module class or a timm name (``"silu"``, as timm's ViT takes).
        dynamic_img_size: take any image size (default); ``False``: only ``img_size`` (timm's strict size).
        dynamic_img_pad: zero-pad the image to a multiple of the patch size (default); ``False``: the sides
            must be multiples of it.
        pos_drop_rate: dropout after the patch embedding.
        final_norm: the LayerNorm after the blocks (``False``: none).
        device, dtype: where and in which dtype to create the parameters.
        **timm_kwargs: the other kwargs of timm's ``VisionTransformer``, accepted at the values that
            describe ViT³ (``class_token=False``, ``reg_tokens=0``, ...) and refused by name otherwise
            (:data:`TIMM_VIT_FIXED`).
    """

    stack_name = "blocks"
    intermediate_fmts = ("NCHW", "NLC", "NHWC")

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool | None = None,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        ttt_cfg: TTTConfig | dict[str, Any] | None = None,
        act_layer: str | type[nn.Module] = nn.GELU,
        dynamic_img_size: bool = True,
        dynamic_img_pad: bool = True,
        pos_drop_rate: float = 0.0,
        final_norm: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **timm_kwargs: Any,
    ) -> None:
        super().__init__(
            timm_kwargs, TIMM_VIT_FIXED, num_classes, global_pool, in_chans, embed_dim, ttt_cfg, qkv_bias
        )
        self.embed_dim = embed_dim
        self.output_fmt = "NHWC"  # forward_features: the map [B, h, w, C], as timm's Swin
        self.spatial_dims = (1, 2)  # the grid dims forward_head pools
        self.feature_dim = -1  # channel dim of forward_features outputs
        self.num_prefix_tokens = 0  # no class / register tokens (timm's VisionTransformer attribute)
        cfg = self.ttt_cfg

        self.patch_embed = PatchEmbed(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            output_fmt="NHWC",
            strict_img_size=not dynamic_img_size,
            dynamic_img_pad=dynamic_img_pad,  # any H, W: pad bottom/right to a multiple of p
        )
        self.pos_drop = nn.Dropout(pos_drop_rate)
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        dpr = stochastic_depth_rates(drop_path_rate, depth)
        mlp = dict(
            mlp_ratio=mlp_ratio, proj_drop=proj_drop_rate, act_layer=get_act_layer(act_layer) or nn.GELU
        )
        self.blocks = ttt_blocks(embed_dim, num_heads, dpr, ttt_cfg=cfg, norm_layer=norm_layer, **mlp)
        reduction = max(self.patch_embed.patch_size)
        self.feature_info = [
            dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=reduction) for i in range(depth)
        ]
        self.norm = norm_layer(embed_dim) if final_norm else nn.Identity()
        self._finish(drop_rate, official_to_ours, device, dtype)

    # --- timm model API -------------------------------------------------------------------------------

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for layer-wise lr decay: stem, each block, final norm last."""
        return dict(stem=r"^patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass."""
        self.grad_checkpointing = enable

    def set_input_size(
        self, img_size: int | tuple[int, int] | None = None, patch_size: int | None = None
    ) -> None:
        """Sets the nominal input size and optionally a new patch size (the patch weights are resampled).

        The model runs on any size regardless; this updates ``patch_embed`` and the recorded input size.
        """
        old_kernel = self.patch_embed.proj.weight.shape[-2:]
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        if patch_size is not None and tuple(self.patch_embed.patch_size) != tuple(old_kernel):
            with torch.no_grad():
                weight = resample_patch_embed(self.patch_embed.proj.weight, list(self.patch_embed.patch_size))
            self.patch_embed.proj.weight = nn.Parameter(weight)
            for info in self.feature_info:
                info["reduction"] = max(self.patch_embed.patch_size)
        update_model_input_size(self, self.patch_embed.img_size, patch_size=patch_size)

    # --- forward --------------------------------------------------------------------------------------

    def _embed(self, x: Tensor) -> Tensor:
        """Images ``[B, C_in, H, W]`` -> tokens ``[B, ceil(H/p), ceil(W/p), C]``."""
        pe = self.patch_embed
        x = check_image(x, self.in_chans, max(pe.patch_size[0], pe.patch_size[1]), self.check_finite)
        if pe.strict_img_size or not pe.dynamic_img_pad:
            strict, pad = pe.strict_img_size, pe.dynamic_img_pad
            check_image_size(x, pe.img_size if strict else None, None if pad else pe.patch_size)
        return self.pos_drop(pe(x))

    def _run_stack(self, x: Tensor) -> Tensor:
        return self.blocks(x)

    def forward_features(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Images ``[B, C_in, H, W]`` -> the normed, unpooled map ``[B, ceil(H/p), ceil(W/p), C]``
        (``output_fmt='NHWC'``; ``.flatten(1, 2)``: the tokens ``[B, N, C]`` in raster order).

        ``attn_mask`` / ``is_causal`` (timm's signature) are refused: see :func:`_check_attention_args`.
        """
        _check_attention_args(attn_mask, is_causal)
        return self._stack_features(x)

    def forward(self, x: Tensor) -> Tensor:
        """Images ``[B, C_in, H, W]`` -> logits ``[B, num_classes]``."""
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]] | dict[str, Any]:
        """timm's ``VisionTransformer.forward_intermediates``: block outputs as ``'NCHW'`` ``[B, C, h, w]``,
        ``'NLC'`` ``[B, N, C]`` (timm's two) or ``'NHWC'`` ``[B, h, w, C]``, every one normed with ``norm``,
        and the final map ``[B, h, w, C]`` of ``forward_features`` (see
        ``LayerStackMixin.forward_intermediates``).

        ``return_prefix_tokens`` is accepted: ViT³ has no prefix tokens, so the intermediates are returned as
        without it (as timm's ``VisionTransformer`` does for a model without prefix tokens); ``attn_mask`` /
        ``is_causal`` are refused (:func:`_check_attention_args`).
        """
        _check_attention_args(attn_mask, is_causal)
        return super().forward_intermediates(
            x, indices, norm, stop_early, output_fmt, intermediates_only, output_dict
        )

    def _norm_fits(self, index: int) -> bool:
        return True  # every block is embed_dim wide

    def _as_features(self, x: Tensor) -> Tensor:
        return x  # the blocks' map [B, h, w, C]

    def _as_fmt(self, x: Tensor, output_fmt: str) -> Tensor:
        if output_fmt == "NCHW":
            return x.permute(0, 3, 1, 2).contiguous()
        return x.flatten(1, 2) if output_fmt == "NLC" else x


def _check_attention_args(attn_mask: Tensor | None, is_causal: bool) -> None:
    """timm's ``VisionTransformer`` takes an attention mask and causal masking; the TTT mixer has neither.

    Raises:
        ValueError: ``attn_mask`` given or ``is_causal=True``, naming why.
    """
    if attn_mask is not None:
        raise ValueError("attn_mask: ViT³ has no attention to mask (every token trains the TTT inner model)")
    if is_causal:
        raise ValueError("is_causal=True: the TTT mixer is non-causal (its inner model trains on all tokens)")


# --- checkpoints -------------------------------------------------------------------------------------


def official_to_ours(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Official ViTTT weights (``vittt_*``) in this family's names: the mixer's inner weights renamed
    (``mixer_key_from_official``); weights already in our names pass through."""
    if any(".attn.inner." in k for k in state_dict):
        return dict(state_dict)
    return {mixer_key_from_official(k): v for k, v in state_dict.items()}


def checkpoint_filter_fn(
    state_dict: dict[str, Tensor], model: ViT3, strict: bool = True
) -> dict[str, Tensor]:
    """Converts official ViTTT weights (``vittt_*``) to this model and checks they fit.

    Official names equal ours except the mixer's inner weights (``attn.w1/w2/w3`` ->
    ``attn.inner.0.w1/inner.0.w2/inner.1.weight``); weights already in our names pass through. A different
    patch size is resampled (timm ``resample_patch_embed``). Raises ``ValueError`` listing missing, unexpected
    and mis-shaped keys when the checkpoint belongs to another model or size; with ``strict=False`` (timm's
    ``pretrained_strict``) missing and unexpected keys pass.
    """
    out = {}
    # the "model" / "state_dict" entry of a training checkpoint, in our names
    for key, value in official_to_ours(select_weights(state_dict)).items():
        if key == "patch_embed.proj.weight" and value.ndim == 4:
            target = model.patch_embed.proj.weight.shape[-2:]
            if value.shape[-2:] != target:
                value = resample_patch_embed(value, list(target))
        out[key] = value
    check_state_dict(
        out, model, ignore_prefixes=("head.",), in_chans_keys=("patch_embed.proj.weight",), strict=strict
    )
    return out


def _create(variant: str, pretrained: bool = False, **kwargs: Any) -> ViT3:
    depth = kwargs.get("depth", 12)  # features_only: the last 3 blocks, like timm's ViT
    return create_family_model(ViT3, variant, pretrained, checkpoint_filter_fn, min(3, depth), **kwargs)


# timm name -> architecture: ViT³-T/S/B (6.15M / 23.80M / 90.06M params, 1.22 / 4.82 / 17.96 GFLOPs at 224²,
# top-1 76.5 / 81.6 / 82.6) and a tiny plain ViT³ for tests (64x64 nominal input)
VARIANTS: dict[str, dict[str, Any]] = {
    "vit3_tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=6),
    "vit3_small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit3_base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    "test_vit3_ttt": dict(img_size=64, patch_size=16, embed_dim=32, depth=3, num_heads=2, mlp_ratio=2.0),
}
default_cfgs = register_family(__name__, _create, VARIANTS, stride=16, first_conv="patch_embed.proj")
