"""DiT³: class-conditional diffusion transformers whose attention is the ViT³ TTT mixer.

The official DiTTT (https://github.com/LeapLabTHU/ViTTT, ``dittt/``, built on facebookresearch/DiT): patch
embedding plus a fixed 2-D sin-cos table, ``depth`` DiT blocks (CPE ``x + dwconv3x3(x)``, then the mixer and
the MLP under adaLN-Zero modulation by the timestep + class embedding), a final adaLN layer, unpatchify. The
mixer is vit3's ``TTTMixer`` in the official configuration; ``mixer="attention"`` is the DiT baseline. Any
``H x W`` latent works (padded to the patch size, cropped after). DiT³ is a diffusers model (``ModelMixin`` +
``ConfigMixin``), not registered with timm: build it with :func:`create_dit3`; importing it needs diffusers.

The architecture in full, what goes beyond the official code, and the diffusers side:
``docs/design/models.md``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from timm.layers import PatchEmbed
from torch import Tensor, nn

from vit3._diffusers import ConfigMixin, ModelMixin, register_to_config
from vit3.layers import TTTConfig, mixer_key_from_official
from vit3.layers.inner_math import assert_finite, static_shape, tracing

from ._dit3_blocks import DiT3Block, FinalLayer, LabelEmbedder, TimestepEmbedder, sincos_pos_embed_2d
from ._pretrained import check_state_dict, safe_torch_load, strip_wrapper_prefixes

__all__ = [
    "DIT3_CONFIGS",
    "DIT3_OVERRIDES",
    "DiT3",
    "DiT3Block",
    "FinalLayer",
    "LabelEmbedder",
    "TimestepEmbedder",
    "create_dit3",
    "dit3_model_args",
    "dit3_state_from_official",
    "load_dit3_weights",
    "num_params",
    "sincos_pos_embed_2d",
]

MIXERS = ("ttt", "attention")

# name -> (depth, hidden_size, patch_size, num_heads), the official DiTTT-{S,B,L,XL}/{2,4,8}.
DIT3_CONFIGS: dict[str, tuple[int, int, int, int]] = {
    f"dit3_{size}_{patch}": (depth, hidden, patch, heads)
    for size, (depth, hidden, heads) in {
        "s": (12, 384, 6),
        "b": (12, 768, 12),
        "l": (24, 1024, 16),
        "xl": (28, 1152, 16),
    }.items()
    for patch in (2, 4, 8)
}
DIT3_OVERRIDES = (
    "input_size",
    "patch_size",
    "in_channels",
    "hidden_size",
    "depth",
    "num_heads",
    "mlp_ratio",
    "num_classes",
    "learn_sigma",
    "class_dropout_prob",
    "ttt_cfg",
    "mixer",
)


class DiT3(ModelMixin, ConfigMixin):
    """Class-conditional diffusion transformer with TTT mixers (see the module docstring).

    A diffusers ``ModelMixin``: ``config``, ``save_pretrained`` / ``from_pretrained`` (safetensors).

    Args:
        input_size: nominal latent size (int or ``(H, W)``); any size runs.
        patch_size: patch size p.
        in_channels: latent channels (4 for the Stable Diffusion VAE, 1 or 3 in pixel space).
        hidden_size: width C.
        depth: number of blocks.
        num_heads: mixer heads.
        mlp_ratio: MLP hidden width / C.
        class_dropout_prob: label dropout during training (> 0 adds the null class for guidance).
        num_classes: number of classes K (labels ``0..K-1``; ``K`` is the null class).
        learn_sigma: predict the variance interpolation ``v`` besides the noise (``2 * in_channels`` outputs).
        mixer: ``"ttt"`` (DiT³) or ``"attention"`` (DiT).
        ttt_cfg: TTT mixer configuration (``TTTConfig`` or dict of its fields).
    """

    @register_to_config
    def __init__(
        self,
        input_size: int | tuple[int, int] = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        mixer: str = "ttt",
        ttt_cfg: TTTConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
        if hidden_size % 4:
            raise ValueError(f"hidden_size must be divisible by 4 (2-D sin-cos table), got {hidden_size}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if not 0.0 <= class_dropout_prob < 1.0:
            raise ValueError(f"class_dropout_prob must be in [0, 1), got {class_dropout_prob}")
        self.input_size = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.learn_sigma = learn_sigma
        self.mixer = mixer
        self.grad_checkpointing = False
        ttt = TTTConfig.create(ttt_cfg) if mixer == "ttt" else None
        self.ttt_cfg = ttt
        # the config is JSON (config.json): the mixer's settings as a plain dict, none for the attention
        # baseline
        self.register_to_config(ttt_cfg=dataclasses.asdict(ttt) if ttt is not None else None)

        self.x_embedder = PatchEmbed(
            img_size=self.input_size,
            patch_size=patch_size,
            in_chans=in_channels,
            embed_dim=hidden_size,
            output_fmt="NHWC",
            strict_img_size=False,
            dynamic_img_pad=True,  # any H, W: zero-pad bottom/right to a multiple of p
        )
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        self.blocks = nn.ModuleList(
            [DiT3Block(hidden_size, num_heads, mlp_ratio, mixer, ttt) for _ in range(depth)]
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    @property
    def has_null_class(self) -> bool:
        """Whether the model has the unconditional class (needed for classifier-free guidance)."""
        return self.y_embedder.has_null

    def initialize_weights(self) -> None:
        """The official init: Xavier-uniform linears with zero bias, the patch embedding like a linear,
        N(0, 0.02) label table and timestep MLP, and zeros for every adaLN modulation and the output layer."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for layer in [b.adaLN_modulation[-1] for b in self.blocks] + [
            self.final_layer.adaLN_modulation[-1],
            self.final_layer.linear,
        ]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass."""
        self.grad_checkpointing = enable

    # --- input checks ---------------------------------------------------------------------------------

    def check_inputs(self, x: Tensor, t: Tensor, y: Tensor) -> None:
        """Raises ``ValueError`` naming the problem for a wrong latent, timestep or label batch."""
        if x.ndim != 4:
            raise ValueError(f"DiT3 expects latents [B, C, H, W], got a tensor of shape {tuple(x.shape)}")
        shape = static_shape(x)  # ints under torch.jit.trace, as the other sizes here
        if shape[1] != self.in_channels:
            raise ValueError(
                f"DiT3 built for {self.in_channels} latent channels got {shape[1]} "
                f"(input {tuple(shape)}); "
                f"a VAE latent has its VAE's latent_channels, a pixel-space model the image channels"
            )
        b = shape[0]
        if t.ndim != 1 or static_shape(t)[0] != b:
            raise ValueError(f"timesteps must be [B] = [{b}], got {tuple(static_shape(t))}")
        if y.ndim != 1 or static_shape(y)[0] != b:
            raise ValueError(f"labels must be [B] = [{b}], got {tuple(static_shape(y))}")
        if y.is_floating_point() or y.is_complex():
            raise ValueError(f"labels must be integer class indices, got dtype {y.dtype}")
        if not tracing() and y.numel():  # the values: eager only
            top = self.num_classes if self.has_null_class else self.num_classes - 1
            lo, hi = int(y.min()), int(y.max())
            if lo < 0 or hi > top:
                null = (
                    f" ({self.num_classes} is the null class)"
                    if self.has_null_class
                    else " (no null class: built with class_dropout_prob=0)"
                )
                raise ValueError(f"labels must lie in [0, {top}]{null}, got values in [{lo}, {hi}]")
            assert_finite(x, ValueError, "DiT3 input latents contain non-finite values (NaN or Inf)")

    # --- forward --------------------------------------------------------------------------------------

    def unpatchify(self, x: Tensor, size: tuple[int, int]) -> Tensor:
        """Tokens ``[B, h, w, p * p * c]`` -> images ``[B, c, H, W]`` (cropped to ``size``)."""
        b, h, w, _ = x.shape
        p, c = self.patch_size, self.out_channels
        x = x.reshape(b, h, w, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x).reshape(b, c, h * p, w * p)
        return x[:, :, : size[0], : size[1]]

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        """Noise (and variance) prediction.

        Args:
            x: noisy latents ``[B, in_channels, H, W]``.
            t: diffusion timesteps ``[B]`` (integer or float, in ``[0, num_timesteps)``).
            y: class labels ``[B]`` (``num_classes`` = the null class, when the model has one).

        Returns:
            ``[B, out_channels, H, W]``: ``eps`` then, with ``learn_sigma``, ``v``.
        """
        self.check_inputs(x, t, y)
        size = x.shape[-2:]
        x = self.x_embedder(x)  # [B, h, w, C]
        _, h, w, ch = static_shape(x)  # the table is made for these sizes (fixed in a trace)
        pos = sincos_pos_embed_2d(ch, (h, w)).to(device=x.device, dtype=x.dtype)
        x = x + pos.view(1, h, w, ch)
        c = self.t_embedder(t) + self.y_embedder(y, self.training)  # [B, C]
        for block in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = torch.utils.checkpoint.checkpoint(block, x, c, use_reentrant=False)
            else:
                x = block(x, c)
        return self.unpatchify(self.final_layer(x, c), size)

    def forward_with_cfg(
        self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float, guided_channels: int | None = None
    ) -> Tensor:
        """The official classifier-free-guidance forward: one batched pass over conditional and null labels.

        The first half of ``x`` is run twice (the second half of ``x`` is ignored), with the labels ``y``
        (first half: classes, second half: normally the null class ``num_classes``); the guided noise
        ``uncond + cfg_scale * (cond - uncond)`` is returned for both halves.

        Args:
            x: latents ``[2B, C, H, W]``.
            t: timesteps ``[2B]``.
            y: labels ``[2B]``.
            cfg_scale: guidance scale (1: the conditional prediction).
            guided_channels: leading output channels that are guided. ``None``: 3, as the official code
                ("for exact reproducibility"; with 4-channel latents the 4th noise channel and the variance
                stay conditional), capped at ``in_channels`` so that a 1-channel model never guides its
                variance. Pass ``in_channels`` for the standard all-noise-channel guidance.

        Returns:
            ``[2B, out_channels, H, W]``.

        Raises:
            ValueError: odd batch, or a guidance scale other than 1 on a model without the null class.
        """
        if x.shape[0] % 2:
            raise ValueError(
                f"forward_with_cfg needs an even batch (conditional + null halves), got {x.shape[0]}"
            )
        if cfg_scale != 1.0 and not self.has_null_class:
            raise ValueError(
                f"cfg_scale={cfg_scale} needs the null class, but this model was built with "
                f"class_dropout_prob=0 (no unconditional embedding): sample with cfg_scale=1"
            )
        n = x.shape[0] // 2
        half = x[:n]
        out = self.forward(torch.cat([half, half], dim=0), t, y)
        k = min(3, self.in_channels) if guided_channels is None else int(guided_channels)
        if not 0 < k <= self.out_channels:
            raise ValueError(f"guided_channels must be in [1, {self.out_channels}], got {k}")
        eps, rest = out[:, :k], out[:, k:]
        cond, uncond = eps[:n], eps[n:]
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([torch.cat([guided, guided], dim=0), rest], dim=1)

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, patch_size={self.patch_size}, in_channels={self.in_channels}, "
            f"num_classes={self.num_classes}, learn_sigma={self.learn_sigma}, mixer={self.mixer}"
        )


# --- checkpoints -------------------------------------------------------------------------------------

_WEIGHT_ENTRIES = ("ema", "model", "state_dict")  # the official sampler takes "ema" first (download.py)


def _select_state_dict(obj: Any, source: str) -> dict[str, Tensor]:
    """The weights of a loaded checkpoint: a bare state dict, or its ``ema`` / ``model`` / ``state_dict``."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{source} holds a {type(obj).__name__}, not a DiT³ checkpoint or state dict")
    if any(isinstance(v, Tensor) for v in obj.values()) and not any(
        isinstance(obj.get(k), Mapping) for k in _WEIGHT_ENTRIES
    ):
        state = obj
    else:
        entry = next((obj[k] for k in _WEIGHT_ENTRIES if isinstance(obj.get(k), Mapping)), None)
        if entry is None:
            raise ValueError(
                f"{source} has no weights: expected a state dict or an 'ema' / 'model' entry, "
                f"found keys {sorted(map(str, obj))[:20]}"
            )
        state = entry
    return strip_wrapper_prefixes(state)


