"""TTT in timm's own models: replace the attention of a timm ViT/DeiT or Swin Transformer by TTT mixers.

``swap_attention_for_ttt(model)`` works in place on a timm ``VisionTransformer`` (DeiT included) or
``SwinTransformer``, also inside a ``features_only`` wrapper: each attention becomes a ``TTTMixer`` of the
same width and heads, its ``qkv`` and ``proj`` weights copied into the mixer's full-width branch; the rest
stays timm's. ViT prefix tokens stay off the token grid; Swin runs one mixer per stage map
(``scope="stage"``) or per window (``scope="window"``). ``timm.create_model("ttt_swap", base=...,
ttt={...}, scope=...)`` builds ``base`` and swaps it (what a converted checkpoint records); from its
defaults ``base`` is Swin-T (:data:`SWAP_DEFAULT_BASE`).

The token layouts, Swin's windows, shifts and bias, and the registered name: ``docs/design/models.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils.checkpoint
from timm.layers import Attention
from timm.models import register_model
from timm.models.swin_transformer import SwinTransformerBlock, WindowAttention
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from vit3.layers import TTTConfig, TTTMixer
from vit3.layers.inner_math import static_shape, static_sizes

__all__ = [
    "SWAP_DEFAULT_BASE",
    "SWAP_MODEL",
    "SWIN_SCOPES",
    "SwinStageTTTBlock",
    "TokenTTT",
    "WindowTTT",
    "copy_attention_weights",
    "swap_attention_for_ttt",
    "ttt_swap",
]

SWAP_MODEL = "ttt_swap"  # the timm name of a swapped model (see the module docstring)
SWAP_DEFAULT_BASE = "swin_tiny_patch4_window7_224"  # what timm.create_model(SWAP_MODEL) swaps

SWIN_SCOPES = ("stage", "window")


@torch.no_grad()
def copy_attention_weights(mixer: TTTMixer, qkv: nn.Linear, proj: nn.Linear) -> None:
    """Copies an attention's ``qkv`` ``[3C, C]`` and ``proj`` ``[C, C]`` into the mixer's first full branch.

    The mixer's ``qkv`` rows are laid out branch by branch, ``[q, k, v]`` each, and its ``proj`` columns
    likewise; the rows and columns of the other branches keep their initialisation. A missing attention
    ``qkv`` bias copies as zeros.

    Raises:
        ValueError: no branch of the mixer has the attention's shapes (e.g. a Swin ``head_dim`` other than
            its width over its heads, or a mixer config without a branch of the attention's width).
    """
    width = qkv.out_features // 3
    if (
        qkv.in_features != mixer.dim
        or proj.out_features != mixer.dim
        or proj.in_features != width
        or width not in mixer.widths
    ):
        raise ValueError(
            f"cannot start the TTT mixer (width {mixer.dim}, branch widths {list(mixer.widths)}) from an "
            f"attention of qkv {tuple(qkv.weight.shape)} and proj {tuple(proj.weight.shape)}: no branch "
            f"has its {width} channels; swap with init_from_attention=False to start the mixers afresh"
        )
    offset = sum(mixer.widths[: mixer.widths.index(width)])  # channels of the branches before it
    rows = slice(3 * offset, 3 * (offset + width))
    mixer.qkv.weight[rows] = qkv.weight
    if mixer.qkv.bias is not None:
        mixer.qkv.bias[rows] = qkv.bias if qkv.bias is not None else 0.0
    mixer.proj.weight[:, offset : offset + width] = proj.weight
    if proj.bias is not None:
        mixer.proj.bias.copy_(proj.bias)


def _mixer_like(
    attn: nn.Module, dim: int, ttt_cfg: TTTConfig | dict[str, Any] | None, init: bool
) -> TTTMixer:
    """A mixer with the attention's width, heads and qkv bias, initialised from its weights where they fit."""
    if isinstance(ttt_cfg, TTTConfig):
        cfg = ttt_cfg
    else:
        cfg = TTTConfig.create({"qkv_bias": attn.qkv.bias is not None, **(ttt_cfg or {})})
    mixer = TTTMixer(dim, attn.num_heads, cfg)
    if init:
        copy_attention_weights(mixer, attn.qkv, attn.proj)
    return mixer.to(device=attn.qkv.weight.device, dtype=attn.qkv.weight.dtype)


class _GridState:
    """The current patch grid of one ViT, set by a pre-hook on its patch embedding."""

    def __init__(self, patch_embed: nn.Module) -> None:
        self.grid: tuple[int, int] | None = None
        self.handle = patch_embed.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: tuple[Tensor, ...]) -> None:
        h, w = args[0].shape[-2:]
        self.grid = tuple(module.dynamic_feat_size((h, w)))


