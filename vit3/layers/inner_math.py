"""The math the inner models share: activations and their derivatives, LayerNorm forward/backward, the
traceable depthwise 3x3 conv; and the questions every layer asks of an input (:func:`tracing`,
:func:`assert_finite`, :func:`shape_text` for its messages).

All of it is plain PyTorch with no parameters, which TorchScript compiles (``torch.jit.script``: no format
specs, closures or globals in it): the inner models (:mod:`vit3.layers.inner_models`) build their closed-form
gradients from it, and the blocks and models ask :func:`tracing` / :func:`assert_finite`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ACTIVATIONS",
    "LN_EPS",
    "activation",
    "activation_grad",
    "assert_finite",
    "gelu_grad",
    "gelu_tanh_grad",
    "layer_norm_backward",
    "layer_norm_forward",
    "legacy_onnx_export",
    "shape_text",
    "shifted_dwconv",
    "shifted_dwconv_weight_grad",
    "silu_grad",
    "static_shape",
    "static_sizes",
    "tracing",
    "tracing_kind",
    "untraced",
]

LN_EPS = 1e-6  # the LayerNorm of ``inner_norm="ln"`` (TTT-Linear/TTT-MLP use 1e-6)


# --- shared math: activations and their derivatives, LayerNorm forward/backward ---------------------------


def silu_grad(z: Tensor, sig: Tensor | None = None) -> Tensor:
    """``d silu(z) / dz = σ(z) (1 + z (1 - σ(z)))``."""
    sig = torch.sigmoid(z) if sig is None else sig
    return sig * (1.0 + z * (1.0 - sig))


def gelu_grad(z: Tensor) -> Tensor:
    """Derivative of the exact (erf) GELU: ``Φ(z) + z φ(z)``."""
    cdf = 0.5 * (1.0 + torch.erf(z * (0.5**0.5)))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


def gelu_tanh_grad(z: Tensor) -> Tensor:
    """Derivative of the tanh-approximated GELU ``0.5 z (1 + tanh(u))``, ``u = √(2/π) (z + 0.044715 z³)``."""
    sqrt_2_over_pi, c = math.sqrt(2.0 / math.pi), 0.044715  # locals: TorchScript reads no global numbers
    t = torch.tanh(sqrt_2_over_pi * (z + c * z * z * z))
    du = sqrt_2_over_pi * (1.0 + 3.0 * c * z * z)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du


def _gelu_tanh(z: Tensor) -> Tensor:
    return F.gelu(z, approximate="tanh")


# name -> (activation, its derivative): the names configs take (``config.INNER_ACTIVATIONS``). A new one also
# gets a branch in ``activation`` and in ``activation_grad`` (the tests hold all three to each other).
ACTIVATIONS = {
    "gelu": (F.gelu, gelu_grad),
    "gelu_tanh": (_gelu_tanh, gelu_tanh_grad),
    "silu": (F.silu, silu_grad),
}


def activation(name: str, z: Tensor) -> Tensor:
    """Activation ``name`` (``"gelu"``, ``"gelu_tanh"``, ``"silu"``) applied elementwise (the functions of
    :data:`ACTIVATIONS`, named one by one: TorchScript calls no function looked up in a dict)."""
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return _gelu_tanh(z)
    if name == "silu":
        return F.silu(z)
    raise ValueError("unknown activation " + name + "; choose from gelu, gelu_tanh, silu")


def activation_grad(name: str, z: Tensor) -> Tensor:
    """The derivative of activation ``name`` at ``z``, elementwise (:data:`ACTIVATIONS`' second functions)."""
    if name == "gelu":
        return gelu_grad(z)
    if name == "gelu_tanh":
        return gelu_tanh_grad(z)
    if name == "silu":
        return silu_grad(z)
    raise ValueError("unknown activation " + name + "; choose from gelu, gelu_tanh, silu")


def layer_norm_forward(
    z: Tensor, weight: Tensor, bias: Tensor, eps: float = LN_EPS
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last dim, ``y = weight ⊙ (z - mean) / sqrt(var + eps) + bias`` (biased variance).

    Returns:
        ``(y, z_hat, rstd)``: the output, the normalised input and ``1 / sqrt(var + eps)`` (``[..., 1]``), the
        last two for :func:`layer_norm_backward`.
    """
    zc = z - z.mean(-1, keepdim=True)
    rstd = torch.rsqrt(zc.pow(2).mean(-1, keepdim=True) + eps)
    z_hat = zc * rstd
    return z_hat * weight + bias, z_hat, rstd


def layer_norm_backward(dy: Tensor, z_hat: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """``dL/dz`` of :func:`layer_norm_forward` given ``dL/dy``:
    ``rstd (g - mean(g) - z_hat mean(g ⊙ z_hat))`` with ``g = dy ⊙ weight`` (means over the last dim)."""
    g = dy * weight
    return rstd * (g - g.mean(-1, keepdim=True) - z_hat * (g * z_hat).mean(-1, keepdim=True))


def assert_finite(x: Tensor, error: type[Exception], message: str, bound: float = math.inf) -> None:
    """Raises ``error(message)`` where ``x`` holds a NaN or an Inf (or, given a finite ``bound``, a value
    beyond ``±bound``), without stopping the host: one reduction that ``torch._assert_async`` checks on
    ``x``'s device. The reduction is a float64 sum (which no finite 32- or 16-bit values overflow; NaN and Inf
    propagate through it), or ``max |x|`` for float64 input and on devices without float64 (MPS); with a
    bound, ``x``'s minimum and maximum (``aminmax``, NaN propagating), compared with it. On CPU the assert
    raises here; on an accelerator it is a device-side assert, reported at the next synchronisation, so a
    training step keeps no host sync and stays capturable by CUDA graphs."""
    if x.numel() == 0:
        return
    x = x.detach()  # a check, not part of the graph: nothing saved for a backward
    if math.isfinite(bound):
        lo, hi = torch.aminmax(x)
        ok = (lo >= -bound) & (hi <= bound)  # False for NaN
    else:
        exact = x.dtype == torch.float64 or x.device.type == "mps"
        ok = torch.isfinite(x.abs().amax() if exact else x.sum(dtype=torch.float64))
    try:
        torch._assert_async(ok, message)
    except RuntimeError as e:
        if message not in str(e):
            raise
        raise error(message) from None


def _onnx_export_probe() -> Callable[[], bool]:
    """``torch.onnx.is_in_onnx_export`` without the two imports it runs on every call (a cost in each mixer
    call): its flags read directly where this PyTorch has them, else the function itself."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:  # another PyTorch layout: the public function
        return torch.onnx.is_in_onnx_export
    return lambda: GLOBALS.in_onnx_export or _flags._is_onnx_exporting


_in_onnx_export = _onnx_export_probe()


def tracing_kind() -> str:
    """How the model is being traced, the one answer every layer reads: ``"trace"`` under ``torch.jit.trace``
    (fvcore's FLOP count) and ONNX export, ``"export"`` under ``torch.export``, ``"compile"`` under
    ``torch.compile``, else ``""``. Traced code takes plain, traceable ops rather than the eager fast paths;
    compiled and exported code may keep the mixer op (``docs/kernels.md``)."""
    if torch.compiler.is_compiling():  # dynamo folds the public checks (not the flags' property) to constants
        if torch.onnx.is_in_onnx_export():
            return "trace"
        return "export" if torch.compiler.is_exporting() else "compile"
    return "trace" if torch._C._is_tracing() or _in_onnx_export() else ""


T = TypeVar("T")


def static_shape(t: Tensor) -> list[int]:
    """``t``'s sizes for a check or a branch that only chooses: ``t.shape``, but Python ints under
    ``torch.jit.trace`` (the legacy ONNX exporter, fvcore's FLOP count), which hands sizes out as tensors and
    warns at every Python test of one (``static_sizes``). Sizes the computation takes keep ``t.shape``:
    traced, they stay live at other sizes. In Python a ``torch.Size`` outside a trace (``list[int]`` is
    TorchScript's type of ``t.shape``)."""
    if torch.jit.is_scripting():
        return t.shape
    else:  # not compiled by TorchScript
        return static_sizes(t.shape)


def static_sizes(sizes: Sequence[Any]) -> Sequence[Any]:
    """``sizes`` read off a shape (a grid, say) as Python ints under ``torch.jit.trace``, where they are
    tensors and every Python test of one warns; else as they are (eager ints, or symbolic sizes compiled or
    exported)."""
    if torch.compiler.is_compiling() or not torch._C._is_tracing():  # dynamo never sees the tracer's state
        return sizes
    return untraced(lambda: [int(n) for n in sizes])


def untraced(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with ``torch.jit.trace``'s state set aside: its ops are not recorded (a tensor it makes
    is a constant of the trace) and the sizes it reads are ints. Outside a trace, ``fn(*args)``."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        return fn(*args)
    finally:
        torch._C._set_tracing_state(state)


def tracing() -> bool:
    """Whether the model is being traced (``tracing_kind``). False in TorchScript, whose code asks
    ``torch.jit.is_scripting()`` itself."""
    if torch.jit.is_scripting():
        return False
    else:  # not compiled by TorchScript
        return tracing_kind() != ""


def legacy_onnx_export() -> bool:
    """Whether the legacy ONNX exporter (``torch.onnx.export(dynamo=False)``, a ``jit.trace``) is tracing."""
    return torch.jit.is_tracing() and torch.onnx.is_in_onnx_export()


def shape_text(x: Tensor) -> str:
    """``x``'s shape as a message writes it, ``(2, 3, 8)`` (``str(tuple(x.shape))``, not in TorchScript)."""
    sizes = [str(n) for n in x.shape]
    return "(" + ", ".join(sizes) + ("," if len(sizes) == 1 else "") + ")"


def _shifted_taps(x: Tensor) -> Tensor:
    """The zero-padded 3x3 neighbourhood of every pixel: ``[B, C, h, w]`` -> ``[B, C, h, w, 3, 3]`` (a view:
    ``taps[..., y, x, i, j] = x_pad[..., y + i, x + j]``).

    ``Tensor.unfold`` (one Range/Gather pair per axis in ONNX) instead of nine slices: under ``torch.export``
    with a dynamic image size every slice of a symbolic extent becomes a chain of shape ops, and nine per
    convolution made the ONNX graph of H-ViT³-T twice as large and its export many minutes long. A view adds
    no FLOPs to fvcore's count (a convolution with one-hot kernels would add 9x the conv's).

    The legacy ONNX exporter (``torch.onnx.export(dynamo=False)``, a ``jit.trace``) has no ``Unfold`` for an
    input of traced size ("input size not accessible", even at static shapes): it gets the nine slices,
    stacked (a copy), whose sizes it traces.
    """
    padded = F.pad(x, (1, 1, 1, 1))
    if not torch.jit.is_scripting():  # nested: TorchScript compiles both operands of an ``and``
        if legacy_onnx_export():
            return _legacy_onnx_taps(x, padded)
    return padded.unfold(2, 3, 1).unfold(3, 3, 1)


def _legacy_onnx_taps(x: Tensor, padded: Tensor) -> Tensor:
    """:func:`_shifted_taps` for the legacy ONNX exporter: the nine slices of ``padded`` stacked."""
    h, w = x.shape[-2:]
    taps = [padded[..., i : i + h, j : j + w] for i in range(3) for j in range(3)]
    return torch.stack(taps, dim=-1).unflatten(-1, (3, 3))


def shifted_dwconv(x: Tensor, weight: Tensor) -> Tensor:
    """Per-sample depthwise 3x3 conv (zero padding) as a weighted sum of the shifted taps: ``[B, C, h, w]``
    maps, ``[B|1, C, 3, 3]`` weights. Used when tracing, where the batch-folded grouped conv (groups = B*C)
    and ``aten.convolution_backward`` cannot be exported with a dynamic batch.

    An ``einsum``, not ``(taps * weight).sum``: the elementwise product's output strides are chosen by
    comparing the overlapping strides of the taps view, which ``torch.export`` turns into a guard that every
    grid side is at least 3 (a graph exported with a dynamic size then refused 2-patch sides eager runs).
    """
    return torch.einsum("bchwij,bcij->bchw", _shifted_taps(x), weight)


def shifted_dwconv_weight_grad(k: Tensor, e: Tensor) -> Tensor:
    """``G[b, c, i, j] = sum_p k_pad[b, c, p + (i, j)] e[b, c, p]`` for ``[B, C, h, w]`` maps ->
    ``[B, C, 3, 3]`` (the traceable twin of the ``convolution_backward`` call in :meth:`DWConvInner.grads`; an
    ``einsum`` as in :func:`shifted_dwconv`)."""
    return torch.einsum("bchwij,bchw->bcij", _shifted_taps(k), e)
