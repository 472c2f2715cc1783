"""Inner models of the TTT mixer, each with a closed-form gradient of its inner loss.

An inner model is a tiny network whose weights are trained at test time on the (k, v) pairs of one sample.
Its learnable *initial* weights are ordinary parameters shared by the batch; the inner loop returns
per-sample weights that are used once, on q, and thrown away. All tensors use the token layout
``[B, G, n, c]`` (``G`` heads of ``c`` channels); per-sample weights carry a leading dim ``B`` or 1
(broadcast). Gradients are written out by hand (no autograd inside the inner loop), while ordinary
autograd flows through them so the outer model trains.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DWConvInner",
    "InnerModel",
    "LinearInner",
    "MLPInner",
    "SiLUInner",
    "SwiGLUInner",
    "create_inner_model",
    "dwconv_backward",
]

Params = dict[str, Tensor]
Cache = dict[str, Tensor]


def silu_grad(z: Tensor, sig: Tensor | None = None) -> Tensor:
    """``d silu(z) / dz = σ(z) (1 + z (1 - σ(z)))``."""
    sig = torch.sigmoid(z) if sig is None else sig
    return sig * (1.0 + z * (1.0 - sig))


def gelu_grad(z: Tensor) -> Tensor:
    """Derivative of the exact (erf) GELU: ``Φ(z) + z φ(z)``."""
    cdf = 0.5 * (1.0 + torch.erf(z * (0.5**0.5)))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


def _act(name: str, z: Tensor) -> Tensor:
    return F.silu(z) if name == "silu" else F.gelu(z)


def _act_grad(name: str, z: Tensor) -> Tensor:
    return silu_grad(z) if name == "silu" else gelu_grad(z)


def _init_weight(shape: tuple[int, ...]) -> nn.Parameter:
    w = nn.Parameter(torch.empty(shape))
    nn.init.trunc_normal_(w, std=0.02)
    return w


class InnerModel(nn.Module):
    """Base class: a model applied to ``[B, G, n, c]`` tokens with hand-written inner gradients.

    Attributes:
        token_wise: True when each token is processed alone (then inner mini-batches slice the tokens);
            False for models that mix neighbouring grid positions (then mini-batches mask the error).
    """

    token_wise: bool = True

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim

    def initial_params(self) -> Params:
        """The learnable initial weights, shaped for broadcasting over the batch (leading dim 1)."""
        raise NotImplementedError

    def forward_train(
        self, p: Params, k: Tensor, grid: tuple[int, int], need_output: bool
    ) -> tuple[Tensor | None, Cache]:
        """Forward on keys ``[B, G, n, c]``; returns the prediction (if asked for) and what ``grads`` needs."""
        raise NotImplementedError

    def grads(self, p: Params, k: Tensor, e: Tensor, cache: Cache, grid: tuple[int, int]) -> Params:
        """Closed-form gradients of ``sum_n <e_n, v_hat_n>`` w.r.t. each weight, per sample.

        Args:
            p: current weights.
            k: keys ``[B, G, n, c]``.
            e: ``dL/dv_hat`` ``[B, G, n, c]`` (loss scale, lr gates and masks already applied).
            cache: from ``forward_train``.
            grid: the token grid ``(h, w)``.
        """
        raise NotImplementedError

    def apply_to(self, p: Params, q: Tensor, grid: tuple[int, int]) -> Tensor:
        """The updated model on queries ``[B, G, n, c]`` -> ``[B, G, n, c]``."""
        raise NotImplementedError

    def norm_dims(self, name: str) -> tuple[int, ...]:
        """Dims over which ``G / (||G|| + 1)`` takes the norm: the input dim of each output column."""
        return (-2,)


class LinearInner(InnerModel):
    """One FC layer ``v_hat = k W``; with the dot loss one step is non-causal linear attention."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.w = _init_weight((1, heads, head_dim, head_dim))

    def initial_params(self) -> Params:
        return {"w": self.w}

    def forward_train(self, p, k, grid, need_output):
        return (k @ p["w"] if need_output else None), {}

    def grads(self, p, k, e, cache, grid):
        return {"w": k.transpose(-2, -1) @ e}

    def apply_to(self, p, q, grid):
        return q @ p["w"]


