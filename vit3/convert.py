"""From a pretrained attention model to a TTT model: conversion by distillation.

The student is the teacher with every attention swapped for a TTT mixer (:func:`vit3.swap_attention_for_ttt`,
the timm model ``ttt_swap``), started from the teacher's weights (the mixers from its attention's
``qkv``/``proj``). Training it back to the teacher's quality takes two stages (the ``convert`` task,
:mod:`vit3.engine.convert`, runs both from a config):

The two stages and how layers are paired: ``docs/design/conversion.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.swin_transformer import SwinTransformerBlock, WindowAttention
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from .layers import TTTMixer
from .models.swap import SwinStageTTTBlock, TokenTTT, WindowTTT, copy_attention_weights

__all__ = [
    "DISTILL_KINDS",
    "LayerCapture",
    "LayerPair",
    "TransferNet",
    "distillation_loss",
    "init_student",
    "layer_pairs",
    "transfer_losses",
]

DISTILL_KINDS = ("soft", "hard", "none")


@dataclass(eq=False)
class LayerPair:
    """One attention of the teacher and the module in its place in the student.

    Attributes:
        name: the module's name (the same in both models), e.g. ``blocks.3.attn``.
        scope: ``"token"`` (ViT/DeiT), ``"window"`` (Swin, window scope) or ``"stage"`` (Swin, stage scope).
        teacher: the teacher's ``Attention`` / ``WindowAttention``, or its ``SwinTransformerBlock`` (stage).
        student: the student's ``TokenTTT`` / ``WindowTTT`` / ``SwinStageTTTBlock``.
        patch_embed: ``token`` pairs: the teacher ViT's patch embedding (its call fixes the patch grid).
    """

    name: str
    scope: str
    teacher: nn.Module
    student: nn.Module
    patch_embed: nn.Module | None = None

    @property
    def mixer(self) -> TTTMixer:
        """The student's TTT mixer of this layer (what attention transfer trains)."""
        return self.student.attn if self.scope == "stage" else self.student.mixer

    @property
    def attention(self) -> nn.Module:
        """The teacher's attention module (its ``qkv``/``proj`` initialise the mixer)."""
        return self.teacher.attn if self.scope == "stage" else self.teacher

    def student_output(self, x: Tensor, grid: tuple[int, int] | None) -> Tensor:
        """The student's mixer on the teacher's layer input ``x`` (the shape of the teacher's output)."""
        if self.scope == "token":
            return self.student(x, grid=grid)
        if self.scope == "stage":
            return self.student.mix(x)
        return self.student(x)


def layer_pairs(teacher: nn.Module, student: nn.Module) -> list[LayerPair]:
    """Every teacher attention with the student module that replaced it, in order
    (``docs/design/conversion.md``).

    Raises:
        ValueError: no student module replaces a teacher attention (the student is not the teacher swapped).
    """
    students = dict(student.named_modules())
    pairs = []
    for name, module in teacher.named_modules():
        if isinstance(module, VisionTransformer):
            for i, block in enumerate(module.blocks):
                attn_name = f"{name}.blocks.{i}.attn".lstrip(".")
                if isinstance(block.attn, Attention) and isinstance(students.get(attn_name), TokenTTT):
                    pairs.append(
                        LayerPair(attn_name, "token", block.attn, students[attn_name], module.patch_embed)
                    )
        other = students.get(name)
        if isinstance(module, WindowAttention) and isinstance(other, WindowTTT):
            pairs.append(LayerPair(name, "window", module, other))
        elif isinstance(module, SwinTransformerBlock) and isinstance(other, SwinStageTTTBlock):
            pairs.append(LayerPair(name, "stage", module, other))
    if not pairs:
        raise ValueError(
            f"the student ({type(student).__name__}) has no TTT mixer in place of an attention of the "
            "teacher "
            f"({type(teacher).__name__}): it must be the teacher with its attention swapped (ttt_swap)"
        )
    return pairs


@torch.no_grad()
def init_student(student: nn.Module, teacher: nn.Module, pairs: Sequence[LayerPair]) -> None:
    """Starts the student from the teacher: every weight they share (by name and shape), and each mixer's main
    branch from its attention's ``qkv``/``proj`` (:func:`~vit3.models.swap.copy_attention_weights`).

    Raises:
        ValueError: a student weight outside the mixers has no counterpart in the teacher, or a mixer has no
            branch of its attention's shapes.
    """
    theirs = teacher.state_dict()
    ours = student.state_dict()
    mixers = tuple(f"{p.name}.{'attn' if p.scope == 'stage' else 'mixer'}." for p in pairs)
    shared = {k: v for k, v in theirs.items() if k in ours and ours[k].shape == v.shape}
    missing = [k for k in ours if k not in shared and not k.startswith(mixers)]
    if missing:
        raise ValueError(
            f"{len(missing)} student weights outside the TTT mixers are not the teacher's "
            f"(e.g. {', '.join(missing[:3])}): the student must be the teacher's model swapped"
        )
    student.load_state_dict(shared, strict=False)
    for pair in pairs:
        copy_attention_weights(pair.mixer, pair.attention.qkv, pair.attention.proj)


