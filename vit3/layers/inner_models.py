"""The inner models of the TTT mixer, each with a closed-form gradient of its inner loss, and their registry.

An inner model is a tiny network whose weights are trained at test time on the (k, v) pairs of one sample
(:func:`vit3.layers.inner.inner_loop`); its learnable *initial* weights are shared by the batch, the
per-sample weights are used once, on q. Tensors are ``[B, G, n, c]`` tokens; gradients are written out by
hand (no autograd inside the inner loop) while ordinary autograd flows through them. Each model declares
itself where it is defined: :func:`register_inner_model` names it and gives its formula, its class
attributes (``grid_model``, ``takes_bias``) and ``from_config`` say the rest; ``vit3.layers.config``
(``INNER_MODELS``, ``GRID_MODELS``, ``BIAS_MODELS``), :func:`create_inner_model` and docs/mixer.md's table
(``docs/generate.py``) read that one registry. The methods are typed for TorchScript (``InnerModel.ttt``).
Adding one: the checklist of ``docs/layout.md`` ("Adding an inner model").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit3.kernels.common import normalize_grad
from vit3.kernels.dwconv import eager as dwconv_eager
from vit3.kernels.paths import compute_inputs

from .inner_math import (
    activation,
    activation_grad,
    layer_norm_backward,
    layer_norm_forward,
    shifted_dwconv,
    shifted_dwconv_weight_grad,
    silu_grad,
    static_shape,
    tracing,
)
from .losses import loss_grad, loss_needs_prediction

__all__ = [
    "Cache",
    "ConvInner",
    "DWConvInner",
    "FCChainInner",
    "InnerModel",
    "InnerModelInfo",
    "LinearInner",
    "MLPInner",
    "Params",
    "RegisteredNames",
    "ResidualNormInner",
    "SiLUInner",
    "SwiGLUInner",
    "SwiGLUOutInner",
    "create_inner_model",
    "register_inner_model",
    "registered_inner_models",
]

Params = dict[str, Tensor]
Cache = dict[str, Tensor]

_Model = TypeVar("_Model", bound="type[InnerModel]")


class InnerModelInfo(NamedTuple):
    """One registered inner model, as :func:`register_inner_model` recorded it.

    Attributes:
        name: the branch name.
        cls: its class.
        options: the constructor keywords the name fixes.
        formula: ``v_hat`` in words and symbols, for the docs (``""`` where the registration gave none).
    """

    name: str
    cls: type[InnerModel]
    options: dict[str, Any]
    formula: str


_REGISTRY: dict[str, InnerModelInfo] = {}  # in registration order


def register_inner_model(name: str, *, formula: str = "", **options: Any) -> Callable[[_Model], _Model]:
    """Class decorator: registers an inner model under ``name``, the name a ``TTTConfig`` branch gives.

    Args:
        name: the branch name (``"swiglu"``, ``"dwconv"``, ...).
        formula: what it computes from ``k``, as docs/mixer.md's table of inner models shows it
            (``"tanh(k W)"``); no ``|``, which would split the table's row.
        **options: constructor keywords this name fixes (one class may stand under several names, e.g.
            ``"mlp3"`` is ``MLPInner`` with ``layers=3``).

    Raises:
        ValueError: ``name`` is registered already, or is not letters, digits and ``_`` (a branch string
            puts ``:heads`` after it, the tests' ids ``-variant``); ``formula`` holds a ``|``.
    """
    if not name.isidentifier():
        raise ValueError(f"an inner model's name is letters, digits and '_', got {name!r}")
    if "|" in formula:
        raise ValueError(f"inner model {name!r}: its formula is a table cell, no |: {formula!r}")

    def register(cls: _Model) -> _Model:
        if name in _REGISTRY:
            raise ValueError(f"inner model {name!r} is registered already ({_REGISTRY[name].cls.__name__})")
        _REGISTRY[name] = InnerModelInfo(name, cls, options, formula)
        return cls

    return register


def registered_inner_models() -> tuple[InnerModelInfo, ...]:
    """Every registered inner model, in registration order."""
    return tuple(_REGISTRY.values())


class RegisteredNames(Sequence[str]):
    """The registered inner-model names whose class passes ``keep``, in registration order, read live: a model
    registered after this view was made is in it. Iterates, indexes and prints as the tuple of names."""

    def __init__(self, keep: Callable[[type[InnerModel]], bool] = lambda cls: True) -> None:
        self._keep = keep

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, info in _REGISTRY.items() if self._keep(info.cls))

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return repr(self._names())


def _init_weight(shape: tuple[int, ...]) -> nn.Parameter:
    w = nn.Parameter(torch.empty(shape))
    nn.init.trunc_normal_(w, std=0.02)
    return w


class InnerModel(nn.Module):
    """Base class: a model applied to ``[B, G, n, c]`` tokens with hand-written inner gradients.

    A subclass is one inner model: it implements the four methods below (its forward, closed-form gradients
    and the update applied to q), is registered with :func:`register_inner_model` and overrides
    :meth:`from_config` when it reads options of the config.

    Attributes:
        grid_model: False when each token is processed alone (inner mini-batches slice the tokens; RoPE and
            ``inner_norm="ln"`` apply); True for models that mix neighbouring grid positions (mini-batches
            mask the error instead; no RoPE, no LayerNorm wrapper).
        takes_bias: its FC layers take biases (``TTTConfig.inner_bias``).
    """

    grid_model: ClassVar[bool] = False
    takes_bias: ClassVar[bool] = False
    __constants__ = ("grid_model",)  # TorchScript reads class attributes as constants only

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim

    @classmethod
    def from_config(cls, heads: int, head_dim: int, cfg: Any, **options: Any) -> InnerModel:
        """The model of ``heads`` heads of ``head_dim`` for mixer config ``cfg`` (a ``TTTConfig``: the options
        a subclass reads; the base reads none) and the constructor keywords ``options`` of its
        registration."""
        return cls(heads, head_dim, **options)

    def initial_params(self) -> Params:
        """The learnable initial weights, shaped for broadcasting over the batch (leading dim 1)."""
        raise NotImplementedError

    def forward_train(
        self, p: Params, k: Tensor, grid: tuple[int, int], need_output: bool
    ) -> tuple[Tensor | None, Cache]:
        """Forward on keys ``[B, G, n, c]``: the prediction (if asked for) and what ``grads`` needs."""
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

    def norm_dims(self, name: str) -> list[int]:
        """Dims over which ``G / (||G|| + 1)`` takes the norm: the input dim of each output column."""
        return [-2]

    def inner_loop(
        self,
        params: Params,
        k: Tensor,
        v: Tensor,
        grid: tuple[int, int],
        loss: str = "dot",
        scale: float = 9**-0.5,
        lr: float = 1.0,
        steps: int = 1,
        mini_batches: int = 1,
        grad_norm: bool = True,
        token_lr: Tensor | None = None,
    ) -> Params:
        """Trains this model on ``(k, v)`` with its closed-form gradients; the per-sample weights.

        ``vit3.layers.inner.inner_loop(model, ...)`` calls this; a method, so that TorchScript compiles it
        with the model's own ``forward_train`` / ``grads``.

        Args:
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
        n_tok = k.shape[-2]  # traced (torch.jit.trace): a tensor, so a trace runs at other sizes
        if mini_batches > static_shape(k)[-2]:
            raise ValueError(f"mini_batches={mini_batches} is larger than the sequence length N={n_tok}")
        # Chunk bounds as torch.tensor_split cuts them (the first N % m chunks one longer), in plain integer
        # arithmetic so that tracing / ONNX export sees no data-dependent values.
        full = mini_batches == 1  # one chunk, the whole sequence
        bounds: list[tuple[int, int]] = []
        if full:
            bounds.append((0, n_tok))
        else:
            size, extra = n_tok // mini_batches, n_tok % mini_batches
            for i in range(mini_batches):
                start = bounds[i - 1][1] if i else 0
                bounds.append((start, (i + 1) * size + min(i + 1, extra)))
        need_pred = loss_needs_prediction(loss)
        for _ in range(steps):
            for start, end in bounds:
                if full or not self.grid_model:
                    kc, vc = (k, v) if full else (k[..., start:end, :], v[..., start:end, :])
                else:
                    kc, vc = k, v  # grid models see the whole grid; the error is masked to the chunk below
                v_hat, cache = self.forward_train(params, kc, grid, need_pred)
                e = loss_grad(loss, v_hat, vc) * _chunk_coef(scale, end - start)
                if token_lr is not None:
                    gate = token_lr if (full or self.grid_model) else token_lr[..., start:end]
                    e = e * gate.unsqueeze(-1)
                if self.grid_model and not full:
                    mask = torch.zeros(n_tok, 1, dtype=e.dtype, device=e.device)
                    mask[start:end] = 1.0
                    e = e * mask
                grads = self.grads(params, kc, e, cache, grid)
                if grad_norm:
                    grads = {name: normalize_grad(g, self.norm_dims(name)) for name, g in grads.items()}
                params = {name: params[name] - lr * grads[name] for name in params}
        return params

    def ttt(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        params: Params,
        grid: tuple[int, int],
        token_lr: Tensor | None,
        loss: str,
        scale: float,
        lr: float,
        steps: int,
        mini_batches: int,
        grad_norm: bool,
    ) -> Tensor:
        """One branch on the generic path, the reference every backend is checked against: q, k, v and the
        initial weights ``params`` in float32 at least (``compute_inputs``), :meth:`inner_loop` on ``(k, v)``,
        the trained weights on q (:meth:`apply_to`).

        Args:
            q, k, v: ``[B, G, N, c]`` (RoPE, where it applies, already on q and k).
            params: the initial weights by name (``initial_params``).
            grid: ``(h, w)`` with ``h * w == N``.
            token_lr: the token lr gate ``[B, G, N]`` or ``None``.
            loss, scale, lr, steps, mini_batches, grad_norm: the inner loop's settings (:meth:`inner_loop`).

        Returns:
            ``[B, G, N, c]`` in the compute dtype.
        """
        q, k, v, params = compute_inputs(q, k, v, params)
        params = self.inner_loop(
            params, k, v, grid, loss, scale, lr, steps, mini_batches, grad_norm, token_lr
        )
        return self.apply_to(params, q, grid)


def _chunk_coef(scale: float, count: int) -> float:
    """``scale / count``, the loss coefficient of a chunk of ``count`` tokens (traced: a 0-dim integer tensor,
    divided in float64, not the default float32)."""
    if not torch.jit.is_scripting() and isinstance(count, Tensor):
        return scale / count.double()
    return scale / count


class FCChainInner(InnerModel):
    """A chain of FC layers per head, ``a_i = act_i(a_{i-1} W_i + b_i)``, ``a_0 = x``; the output is ``a_L``.

    The closed-form inner gradient is backpropagation through the chain written out:
    ``dZ_i = dA_i ⊙ act_i'(Z_i)``, ``G_Wi = A_{i-1}ᵀ dZ_i``, ``G_bi = Σ_n dZ_i``, ``dA_{i-1} = dZ_i W_iᵀ``.

    Weights ``[1, G, in, out]`` are named ``w`` (one layer) or ``w1 .. wL``; biases (``bias=True``, zero at
    init) ``b`` / ``b1 .. bL``, stored flat ``[G * out]`` (1-D, so the outer optimizer does not decay them)
    and handed to the inner loop as ``[1, G, 1, out]``.

    Args:
        heads: heads G.
        head_dim: channels c per head (the chain maps c -> c).
        widths: ``[c, h_1, ..., c]``, the widths between the layers.
        acts: activation after each layer (``None``: linear), names of :func:`activation`.
        bias: FC layers with biases.
        residual: ``"none"``; ``"add"``: the output is ``a_L + x``; ``"identity"``: every layer after the
            first uses ``W_i + I``.
        identity_init: the layers after the first start as ``W_i = I``.
    """

    takes_bias = True

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
                "mlp_residual='identity' and mlp_identity_init need mlp_ratio 1 "
                f"(hidden {widths[1]} != {head_dim})"
            )
        self.acts = [act or "" for act in acts]  # "" for a linear layer (a list of one type, for TorchScript)
        self.residual = residual
        layers = len(acts)
        self.weight_names = ["w"] if layers == 1 else [f"w{i + 1}" for i in range(layers)]
        self.bias_names = ["b" + name[1:] for name in self.weight_names] if bias else []
        self.biased = (
            bias  # the bias of weight "w<i>" is "b<i>" (TorchScript infers no type of an empty list)
        )
        for i, name in enumerate(self.weight_names):
            w = _init_weight((1, heads, widths[i], widths[i + 1]))
            if identity_init and i > 0:
                with torch.no_grad():
                    w.copy_(torch.eye(head_dim).expand_as(w))
            self.register_parameter(name, w)
        for i, name in enumerate(self.bias_names):
            self.register_parameter(name, nn.Parameter(torch.zeros(heads * widths[i + 1])))

    @classmethod
    def from_config(cls, heads: int, head_dim: int, cfg: Any, **options: Any) -> InnerModel:
        return cls(heads, head_dim, bias=cfg.inner_bias, **options)

    def initial_params(self) -> Params:
        if torch.jit.is_scripting():
            return self._scripted_params()
        p = {name: getattr(self, name) for name in self.weight_names}
        p.update({name: getattr(self, name).view(1, self.heads, 1, -1) for name in self.bias_names})
        return p

    def _scripted_params(self) -> Params:
        """:meth:`initial_params` as TorchScript reads them: by literal names only (``getattr`` of a variable
        name does not compile), those of chains of up to three layers (every registered chain)."""
        p: Params = {}
        view = [1, self.heads, 1, -1]
        if hasattr(self, "w"):
            p["w"] = self.w
        if hasattr(self, "w1"):
            p["w1"] = self.w1
        if hasattr(self, "w2"):
            p["w2"] = self.w2
        if hasattr(self, "w3"):
            p["w3"] = self.w3
        if hasattr(self, "b"):
            p["b"] = self.b.view(view)
        if hasattr(self, "b1"):
            p["b1"] = self.b1.view(view)
        if hasattr(self, "b2"):
            p["b2"] = self.b2.view(view)
        if hasattr(self, "b3"):
            p["b3"] = self.b3.view(view)
        if len(p) != len(self.weight_names) * (2 if self.biased else 1):
            raise RuntimeError("TorchScript runs FC chains of up to 3 layers (w, w1..w3, b, b1..b3)")
        return p

    def _layer(self, p: Params, i: int, a: Tensor) -> Tensor:
        name = self.weight_names[i]
        z = a @ p[name]
        if self.biased:
            z = z + p["b" + name[1:]]
        return z + a if self.residual == "identity" and i > 0 else z

    def _forward(self, p: Params, x: Tensor, cache: Cache | None, need_output: bool = True) -> Tensor | None:
        a, last = x, len(self.acts) - 1
        for i, act in enumerate(self.acts):
            if cache is not None:
                cache[f"a{i}"] = a  # the input of layer i
            if i == last and act == "" and not need_output:
                return None  # the gradients need only the inputs of a linear last layer
            z = self._layer(p, i, a)
            if act != "" and cache is not None:
                cache[f"z{i}"] = z
            a = z if act == "" else activation(act, z)
        return a + x if self.residual == "add" else a

    def forward_train(
        self, p: Params, k: Tensor, grid: tuple[int, int], need_output: bool
    ) -> tuple[Tensor | None, Cache]:
        cache: Cache = {}
        return self._forward(p, k, cache, need_output), cache

    def grads(self, p: Params, k: Tensor, e: Tensor, cache: Cache, grid: tuple[int, int]) -> Params:
        out: Params = {}
        da = e  # dL/d(output of layer i); the "add" residual does not depend on the weights
        for i in range(len(self.acts) - 1, -1, -1):
            act = self.acts[i]
            dz = da if act == "" else da * activation_grad(act, cache[f"z{i}"])
            name = self.weight_names[i]
            out[name] = cache[f"a{i}"].transpose(-2, -1) @ dz
            if self.biased:
                out["b" + name[1:]] = dz.sum(-2, keepdim=True)
            if i:
                da = dz @ p[self.weight_names[i]].transpose(-2, -1)
                if self.residual == "identity":
                    da = da + dz
        return {name: out[name] for name in p}

    def apply_to(self, p: Params, q: Tensor, grid: tuple[int, int]) -> Tensor:
        out = self._forward(p, q, None)
        assert out is not None  # need_output: the chain's output
        return out