class SiLUInner(InnerModel):
    """``v_hat = SiLU(k W)`` (the paper's SiLU(FC))."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.w = _init_weight((1, heads, head_dim, head_dim))

    def initial_params(self) -> Params:
        return {"w": self.w}

    def forward_train(self, p, k, grid, need_output):
        z = k @ p["w"]
        return (F.silu(z) if need_output else None), {"z": z}

    def grads(self, p, k, e, cache, grid):
        return {"w": k.transpose(-2, -1) @ (e * silu_grad(cache["z"]))}

    def apply_to(self, p, q, grid):
        return F.silu(q @ p["w"])


class SwiGLUInner(InnerModel):
    """The official ViT³ inner model ``v_hat = (k W1) ⊙ SiLU(k W2)`` (SwiGLU with an identity output layer)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.w1 = _init_weight((1, heads, head_dim, head_dim))
        self.w2 = _init_weight((1, heads, head_dim, head_dim))

    def initial_params(self) -> Params:
        return {"w1": self.w1, "w2": self.w2}

    def forward_train(self, p, k, grid, need_output):
        z1 = k @ p["w1"]
        z2 = k @ p["w2"]
        sig = torch.sigmoid(z2)
        a = z2 * sig
        return (z1 * a if need_output else None), {"z1": z1, "z2": z2, "sig": sig, "a": a}

    def grads(self, p, k, e, cache, grid):
        kt = k.transpose(-2, -1)
        g1 = kt @ (e * cache["a"])
        g2 = kt @ (e * cache["z1"] * silu_grad(cache["z2"], cache["sig"]))
        return {"w1": g1, "w2": g2}

    def apply_to(self, p, q, grid):
        return (q @ p["w1"]) * F.silu(q @ p["w2"])


class MLPInner(InnerModel):
    """Two-layer MLP ``v_hat = act(k W1) W2`` and the paper's residual variants.

    ``residual="add"``: ``act(k W1) W2 + k``; ``residual="identity"``: ``act(k W1)(W2 + I)``;
    ``identity_init``: W2 starts as I. The last two need ``ratio == 1``.
    """

    def __init__(
        self,
        heads: int,
        head_dim: int,
        ratio: float = 1.0,
        act: str = "gelu",
        residual: str = "none",
        identity_init: bool = False,
    ) -> None:
        super().__init__(heads, head_dim)
        hidden = round(head_dim * ratio)
        if hidden < 1:
            raise ValueError(f"mlp_ratio {ratio} gives an empty hidden layer for head_dim {head_dim}")
        if (residual == "identity" or identity_init) and hidden != head_dim:
            raise ValueError(
                f"mlp_residual='identity' and mlp_identity_init need mlp_ratio 1 (hidden {hidden} != {head_dim})"
            )
        self.act, self.residual, self.hidden = act, residual, hidden
        self.w1 = _init_weight((1, heads, head_dim, hidden))
        self.w2 = _init_weight((1, heads, hidden, head_dim))
        if identity_init:
            with torch.no_grad():
                self.w2.copy_(torch.eye(head_dim).expand_as(self.w2))

    def initial_params(self) -> Params:
        return {"w1": self.w1, "w2": self.w2}

    def _out(self, p: Params, x: Tensor, a: Tensor) -> Tensor:
        y = a @ p["w2"]
        if self.residual == "identity":
            y = y + a
        elif self.residual == "add":
            y = y + x
        return y

    def forward_train(self, p, k, grid, need_output):
        h = k @ p["w1"]
        a = _act(self.act, h)
        return (self._out(p, k, a) if need_output else None), {"h": h, "a": a}

    def grads(self, p, k, e, cache, grid):
        g2 = cache["a"].transpose(-2, -1) @ e
        da = e @ p["w2"].transpose(-2, -1)
        if self.residual == "identity":
            da = da + e
        g1 = k.transpose(-2, -1) @ (da * _act_grad(self.act, cache["h"]))
        return {"w1": g1, "w2": g2}

    def apply_to(self, p, q, grid):
        return self._out(p, q, _act(self.act, q @ p["w1"]))