@dataclass
class _Record:
    """What one teacher forward left for one pair: its layer input and attention output, and the patch
    grid."""

    input: Tensor | None = None
    target: Tensor | None = None
    grid: tuple[int, int] | None = None


class LayerCapture:
    """Records, during a teacher forward, every pair's layer input and attention output (detached).

    A context manager around the teacher's forward (its hooks are removed on exit); ``inputs()``,
    ``targets()`` and ``grids()`` then list what the last forward left, in pair order.
    """

    def __init__(self, pairs: Sequence[LayerPair]) -> None:
        self.pairs = list(pairs)
        self.records = [_Record() for _ in self.pairs]
        self._handles: list[Any] = []

    def __enter__(self) -> LayerCapture:
        for pair, rec in zip(self.pairs, self.records):
            self._hook(pair, rec)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, pair: LayerPair, rec: _Record) -> None:
        add = self._handles.append
        if pair.scope == "stage":  # the block's attention branch: norm1's output in, drop_path1's input out

            def branch_in(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
                rec.input = out.detach()

            def branch_out(module: nn.Module, args: tuple[Tensor, ...]) -> None:
                rec.target = args[0].detach()

            add(pair.teacher.norm1.register_forward_hook(branch_in))
            add(pair.teacher.drop_path1.register_forward_pre_hook(branch_out))
            return

        def attention(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            rec.input, rec.target = args[0].detach(), out.detach()

        add(pair.teacher.register_forward_hook(attention))
        if pair.patch_embed is not None:

            def grid(module: nn.Module, args: tuple[Tensor, ...]) -> None:
                rec.grid = tuple(module.dynamic_feat_size(tuple(args[0].shape[-2:])))

            add(pair.patch_embed.register_forward_pre_hook(grid))

    def _field(self, key: str) -> list[Any]:
        values = [getattr(r, key) for r in self.records]
        missing = [p.name for p, v in zip(self.pairs, values) if v is None]
        if key != "grid" and missing:
            raise RuntimeError(f"the teacher forward did not pass the attention of {', '.join(missing)}")
        return values

    def inputs(self) -> list[Tensor]:
        """Each pair's layer input (the teacher's, of the last forward)."""
        return self._field("input")

    def targets(self) -> list[Tensor]:
        """Each pair's attention output (the teacher's, of the last forward)."""
        return self._field("target")

    def grids(self) -> list[tuple[int, int] | None]:
        """Each ``token`` pair's patch grid (``None`` for the others)."""
        return self._field("grid")


class TransferNet(nn.Module):
    """The student as the training loop (and DDP) calls it: images to logits, or layer inputs to mixer
    outputs.

    Args:
        student: the swapped model (a child module: its parameters are this module's).
        pairs: its :func:`layer_pairs` with the teacher.
    """

    def __init__(self, student: nn.Module, pairs: Sequence[LayerPair]) -> None:
        super().__init__()
        self.student = student
        self._pairs = list(pairs)  # a plain list: the modules are the student's (and the teacher's)

    def forward(
        self,
        x: Tensor | None = None,
        layer_inputs: Sequence[Tensor] | None = None,
        grids: Sequence[tuple[int, int] | None] | None = None,
    ) -> Tensor | list[Tensor]:
        """``x [B, C_in, H, W]`` -> logits ``[B, K]``; or, given ``layer_inputs`` (one per pair, the
        teacher's, e.g. ``[B, N, C]``), each student mixer's output on its input (same shapes)."""
        if layer_inputs is None:
            return self.student(x)
        grids = list(grids) if grids is not None else [None] * len(self._pairs)
        return [p.student_output(h, g) for p, h, g in zip(self._pairs, layer_inputs, grids)]


def transfer_losses(outputs: Sequence[Tensor], targets: Sequence[Tensor]) -> Tensor:
    """Per-layer mean squared error between the student mixers' outputs and the teacher's attention outputs.

    Returns:
        ``[L]``, float32 (the attention-transfer loss is their mean).
    """
    return torch.stack([F.mse_loss(o.float(), t.float()) for o, t in zip(outputs, targets)])


def distillation_loss(
    student_logits: Tensor, teacher_logits: Tensor, kind: str = "soft", temperature: float = 1.0
) -> Tensor:
    """Distillation from the teacher's logits, as timm trains it.

    ``soft``: ``KL(softmax(t / T) || softmax(s / T)) * T²``, batch mean (timm's ``LogitDistillationTask``);
    ``hard``: cross-entropy with the teacher's top class (DeiT's hard distillation); ``none``: 0.
    Logits ``[B, K]``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "none":
        return student_logits.new_zeros((), dtype=torch.float32)
    s, t = student_logits.float(), teacher_logits.float()
    if kind == "soft":
        log_s, log_t = F.log_softmax(s / temperature, dim=-1), F.log_softmax(t / temperature, dim=-1)
        return F.kl_div(log_s, log_t, reduction="batchmean", log_target=True) * temperature**2
    if kind == "hard":
        return F.cross_entropy(s, t.argmax(dim=-1))
    raise ValueError(f"distillation kind must be one of {DISTILL_KINDS}, got {kind!r}")
