"""Which implementation runs each branch of a TTT mixer, and why: the one place that decides.

A *backend* is one implementation of a branch's inner loop + read-out. It implements the ops that declare its
fast path (``vit3.kernels.<op>.PATHS``, read through ``vit3.kernels.ops_with``) and has
``supports(branch, cfg, x) -> (ok, reason)`` and a priority per device type:

========  ==========================================================  ===========================
backend   what runs                                                   auto order
========  ==========================================================  ===========================
triton    the Triton op ``vit3.kernels.triton_ttt``                    CUDA: first
cpu       the C++ CPU kernel (``swiglu.cpp``, ``dwconv.cpp``)          CPU: first (SwiGLU from 32 tokens)
eager     the eager paths (``swiglu.eager``, ``dwconv.eager``)        CPU: second; CUDA: last
generic   closed-form ``inner_loop`` + ``apply_to`` (every config)    CPU: last; CUDA: second
========  ==========================================================  ===========================

``TTTConfig.backend`` names one (it wins over ``$VIT3_TTT_BACKEND``; both default to ``auto``); a named
backend that cannot serve a branch it implements falls back with a warning (an error under
``VIT3_TTT_STRICT=1``); branches it does not implement take the auto order silently. When every branch runs
on ``cpu`` / ``eager``, all branches form one eager node (``vit3.layers.eager_mix``).

The mixer resolves its plan once per key (device, dtype, the inner-loop settings, each branch's inner model
and head dim, the token-count class, grad mode, tracing, the backend asked for) and caches it.

Failures demote, never kill: the first calls of a key run guarded. A backend that raises there (a compile
error, ``OutOfResources``, a launch or build error), in the forward or in the backward, is demoted for that
key with one warning naming the device, the key and the error, and the next backend computes the result
(the backward recomputes the forward on the saved inputs). After one good forward (+ backward when grads
flow) the key runs unguarded. ``VIT3_TTT_STRICT=1`` raises instead. Traced and compiled code runs unguarded
(only ``triton`` under ``torch.compile`` and ``generic`` serve there). A backend compiled per input
specialisation (Triton's JIT: shapes, strides, alignment, which the key does not hold) runs guarded on the
first call of each new one, synchronised (an asynchronous fault surfaces inside the guard) and verified: the
output and input gradients of the first and last sample against the generic path's (``VERIFY_RTOL``); a
mismatch demotes like an error. A sticky GPU fault (the CUDA context lost) cannot be demoted: it raises
``KernelFault`` naming the kernels' backend and ``VIT3_TTT_BACKEND=generic``. A kernel that cannot run on the
hardware at hand (``Backend.fits``: shared memory, compute capability, ROCm's dot precisions) steps aside
with a warning. A double backward (``create_graph=True``) differentiates the guarded unit on its inputs
themselves; the Triton op's backward is then differentiable (autograd through its reference), the generic
path's always; the C++ and eager paths' backwards are not (``VIT3_TTT_BACKEND=generic`` serves).

Memory-lean training: the fused eager paths (``cpu``, ``eager``) save only q, k, v and the small weights of
a SwiGLU branch and recompute its per-token pre-activations Z = k W, Y = q W' in the backward, as the Triton
backward does (``recompute``: ``TTTConfig.recompute``, else ``$VIT3_TTT_RECOMPUTE``; ``auto`` and ``always``
recompute, ``never`` saves them, 4·d values per token and head apart, for a few % of a training step; ``qkv``
recomputes the whole mixer but its output projection in the backward, saving only the mixer's input). The
same switch makes the ViT³ block recompute its CPE output and its MLP's LayerNorm and GELU outputs
(``vit3.layers.blocks``) unless it is ``never``.

``TTTMixer.explain``, ``vit3.explain(model, input)`` and ``vit3-explain <model>`` report the
backend of every branch and why each other one was passed over, and what the backward recomputes.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from vit3.kernels import ops_with
from vit3.kernels.common import grad_flows
from vit3.kernels.ops import Branch, Inputs, Settings, Step
from vit3.kernels.swiglu.eager import swiglu_ttt

from ..config import BACKEND_NAMES, RECOMPUTE_MODES
from ..eager_mix import KINDS, MixBranch, MixPlan, eager_mix
from ..inner import inner_loop

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "MIN_CPU_KERNEL_TOKENS",
    "NAMES",
    "RECOMPUTE_ENV",
    "RECOMPUTE_MODES",
    "REMOVED_ENV",
    "STRICT_ENV",
    "VERIFY_RTOL",
    "Backend",
    "BackendWarning",
    "BranchExplanation",
    "KernelFault",
    "MixerExplanation",
    "ModelExplanation",
    "Plan",
    "VerificationError",
    "conv_pos_kernel",
    "explain_mixer",
    "plan",
    "recompute_choice",
    "recompute_mode",
    "reset",
]

BACKEND_ENV = "VIT3_TTT_BACKEND"
STRICT_ENV = "VIT3_TTT_STRICT"
RECOMPUTE_ENV = "VIT3_TTT_RECOMPUTE"
# The variables VIT3_TTT_BACKEND replaced: setting one warns once, naming its replacement.
REMOVED_ENV = {
    "VIT3_TTT_IMPL": "VIT3_TTT_BACKEND ('torch' -> 'eager' or 'generic', 'triton' -> 'triton')",
    "VIT3_TTT_KERNEL": "VIT3_TTT_BACKEND ('reference' -> 'generic')",
    "VIT3_CPU_KERNEL": "VIT3_TTT_BACKEND ('1' -> 'cpu', '0' -> 'eager')",
}
# Fewer tokens per head than this and auto keeps the tiled eager path on CPUs: it folds the problems of all
# samples into one tile, where the C++ kernel groups the heads of each sample into batched matmuls and pays
# a few ATen calls per sample (measured fwd+bwd, one thread: the kernel is 0.58x / 0.72x the tiled path at
# 4 / 16 tokens with B*H = 256, on par at 49 tokens with B*H = 1024, 1.1-1.6x at 16-64 tokens with
# B*H = 32 and from 196 tokens on).
MIN_CPU_KERNEL_TOKENS = 32


class BackendWarning(UserWarning):
    """A backend was passed over or demoted (``warnings.filterwarnings`` can silence this category)."""


# ------------------------------------------------------------------------------------------- what is seen


_FEW_TOKENS = f"N<{MIN_CPU_KERNEL_TOKENS}"


_ANY_TOKENS = "any N"


def token_class(n: int, tracing: str = "") -> str:
    """The token-count class of ``n`` tokens per head: the CPU kernel's rule (``MIN_CPU_KERNEL_TOKENS``).

    Under tracing (``tracing_kind()``) only the traceable paths serve, and they take any count: one class,
    decided without reading ``n``, so the rule becomes no guard on the traced program's size.
    """
    if tracing:
        return _ANY_TOKENS
    return _FEW_TOKENS if n < MIN_CPU_KERNEL_TOKENS else f"N>={MIN_CPU_KERNEL_TOKENS}"


def tracing_kind() -> str:
    """``"trace"`` under ``torch.jit.trace`` / ONNX export, ``"compile"`` under torch.compile / export, else ``""``."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return "trace"
    return "compile" if torch.compiler.is_compiling() else ""


