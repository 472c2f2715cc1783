"""Configuration of the TTT token mixer: the paper's whole design space in one dataclass."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["INNER_LOSSES", "INNER_MODELS", "TTTConfig", "parse_branch"]

INNER_MODELS = ("linear", "silu", "mlp", "swiglu", "dwconv")
INNER_LOSSES = ("dot", "mse", "rmse", "mae", "smooth_l1")
MLP_RESIDUALS = ("none", "add", "identity")
# The removed ``impl`` key of old configs and checkpoints, read as ``backend``.
IMPL_TO_BACKEND = {"auto": "auto", "torch": "eager", "triton": "triton"}


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


@dataclass
class TTTConfig:
    """Everything that defines a TTT mixer besides its width and head count.

    The defaults are the official ViT³ mixer: a SwiGLU-style inner model ``(xW1) ⊙ SiLU(xW2)`` on every
    head plus one 3x3 depthwise-conv head, dot-product loss, one full-batch step with lr 1.0, the
    gradient normalisation ``G / (||G|| + 1)`` and scale 1/3.

    Attributes:
        branches: inner models side by side, each ``"name"`` (``num_heads`` heads) or ``"name:k"`` (k heads
            of ``head_dim``); names from ``INNER_MODELS``.
        loss: inner loss, one of ``INNER_LOSSES``.
        inner_lr: inner learning rate η.
        lr_mode: ``"fixed"`` (η) or ``"token"`` (η·σ(x W_η), one gate per token and head).
        steps: inner epochs over the sequence.
        mini_batches: inner mini-batches per epoch (contiguous chunks of the raster order).
        grad_norm: the official normalisation ``G / (||G|| + 1)`` over each output column.
        scale: loss scale; ``None`` is the official 1/3 (``9 ** -0.5``), ``"head_dim"`` is ``head_dim ** -0.5``.
        mlp_ratio: hidden width of the ``mlp`` inner model, in units of ``head_dim``.
        mlp_act: ``"gelu"`` or ``"silu"`` for the ``mlp`` inner model.
        mlp_residual: ``"none"``, ``"add"`` (SiLU(xW1)W2 + x) or ``"identity"`` (SiLU(xW1)(W2 + I)).
        mlp_identity_init: initialise W2 of the ``mlp`` inner model as the identity.
        rope: 2-D RoPE on q and k of the token-wise branches (H-ViT³).
        rope_base: RoPE base.
        qkv_bias: bias of the qkv projection.
        backend: the implementation of the inner loops: ``"auto"`` (the default: ``$VIT3_TTT_BACKEND``, else
            the best that serves), ``"triton"``, ``"cpu"``, ``"eager"`` or ``"generic"``; see
            ``vit3.layers.backends``. It wins over ``$VIT3_TTT_BACKEND``. (Old configs' ``impl`` is read as
            this: ``"torch"`` as ``"eager"``.)
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
    rope: bool = False
    rope_base: float = 10000.0
    qkv_bias: bool = True
    backend: str = "auto"
    check_finite: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
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
        if self.mlp_act not in ("gelu", "silu"):
            raise ValueError(f"mlp_act must be 'gelu' or 'silu', got {self.mlp_act!r}")
        if self.mlp_residual not in MLP_RESIDUALS:
            raise ValueError(f"mlp_residual must be one of {MLP_RESIDUALS}, got {self.mlp_residual!r}")
        from .backends import NAMES  # the registry imports this module

        if self.backend not in NAMES:
            raise ValueError(f"backend must be one of {NAMES}, got {self.backend!r}")
        if isinstance(self.scale, str) and self.scale != "head_dim":
            raise ValueError(f"scale must be a number, None or 'head_dim', got {self.scale!r}")
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
        if "impl" in base:
            base = _read_impl(base)
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
        return float(self.scale)

    def branch_specs(self, num_heads: int) -> list[tuple[str, int]]:
        """``[(inner model name, heads), ...]`` for a mixer with ``num_heads`` heads."""
        return [parse_branch(b, num_heads) for b in self.branches]


def _read_impl(cfg: dict[str, Any]) -> dict[str, Any]:
    """Old configs and checkpoints carry ``impl``, renamed ``backend``: read it as that, with a warning."""
    cfg = dict(cfg)
    impl = cfg.pop("impl")
    if impl not in IMPL_TO_BACKEND:
        raise ValueError(
            f"TTT config key 'impl' was renamed 'backend' (auto, triton, cpu, eager, generic); got impl={impl!r}"
        )
    backend = IMPL_TO_BACKEND[impl]
    if "backend" in cfg and cfg["backend"] != backend:
        raise ValueError(
            f"TTT config has both impl={impl!r} and backend={cfg['backend']!r}; keep only 'backend'"
        )
    if backend == "auto":
        warnings.warn(
            "TTT config key 'impl' was renamed 'backend'; impl='auto' is dropped", DeprecationWarning, 3
        )
    else:
        warnings.warn(
            f"TTT config key 'impl' was renamed 'backend'; impl={impl!r} reads as backend={backend!r}",
            FutureWarning,
            3,
        )
        cfg["backend"] = backend
    return cfg
