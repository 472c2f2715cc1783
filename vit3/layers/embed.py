"""From images to token maps: the image checks every vit3 model runs first, and the H-ViT³ convolutional stem
and downsampling (``[B, C, H, W]`` convolutions; the blocks between them are ``vit3.layers.blocks``).
TorchScript compiles all of it (a model built scriptable); its checks but the finiteness one, as traced
code."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import Tensor, nn

from vit3.kernels.common import autocast_on

from .inner_math import assert_finite, shape_text, static_shape, tracing
from .lean import RecomputedStack

__all__ = [
    "ConvDownsample",
    "ConvNormAct",
    "ConvStem",
    "check_image",
    "check_image_size",
    "grad_in_param_strides",
    "image_bound",
]


class _GradInParamStrides(torch.autograd.Function):
    """The identity on a parameter whose backward hands the gradient in the parameter's strides where their
    layouts agree (the same strides on every dimension of size > 1; a view, no copy)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor) -> Tensor:
        ctx.stride = weight.stride()
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        stride = ctx.stride
        same = all(n == 1 or a == b for n, a, b in zip(grad.shape, grad.stride(), stride))
        return grad.as_strided(grad.shape, stride) if same and grad.stride() != stride else grad


def grad_in_param_strides(weight: Tensor) -> Tensor:
    """``weight`` for a convolution whose weight gradient takes its input's memory format: the gradient comes
    back in ``weight``'s own strides, as DDP's gradient buckets lay it out.

    A convolution on a channels-last input (the H-ViT³ stages hand their maps on as ``[B, H, W, C]`` permuted
    to NCHW) returns a channels-last weight gradient; for a 1x1 or a depthwise weight (a size-1 dimension)
    that is the parameter's layout with other strides on the size-1 dimension, which autograd keeps as it is
    and DDP reports ("Grad strides do not match bucket view strides"). Traced, compiled, scripted or without
    gradients: the weight itself."""
    if torch.jit.is_scripting():
        return weight
    if tracing() or not (torch.is_grad_enabled() and weight.requires_grad):
        return weight
    return _GradInParamStrides.apply(weight)


register_notrace_function(grad_in_param_strides)


class ConvNormAct(nn.Module):
    """``act(norm(conv(x)))`` with optional BatchNorm and ReLU (official ``ConvLayer`` names: conv, norm).

    Args:
        in_chs: input channels.
        out_chs: output channels.
        kernel_size: square kernel.
        stride: stride.
        groups: convolution groups.
        bias: convolution bias.
        norm: add BatchNorm2d.
        act: add ReLU.
    """

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        kernel_size: int = 1,
        stride: int = 1,
        groups: int = 1,
        bias: bool = True,
        norm: bool = True,
        act: bool = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(
            in_chs, out_chs, kernel_size, stride, kernel_size // 2, groups=groups, bias=bias
        )
        self.norm = nn.BatchNorm2d(out_chs) if norm else nn.Identity()
        self.act = nn.ReLU() if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """``[B, in_chs, H, W] -> [B, out_chs, ceil(H / stride), ceil(W / stride)]``; the weight's gradient in
        its own strides whatever ``x``'s memory format (``grad_in_param_strides``)."""
        conv = self.conv
        x = F.conv2d(
            x,
            grad_in_param_strides(conv.weight),
            conv.bias,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
        )
        return self.act(self.norm(x))


class ConvStem(RecomputedStack):
    """The H-ViT³ stem, stride 4: 3x3 s2 -> two 3x3 -> 3x3 s2 to 4C -> 1x1 to C, BN everywhere, ReLU but last.

    Padded convolutions give ``ceil(H / 4) x ceil(W / 4)`` for any ``H, W``. In training it saves only the
    images and reruns itself in the backward (``RecomputedStack``; not under ``recompute="never"``).

    Args:
        in_chans: image channels.
        dim: output width C (the hidden width is C / 2).
        recompute: the model's ``TTTConfig.recompute``.
    """

    def __init__(self, in_chans: int, dim: int, recompute: str = "auto") -> None:
        half = dim // 2
        super().__init__(
            ConvNormAct(in_chans, half, 3, stride=2, bias=False),
            ConvNormAct(half, half, 3, bias=False),
            ConvNormAct(half, half, 3, bias=False),
            ConvNormAct(half, dim * 4, 3, stride=2, bias=False),
            ConvNormAct(dim * 4, dim, 1, bias=False, act=False),
            recompute=recompute,
        )