# ---------------------------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class Backend:
    """One implementation of a branch's inner loop + read-out.

    Attributes:
        name: what ``TTTConfig.backend`` / ``$VIT3_TTT_BACKEND`` call it.
        what: a noun phrase for messages ("the Triton kernels").
        models: the inner models it implements (``None``: all).
        priority: rank per device type (higher first; ``"*"``: other device types); absent: only when named.
        supports: ``(branch, cfg, x) -> (ok, reason)``; may read only ``Settings`` / ``Inputs`` fields.
        run: ``(step, q, k, v, params, gate) -> out``, q, k, v ``[B, G, N, c]`` in the io dtype, the
            initial weights by name, the token lr gate ``[B, G, N]`` or ``None``; returns ``[B, G, N, c]``.
        prefers: auto only: ``(branch, cfg, x) -> (ok, reason)``, where auto passes a serving backend over.
        native: compiled code (kernels), the likeliest culprit when a fused node of several fails.
        fits: ``(branch, cfg, x) -> (ok, reason)``, asked once ``supports`` passed: whether the hardware at
            hand can run it. A refusal steps aside with a warning, in auto too (``_resolve``).
        specialises: compiled per input specialisation (Triton's JIT: shapes, strides, alignment), which the
            plan key does not hold: the first call of each new one runs guarded and verified (``run``).
    """

    name: str
    what: str
    models: tuple[str, ...] | None
    priority: Mapping[str, int]
    supports: Callable[[Branch, Settings, Inputs], tuple[bool, str]]
    run: Callable[..., Tensor]
    prefers: Callable[[Branch, Settings, Inputs], tuple[bool, str]] | None = None
    native: bool = False
    fits: Callable[[Branch, Settings, Inputs], tuple[bool, str]] | None = None
    specialises: bool = False

    def rank(self, device_type: str) -> int | None:
        return self.priority.get(device_type, self.priority.get("*"))


@functools.cache
def _kernels() -> tuple[Any, str]:
    """The Triton path ``vit3.kernels.triton_op``, or ``None`` and why it cannot be imported.

    Cached: a failing import (no Triton) would otherwise be retried by every mixer call.
    """
    try:
        from vit3.kernels import triton_op
    except Exception as exc:  # Triton missing or broken: the other paths serve
        return None, f"the Triton kernels cannot be imported ({type(exc).__name__}: {exc})"
    return triton_op, ""


def _bare(branch: Branch) -> str:
    """Why a fused path cannot run ``branch`` (``""`` when it can): they implement the bare inner models."""
    if branch.plain:
        return ""
    return "inner_norm / inner_bias wrap the inner model: the fused paths implement the bare models"


def _one_step(cfg: Settings) -> str:
    """Why a fused path cannot run ``cfg``'s inner loop (``""`` when it can): one full-batch step, fixed lr."""
    if cfg.steps != 1:
        return f"steps={cfg.steps}: fused paths take one inner step"
    if cfg.mini_batches != 1:
        return f"mini_batches={cfg.mini_batches}: fused paths take one full-batch step"
    if cfg.lr_mode != "fixed":
        return f"lr_mode={cfg.lr_mode!r}: per-token lr gates are not fused"
    return ""


