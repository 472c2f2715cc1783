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

from vit3.kernels.common import normalize_grad
from vit3.kernels.dwconv import eager as dwconv_eager

from .losses import loss_grad, loss_needs_prediction

__all__ = [
    "LN_EPS",
    "ConvInner",
    "DWConvInner",
    "FCChainInner",
    "InnerModel",
    "LinearInner",
    "MLPInner",
    "ResidualNormInner",
    "SiLUInner",
    "SwiGLUInner",
    "SwiGLUOutInner",
    "activation",
    "activation_grad",
    "all_finite",
    "create_inner_model",
    "inner_loop",
    "layer_norm_backward",
    "layer_norm_forward",
]

Params = dict[str, Tensor]
Cache = dict[str, Tensor]

LN_EPS = 1e-6  # the LayerNorm of ``inner_norm="ln"`` (TTT-Linear/TTT-MLP use 1e-6)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


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
    t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_C * z * z * z))
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * z * z)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du


def _gelu_tanh(z: Tensor) -> Tensor:
    return F.gelu(z, approximate="tanh")


# name -> (activation, its derivative); the names are ``config.INNER_ACTIVATIONS``
_ACTIVATIONS = {
    "gelu": (F.gelu, gelu_grad),
    "gelu_tanh": (_gelu_tanh, gelu_tanh_grad),
    "silu": (F.silu, silu_grad),
}


def activation(name: str, z: Tensor) -> Tensor:
    """Activation ``name`` (``"gelu"``, ``"gelu_tanh"``, ``"silu"``) applied elementwise."""
    return _ACTIVATIONS[name][0](z)