class TokenTTT(nn.Module):
    """A ``TTTMixer`` in place of a timm ViT ``Attention``: prefix tokens + an ``h x w`` grid of patch tokens.

    Args:
        mixer: the mixer (width C).
        num_prefix_tokens: class/distillation/register tokens in front of the patch tokens.
        grid_state: where the model's current patch grid is recorded.
    """

    def __init__(self, mixer: TTTMixer, num_prefix_tokens: int, grid_state: _GridState) -> None:
        super().__init__()
        self.mixer = mixer
        self.num_prefix_tokens = num_prefix_tokens
        self._grid_state = grid_state
        self.checkpoint = False  # the model's gradient checkpointing (_CheckpointMixers)

    def forward(
        self, x: Tensor, attn_mask: Tensor | None = None, grid: tuple[int, int] | None = None, **_: Any
    ) -> Tensor:
        """``[B, P + h*w, C] -> [B, P + h*w, C]``; prefix outputs are the mean of the patch outputs.

        ``grid`` is the patch grid ``(h, w)``; ``None`` (inside the model) takes the one its patch embedding
        recorded (a caller that feeds a layer alone, e.g. ``vit3.convert``, passes it).
        """
        if attn_mask is not None:
            raise ValueError("a TTT mixer has no attention mask; attn_mask must be None")
        p = self.num_prefix_tokens
        n = static_shape(x)[1] - p  # checked as ints (under torch.jit.trace sizes are tensors)
        grid = self._grid_state.grid if grid is None else tuple(grid)
        if grid is None or math.prod(static_sizes(grid)) != n:
            raise ValueError(
                f"cannot lay {n} patch tokens on the recorded grid {grid}; call the model on images"
            )
        if self.checkpoint and torch.is_grad_enabled():  # recomputed on this call's grid, an argument
            y = torch.utils.checkpoint.checkpoint(self.mixer, x[:, p:], grid=grid, use_reentrant=False)
        else:
            y = self.mixer(x[:, p:], grid=grid)  # [B, h*w, C]
        if p == 0:
            return y
        return torch.cat([y.mean(1, keepdim=True).expand(-1, p, -1), y], dim=1)