def _triton_supports(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    kernels, why = _kernels()
    if kernels is None:
        return False, why
    losses = kernels.TRITON_LOSSES[branch.name]
    if cfg.loss not in losses:
        return False, f"loss {cfg.loss!r} is not fused for {branch.name!r} (fused: {', '.join(losses)})"
    if why := _bare(branch) or _one_step(cfg):
        return False, why
    if x.tracing == "trace":
        return False, "jit tracing / ONNX export: traceable ops serve"
    if x.dtype not in kernels.IO_DTYPES:
        return False, f"{x.dtype} inputs are not fused"
    if not kernels.triton_runs_on(x.device):
        if x.device.type == "cpu":
            return False, "CPU tensors: Triton runs them only under TRITON_INTERPRET=1"
        return False, f"{x.device.type} tensors: the Triton kernels run on CUDA GPUs"
    top = kernels.max_head_dim(branch.name)
    if branch.head_dim > top:
        return False, f"head dim {branch.head_dim} > {top}: wider tiles exceed on-chip shared memory"
    if branch.head_dim < kernels.MIN_HEAD_DIM:
        return False, f"head dim {branch.head_dim} < {kernels.MIN_HEAD_DIM}: below the smallest dot tile"
    return True, ""


def _triton_fits(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    """Whether this GPU can run the kernels (shared memory, compute capability, ROCm's dot precisions)."""
    return _kernels()[0].fits_device(branch.name, branch.head_dim, x.dtype, x.device)


def _eager_why(branch: Branch, cfg: Settings, x: Inputs) -> str:
    """Why the fused eager path (and the CPU kernel inside it) cannot serve, ``""`` when it can."""
    if why := _bare(branch):
        return why
    if cfg.loss != "dot":
        return f"loss {cfg.loss!r} is not fused (the eager path runs the dot loss)"
    if why := _one_step(cfg):
        return why
    if x.tracing:
        return "tracing/compiling: traceable ops serve"
    return ""


def _eager_supports(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    why = _eager_why(branch, cfg, x)
    return not why, why


def _cpu_supports(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    if why := _eager_why(branch, cfg, x):
        return False, why
    if x.device.type != "cpu":
        return False, f"{x.device.type} tensors: the C++ kernel runs CPU tensors"
    return True, ""


def _cpu_prefers(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    if branch.name == "swiglu" and x.tokens == _FEW_TOKENS:
        return False, (
            f"fewer than {MIN_CPU_KERNEL_TOKENS} tokens per head: the tiled path, which folds every sample's "
            "problems into one tile, is faster"
        )
    return True, ""


def _compute(q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """q, k, v and the weights in the inner loop's dtype: float32 at least (bf16/fp16 inner gradients are
    too coarse)."""
    ct = torch.promote_types(q.dtype, torch.float32)
    return q.to(ct), k.to(ct), v.to(ct), {name: p.to(ct) for name, p in params.items()}


def _run_triton(step: Step, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], gate: Any) -> Tensor:
    c = step.cfg
    return _kernels()[0].triton_ttt(
        step.name,
        q,
        k,
        v,
        params,
        grid=step.grid,
        scale=step.scale,
        lr=c.inner_lr,
        grad_norm=c.grad_norm,
        loss=c.loss,
        backend="triton",
    )


def _run_eager(cpp: bool) -> Callable[..., Tensor]:
    """The eager path of one branch: SwiGLU through ``swiglu_ttt`` (tiles, or the C++ kernel when ``cpp``),
    the depthwise conv as a one-branch ``eager_mix`` node (native convolutions, or the C++ kernel)."""

    def run(step: Step, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], gate: Any) -> Tensor:
        q, k, v, params = _compute(q, k, v, params)
        c = step.cfg
        if step.name == "swiglu":
            return swiglu_ttt(
                q,
                k,
                v,
                params["w1"],
                params["w2"],
                scale=step.scale,
                lr=c.inner_lr,
                grad_norm=c.grad_norm,
                recompute=step.recompute,
                cpp=cpp,
            )
        b, g, n, d = q.shape
        qkv = torch.cat([t.transpose(1, 2).reshape(b, n, g * d) for t in (q, k, v)], dim=-1)  # [B, N, 3*G*d]
        plan = MixPlan(
            (MixBranch("dwconv", 0, g, d, False, cpp),),
            step.grid,
            step.scale,
            c.inner_lr,
            c.grad_norm,
            c.rope_base,
            step.recompute,
        )
        return eager_mix(qkv, plan, [params["weight"]]).unflatten(-1, (g, d)).transpose(1, 2)

    return run


def _run_generic(step: Step, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], gate: Any) -> Tensor:

    q, k, v, params = _compute(q, k, v, params)
    c = step.cfg
    params = inner_loop(
        step.model,
        params,
        k,
        v,
        step.grid,
        loss=c.loss,
        scale=step.scale,
        lr=c.inner_lr,
        steps=c.steps,
        mini_batches=c.mini_batches,
        grad_norm=c.grad_norm,
        token_lr=gate,
    )
    return step.model.apply_to(params, q, step.grid)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "triton",
            what="the Triton kernels",
            models=ops_with("triton"),
            priority={"cuda": 3},
            supports=_triton_supports,
            run=_run_triton,
            native=True,
            fits=_triton_fits,
            specialises=True,
        ),
        Backend(
            "cpu",
            what="the C++ CPU kernel",
            models=ops_with("cpu"),
            priority={"cpu": 3},
            supports=_cpu_supports,
            run=_run_eager(cpp=True),
            prefers=_cpu_prefers,
            native=True,
        ),
        # The tiled walk is tuned for CPU caches: elsewhere auto prefers the generic path.
        Backend(
            "eager",
            what="the fused eager path",
            models=KINDS,
            priority={"cpu": 2, "*": 1},
            supports=_eager_supports,
            run=_run_eager(cpp=False),
        ),
        Backend(
            "generic",
            what="the generic inner loop",
            models=None,
            priority={"cpu": 1, "*": 2},
            supports=lambda branch, cfg, x: (True, ""),
            run=_run_generic,
        ),
    )
}
NAMES = BACKEND_NAMES  # what a config may name (vit3.layers.config): "auto" and these backends
# Backends that join the all-branches fused eager node.
_NODE = ("cpu", "eager")


def order(device_type: str) -> list[str]:
    """The backends auto tries on ``device_type``, first to last."""
    ranked = [(b.rank(device_type), b.name) for b in BACKENDS.values() if b.rank(device_type) is not None]
    return [name for _, name in sorted(ranked, key=lambda r: -r[0])]


def conv_pos_kernel(x: Tensor, weight: Tensor, backend: str = "auto") -> bool:
    """Whether a ``ConvPosEnc`` (CPE, ``x + dwconv3x3(x)``, outside the mixer) runs on the C++ kernel's
    depthwise op instead of oneDNN (measured one thread, 192 channels: forward 27 µs vs 138 µs at 14x14,
    0.44 ms vs 7.4 ms at 56x56, where oneDNN also needs an NCHW copy): CPU float32/float64 tensors of one
    dtype, no autocast, not tracing (FX, jit, ONNX, compile), a 3x3 kernel, the backend asked for ``auto`` or
    ``cpu`` (``backend``, the block's ``TTTConfig.backend``, which wins over ``$VIT3_TTT_BACKEND`` as for the
    mixer), and the kernel built (else the oneDNN convolution serves, as a failed build warns through the
    mixer's backends)."""
    if (
        not isinstance(x, Tensor)  # an FX proxy: traced code takes the plain convolution
        or x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.float64)
        or weight.dtype != x.dtype
        or weight.shape[-2:] != (3, 3)
        or torch.is_autocast_enabled("cpu")
        or tracing_kind()
    ):
        return False
    if _requested(backend)[0] not in ("auto", "cpu"):
        return False
    try:
        from vit3.kernels.swiglu.cpp import load
    except Exception:  # the kernels package cannot be imported: oneDNN serves
        return False
    return load()[0] is not None


