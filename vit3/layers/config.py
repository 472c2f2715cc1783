"""Configuration of the TTT token mixer: the paper's whole design space in one dataclass."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

from .inner_math import ACTIVATIONS
from .inner_models import RegisteredNames

__all__ = [
    "BACKEND_NAMES",
    "BIAS_MODELS",
    "GRID_MODELS",
    "INNER_ACTIVATIONS",
    "INNER_LOSSES",
    "INNER_MODELS",
    "INNER_NORMS",
    "NUMBER_FIELDS",
    "RECOMPUTE_MODES",
    "TTTConfig",
    "check_backend",
    "check_choice",
    "check_count",
    "check_recompute",
    "is_count",
    "parse_branch",
]

# The inner models a branch may name, read live from their registry (``vit3.layers.inner_models``): those
# that mix neighbouring grid positions (every other one is token-wise) and those whose FC layers take
# ``inner_bias``.
INNER_MODELS = RegisteredNames()
GRID_MODELS = RegisteredNames(lambda cls: cls.grid_model)
BIAS_MODELS = RegisteredNames(lambda cls: cls.takes_bias)
INNER_LOSSES = ("dot", "mse", "rmse", "mae", "smooth_l1")
INNER_ACTIVATIONS = tuple(ACTIVATIONS)
INNER_NORMS = ("none", "ln")
MLP_RESIDUALS = ("none", "add", "identity")
SCALES = ("head_dim", "1/head_dim")
# The backends a config may name (``vit3.layers.backends.BACKENDS``, in its order, after "auto") and what the
# fused eager paths' SwiGLU backward does with the per-token pre-activations Z, Y (``TTTConfig.recompute``).
BACKEND_NAMES = ("auto", "triton", "cpu", "eager", "generic")
RECOMPUTE_MODES = ("auto", "always", "never", "qkv")


def check_choice(key: str, value: Any, choices: tuple) -> Any:
    """``value`` where it is one of ``choices``; else a ValueError naming ``key`` and the choices."""
    if value not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {value!r}")
    return value


def check_backend(name: str) -> str:
    """``name`` where a config may name it as ``TTTConfig.backend`` (``BACKEND_NAMES``). The one check of a
    backend a module is given: the dispatcher takes it as checked."""
    return check_choice("backend", name, BACKEND_NAMES)


def check_recompute(mode: str) -> str:
    """``mode`` where it is a ``TTTConfig.recompute`` (``RECOMPUTE_MODES``). The one check of a recompute
    mode a module is given: the dispatcher takes it as checked."""
    return check_choice("recompute", mode, RECOMPUTE_MODES)


def parse_branch(spec: str, num_heads: int) -> tuple[str, int]:
    """Parses a branch spec ``"name"`` or ``"name:heads"`` into ``(name, heads)``.

    A bare name takes ``num_heads`` heads (the mixer's main branch); ``"dwconv:1"`` is the official extra
    depthwise-conv head of ``head_dim`` channels.
    """
    name, _, heads = spec.partition(":")
    name = name.strip()
    if name not in INNER_MODELS:
        raise ValueError(f"unknown inner model {name!r} in branch {spec!r}; choose from {INNER_MODELS}")
    n = num_heads if heads == "" else int(heads)
    if n < 1:
        raise ValueError(f"branch {spec!r} must have at least one head, got {n}")
    return name, n


# The number fields of a config and the kind each takes (``bool`` is neither, though Python counts it an int).
NUMBER_FIELDS = {
    "inner_lr": numbers.Real,
    "steps": numbers.Integral,
    "mini_batches": numbers.Integral,
    "mlp_ratio": numbers.Real,
    "rope_base": numbers.Real,
}


def is_count(value: Any) -> bool:
    """Whether ``value`` is an integer >= 1 (not a ``bool``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def check_count(owner: str, name: str, value: Any, hint: str = "") -> int:
    """``value`` as an ``int`` if it is an integer >= 1, else one line naming ``owner``'s argument ``name``.

    Raises:
        TypeError: ``value`` is no integer (a ``bool``, a float, a tensor, ``None``); ``hint`` is appended.
        ValueError: an integer below 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{owner} {name} must be a positive integer, got {type(value).__name__} {_short(value)}{hint}"
        )
    if value < 1:
        raise ValueError(f"{owner} {name} must be a positive integer, got {value}")
    return int(value)


def _short(value: Any) -> str:
    """A one-line repr of ``value`` (a tensor's shape, not its values)."""
    shape = getattr(value, "shape", None)
    return f"of shape {list(shape)}" if shape is not None else repr(value)


@dataclass
class TTTConfig:
    """Everything that defines a TTT mixer besides its width and head count.

    The defaults are the official ViT³ mixer: a SwiGLU-style inner model ``(xW1) ⊙ SiLU(xW2)`` on every
    head plus one 3x3 depthwise-conv head, dot-product loss, one full-batch step with lr 1.0, the
    gradient normalisation ``G / (||G|| + 1)`` and scale 1/3.

    Attributes:
        branches: inner models side by side, each ``"name"`` (``num_heads`` heads) or ``"name:k"`` (k heads
            of ``head_dim``); names from ``INNER_MODELS``, the registry (each described in
            ``docs/mixer.md``).
        loss: inner loss, one of ``INNER_LOSSES``.
        inner_lr: inner learning rate η.
        lr_mode: ``"fixed"`` (η) or ``"token"`` (η·σ(x W_η), one gate per token and head).
        steps: inner epochs over the sequence.
        mini_batches: inner mini-batches per epoch (contiguous chunks of the raster order).
        grad_norm: the official normalisation ``G / (||G|| + 1)`` over each output column.
        scale: loss scale; ``None`` is the official 1/3 (``9 ** -0.5``), ``"head_dim"`` is
            ``head_dim ** -0.5``, ``"1/head_dim"`` is ``1 / head_dim`` (TTT-Linear/TTT-MLP's η / d).
        mlp_ratio: hidden width of the ``mlp``, ``mlp3`` and ``swiglu_out`` inner models, in units of
            ``head_dim``.
        mlp_act: activation of the ``mlp`` and ``mlp3`` inner models: ``"gelu"`` (exact), ``"gelu_tanh"``
            (the tanh approximation, as TTT-MLP) or ``"silu"``.
        mlp_residual: ``"none"``, ``"add"`` (act(xW1)W2 + x) or ``"identity"`` (act(xW1)(W2 + I)); for
            ``mlp3`` ``"identity"`` adds I to every layer after the first.
        mlp_identity_init: initialise the layers after the first as the identity (W2 of ``mlp``; W2, W3 of
            ``mlp3``; W3 of ``swiglu_out``); needs ``mlp_ratio`` 1.
        inner_norm: ``"none"`` or ``"ln"``: every token-wise inner model g becomes f(x) = x + LN(g(x)) with a
            learnable per-head LayerNorm (weight 1, bias 0 at init, eps 1e-6; trained by the outer loop only),
            as in TTT-Linear/TTT-MLP (Sun et al. 2024). Grid models (``GRID_MODELS``) are left as they are.
        inner_bias: FC layers of the ``BIAS_MODELS`` with biases (zero at init, trained by the inner loop), as
            in TTT-Linear/TTT-MLP; other inner models are left as they are.
        rope: 2-D RoPE on q and k of the token-wise branches (H-ViT³).
        rope_base: RoPE base.
        qkv_bias: bias of the qkv projection.
        backend: the implementation of the inner loops: ``"auto"`` (the default: ``$VIT3_TTT_BACKEND``, else
            the best that serves), ``"triton"``, ``"cpu"``, ``"eager"`` or ``"generic"``; see
            ``vit3.layers.backends``. It wins over ``$VIT3_TTT_BACKEND``.
        recompute: what the SwiGLU backward of the fused eager paths (``cpu``, ``eager``) does with the
            per-token pre-activations Z = k W, Y = q W': ``"auto"`` (the default: ``$VIT3_TTT_RECOMPUTE``,
            else as ``"always"``), ``"always"`` (recompute them: memory-lean, a little slower), ``"never"``
            (save them: 4·d more values per token and head; the fastest) or ``"qkv"`` (the mixer's backward
            reruns its qkv projection and inner loops, any backend: it saves only its input, for more training
            compute). The Triton backward always recomputes Z, Y (and rotates a RoPE branch's q, k as it
            loads them). The ViT³ block follows it too: unless
            ``"never"``, its backward recomputes the CPE output and the MLP's LayerNorm and GELU outputs
            (``vit3.layers.blocks.LeanMlp``).
        check_finite: raise on non-finite input tokens (skipped under tracing and compilation).
    """

    branches: tuple[str, ...] = ("swiglu", "dwconv:1")
    loss: str = "dot"
    inner_lr: float = 1.0
    lr_mode: str = "fixed"
    steps: int = 1
    mini_batches: int = 1
    grad_norm: bool = True
    scale: float | str | None = None
    mlp_ratio: float = 1.0
    mlp_act: str = "gelu"
    mlp_residual: str = "none"
    mlp_identity_init: bool = False
    inner_norm: str = "none"
    inner_bias: bool = False
    rope: bool = False
    rope_base: float = 10000.0
    qkv_bias: bool = True
    backend: str = "auto"
    recompute: str = "auto"
    check_finite: bool = True

    def __post_init__(self) -> None:
        for name, kind in NUMBER_FIELDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                what = "an integer" if kind is numbers.Integral else "a real number"
                raise TypeError(f"TTTConfig {name} must be {what}, got {type(value).__name__} {value!r}")
        if isinstance(self.branches, str):
            self.branches = tuple(b for b in self.branches.split(",") if b.strip())
        self.branches = tuple(self.branches)
        if not self.branches:
            raise ValueError("TTTConfig.branches must name at least one inner model")
        for b in self.branches:
            parse_branch(b, 1)
        if self.loss not in INNER_LOSSES:
            raise ValueError(f"unknown inner loss {self.loss!r}; choose from {INNER_LOSSES}")
        if self.lr_mode not in ("fixed", "token"):
            raise ValueError(f"lr_mode must be 'fixed' or 'token', got {self.lr_mode!r}")
        if self.steps < 1 or self.mini_batches < 1:
            raise ValueError(f"steps and mini_batches must be >= 1, got {self.steps}, {self.mini_batches}")
        check_choice("mlp_act", self.mlp_act, INNER_ACTIVATIONS)
        check_choice("mlp_residual", self.mlp_residual, MLP_RESIDUALS)
        check_backend(self.backend)
        check_recompute(self.recompute)
        if isinstance(self.scale, str) and self.scale not in SCALES:
            raise ValueError(f"scale must be a number, None, 'head_dim' or '1/head_dim', got {self.scale!r}")
        check_choice("inner_norm", self.inner_norm, INNER_NORMS)
        names = [parse_branch(b, 1)[0] for b in self.branches]
        if self.inner_norm != "none" and all(n in GRID_MODELS for n in names):
            raise ValueError(
                f"inner_norm={self.inner_norm!r} wraps token-wise inner models, but branches {self.branches} "
                f"are all grid models {GRID_MODELS}"
            )
        if self.inner_bias and not any(n in BIAS_MODELS for n in names):
            raise ValueError(
                f"inner_bias applies to the inner models {BIAS_MODELS}, none of which is in {self.branches}"
            )
        if not math.isfinite(self.inner_lr):
            raise ValueError(f"inner_lr must be finite, got {self.inner_lr}")

    @classmethod
    def create(cls, cfg: TTTConfig | dict[str, Any] | None = None, **overrides: Any) -> TTTConfig:
        """Builds a config from a config, a dict (e.g. parsed YAML) or nothing, plus keyword overrides."""
        if isinstance(cfg, TTTConfig):
            base = asdict(cfg)
        else:
            base = dict(cfg or {})
        base.update(overrides)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise ValueError(f"unknown TTT config keys {unknown}; known keys: {sorted(known)}")
        return cls(**base)

    def resolve_scale(self, head_dim: int) -> float:
        """The loss scale s as a number."""
        if self.scale is None:
            return 9**-0.5  # official: the "equivalent head dim" of a 3x3 kernel
        if self.scale == "head_dim":
            return head_dim**-0.5
        if self.scale == "1/head_dim":
            return 1.0 / head_dim
        return float(self.scale)

    def branch_norm(self, name: str) -> bool:
        """Whether inner model ``name`` is wrapped as ``x + LN(g(x))`` (``inner_norm="ln"``, token-wise)."""
        return self.inner_norm == "ln" and name not in GRID_MODELS

    def branch_bias(self, name: str) -> bool:
        """Whether the FC layers of inner model ``name`` carry biases (``inner_bias``)."""
        return self.inner_bias and name in BIAS_MODELS

    def plain_branch(self, name: str) -> bool:
        """Whether branch ``name`` is the bare named inner model (no LayerNorm wrapper, no biases): the only
        form the fast paths (Triton kernels, C++ kernel, eager paths) implement."""
        return not (self.branch_norm(name) or self.branch_bias(name))

    def branch_specs(self, num_heads: int) -> list[tuple[str, int]]:
        """``[(inner model name, heads), ...]`` for a mixer with ``num_heads`` heads."""
        return [parse_branch(b, num_heads) for b in self.branches]