def tracing() -> bool:
    """True under ``torch.jit.trace`` (fvcore FLOP counting), ONNX export and ``torch.compile``/``torch.export``,
    which need plain, traceable ops rather than the eager fast paths."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


def _shifted_dwconv(x: Tensor, weight: Tensor) -> Tensor:
    """Per-sample depthwise 3x3 conv (zero padding) as nine shifted multiply-adds: ``[B, C, h, w]`` maps,
    ``[B|1, C, 3, 3]`` weights. Used for ONNX export, where the batch-folded grouped conv (groups = B*C) and
    ``aten.convolution_backward`` cannot be exported with a dynamic batch."""
    h, w = x.shape[-2:]
    xp = F.pad(x, (1, 1, 1, 1))
    return sum(
        xp[..., i : i + h, j : j + w] * weight[..., i, j, None, None] for i in range(3) for j in range(3)
    )


def _shifted_dwconv_weight_grad(k: Tensor, e: Tensor) -> Tensor:
    """``G[b, c, i, j] = sum_p k_pad[b, c, p + (i, j)] e[b, c, p]`` for ``[B, C, h, w]`` maps -> ``[B, C, 3, 3]``
    (the export-friendly twin of the ``convolution_backward`` call in :meth:`DWConvInner.grads`)."""
    h, w = k.shape[-2:]
    kp = F.pad(k, (1, 1, 1, 1))
    taps = [(kp[..., i : i + h, j : j + w] * e).sum((-2, -1)) for i in range(3) for j in range(3)]
    return torch.stack(taps, -1).unflatten(-1, (3, 3))


def fold_batch(t: Tensor) -> Tensor:
    """Maps ``[B, C, h, w]`` -> ``[1, B*C, h, w]`` (a view where the layout allows), channels-last kept.

    A plain reshape of a map whose channels are innermost gives the merged dim the right strides but the new
    batch dim an arbitrary one; the convolution ops then no longer see channels-last and copy both inputs to
    NCHW (~1 ms each at 4x64x56x56). Going through ``[h, w, B*C]`` gives a proper channels-last map.
    """
    b, ch, h, w = t.shape
    if b == 1:
        return t
    if t.stride(1) == 1:  # channels innermost
        return t.permute(2, 3, 0, 1).reshape(1, h, w, b * ch).permute(0, 3, 1, 2)
    return t.reshape(1, b * ch, h, w)


def dwconv_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor | None, *, need_input: bool = True, need_weight: bool = True
) -> tuple[Tensor | None, Tensor | None]:
    """Backward of the per-sample depthwise 3x3 conv ``DWConvInner.conv`` (zero padding 1), in one native call.

    Args:
        grad_out: gradient of the conv output ``[B, C, h, w]``.
        x: the conv input ``[B, C, h, w]``.
        weight: the kernels ``[B|1, C, 3, 3]`` (only needed for the input gradient).
        need_input: return dL/dx ``[B, C, h, w]`` (else ``None``).
        need_weight: return the per-sample dL/dweight ``[B, C, 3, 3]`` (else ``None``).
    """
    b, ch, h, w = x.shape
    # The batch folded into groups: every sample has its own kernels, and one call serves them all.
    kernels = (
        x.new_empty(b * ch, 1, 3, 3) if weight is None else weight.expand(b, ch, 3, 3).reshape(-1, 1, 3, 3)
    )
    gx, gw, _ = torch.ops.aten.convolution_backward(
        fold_batch(grad_out),
        fold_batch(x),
        kernels,
        None,
        [1, 1],
        [1, 1],
        [1, 1],
        False,
        [0, 0],
        b * ch,
        [need_input, need_weight, False],
    )
    return (gx.view(b, ch, h, w) if need_input else None, gw.view(b, ch, 3, 3) if need_weight else None)


class DWConvInner(InnerModel):
    """A 3x3 depthwise convolution over the grid (zero padding), one kernel per channel.

    Channels are the ``G * c`` channels of the branch. The weight is stored as a conv weight ``[G*c, 1, 3, 3]``
    (the official layout); per-sample weights are ``[B|1, G*c, 3, 3]``.
    """

    token_wise = False

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.weight = _init_weight((heads * head_dim, 1, 3, 3))

    def initial_params(self) -> Params:
        return {"weight": self.weight.view(1, -1, 3, 3)}

    @staticmethod
    def to_map(x: Tensor, grid: tuple[int, int]) -> Tensor:
        """``[B, G, n, c]`` tokens -> ``[B, G*c, h, w]`` maps, views of one batch-folded channels-last map.

        The memory is ``[h, w, B*G*c]``, so ``conv`` and ``dwconv_backward`` fold the batch into the channels
        (``[1, B*C, h, w]``, channels-last) without a copy: oneDNN's channels-last depthwise kernels then run
        ~28x faster on a CPU than on contiguous NCHW maps (4x64x56x56), or on a folded per-sample
        channels-last map, whose strides no longer match any layout.
        """
        b, g, _, c = x.shape
        folded = x.permute(2, 0, 1, 3).reshape(*grid, b * g * c)  # [h, w, B*C]
        return folded.view(*grid, b, g * c).permute(2, 3, 0, 1)

    def from_map(self, x: Tensor) -> Tensor:
        """``[B, G*c, h, w]`` maps -> ``[B, G, n, c]`` tokens."""
        b = x.shape[0]
        return x.reshape(b, self.heads, self.head_dim, -1).transpose(-2, -1)

    @staticmethod
    def conv(x: Tensor, weight: Tensor) -> Tensor:
        """Per-sample depthwise 3x3 conv: maps ``[B, C, h, w]`` with weights ``[B|1, C, 3, 3]``."""
        b, ch, h, w = x.shape
        if tracing():
            return _shifted_dwconv(x, weight)
        if b == 1:
            return F.conv2d(x, weight.reshape(ch, 1, 3, 3), padding=1, groups=ch)
        # Fold the batch into groups so every sample gets its own kernels in one call (on ``to_map``'s maps
        # the fold is a view of a channels-last map).
        kernels = weight.expand(b, ch, 3, 3).reshape(b * ch, 1, 3, 3)
        out = F.conv2d(fold_batch(x), kernels, padding=1, groups=b * ch)
        return out.view(b, ch, h, w)

    def forward_train(self, p, k, grid, need_output):
        km = self.to_map(k, grid)
        out = self.from_map(self.conv(km, p["weight"])) if need_output else None
        return out, {"k_map": km}

    def grads(self, p, k, e, cache, grid):
        km = cache["k_map"]
        em = self.to_map(e, grid)
        if tracing():
            return {"weight": _shifted_dwconv_weight_grad(km, em)}
        # G[c, δ] = sum_p k[c, p + δ] e[c, p] is the weight gradient of a depthwise conv of k with output
        # gradient e.
        return {"weight": dwconv_backward(em, km, None, need_input=False)[1]}

    def apply_to(self, p, q, grid):
        return self.from_map(self.conv(self.to_map(q, grid), p["weight"]))

    def norm_dims(self, name: str) -> tuple[int, ...]:
        return (-2, -1)


def create_inner_model(name: str, heads: int, head_dim: int, cfg: object) -> InnerModel:
    """Builds inner model ``name`` with ``heads`` heads of ``head_dim`` (options read from a ``TTTConfig``)."""
    if name == "linear":
        return LinearInner(heads, head_dim)
    if name == "silu":
        return SiLUInner(heads, head_dim)
    if name == "swiglu":
        return SwiGLUInner(heads, head_dim)
    if name == "mlp":
        return MLPInner(
            heads,
            head_dim,
            ratio=cfg.mlp_ratio,
            act=cfg.mlp_act,
            residual=cfg.mlp_residual,
            identity_init=cfg.mlp_identity_init,
        )
    if name == "dwconv":
        return DWConvInner(heads, head_dim)
    raise ValueError(f"unknown inner model {name!r}")