# ------------------------------------------------------------------------------------------- the choice


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${name} must be 0 or 1, got {value!r}")


def _requested(cfg_backend: str) -> tuple[str, str]:
    """The backend asked for and who asked: the config (argument) wins over ``$VIT3_TTT_BACKEND``."""
    if cfg_backend != "auto":
        if cfg_backend not in NAMES:
            raise ValueError(f"TTTConfig.backend must be one of {', '.join(NAMES)}, got {cfg_backend!r}")
        return cfg_backend, f"TTTConfig.backend={cfg_backend!r}"
    env = os.environ.get(BACKEND_ENV, "").strip().lower() or "auto"
    if env not in NAMES:
        raise ValueError(f"${BACKEND_ENV} must be one of {', '.join(NAMES)}, got {env!r}")
    return env, f"{BACKEND_ENV}={env}"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, BackendWarning, stacklevel=4)


def _warn_removed_env() -> None:
    for name, replacement in REMOVED_ENV.items():
        if os.environ.get(name):
            _warn_once(
                f"vit3: ${name} is no longer read (it is set to {os.environ[name]!r}); use {replacement}."
            )


class BranchKey(NamedTuple):
    """What a branch's backend choice, its demotions and its guard depend on."""

    device: torch.device
    dtype: torch.dtype
    tokens: str
    grad: bool
    settings: Settings
    name: str
    head_dim: int
    plain: bool

    def __str__(self) -> str:
        mode = "training" if self.grad else "inference"
        s = self.settings
        wrapped = "" if self.plain else " (wrapped: inner_norm / inner_bias)"
        return (
            f"{self.name} branch{wrapped}, head dim {self.head_dim}, {self.dtype}, {self.tokens} tokens, {mode}, "
            f"loss {s.loss}, steps {s.steps}, mini_batches {s.mini_batches}, lr_mode {s.lr_mode}"
        )


def _not_in(b: Backend, names: list[str]) -> str:
    """Why ``b`` cannot serve inner models ``names`` it does not implement."""
    return f"no {', '.join(map(repr, dict.fromkeys(names)))} in {b.what} ({', '.join(b.models or ())} only)"


class Choice(NamedTuple):
    backend: str
    passed_over: tuple[tuple[str, str], ...]  # (backend, reason), in the order they were considered
    named_refused: str  # why the named backend cannot serve this branch it implements ("" if it can / n.a.)
    unfit: tuple[tuple[str, str], ...] = ()  # (backend, reason): refused by its ``fits`` (the hardware)


def _choose(
    branch: Branch, cfg: Settings, x: Inputs, requested: str, source: str, demoted: Mapping[str, str]
) -> Choice:
    """The backend of one branch: the named one when it serves, else the first of the auto order that does."""
    dev = x.device.type
    verdicts: dict[str, str] = {}  # backend -> why it cannot serve ("" if it can)
    unfit = []
    for b in BACKENDS.values():
        if b.name in demoted:
            verdicts[b.name] = f"demoted after it failed here: {demoted[b.name]}"
        elif b.models is not None and branch.name not in b.models:
            verdicts[b.name] = _not_in(b, [branch.name])
        else:
            ok, why = b.supports(branch, cfg, x)
            if ok and b.fits is not None:
                ok, why = b.fits(branch, cfg, x)
                unfit += [] if ok else [(b.name, why)]
            verdicts[b.name] = "" if ok else (why or "not supported")
    chosen, refused = None, ""
    if requested != "auto":
        b = BACKENDS[requested]
        if not verdicts[requested]:
            chosen = requested
        elif (b.models is None or branch.name in b.models) and requested not in demoted:
            refused = verdicts[requested]
    auto = order(dev)
    for name in auto if chosen is None else ():
        if verdicts[name]:
            continue
        prefers = BACKENDS[name].prefers
        ok, why = prefers(branch, cfg, x) if prefers is not None else (True, "")
        if ok:
            chosen = name
            break
        verdicts[name] = why
    assert chosen is not None, "the generic backend serves every branch"
    passed = []
    considered = [requested] * (requested != "auto") + auto + list(BACKENDS)
    for name in dict.fromkeys(n for n in considered if n != chosen):
        if verdicts[name]:
            why = verdicts[name]
        elif chosen == requested:
            why = f"{chosen!r} is named ({source})"
        elif name in auto:
            why = f"{chosen!r} ranks higher on {dev}"
        else:
            why = f"not used on {dev} unless named ({BACKEND_ENV}={name} or TTTConfig.backend)"
        passed.append((name, why))
    return Choice(chosen, tuple(passed), refused, tuple(unfit))


class Plan(NamedTuple):
    """A mixer call's plan: the backend of each branch, whether they form one fused eager node, the keys,
    and whether the fused eager paths recompute the per-token pre-activations in the backward (and why)."""

    backends: tuple[str, ...]
    fused: bool
    keys: tuple[BranchKey, ...]
    tracing: str
    args: tuple  # what ``plan`` was called with (to re-plan after a demotion)
    recompute: bool = True
    recompute_why: str = ""


def recompute_mode(cfg_recompute: str = "auto") -> tuple[str, str]:
    """The recompute mode in force (``always``, ``never`` or ``qkv``; ``auto`` is ``always``) and who set it:
    ``TTTConfig.recompute`` wins over ``$VIT3_TTT_RECOMPUTE``."""
    if cfg_recompute not in RECOMPUTE_MODES:
        raise ValueError(
            f"TTTConfig.recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {cfg_recompute!r}"
        )
    if cfg_recompute != "auto":
        return cfg_recompute, f"TTTConfig.recompute={cfg_recompute!r}"
    mode = os.environ.get(RECOMPUTE_ENV, "").strip().lower() or "auto"
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"${RECOMPUTE_ENV} must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    return ("always" if mode == "auto" else mode), (
        "memory-lean default" if mode == "auto" else f"{RECOMPUTE_ENV}={mode}"
    )