class WindowTTT(nn.Module):
    """A ``TTTMixer`` in place of a Swin ``WindowAttention``: one inner model per window (its grid)."""

    def __init__(self, mixer: TTTMixer, window_size: tuple[int, int]) -> None:
        super().__init__()
        self.mixer = mixer
        self.window_size = tuple(window_size)

    def set_window_size(self, window_size: tuple[int, int]) -> None:
        """Called by Swin's ``set_input_size``."""
        self.window_size = tuple(window_size)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Windows ``[B*nW, wh*ww, C] -> [B*nW, wh*ww, C]`` (the shift mask is ignored, see module doc)."""
        return self.mixer(x, grid=self.window_size)


class SwinStageTTTBlock(nn.Module):
    """A Swin block whose token mixer is one ``TTTMixer`` over the whole stage map (no windows, no shift).

    Reuses the Swin block's ``norm1``, ``drop_path1``, ``norm2``, ``mlp``, ``drop_path2`` (same names, so the
    rest of a Swin checkpoint still loads); ``attn`` is the mixer.
    """

    def __init__(self, block: SwinTransformerBlock, mixer: TTTMixer) -> None:
        super().__init__()
        self.dim = block.dim
        self.norm1 = block.norm1
        self.attn = mixer
        self.drop_path1 = block.drop_path1
        self.norm2 = block.norm2
        self.mlp = block.mlp
        self.drop_path2 = block.drop_path2

    def set_input_size(self, *args: Any, **kwargs: Any) -> None:
        """Called by Swin's ``set_input_size``: a stage-wide mixer works on any map size, nothing to do."""

    def mix(self, x: Tensor) -> Tensor:
        """The token mixer alone, on a normalised stage map: ``[B, H, W, C] -> [B, H, W, C]``."""
        b, h, w, c = x.shape
        return self.attn(x.reshape(b, h * w, c), grid=(h, w)).reshape(b, h, w, c)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, H, W, C] -> [B, H, W, C]``."""
        x = x + self.drop_path1(self.mix(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class _CheckpointMixers:
    """A swapped ViT's ``set_grad_checkpointing``: each mixer checkpoints itself, its patch grid an argument
    of the recomputation. timm's checkpoint of whole blocks would recompute the mixers on the grid of the
    model's last forward, wrong where another image size came between a forward and its backward. An object
    holding its model, so that copies and pickles of the model take it along."""

    def __init__(self, vit: VisionTransformer) -> None:
        self.vit = vit

    def __call__(self, enable: bool = True) -> None:
        self.vit.grad_checkpointing = False
        for module in self.vit.modules():
            if isinstance(module, TokenTTT):
                module.checkpoint = enable


def _swap_vit(vit: VisionTransformer, ttt_cfg: Any, init: bool) -> int:
    if not isinstance(getattr(vit, "patch_drop", nn.Identity()), nn.Identity):
        raise ValueError(
            "a TTT mixer trains on the whole patch grid: this ViT drops patch tokens in training "
            "(patch_drop_rate); build it with patch_drop_rate=0"
        )
    state = _GridState(vit.patch_embed)
    count = 0
    for block in vit.blocks:
        if isinstance(getattr(block, "attn", None), Attention):
            mixer = _mixer_like(block.attn, block.attn.qkv.in_features, ttt_cfg, init)
            block.attn = TokenTTT(mixer, vit.num_prefix_tokens, state)
            count += 1
    if count:
        checkpointing = bool(getattr(vit, "grad_checkpointing", False))
        vit.set_grad_checkpointing = _CheckpointMixers(vit)
        vit.set_grad_checkpointing(checkpointing)
    return count


def _swap_swin_blocks(model: nn.Module, ttt_cfg: Any, init: bool, scope: str) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, SwinTransformerBlock) or not isinstance(child.attn, WindowAttention):
                continue
            mixer = _mixer_like(child.attn, child.dim, ttt_cfg, init)
            if scope == "stage":
                setattr(parent, name, SwinStageTTTBlock(child, mixer))
            else:
                child.attn = WindowTTT(mixer, child.window_size)
            count += 1
    return count


def swap_attention_for_ttt(
    model: nn.Module,
    ttt_cfg: TTTConfig | dict[str, Any] | None = None,
    init_from_attention: bool = True,
    scope: str = "stage",
) -> nn.Module:
    """Replaces every attention of a timm ViT/DeiT or Swin Transformer by a ``TTTMixer`` (in place).

    Args:
        model: a timm ``VisionTransformer`` (DeiT included) or ``SwinTransformer``, or a ``features_only``
            wrapper of one.
        ttt_cfg: mixer configuration for every mixer (default: the official ViT³ mixer; a dict takes the
            attention's qkv bias unless it says otherwise, a ``TTTConfig`` is used as given).
        init_from_attention: copy the attention's ``qkv``/``proj`` weights into the mixer's main branch.
        scope: Swin only: ``"stage"`` (one mixer over the whole stage map) or ``"window"`` (per window).

    Returns:
        The same model, with TTT mixers.

    Raises:
        TypeError: ``model`` is no ``nn.Module`` (e.g. a model's name).
        ValueError: unknown ``scope``, no timm attention found to replace, a ViT that drops patch tokens
            (``patch_drop_rate``), or (``init_from_attention``) a mixer with no branch of its attention's
            shapes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"swap_attention_for_ttt takes a model (an nn.Module), got {model!r}: build it first, e.g. "
            f"swap_attention_for_ttt(timm.create_model({str(model)!r}))"
            if isinstance(model, str)
            else f"swap_attention_for_ttt takes a model (an nn.Module), got a {type(model).__name__}"
        )
    if scope not in SWIN_SCOPES:
        raise ValueError(f"scope must be one of {SWIN_SCOPES}, got {scope!r}")
    count = 0
    for module in list(model.modules()):
        if isinstance(module, VisionTransformer):
            count += _swap_vit(module, ttt_cfg, init_from_attention)
    count += _swap_swin_blocks(model, ttt_cfg, init_from_attention, scope)
    if count == 0:
        raise ValueError(
            f"found no timm ViT Attention or Swin WindowAttention to replace in {type(model).__name__}"
        )
    return model


@register_model
def ttt_swap(
    pretrained: bool = False,
    base: str = SWAP_DEFAULT_BASE,
    ttt: dict[str, Any] | None = None,
    scope: str = "stage",
    pretrained_cfg: Any = None,
    **kwargs: Any,
) -> nn.Module:
    """timm's attention model ``base`` with its attention swapped for TTT (:func:`swap_attention_for_ttt`).

    Args:
        pretrained: load ``base``'s pretrained weights first (``pretrained_cfg_overlay`` names a file); the
            mixers then start from its attention's ``qkv``/``proj``.
        base: timm name of a ViT/DeiT or Swin model (default: Swin-T, :data:`SWAP_DEFAULT_BASE`).
        ttt: mixer config (``TTTConfig`` keys; default: the official ViT³ mixer).
        scope: Swin only: ``"stage"`` or ``"window"``.
        pretrained_cfg: timm's config of the ``ttt_swap`` entry itself (there is none; ``base`` has its own).
        **kwargs: ``timm.create_model`` kwargs of ``base`` (``img_size``, ``num_classes``,
            ``features_only``...).

    Raises:
        ValueError: ``base`` is empty, or not a model whose attention can be swapped.
    """
    del pretrained_cfg
    if not base:
        raise ValueError(
            f"{SWAP_MODEL}: base={base!r} must name a timm ViT/DeiT or Swin model, e.g. "
            f"base='deit_small_patch16_224' (left out: {SWAP_DEFAULT_BASE})"
        )
    import timm

    model = timm.create_model(base, pretrained=pretrained, **kwargs)
    return swap_attention_for_ttt(model, ttt, init_from_attention=pretrained, scope=scope)