def dit3_state_from_official(
    state_dict: Mapping[str, Tensor], model: DiT3, source: str = "checkpoint"
) -> dict[str, Tensor]:
    """Official DiTTT weights (or ours) -> this model's names, checked against ``model``.

    Only the TTT inner weights move (``attn.w1/w2/w3`` -> ``attn.inner.0.w1/inner.0.w2/inner.1.weight``, as
    :func:`vit3.layers.mixer_key_from_official`). The official fixed ``pos_embed`` table is not a weight
    here (computed per grid): it is compared with ours and dropped.

    Raises:
        ValueError: a key is missing, unexpected or mis-shaped (another architecture or size; all are
            listed), or the file's ``pos_embed`` is not the sin-cos table of this model.
    """
    ours = any(".attn.inner." in k for k in state_dict)
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key == "pos_embed":
            _check_pos_embed(value, model, source)
            continue
        out[key if ours or model.mixer != "ttt" else mixer_key_from_official(key)] = value
    check_state_dict(out, model, what=source)
    return out


def _check_pos_embed(value: Tensor, model: DiT3, source: str) -> None:
    h, w = (-(-s // model.patch_size) for s in model.input_size)
    want = sincos_pos_embed_2d(model.hidden_size, (h, w))
    if tuple(value.shape) != (1, h * w, model.hidden_size):
        raise ValueError(
            f"{source}: pos_embed {tuple(value.shape)} does not fit input_size {model.input_size} with patch "
            f"{model.patch_size} and hidden_size {model.hidden_size} "
            f"(expected {(1, h * w, model.hidden_size)}): "
            f"pass the input_size the checkpoint was trained at"
        )
    err = (value[0].double() - want.double()).abs().max().item()
    if err > 1e-6:  # a float32 table computed another way differs by a few ulps at most
        raise ValueError(f"{source}: pos_embed is not the fixed 2-D sin-cos table (max deviation {err:.3g})")


def load_dit3_weights(model: DiT3, path: str | os.PathLike) -> DiT3:
    """Loads a checkpoint file into ``model`` (strict; see :func:`create_dit3` for the accepted formats)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DiT³ checkpoint not found: {path}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        obj: Any = load_file(path)
    else:
        try:
            obj = safe_torch_load(path)  # official train.py files pickle an argparse Namespace: read as inert
        except Exception as exc:
            raise ValueError(f"cannot read DiT³ checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    state = dit3_state_from_official(_select_state_dict(obj, path), model, path)
    model.load_state_dict(state)
    return model


def dit3_model_args(name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The ``DiT3`` arguments of model ``name`` (``DIT3_CONFIGS``) with ``overrides``; a ``ValueError`` names
    an unknown name or override."""
    key = name.strip().lower().replace("dittt-", "dit3_").replace("dit3-", "dit3_").replace("/", "_")
    if key not in DIT3_CONFIGS:
        raise ValueError(f"unknown DiT³ model {name!r}; choose from {sorted(DIT3_CONFIGS)}")
    unknown = sorted(set(overrides) - set(DIT3_OVERRIDES))
    if unknown:
        raise ValueError(f"unknown create_dit3 overrides {unknown}; known: {list(DIT3_OVERRIDES)}")
    depth, hidden, patch, heads = DIT3_CONFIGS[key]
    return {"depth": depth, "hidden_size": hidden, "patch_size": patch, "num_heads": heads, **overrides}


def create_dit3(name: str, checkpoint_path: str | os.PathLike | None = None, **overrides: Any) -> DiT3:
    """Builds ``dit3_{s,b,l,xl}_{2,4,8}`` (the official DiTTT-S/2 ... XL/8; ``"DiTTT-B/2"`` also works).

    Args:
        name: model name.
        checkpoint_path: optional weights: a bare official state dict (what the official sampler reads), an
            official training checkpoint (``ema`` taken before ``model``, as the official sampler), a vit3
            generation checkpoint (``ema`` if it has one, else ``model``) or a ``.safetensors`` file.
        **overrides: ``input_size`` (default 32), ``patch_size``, ``in_channels`` (4), ``hidden_size``,
            ``depth``, ``num_heads``, ``mlp_ratio`` (4), ``num_classes`` (1000), ``learn_sigma`` (True),
            ``class_dropout_prob`` (0.1), ``ttt_cfg`` (official mixer), ``mixer`` (``"ttt"`` or
            ``"attention"``).

    Raises:
        ValueError: unknown name or override, or a checkpoint of another architecture (its missing,
            unexpected and mis-shaped keys are listed).
        FileNotFoundError: ``checkpoint_path`` does not exist.
    """
    model = DiT3(**dit3_model_args(name, overrides))
    if checkpoint_path:
        load_dit3_weights(model, checkpoint_path)
    return model


def num_params(model: nn.Module) -> int:
    """Trainable parameters (the official count: the fixed position table is not one)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