class ConvDownsample(RecomputedStack):
    """The H-ViT³ downsampling, stride 2: 1x1 to 4C_out + ReLU, depthwise 3x3 s2 + ReLU, 1x1 to C_out + BN.

    In training it saves only its input and reruns itself in the backward (``RecomputedStack``; not under
    ``recompute="never"``): its 4C_out map at the input's resolution is not kept.

    Args:
        in_chs: input width.
        out_chs: output width C_out.
        ratio: hidden width / C_out.
        recompute: the model's ``TTTConfig.recompute``.
    """

    def __init__(self, in_chs: int, out_chs: int, ratio: float = 4.0, recompute: str = "auto") -> None:
        hidden = int(out_chs * ratio)
        super().__init__(
            ConvNormAct(in_chs, hidden, 1, norm=False),
            ConvNormAct(hidden, hidden, 3, stride=2, groups=hidden, norm=False),
            ConvNormAct(hidden, out_chs, 1, act=False),
            recompute=recompute,
        )


def check_image(x: Tensor, in_chans: int, min_size: int, check_finite: bool = True) -> Tensor:
    """Validates an image batch ``[B, C, H, W]`` and returns it unchanged.

    Registered with timm as an FX leaf function (the checks are Python control flow on shapes and values);
    returning ``x`` keeps the call in traced graphs.

    Raises:
        TypeError: images of an integer or ``bool`` dtype (unscripted).
        ValueError: wrong rank or channel count, a side smaller than ``min_size`` (the model's total
            reduction), or values that are non-finite or beyond :func:`image_bound` (finite, yet they would
            overflow the model's float type into NaN logits).
    """
    if x.ndim != 4:
        raise ValueError(f"expected images [B, C, H, W], got a tensor of shape {shape_text(x)}")
    shape = static_shape(x)
    if shape[1] != in_chans:
        raise ValueError(f"model expects {in_chans} input channels, got {shape[1]} (input {shape_text(x)})")
    h, w = shape[-2], shape[-1]
    if h < min_size or w < min_size:
        raise ValueError(
            f"image {h}x{w} is too small for this model: both sides must be at least {min_size} pixels "
            f"(its total reduction)"
        )
    if not torch.jit.is_scripting():  # scripted: no dtype or finiteness check, as traced
        if not x.is_floating_point():
            raise TypeError(
                "expected images of a floating-point dtype (float32, float64, bfloat16, float16), got "
                f"{x.dtype}: convert them first, e.g. x.float() / 255, then normalise"
            )
        if check_finite and not tracing():
            _check_finite_image(x)
    return x


def _check_finite_image(x: Tensor) -> None:
    """:func:`check_image`'s check of the values (see there)."""
    bound = image_bound(x)
    assert_finite(
        x,
        ValueError,
        f"input images hold non-finite values (NaN or Inf) or values beyond ±{bound:.3g}, the square root "
        f"of the largest number of the float type the model computes in (its activations are squared, "
        f"which would overflow into NaN logits)",
        bound,
    )


register_notrace_function(check_image)


def image_bound(x: Tensor) -> float:
    """The largest magnitude an image ``x`` may hold: the square root of the largest number of the float type
    the model computes in (autocast's on ``x``'s device, else ``x``'s own), as LayerNorm variances, attention
    scores and the inner models' losses square the activations (e.g. 1.8e19 for float32 and bfloat16, 256
    for float16; normalised images lie within a few units); ``inf`` for a non-float ``x``."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if autocast_on(device) else x.dtype
    return torch.finfo(dtype).max ** 0.5 if dtype.is_floating_point else math.inf


def check_image_size(
    x: Tensor, size: tuple[int, int] | None, multiple: tuple[int, int] | None = None
) -> Tensor:
    """Checks the image sides of ``[B, C, H, W]``: equal to ``size`` (a model built with
    ``dynamic_img_size=False``) and multiples of ``multiple`` (``dynamic_img_pad=False``); ``None``: any.

    Raises:
        ValueError: naming the size found and the one expected.
    """
    shape = static_shape(x)
    h, w = shape[-2], shape[-1]
    if size is not None and (h != size[0] or w != size[1]):
        raise ValueError(
            f"image {h}x{w}: this model was built for {size[0]}x{size[1]} only (dynamic_img_size=False)"
        )
    if multiple is not None and (h % multiple[0] != 0 or w % multiple[1] != 0):
        raise ValueError(
            f"image {h}x{w}: the sides must be multiples of the patch size {multiple[0]}x{multiple[1]} "
            f"(dynamic_img_pad=False)"
        )
    return x


register_notrace_function(check_image_size)