@register_inner_model("linear", formula="k W")
class LinearInner(FCChainInner):
    """One FC layer ``v_hat = k W (+ b)``; with the dot loss one step is non-causal linear attention."""

    def __init__(self, heads: int, head_dim: int, bias: bool = False) -> None:
        super().__init__(heads, head_dim, [head_dim, head_dim], [None], bias=bias)


@register_inner_model("silu", formula="SiLU(k W)")
class SiLUInner(FCChainInner):
    """``v_hat = SiLU(k W (+ b))`` (the paper's SiLU(FC))."""

    def __init__(self, heads: int, head_dim: int, bias: bool = False) -> None:
        super().__init__(heads, head_dim, [head_dim, head_dim], ["silu"], bias=bias)


@register_inner_model("mlp3", formula="act(act(k W1) W2) W3", layers=3)
@register_inner_model("mlp", formula="act(k W1) W2", layers=2)  # applied first: registered before "mlp3"
class MLPInner(FCChainInner):
    """MLP with ``layers - 1`` hidden layers of ``ratio * head_dim``: ``act(k W1) W2`` (``layers=2``, the
    paper's 2-layer MLP), ``act(act(k W1) W2) W3`` (``layers=3``), and the paper's residual variants.

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

    @classmethod
    def from_config(cls, heads: int, head_dim: int, cfg: Any, **options: Any) -> InnerModel:
        mlp = dict(ratio=cfg.mlp_ratio, act=cfg.mlp_act, residual=cfg.mlp_residual, bias=cfg.inner_bias)
        return cls(heads, head_dim, identity_init=cfg.mlp_identity_init, **mlp, **options)


def _swiglu_forward(x: Tensor, w1: Tensor, w2: Tensor, cache: Cache | None) -> Tensor:
    """``(x W1) ⊙ SiLU(x W2)``, keeping in ``cache`` what :func:`_swiglu_grads` needs."""
    z1 = x @ w1
    z2 = x @ w2
    sig = torch.sigmoid(z2)
    a = z2 * sig
    if cache is not None:
        cache["z1"], cache["z2"], cache["sig"], cache["a"] = z1, z2, sig, a
    return z1 * a


def _swiglu_grads(x: Tensor, dh: Tensor, cache: Cache) -> tuple[Tensor, Tensor]:
    """Gradients of ``sum <dh, (x W1) ⊙ SiLU(x W2)>`` w.r.t. W1 and W2."""
    xt = x.transpose(-2, -1)
    g1 = xt @ (dh * cache["a"])
    g2 = xt @ (dh * cache["z1"] * silu_grad(cache["z2"], cache["sig"]))
    return g1, g2


@register_inner_model("swiglu", formula="(k W1) ⊙ SiLU(k W2), the official model")
class SwiGLUInner(InnerModel):
    """The official ViT³ inner model ``v_hat = (k W1) ⊙ SiLU(k W2)`` (SwiGLU, identity output layer)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.w1 = _init_weight((1, heads, head_dim, head_dim))
        self.w2 = _init_weight((1, heads, head_dim, head_dim))

    def initial_params(self) -> Params:
        return {"w1": self.w1, "w2": self.w2}

    def forward_train(
        self, p: Params, k: Tensor, grid: tuple[int, int], need_output: bool
    ) -> tuple[Tensor | None, Cache]:
        cache: Cache = {}
        out = _swiglu_forward(k, p["w1"], p["w2"], cache)
        return (out if need_output else None), cache

    def grads(self, p: Params, k: Tensor, e: Tensor, cache: Cache, grid: tuple[int, int]) -> Params:
        g1, g2 = _swiglu_grads(k, e, cache)
        return {"w1": g1, "w2": g2}

    def apply_to(self, p: Params, q: Tensor, grid: tuple[int, int]) -> Tensor:
        return _swiglu_forward(q, p["w1"], p["w2"], None)