def recompute_choice(cfg_recompute: str = "auto") -> tuple[bool, str]:
    """Whether the SwiGLU backward of the fused eager paths recomputes Z = k W, Y = q W', and why.

    ``auto`` (memory-lean: measured on CPU, a ViT³-T training step is within 1-4% of the saving variant at
    224 and 896 px, while the mixer's inner loop alone pays 3% at 196 tokens per head and 10-20% at 3136) and
    ``always`` recompute, ``never`` saves them. ``qkv`` recomputes the mixer's qkv projection and inner loops in
    its backward (``TTTMixer.forward``): the mixer then saves only its input (~12% more training FLOPs for
    ViT³-T); inside that recomputation Z, Y are kept (for one mixer at a time).

    Args:
        cfg_recompute: ``TTTConfig.recompute`` (it wins over ``$VIT3_TTT_RECOMPUTE``).
    """
    mode, source = recompute_mode(cfg_recompute)
    if mode == "qkv":
        return False, (
            f"the mixer recomputes its qkv projection and inner loops in the backward ({source}; saved per "
            "token: the mixer input)"
        )
    if source == "memory-lean default":
        source = "auto: memory-lean"
    if mode == "never":
        return False, f"saves Z = k W, Y = q W' ({source}; 4·d more values per token and head)"
    return True, f"recomputes Z = k W, Y = q W' ({source}; saved per token and head: q, k, v)"


_plans: dict[tuple, Plan] = {}
_demoted: dict[BranchKey, dict[str, str]] = {}  # key -> {backend: error}
_pending: dict[BranchKey, dict[str, str]] = {}  # demoted during a backward pass, applied at its end
# (key, backend, specialisation or None) that ran a guarded, verified forward (+ backward)
_verified: set[tuple[BranchKey, str, tuple | None]] = set()


def reset() -> None:
    """Forgets every cached plan, demotion, verified key and warning (tests; a new device)."""
    for state in (_plans, _demoted, _pending, _verified, _warned):
        state.clear()


def _keys(settings: Settings, branches: tuple, x: Inputs) -> tuple[BranchKey, ...]:
    return tuple(
        BranchKey(x.device, x.dtype, x.tokens, x.grad, settings, name, d, plain)
        for name, _, d, plain in branches
    )


def _merged(*maps: Mapping[BranchKey, Mapping[str, str]]) -> dict[BranchKey, dict[str, str]]:
    out: dict[BranchKey, dict[str, str]] = {}
    for m in maps:
        for key, errors in m.items():
            out.setdefault(key, {}).update(errors)
    return out


def _resolve(args: tuple, demoted: Mapping[BranchKey, Mapping[str, str]], warn: bool) -> Plan:
    settings, cfg_backend, branches, device, dtype, tokens, grad, tracing, cfg_recompute = args
    settings = Settings(*settings)
    x = Inputs(device, dtype, tokens, grad, tracing)
    requested, source = _requested(cfg_backend)
    keys = _keys(settings, branches, x)
    choices = [
        _choose(Branch(i, *branch), settings, x, requested, source, demoted.get(key, {}))
        for i, (branch, key) in enumerate(zip(branches, keys))
    ]
    if warn and requested != "auto":
        strict = _env_flag(STRICT_ENV)
        impl = BACKENDS[requested].models
        if impl is not None and not any(name in impl for name, *_ in branches):
            problems = [f"mixer: {_not_in(BACKENDS[requested], [name for name, *_ in branches])}"]
        else:
            problems = [
                f"{name!r} branch: {c.named_refused}; {c.backend!r} serves it"
                for (name, *_), c in zip(branches, choices)
                if c.named_refused
            ]
        for problem in problems:
            message = (
                f"vit3: backend {requested!r} ({source}) cannot serve the {problem} (on {device}, {dtype})"
            )
            if strict:
                raise ValueError(f"{message}; unset {STRICT_ENV} to fall back")
            _warn_once(message + ".")
    if warn and requested == "auto":  # a kernel that cannot run on this hardware steps aside with a warning
        rank = order(device.type)
        for (name, *_), c in zip(branches, choices):
            for backend, why in c.unfit:
                if backend in rank and rank.index(backend) < rank.index(c.backend):
                    _warn_once(
                        f"vit3: {BACKENDS[backend].what} cannot run the {name!r} branch on "
                        f"{_device_name(device)} ({dtype}): {why}; {c.backend!r} serves it."
                    )
    names = tuple(c.backend for c in choices)
    recompute, why = recompute_choice(cfg_recompute)
    return Plan(names, all(n in _NODE for n in names), keys, tracing, args, recompute, why)


@torch.compiler.assume_constant_result  # traced once by torch.compile: the plan is a constant of the graph
def plan(
    settings: tuple,
    cfg_backend: str,
    branches: tuple,
    device: torch.device,
    dtype: torch.dtype,
    tokens: str,
    grad: bool,
    tracing: str,
    recompute: str = "auto",
) -> Plan:
    """The cached plan of a mixer call (plain values only, so that compilers can fold the call).

    Args:
        settings: ``Settings`` fields of the mixer's config, as a tuple.
        cfg_backend: ``TTTConfig.backend``.
        branches: ``((inner model, heads, head_dim, plain), ...)`` (``Branch`` fields after ``index``).
        device, dtype: of the qkv projection output.
        tokens: ``token_class(N)``.
        grad: whether gradients flow through the mixer.
        tracing: ``tracing_kind()``.
        recompute: ``TTTConfig.recompute``.
    """
    args = (settings, cfg_backend, branches, device, dtype, tokens, grad, tracing, recompute)
    key = (*args, *(os.environ.get(name) for name in (BACKEND_ENV, STRICT_ENV, RECOMPUTE_ENV)))
    found = _plans.get(key)
    if found is None:
        _warn_removed_env()
        found = _plans[key] = _resolve(args, _demoted, warn=True)
    return found