def activation_grad(name: str, z: Tensor) -> Tensor:
    """The derivative of activation ``name`` at ``z``, elementwise."""
    return _ACTIVATIONS[name][1](z)


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

        Returns:
            One gradient per weight, in the order of ``p``.
        """
        raise NotImplementedError

    def apply_to(self, p: Params, q: Tensor, grid: tuple[int, int]) -> Tensor:
        """The updated model on queries ``[B, G, n, c]`` -> ``[B, G, n, c]``."""
        raise NotImplementedError

    def norm_dims(self, name: str) -> tuple[int, ...]:
        """Dims over which ``G / (||G|| + 1)`` takes the norm: the input dim of each output column."""
        return (-2,)


class FCChainInner(InnerModel):
    """A chain of FC layers per head, ``a_i = act_i(a_{i-1} W_i + b_i)`` with ``a_0 = x``; the output is ``a_L``.

    The closed-form inner gradient is backpropagation through the chain written out:
    ``dZ_i = dA_i ⊙ act_i'(Z_i)``, ``G_Wi = A_{i-1}ᵀ dZ_i``, ``G_bi = Σ_n dZ_i``, ``dA_{i-1} = dZ_i W_iᵀ``.

    Weights ``[1, G, in, out]`` are named ``w`` (one layer) or ``w1 .. wL``; biases (``bias=True``, zero at
    init) ``b`` / ``b1 .. bL``, stored flat ``[G * out]`` (1-D, so the outer optimizer does not decay them) and
    handed to the inner loop as ``[1, G, 1, out]``.

    Args:
        heads: heads G.
        head_dim: channels c per head (the chain maps c -> c).
        widths: ``[c, h_1, ..., c]``, the widths between the layers.
        acts: activation after each layer (``None``: linear), names of :func:`activation`.
        bias: FC layers with biases.
        residual: ``"none"``; ``"add"``: the output is ``a_L + x``; ``"identity"``: every layer after the first
            uses ``W_i + I``.
        identity_init: the layers after the first start as ``W_i = I``.
    """

    def __init__(
        self,
        heads: int,
        head_dim: int,
        widths: list[int],
        acts: list[str | None],
        *,
        bias: bool = False,
        residual: str = "none",
        identity_init: bool = False,
    ) -> None:
        super().__init__(heads, head_dim)
        if len(widths) != len(acts) + 1 or widths[0] != head_dim or widths[-1] != head_dim:
            raise ValueError(f"widths {widths} do not chain {len(acts)} layers from {head_dim} to {head_dim}")
        if (residual == "identity" or identity_init) and any(w != head_dim for w in widths[1:-1]):
            raise ValueError(
                f"mlp_residual='identity' and mlp_identity_init need mlp_ratio 1 (hidden {widths[1]} != {head_dim})"
            )
        self.acts, self.residual = tuple(acts), residual
        layers = len(acts)
        self.weight_names = ["w"] if layers == 1 else [f"w{i + 1}" for i in range(layers)]
        self.bias_names = ["b" + name[1:] for name in self.weight_names] if bias else []
        for i, name in enumerate(self.weight_names):
            w = _init_weight((1, heads, widths[i], widths[i + 1]))
            if identity_init and i > 0:
                with torch.no_grad():
                    w.copy_(torch.eye(head_dim).expand_as(w))
            self.register_parameter(name, w)
        for i, name in enumerate(self.bias_names):
            self.register_parameter(name, nn.Parameter(torch.zeros(heads * widths[i + 1])))

    def initial_params(self) -> Params:
        p = {name: getattr(self, name) for name in self.weight_names}
        p.update({name: getattr(self, name).view(1, self.heads, 1, -1) for name in self.bias_names})
        return p

    def _layer(self, p: Params, i: int, a: Tensor) -> Tensor:
        z = a @ p[self.weight_names[i]]
        if self.bias_names:
            z = z + p[self.bias_names[i]]
        return z + a if self.residual == "identity" and i > 0 else z

    def _forward(self, p: Params, x: Tensor, cache: Cache | None, need_output: bool = True) -> Tensor | None:
        a, last = x, len(self.acts) - 1
        for i, act in enumerate(self.acts):
            if cache is not None:
                cache[f"a{i}"] = a  # the input of layer i
            if i == last and act is None and not need_output:
                return None  # the gradients need only the inputs of a linear last layer
            z = self._layer(p, i, a)
            if act is not None and cache is not None:
                cache[f"z{i}"] = z
            a = z if act is None else activation(act, z)
        return a + x if self.residual == "add" else a

    def forward_train(self, p, k, grid, need_output):
        cache: Cache = {}
        return self._forward(p, k, cache, need_output), cache

    def grads(self, p, k, e, cache, grid):
        out, da = {}, e  # da: dL/d(output of layer i); the "add" residual does not depend on the weights
        for i in reversed(range(len(self.acts))):
            act = self.acts[i]
            dz = da if act is None else da * activation_grad(act, cache[f"z{i}"])
            out[self.weight_names[i]] = cache[f"a{i}"].transpose(-2, -1) @ dz
            if self.bias_names:
                out[self.bias_names[i]] = dz.sum(-2, keepdim=True)
            if i:
                da = dz @ p[self.weight_names[i]].transpose(-2, -1)
                if self.residual == "identity":
                    da = da + dz
        return {name: out[name] for name in p}

    def apply_to(self, p, q, grid):
        return self._forward(p, q, None)


class LinearInner(FCChainInner):
    """One FC layer ``v_hat = k W (+ b)``; with the dot loss one step is non-causal linear attention."""

    def __init__(self, heads: int, head_dim: int, bias: bool = False) -> None:
        super().__init__(heads, head_dim, [head_dim, head_dim], [None], bias=bias)


class SiLUInner(FCChainInner):
    """``v_hat = SiLU(k W (+ b))`` (the paper's SiLU(FC))."""

    def __init__(self, heads: int, head_dim: int, bias: bool = False) -> None:
        super().__init__(heads, head_dim, [head_dim, head_dim], ["silu"], bias=bias)


class MLPInner(FCChainInner):
    """MLP with ``layers - 1`` hidden layers of ``ratio * head_dim``: ``act(k W1) W2`` (``layers=2``, the paper's
    2-layer MLP), ``act(act(k W1) W2) W3`` (``layers=3``), and the paper's residual variants.

    ``residual="add"``: ``act(k W1) W2 + k``; ``residual="identity"``: ``act(k W1)(W2 + I)``;
    ``identity_init``: W2 (and W3) start as I. The last two need ``ratio == 1``.
    """

    def __init__(
        self,
        heads: int,
        head_dim: int,
        ratio: float = 1.0,
        act: str = "gelu",
        residual: str = "none",
        identity_init: bool = False,
        bias: bool = False,
        layers: int = 2,
    ) -> None:
        hidden = round(head_dim * ratio)
        if hidden < 1:
            raise ValueError(f"mlp_ratio {ratio} gives an empty hidden layer for head_dim {head_dim}")
        widths = [head_dim, *[hidden] * (layers - 1), head_dim]
        acts = [act] * (layers - 1) + [None]
        super().__init__(
            heads, head_dim, widths, acts, bias=bias, residual=residual, identity_init=identity_init
        )


def _glu_forward(x: Tensor, w1: Tensor, w2: Tensor, cache: Cache | None) -> Tensor:
    """``(x W1) ⊙ SiLU(x W2)``, keeping in ``cache`` what :func:`_glu_grads` needs."""
    z1 = x @ w1
    z2 = x @ w2
    sig = torch.sigmoid(z2)
    a = z2 * sig
    if cache is not None:
        cache.update(z1=z1, z2=z2, sig=sig, a=a)
    return z1 * a


def _glu_grads(x: Tensor, dh: Tensor, cache: Cache) -> tuple[Tensor, Tensor]:
    """Gradients of ``sum <dh, (x W1) ⊙ SiLU(x W2)>`` w.r.t. W1 and W2."""
    xt = x.transpose(-2, -1)
    g1 = xt @ (dh * cache["a"])
    g2 = xt @ (dh * cache["z1"] * silu_grad(cache["z2"], cache["sig"]))
    return g1, g2


class SwiGLUInner(InnerModel):
    """The official ViT³ inner model ``v_hat = (k W1) ⊙ SiLU(k W2)`` (SwiGLU with an identity output layer)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.w1 = _init_weight((1, heads, head_dim, head_dim))
        self.w2 = _init_weight((1, heads, head_dim, head_dim))

    def initial_params(self) -> Params:
        return {"w1": self.w1, "w2": self.w2}

    def forward_train(self, p, k, grid, need_output):
        cache: Cache = {}
        out = _glu_forward(k, p["w1"], p["w2"], cache)
        return (out if need_output else None), cache

    def grads(self, p, k, e, cache, grid):
        g1, g2 = _glu_grads(k, e, cache)
        return {"w1": g1, "w2": g2}

    def apply_to(self, p, q, grid):
        return _glu_forward(q, p["w1"], p["w2"], None)


class SwiGLUOutInner(InnerModel):
    """SwiGLU with its output layer, ``v_hat = ((k W1) ⊙ SiLU(k W2)) W3`` (the paper's "SwiGLU" row).

    Hidden width ``ratio * head_dim``; all weights trunc-normal(0.02) like the official SwiGLU, or W3 = I
    with ``identity_init`` (then the model starts as the official ``swiglu``; needs ``ratio == 1``).
    """

    def __init__(self, heads: int, head_dim: int, ratio: float = 1.0, identity_init: bool = False) -> None:
        super().__init__(heads, head_dim)
        hidden = round(head_dim * ratio)
        if hidden < 1:
            raise ValueError(f"mlp_ratio {ratio} gives an empty hidden layer for head_dim {head_dim}")
        if identity_init and hidden != head_dim:
            raise ValueError(f"mlp_identity_init needs mlp_ratio 1 (hidden {hidden} != {head_dim})")
        self.w1 = _init_weight((1, heads, head_dim, hidden))
        self.w2 = _init_weight((1, heads, head_dim, hidden))
        self.w3 = _init_weight((1, heads, hidden, head_dim))
        if identity_init:
            with torch.no_grad():
                self.w3.copy_(torch.eye(head_dim).expand_as(self.w3))

    def initial_params(self) -> Params:
        return {"w1": self.w1, "w2": self.w2, "w3": self.w3}

    def forward_train(self, p, k, grid, need_output):
        cache: Cache = {}
        h = cache["h"] = _glu_forward(k, p["w1"], p["w2"], cache)
        return (h @ p["w3"] if need_output else None), cache

    def grads(self, p, k, e, cache, grid):
        g1, g2 = _glu_grads(k, e @ p["w3"].transpose(-2, -1), cache)
        return {"w1": g1, "w2": g2, "w3": cache["h"].transpose(-2, -1) @ e}

    def apply_to(self, p, q, grid):
        return _glu_forward(q, p["w1"], p["w2"], None) @ p["w3"]


def all_finite(x: Tensor) -> bool:
    """Whether every value of ``x`` is finite: a finite sum proves it in one reduction (NaN and Inf propagate
    through it), ~20x cheaper than ``isfinite().all()`` on an image batch; only an overflowing sum of finite
    values needs the exact check."""
    return math.isfinite(x.sum().item()) or bool(torch.isfinite(x).all())


def tracing() -> bool:
    """True under ``torch.jit.trace`` (fvcore FLOP counting), ONNX export and ``torch.compile``/``torch.export``,
    which need plain, traceable ops rather than the eager fast paths."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


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
    if torch.jit.is_tracing() and torch.onnx.is_in_onnx_export():
        h, w = x.shape[-2:]
        taps = [padded[..., i : i + h, j : j + w] for i in range(3) for j in range(3)]
        return torch.stack(taps, dim=-1).unflatten(-1, (3, 3))
    return padded.unfold(2, 3, 1).unfold(3, 3, 1)


def _shifted_dwconv(x: Tensor, weight: Tensor) -> Tensor:
    """Per-sample depthwise 3x3 conv (zero padding) as a weighted sum of the shifted taps: ``[B, C, h, w]``
    maps, ``[B|1, C, 3, 3]`` weights. Used when tracing, where the batch-folded grouped conv (groups = B*C)
    and ``aten.convolution_backward`` cannot be exported with a dynamic batch.

    An ``einsum``, not ``(taps * weight).sum``: the elementwise product's output strides are chosen by
    comparing the overlapping strides of the taps view, which ``torch.export`` turns into a guard that every
    grid side is at least 3 (a graph exported with a dynamic size then refused 2-patch sides eager runs).
    """
    return torch.einsum("bchwij,bcij->bchw", _shifted_taps(x), weight)


def _shifted_dwconv_weight_grad(k: Tensor, e: Tensor) -> Tensor:
    """``G[b, c, i, j] = sum_p k_pad[b, c, p + (i, j)] e[b, c, p]`` for ``[B, C, h, w]`` maps -> ``[B, C, 3, 3]``
    (the traceable twin of the ``convolution_backward`` call in :meth:`DWConvInner.grads`; an ``einsum`` as in
    :func:`_shifted_dwconv`)."""
    return torch.einsum("bchwij,bchw->bcij", _shifted_taps(k), e)


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

    to_map = staticmethod(dwconv_eager.to_map)

    def from_map(self, x: Tensor) -> Tensor:
        """``[B, G*c, h, w]`` maps -> ``[B, G, n, c]`` tokens."""
        b = x.shape[0]
        return x.reshape(b, self.heads, self.head_dim, -1).transpose(-2, -1)

    @staticmethod
    def conv(x: Tensor, weight: Tensor) -> Tensor:
        """Per-sample depthwise 3x3 conv: maps ``[B, C, h, w]`` with weights ``[B|1, C, 3, 3]``."""
        return _shifted_dwconv(x, weight) if tracing() else dwconv_eager.conv(x, weight)

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
        return {"weight": dwconv_eager.dwconv_backward(em, km, None, need_input=False)[1]}

    def apply_to(self, p, q, grid):
        return self.from_map(self.conv(self.to_map(q, grid), p["weight"]))

    def norm_dims(self, name: str) -> tuple[int, ...]:
        return (-2, -1)


class ConvInner(InnerModel):
    """A dense 3x3 convolution over the grid (zero padding) from all ``c`` channels of a head to all ``c``.

    The weight is one conv weight per head, ``[G, c_out, c_in, 3, 3]``. In the token layout the conv is an FC
    layer on each token's 3x3 neighbourhood: ``v_hat = P(k) W`` with the patches ``P(k) [B, G, n, 9c]``
    (``F.unfold``, row ``i * 9 + 3 * kh + kw`` for input channel ``i``) and ``W [B|1, G, 9c, c]``, so the
    inner gradient is ``P(k)ᵀ e`` and the gradient normalisation takes each output channel's norm over its
    ``9c`` inputs (the whole ``c_in x 3 x 3`` kernel, as ``dwconv`` does per channel). Init trunc-normal(0.02).
    """

    token_wise = False

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.weight = _init_weight((heads, head_dim, head_dim, 3, 3))

    def initial_params(self) -> Params:
        return {"weight": self.weight.flatten(2).transpose(-2, -1).unsqueeze(0)}  # [1, G, 9c, c]

    @staticmethod
    def patches_t(x: Tensor, grid: tuple[int, int]) -> Tensor:
        """Transposed 3x3 patches of tokens ``[B, G, n, c]``: ``[B, G, 9c, n]``."""
        b, g, n, c = x.shape
        maps = x.transpose(-2, -1).reshape(b * g, c, *grid)  # [B*G, c, h, w]
        return F.unfold(maps, 3, padding=1).view(b, g, 9 * c, n)

    def forward_train(self, p, k, grid, need_output):
        cols_t = self.patches_t(k, grid)
        return (cols_t.transpose(-2, -1) @ p["weight"] if need_output else None), {"cols_t": cols_t}

    def grads(self, p, k, e, cache, grid):
        return {"weight": cache["cols_t"] @ e}

    def apply_to(self, p, q, grid):
        return self.patches_t(q, grid).transpose(-2, -1) @ p["weight"]


class ResidualNormInner(InnerModel):
    """``f(x) = x + LN(g(x))`` around a token-wise inner model ``g``: TTT-Linear / TTT-MLP (Sun et al. 2024).

    The LayerNorm is per head (weight and bias ``[G * c]``, 1 and 0 at init, eps 1e-6, biased variance, as the
    TTT code): its parameters are trained by the outer loop and fixed inside the inner loop, which trains g's
    weights through the LayerNorm's closed-form backward (:func:`layer_norm_backward`).

    With a residual loss ``l(v_hat - v)`` (MSE, RMSE, MAE, smooth-L1) training f on ``(k, v)`` is training
    ``LN ∘ g`` on ``(k, v - k)``, the TTT code's "reconstruction target".
    """

    def __init__(self, model: InnerModel) -> None:
        if not model.token_wise:
            raise ValueError(f"x + LN(g(x)) needs a token-wise inner model, not {type(model).__name__}")
        super().__init__(model.heads, model.head_dim)
        self.model = model
        self.ln_weight = nn.Parameter(torch.ones(model.heads * model.head_dim))
        self.ln_bias = nn.Parameter(torch.zeros(model.heads * model.head_dim))

    def _affine(self) -> tuple[Tensor, Tensor]:
        shape = (1, self.heads, 1, self.head_dim)
        return self.ln_weight.view(shape), self.ln_bias.view(shape)

    def norm(self, z: Tensor) -> tuple[Tensor, Cache]:
        """The LayerNorm of ``g``'s output ``[B, G, n, c]`` and what :meth:`norm_backward` needs."""
        y, z_hat, rstd = layer_norm_forward(z, *self._affine())
        return y, {"ln_z_hat": z_hat, "ln_rstd": rstd}

    def norm_backward(self, dy: Tensor, cache: Cache) -> Tensor:
        """``dL/dz`` from ``dL/dy`` of :meth:`norm`."""
        return layer_norm_backward(dy, cache["ln_z_hat"], cache["ln_rstd"], self._affine()[0])

    def initial_params(self) -> Params:
        return self.model.initial_params()

    def forward_train(self, p, k, grid, need_output):
        z, cache = self.model.forward_train(p, k, grid, True)  # the norm's backward needs z for every loss
        y, norm_cache = self.norm(z)
        return (k + y if need_output else None), {**cache, **norm_cache}

    def grads(self, p, k, e, cache, grid):
        return self.model.grads(p, k, self.norm_backward(e, cache), cache, grid)

    def apply_to(self, p, q, grid):
        return q + self.norm(self.model.apply_to(p, q, grid))[0]

    def norm_dims(self, name: str) -> tuple[int, ...]:
        return self.model.norm_dims(name)


def create_inner_model(name: str, heads: int, head_dim: int, cfg: object) -> InnerModel:
    """Builds inner model ``name`` with ``heads`` heads of ``head_dim`` (options read from a ``TTTConfig``).

    ``cfg.inner_bias`` gives the FC chains biases; ``cfg.inner_norm="ln"`` wraps a token-wise model as
    ``x + LN(g(x))`` (``TTTConfig.branch_bias`` / ``branch_norm`` say which branches).
    """
    bias = cfg.branch_bias(name)
    if name == "linear":
        model: InnerModel = LinearInner(heads, head_dim, bias=bias)
    elif name == "silu":
        model = SiLUInner(heads, head_dim, bias=bias)
    elif name == "swiglu":
        model = SwiGLUInner(heads, head_dim)
    elif name == "swiglu_out":
        model = SwiGLUOutInner(heads, head_dim, ratio=cfg.mlp_ratio, identity_init=cfg.mlp_identity_init)
    elif name in ("mlp", "mlp3"):
        model = MLPInner(
            heads,
            head_dim,
            ratio=cfg.mlp_ratio,
            act=cfg.mlp_act,
            residual=cfg.mlp_residual,
            identity_init=cfg.mlp_identity_init,
            bias=bias,
            layers=3 if name == "mlp3" else 2,
        )
    elif name == "conv":
        model = ConvInner(heads, head_dim)
    elif name == "dwconv":
        model = DWConvInner(heads, head_dim)
    else:
        raise ValueError(f"unknown inner model {name!r}")
    return ResidualNormInner(model) if cfg.branch_norm(name) else model


def inner_loop(
    model: InnerModel,
    params: Params,
    k: Tensor,
    v: Tensor,
    grid: tuple[int, int],
    *,
    loss: str = "dot",
    scale: float = 9**-0.5,
    lr: float = 1.0,
    steps: int = 1,
    mini_batches: int = 1,
    grad_norm: bool = True,
    token_lr: Tensor | None = None,
) -> Params:
    """Trains an inner model on ``(k, v)`` and returns its per-sample weights.

    Args:
        model: the inner model (its closed-form gradients are used).
        params: initial weights (leading dim 1 or B).
        k: keys ``[B, G, N, c]``.
        v: values ``[B, G, N, c]``.
        grid: ``(h, w)`` with ``h * w == N``.
        loss: inner loss name.
        scale: loss scale s; each mini-batch loss is ``(s / n) * sum_n l_n``.
        lr: inner learning rate η.
        steps: epochs over the sequence.
        mini_batches: contiguous chunks per epoch (one step each).
        grad_norm: apply ``G / (||G|| + 1)`` before the step.
        token_lr: optional per-token gate ``[B, G, N]`` multiplying each token's gradient (η·σ(x W_η)).

    Returns:
        The updated weights, each ``[B, ...]`` (or ``[1, ...]`` where nothing depends on the sample).
    """
    n_tok = k.shape[-2]
    if mini_batches > n_tok:
        raise ValueError(f"mini_batches={mini_batches} is larger than the sequence length N={n_tok}")
    # Chunk bounds as torch.tensor_split cuts them (the first N % m chunks one longer), in plain integer
    # arithmetic so that tracing / ONNX export sees no data-dependent values.
    size, extra = n_tok // mini_batches, n_tok % mini_batches
    ends = [(i + 1) * size + min(i + 1, extra) for i in range(mini_batches)]
    bounds = list(zip([0, *ends[:-1]], ends))
    need_pred = loss_needs_prediction(loss)
    for _ in range(steps):
        for start, end in bounds:
            full = start == 0 and end == n_tok
            if model.token_wise or full:
                kc, vc = (k, v) if full else (k[..., start:end, :], v[..., start:end, :])
            else:
                kc, vc = k, v  # grid models see the whole grid; the error is masked to the chunk below
            v_hat, cache = model.forward_train(params, kc, grid, need_pred)
            e = loss_grad(loss, v_hat, vc) * (scale / (end - start))
            if token_lr is not None:
                gate = token_lr if (full or not model.token_wise) else token_lr[..., start:end]
                e = e * gate.unsqueeze(-1)
            if not (model.token_wise or full):
                mask = torch.zeros(n_tok, 1, dtype=e.dtype, device=e.device)
                mask[start:end] = 1.0
                e = e * mask
            grads = model.grads(params, kc, e, cache, grid)
            if grad_norm:
                grads = {name: normalize_grad(g, model.norm_dims(name)) for name, g in grads.items()}
            params = {name: params[name] - lr * grads[name] for name in params}
    return params