@register_inner_model("swiglu_out", formula="((k W1) ⊙ SiLU(k W2)) W3")
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

    @classmethod
    def from_config(cls, heads: int, head_dim: int, cfg: Any, **options: Any) -> InnerModel:
        return cls(heads, head_dim, ratio=cfg.mlp_ratio, identity_init=cfg.mlp_identity_init, **options)

    def initial_params(self) -> Params:
        return {"w1": self.w1, "w2": self.w2, "w3": self.w3}

    def forward_train(
        self, p: Params, k: Tensor, grid: tuple[int, int], need_output: bool
    ) -> tuple[Tensor | None, Cache]:
        cache: Cache = {}
        h = _swiglu_forward(k, p["w1"], p["w2"], cache)
        cache["h"] = h
        return (h @ p["w3"] if need_output else None), cache

    def grads(self, p: Params, k: Tensor, e: Tensor, cache: Cache, grid: tuple[int, int]) -> Params:
        g1, g2 = _swiglu_grads(k, e @ p["w3"].transpose(-2, -1), cache)
        return {"w1": g1, "w2": g2, "w3": cache["h"].transpose(-2, -1) @ e}

    def apply_to(self, p: Params, q: Tensor, grid: tuple[int, int]) -> Tensor:
        return _swiglu_forward(q, p["w1"], p["w2"], None) @ p["w3"]