# ------------------------------------------------------------------------------------ guards and demotion


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            return f"{torch.cuda.get_device_name(device)} ({device})"
        except Exception:  # no driver: name the device only
            pass
    return str(device)


def _apply_pending() -> None:
    """End of a backward pass: its demotions apply to the calls that follow."""
    for key, errors in _pending.items():
        _demoted.setdefault(key, {}).update(errors)
    _pending.clear()
    _plans.clear()


@contextmanager
def _no_autocast(device: torch.device) -> Iterator[None]:
    with torch.autocast(device_type=device.type, enabled=False):
        yield


class KernelFault(RuntimeError):
    """A backend's kernel faulted on a GPU and the CUDA context went with it: the fault is sticky, so no other
    backend can take over in this process."""


class VerificationError(RuntimeError):
    """A backend's first call of a new input specialisation disagreed with the generic path."""


# Relative RMS error (per tensor) above which a verified call counts as wrong, by io dtype: far above
# rounding and TF32 dots (~1e-3), far below what a wrong pointer or an unwritten tile gives (~1, or NaN).
VERIFY_RTOL = {torch.float64: 1e-6}
VERIFY_RTOL_DEFAULT = 0.1


def _specialisation(tensors: Sequence[Tensor]) -> tuple:
    """What a JIT-compiled backend specialises on beyond the plan key, as far as its inputs decide it: the
    shape, strides and storage offset of q, k, v (Triton: sizes and strides equal to 1 or multiples of 16,
    16-byte aligned pointers; and the grid). The weights' (``[1, G, ...]``, contiguous) are the key's; a
    gate's follow q's."""
    return tuple((t.shape, t.stride(), t.storage_offset()) for t in tensors[:3])