@register_inner_model("conv", formula="conv3x3(k), dense over the grid: all channels of a head")
class ConvInner(InnerModel):
    """A dense 3x3 convolution over the grid (zero padding) from all ``c`` channels of a head to all ``c``.

    The weight is one conv weight per head, ``[G, c_out, c_in, 3, 3]``. In the token layout the conv is an FC
    layer on each token's 3x3 neighbourhood: ``v_hat = P(k) W`` with the patches ``P(k) [B, G, n, 9c]``
    (``F.unfold``, row ``i * 9 + 3 * kh + kw`` for input channel ``i``) and ``W [B|1, G, 9c, c]``, so the
    inner gradient is ``P(k)ᵀ e`` and the gradient normalisation takes each output channel's norm over its
    ``9c`` inputs (the whole ``c_in x 3 x 3`` kernel, as ``dwconv`` does per channel). Init
    trunc-normal(0.02).
    """

    grid_model = True

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.weight = _init_weight((heads, head_dim, head_dim, 3, 3))

    def initial_params(self) -> Params:
        return {"weight": self.weight.flatten(2).transpose(-2, -1).unsqueeze(0)}  # [1, G, 9c, c]

    @staticmethod
    def patches_t(x: Tensor, grid: tuple[int, int]) -> Tensor:
        """Transposed 3x3 patches of tokens ``[B, G, n, c]``: ``[B, G, 9c, n]``."""
        b, g, n, c = x.shape
        maps = x.transpose(-2, -1).reshape(b * g, c, grid[0], grid[1])  # [B*G, c, h, w]
        return F.unfold(maps, 3, padding=1).view(b, g, 9 * c, n)

    def forward_train(
        self, p: Params, k: Tensor, grid: tuple[int, int], need_output: bool
    ) -> tuple[Tensor | None, Cache]:
        cols_t = self.patches_t(k, grid)
        return (cols_t.transpose(-2, -1) @ p["weight"] if need_output else None), {"cols_t": cols_t}

    def grads(self, p: Params, k: Tensor, e: Tensor, cache: Cache, grid: tuple[int, int]) -> Params:
        return {"weight": cache["cols_t"] @ e}

    def apply_to(self, p: Params, q: Tensor, grid: tuple[int, int]) -> Tensor:
        return self.patches_t(q, grid).transpose(-2, -1) @ p["weight"]


@register_inner_model("dwconv", formula="dwconv3x3(k), depthwise over the grid")
class DWConvInner(InnerModel):
    """A 3x3 depthwise convolution over the grid (zero padding), one kernel per channel.

    Channels are the ``G * c`` channels of the branch. The weight is stored as a conv weight
    ``[G*c, 1, 3, 3]`` (the official layout); per-sample weights are ``[B|1, G*c, 3, 3]``. Traced and
    TorchScript code convolves with the shifted taps (:func:`shifted_dwconv`), eager code with the
    batch-folded grouped convolution.
    """

    grid_model = True

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
        if torch.jit.is_scripting() or tracing():
            return shifted_dwconv(x, weight)
        return dwconv_eager.conv(x, weight)

    def forward_train(
        self, p: Params, k: Tensor, grid: tuple[int, int], need_output: bool
    ) -> tuple[Tensor | None, Cache]:
        km = self.to_map(k, grid)
        out = self.from_map(self.conv(km, p["weight"])) if need_output else None
        return out, {"k_map": km}

    def grads(self, p: Params, k: Tensor, e: Tensor, cache: Cache, grid: tuple[int, int]) -> Params:
        km = cache["k_map"]
        em = self.to_map(e, grid)
        if torch.jit.is_scripting() or tracing():
            return {"weight": shifted_dwconv_weight_grad(km, em)}
        # G[c, δ] = sum_p k[c, p + δ] e[c, p] is the weight gradient of a depthwise conv of k with output
        # gradient e.
        return {"weight": dwconv_eager.dwconv_backward(em, km, None, need_input=False)[1]}

    def apply_to(self, p: Params, q: Tensor, grid: tuple[int, int]) -> Tensor:
        return self.from_map(self.conv(self.to_map(q, grid), p["weight"]))

    def norm_dims(self, name: str) -> list[int]:
        return [-2, -1]