def _entry(plan: Plan, i: int, shapes: tuple | None) -> tuple:
    """Branch ``i``'s entry in ``_verified``: its key and backend, and the specialisation if it has them."""
    name = plan.backends[i]
    return plan.keys[i], name, shapes if BACKENDS[name].specialises else None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _context_lost(device: torch.device) -> bool:
    """Whether ``device``'s CUDA context is unusable after an error: a kernel's fault (an illegal address, a
    device-side assert) is sticky, every later call on the device fails with it; a compile, launch-size or
    memory error is not."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
    except Exception:
        return True
    return False


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _samples(b: int) -> list[int]:
    """The samples a verification recomputes: the first and the last (where a grid or stride error shows)."""
    return [0, b - 1] if b > 1 else [0]


def _rel_rms(got: Tensor, want: Tensor) -> float:
    """Relative RMS error of ``got`` against ``want`` (infinite where ``got`` is not finite but ``want`` is)."""
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(want).all():
        return 0.0  # non-finite inputs: nothing to hold the backend to
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


class _Guard:
    """One guarded unit of a mixer call: branches ``units`` computed by ``compute(plan, *tensors)``; ``shapes``
    the inputs' specialisation (``_specialisation``) where a unit's backend specialises on it, else ``None``."""

    def __init__(
        self, plan: Plan, units: tuple[int, ...], compute: Callable[..., Tensor], shapes: tuple | None
    ) -> None:
        self.plan, self.units, self.compute, self.shapes = plan, units, compute, shapes
        self.first = plan  # whose kernels a sticky fault is laid to, even where it surfaces in a fallback

    def checks(self) -> bool:
        """Whether this call is verified against the generic path: a unit's backend specialises per input."""
        return self.shapes is not None and any(
            BACKENDS[self.plan.backends[i]].specialises for i in self.units
        )

    def forward(self, *tensors: Tensor) -> Tensor:
        """``compute`` on the current plan; where ``checks``, synchronised (an asynchronous fault surfaces here,
        inside the guard) and the output of the first and last sample compared with the generic path's."""
        out = self.compute(self.plan, *tensors)
        if self.checks():
            _synchronize(out.device)
            with torch.no_grad():  # nothing recorded: activation checkpointing counts the saved tensors
                want = self.compute(self._reference_plan(), *self._slice(tensors))
                self._compare("output", self._slice([out])[0], want)
        return out

    def check_backward(
        self, leaves: Sequence[Tensor], grads: Sequence[Tensor | None], grad_out: Tensor
    ) -> None:
        """The gradients of the batched inputs (first and last sample) against the generic path's; the others
        (the initial weights, summed over the batch) must be finite."""
        _synchronize(grad_out.device)
        b = leaves[0].shape[0]
        sliced = [s.detach().requires_grad_(t.requires_grad) for s, t in zip(self._slice(leaves), leaves)]
        with torch.enable_grad():
            out = self.compute(self._reference_plan(), *sliced)
        wanted = [s for s in sliced if s.requires_grad]
        want = iter(torch.autograd.grad(out, wanted, self._slice([grad_out])[0], allow_unused=True))
        got = iter(grads)
        for j, t in enumerate(leaves):
            if not t.requires_grad:
                continue
            g, w = next(got), next(want)
            if g is None or w is None:
                continue
            if b == 1 or t.shape[0] == b:
                self._compare(f"gradient of input {j}", self._slice([g])[0] if b > 1 else g, w)
            elif not torch.isfinite(g).all():
                raise VerificationError(f"the gradient of input {j} is not finite")

    def _reference_plan(self) -> Plan:
        p = self.plan
        names = tuple("generic" if i in self.units else name for i, name in enumerate(p.backends))
        return p._replace(backends=names, fused=False)

    def _slice(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The first and last sample of every batched tensor (leading dim B, as the first one's); the others
        (the initial weights, leading dim 1) whole. The inner loops are per sample."""
        b = self.shapes[0][0][0]
        if b == 1:
            return list(tensors)
        idx = _samples(b)
        return [t[idx] if t.shape[0] == b else t for t in tensors]

    def _compare(self, what: str, got: Tensor, want: Tensor) -> None:
        tol = VERIFY_RTOL.get(got.dtype, VERIFY_RTOL_DEFAULT)
        err = _rel_rms(got, want)
        if err > tol:
            b = self.shapes[0][0][0]
            raise VerificationError(
                f"the {what} of samples {_samples(b)} differs from the generic path's on the first call of this "
                f"input specialisation (batch {b}): relative RMS error {err:.3g} > {tol:g}"
            )

    def demote(self, exc: Exception, phase: str, in_backward: bool) -> None:
        """Demotes the backend(s) that raised ``exc`` for their keys and re-plans; re-raises when strict,
        for out-of-memory errors and when only the generic path was left. A sticky GPU fault raises
        ``KernelFault`` naming the kernels that ran first: no backend can compute on that GPU any more."""
        p = self.plan
        device = p.keys[self.units[0]].device
        if _context_lost(device):
            raise self._fault(exc, phase, device) from exc
        if isinstance(exc, torch.cuda.OutOfMemoryError) or _env_flag(STRICT_ENV):
            raise exc
        live = [i for i in self.units if p.backends[i] != "generic"]
        # In a fused node of several branches the kernels are the likeliest culprits.
        culprits = [i for i in live if BACKENDS[p.backends[i]].native] or live
        if not culprits:
            raise exc
        error = _error_line(exc)
        fresh = []
        for i in culprits:
            key, name = p.keys[i], p.backends[i]
            if name not in {**_demoted.get(key, {}), **_pending.get(key, {})}:
                fresh.append((i, key, name))
            # A forward that fails fails with or without gradients: both keys are demoted.
            for k in (key, key._replace(grad=not key.grad)) if phase == "forward" else (key,):
                (_pending if in_backward else _demoted).setdefault(k, {})[name] = f"{error} ({phase})"
        if in_backward:
            try:  # the demotion applies once this backward pass is over (recomputations keep their plan)
                torch.autograd.Variable._execution_engine.queue_callback(_apply_pending)
            except RuntimeError:
                _apply_pending()
        else:
            _plans.clear()
        self.plan = _resolve(p.args, _merged(_demoted, _pending), warn=False)
        for i, key, name in fresh:
            _warn_once(
                f"vit3: backend {name!r} failed in the {phase} on {_device_name(key.device)} for the {key}: "
                f"{error}. It is demoted for this key; {self.plan.backends[i]!r} computes the result "
                f"(set {STRICT_ENV}=1 to raise instead)."
            )

    def _fault(self, exc: Exception, phase: str, device: torch.device) -> KernelFault:
        p = self.first
        ran = [p.backends[i] for i in self.units]
        names = list(dict.fromkeys([n for n in ran if BACKENDS[n].native] or ran))
        return KernelFault(
            f"vit3: backend {', '.join(map(repr, names))} faulted on {_device_name(device)} in the {phase} for "
            f"the {p.keys[self.units[0]]}: {_error_line(exc)}. A GPU fault is sticky: this process cannot use "
            f"the GPU any more, so no other backend can take over. Run with {BACKEND_ENV}=generic to keep the "
            "kernels out, and report the fault with this message."
        )

    def verify(self) -> None:
        _verified.update(_entry(self.plan, i, self.shapes) for i in self.units)


class _GuardFn(torch.autograd.Function):
    """Runs a unit under its own autograd graph so that a failing backward can be caught and recomputed."""

    @staticmethod
    def forward(ctx: Any, guard: _Guard, *tensors: Tensor) -> Tensor:
        # Leaves of the inner graph; nothing goes through save_for_backward, so the saved tensors (and the
        # saved-tensor hooks of activation checkpointing) are those of the unguarded path. The inputs
        # themselves (the leaves' storage) are kept for a double backward.
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        with torch.enable_grad():
            out = guard.forward(*leaves)
        ctx.guard, ctx.leaves, ctx.out, ctx.inputs = guard, leaves, out, tensors
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True
            return (None, *_GuardFn.differentiable_grads(ctx, grad_out))
        guard, leaves, out = ctx.guard, ctx.leaves, ctx.out
        wanted = [t for t in leaves if t.requires_grad]
        while True:
            try:
                if out is None:  # re-run the forward on the saved inputs with the demoted plan
                    with torch.enable_grad(), _no_autocast(grad_out.device):
                        out = ctx.out = guard.compute(guard.plan, *leaves)
                grads = torch.autograd.grad(out, wanted, grad_out, retain_graph=True, allow_unused=True)
                if guard.checks():
                    guard.check_backward(leaves, grads, grad_out)
                break
            except Exception as exc:
                guard.demote(exc, "forward" if out is None else "backward", in_backward=True)
                out = None
        guard.verify()
        it = iter(grads)
        return (None, *(next(it) if t.requires_grad else None for t in leaves))

    @staticmethod
    def differentiable_grads(ctx: Any, grad_out: Tensor) -> list[Tensor | None]:
        """A backward that is itself differentiable (``create_graph=True``): the unit recomputed on the inputs
        themselves, not on the detached leaves, so that a second backward reaches them."""
        guard, inputs = ctx.guard, ctx.inputs
        wanted = [t for t in inputs if t.requires_grad]
        while True:
            try:
                with _no_autocast(grad_out.device):
                    out = guard.compute(guard.plan, *inputs)
                grads = torch.autograd.grad(out, wanted, grad_out, create_graph=True, allow_unused=True)
                break
            except Exception as exc:
                guard.demote(exc, "backward", in_backward=True)
        it = iter(grads)
        return [next(it) if t.requires_grad else None for t in inputs]


def run(
    plan: Plan, units: tuple[int, ...], compute: Callable[..., Tensor], tensors: Sequence[Tensor]
) -> Tensor:
    """``compute(plan, *tensors)`` for branches ``units`` of a mixer call, guarded on a key's first calls, and
    on the first call of each new input specialisation of a backend that specialises (Triton).

    Args:
        plan: the call's plan.
        units: the branches ``compute`` covers (one, or all of a fused node).
        compute: ``(plan, *tensors) -> Tensor``, run again with the re-planned backends after a failure.
        tensors: every tensor input gradients may flow to (q, k, v or qkv, the weights, a gate).
    """
    if plan.tracing or all(plan.backends[i] == "generic" for i in units):
        return compute(plan, *tensors)
    shapes = _specialisation(tensors) if any(BACKENDS[plan.backends[i]].specialises for i in units) else None
    if all(_entry(plan, i, shapes) in _verified for i in units):
        return compute(plan, *tensors)
    guard = _Guard(plan, units, compute, shapes)
    grad = grad_flows(*tensors)
    while True:
        try:
            out = _GuardFn.apply(guard, *tensors) if grad else guard.forward(*tensors)
        except Exception as exc:
            guard.demote(exc, "forward", in_backward=False)
            continue
        if not grad:
            guard.verify()
        return out


def run_branch(
    plan: Plan,
    i: int,
    step: Step,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: dict[str, Tensor],
    gate: Tensor | None,
    guard: bool = True,
) -> Tensor:
    """Branch ``i``'s inner loop and read-out on its planned backend (guarded unless ``guard=False``).

    Args:
        q, k, v: ``[B, G, N, c]`` (views of the qkv projection, io dtype).
        params: the branch's initial weights by name.
        gate: the token lr gate ``[B, G, N]`` or ``None``.

    Returns:
        ``[B, G, N, c]``.
    """
    names = list(params)

    def compute(p: Plan, q: Tensor, k: Tensor, v: Tensor, *rest: Tensor) -> Tensor:
        g = rest[len(names)] if gate is not None else None
        return BACKENDS[p.backends[i]].run(step, q, k, v, dict(zip(names, rest)), g)

    tensors = [q, k, v, *params.values(), *([gate] if gate is not None else [])]
    return run(plan, (i,), compute, tensors) if guard else compute(plan, *tensors)


# ------------------------------------------------------------------------------------------------ explain


@dataclass(frozen=True)
class BranchExplanation:
    """One branch: the backend chosen and why each other one was passed over."""

    index: int
    name: str
    heads: int
    head_dim: int
    backend: str
    passed_over: tuple[tuple[str, str], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "branch": self.index,
            "inner_model": self.name,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "backend": self.backend,
            "passed_over": dict(self.passed_over),
        }


@dataclass(frozen=True)
class MixerExplanation:
    """Which backend runs each branch of a mixer for one input, and why (``str()`` is a readable table)."""

    dim: int
    num_heads: int
    device: str
    dtype: str
    tokens: int
    grid: tuple[int, int]
    grad: bool
    requested: str
    fused: bool
    branches: tuple[BranchExplanation, ...]
    # training with a SwiGLU branch on ``cpu`` / ``eager``: what its backward recomputes or saves, and why
    recompute: str = ""

    def __str__(self) -> str:
        mode = "training" if self.grad else "inference"
        lines = [
            f"TTTMixer dim={self.dim} heads={self.num_heads} | {self.device} {self.dtype} | N={self.tokens} "
            f"({self.grid[0]}x{self.grid[1]}) | {mode} | backend {self.requested}",
            "  " + ("one fused eager node runs every branch" if self.fused else "branch by branch"),
        ]
        if self.recompute:
            lines.append(f"  SwiGLU backward: {self.recompute}")
        rows = [("branch", "backend", "passed over")]
        for b in self.branches:
            label = f"{b.index} {b.name} x{b.heads} d={b.head_dim}"
            first = True
            for name, why in b.passed_over or (("", ""),):
                rows.append(
                    (label if first else "", b.backend if first else "", f"{name}: {why}" if name else "")
                )
                first = False
        widths = [max(len(r[j]) for r in rows) for j in range(2)]
        lines += [f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}".rstrip() for r in rows]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "num_heads": self.num_heads,
            "device": self.device,
            "dtype": self.dtype,
            "tokens": self.tokens,
            "grid": list(self.grid),
            "grad": self.grad,
            "requested": self.requested,
            "fused_node": self.fused,
            "recompute": self.recompute,
            "branches": [b.to_dict() for b in self.branches],
        }


def explain_mixer(
    mixer: nn.Module, device: torch.device, dtype: torch.dtype, grid: tuple[int, int], grad: bool
) -> MixerExplanation:
    """The plan a call of ``mixer`` (a ``TTTMixer``: this registry stands below the mixer, which calls it) would
    take, with reasons (no warnings, nothing cached)."""
    cfg = mixer.cfg
    settings = Settings(cfg.loss, cfg.steps, cfg.mini_batches, cfg.lr_mode)
    n = grid[0] * grid[1]
    x = Inputs(device, dtype, token_class(n), grad, "")
    requested, source = _requested(cfg.backend)
    branches = mixer.plan_branches
    demoted = _merged(_demoted, _pending)
    out = []
    for i, ((name, heads, d, plain), key) in enumerate(zip(branches, _keys(settings, branches, x))):
        c = _choose(Branch(i, name, heads, d, plain), settings, x, requested, source, demoted.get(key, {}))
        out.append(BranchExplanation(i, name, heads, d, c.backend, c.passed_over))
    lean = grad and (
        recompute_mode(cfg.recompute)[0] == "qkv"
        or any(b.name == "swiglu" and b.backend in _NODE for b in out)
    )
    return MixerExplanation(
        mixer.dim,
        mixer.num_heads,
        str(device),
        str(dtype),
        n,
        tuple(grid),
        grad,
        "auto" if requested == "auto" else source,
        all(b.backend in _NODE for b in out),
        tuple(out),
        recompute_choice(cfg.recompute)[1] if lean else "",
    )


@dataclass(frozen=True)
class ModelExplanation:
    """``explain(model, input)``: each distinct mixer plan, with the mixers (module names) that take it."""

    groups: tuple[tuple[tuple[str, ...], MixerExplanation], ...]

    def __str__(self) -> str:
        if not self.groups:
            return "no TTT mixers ran"
        parts = []
        for names, expl in self.groups:
            where = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]} ({len(names)} mixers)"
            parts.append(f"{where}:\n{expl}")
        return "\n\n".join(parts)

    def to_dict(self) -> list[dict[str, Any]]:
        return [{"mixers": list(names), **expl.to_dict()} for names, expl in self.groups]