class ResidualNormInner(InnerModel):
    """``f(x) = x + LN(g(x))`` around a token-wise inner model ``g``: TTT-Linear / TTT-MLP (Sun et al. 2024).

    The LayerNorm is per head (weight and bias ``[G * c]``, 1 and 0 at init, eps 1e-6, biased variance, as the
    TTT code): its parameters are trained by the outer loop and fixed inside the inner loop, which trains g's
    weights through the LayerNorm's closed-form backward (:func:`layer_norm_backward`).

    With a residual loss ``l(v_hat - v)`` (MSE, RMSE, MAE, smooth-L1) training f on ``(k, v)`` is training
    ``LN ∘ g`` on ``(k, v - k)``, the TTT code's "reconstruction target".
    """

    def __init__(self, model: InnerModel) -> None:
        if model.grid_model:
            raise ValueError(f"x + LN(g(x)) needs a token-wise inner model, not {type(model).__name__}")
        super().__init__(model.heads, model.head_dim)
        self.model = model
        self.ln_weight = nn.Parameter(torch.ones(model.heads * model.head_dim))
        self.ln_bias = nn.Parameter(torch.zeros(model.heads * model.head_dim))

    def _affine(self) -> tuple[Tensor, Tensor]:
        shape = [1, self.heads, 1, self.head_dim]
        return self.ln_weight.view(shape), self.ln_bias.view(shape)

    def norm(self, z: Tensor) -> tuple[Tensor, Cache]:
        """The LayerNorm of ``g``'s output ``[B, G, n, c]`` and what :meth:`norm_backward` needs."""
        weight, bias = self._affine()
        y, z_hat, rstd = layer_norm_forward(z, weight, bias)
        return y, {"ln_z_hat": z_hat, "ln_rstd": rstd}

    def norm_backward(self, dy: Tensor, cache: Cache) -> Tensor:
        """``dL/dz`` from ``dL/dy`` of :meth:`norm`."""
        return layer_norm_backward(dy, cache["ln_z_hat"], cache["ln_rstd"], self._affine()[0])

    def initial_params(self) -> Params:
        return self.model.initial_params()

    def forward_train(
        self, p: Params, k: Tensor, grid: tuple[int, int], need_output: bool
    ) -> tuple[Tensor | None, Cache]:
        z, cache = self.model.forward_train(p, k, grid, True)  # the norm's backward needs z for every loss
        assert z is not None  # need_output: the model's output
        y, norm_cache = self.norm(z)
        cache.update(norm_cache)
        return (k + y if need_output else None), cache

    def grads(self, p: Params, k: Tensor, e: Tensor, cache: Cache, grid: tuple[int, int]) -> Params:
        return self.model.grads(p, k, self.norm_backward(e, cache), cache, grid)

    def apply_to(self, p: Params, q: Tensor, grid: tuple[int, int]) -> Tensor:
        return q + self.norm(self.model.apply_to(p, q, grid))[0]

    def norm_dims(self, name: str) -> list[int]:
        return self.model.norm_dims(name)


def create_inner_model(name: str, heads: int, head_dim: int, cfg: Any) -> InnerModel:
    """Builds the inner model registered as ``name`` with ``heads`` heads of ``head_dim`` (options read from
    the ``TTTConfig`` ``cfg`` by its ``from_config``); ``cfg.inner_norm="ln"`` wraps a token-wise model as
    ``x + LN(g(x))`` (``TTTConfig.branch_norm`` says which branches).

    Raises:
        ValueError: no inner model is registered as ``name``.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown inner model {name!r}; choose from {tuple(_REGISTRY)}")
    info = _REGISTRY[name]
    model = info.cls.from_config(heads, head_dim, cfg, **info.options)
    return ResidualNormInner(model) if cfg.branch_norm(name) else model
