"""A mixer call's route: the keys, the route cache, the recompute policy and the ``VIT3_*`` environment.

This module is the one reader of the ``VIT3_*`` variables: ``$VIT3_TTT_BACKEND`` (``registry.BACKEND_ENV``),
``$VIT3_TTT_STRICT`` and ``$VIT3_TTT_RECOMPUTE``. It reads them once, on first use (a CLI or trainer that
sets them before its first mixer call is served), into a snapshot that every call reads instead of
``os.environ``; code that changes them later calls
:func:`refresh_env` (the tests' ``monkeypatch.setenv`` does, through ``tests/conftest.py``). Every change
to what routes depend on (a refreshed environment, a demotion, ``reset``) drops the cached routes, the mixers'
own caches with them (:func:`keep_with_routes`). A layer built for TorchScript takes no route at all
(:func:`scriptable_build`).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from timm.layers import is_scriptable
from torch import Tensor

from vit3.errors import ConfigError
from vit3.kernels import cpp as cpu_ext

from ..config import RECOMPUTE_MODES
from ..fused_mix import mix_layout
from ..inner_math import tracing_kind
from .interface import Inputs, Settings
from .registry import BACKEND_ENV, BACKENDS, NAMES, Branch, Choice, choose, joined, not_implemented, order

STRICT_ENV = "VIT3_TTT_STRICT"
RECOMPUTE_ENV = "VIT3_TTT_RECOMPUTE"


class BackendWarning(UserWarning):
    """A backend was passed over or demoted (``warnings.filterwarnings`` can silence this category)."""


class _Env(NamedTuple):
    """The ``VIT3_*`` variables as read and checked by :func:`refresh_env`: the backend and the recompute mode
    asked for (``auto`` where unset) and whether a demotion raises."""

    backend: str
    strict: bool
    recompute: str


class _State:
    """All the dispatcher remembers, in one place: the environment's snapshot, the routes by call, the
    demotions (applied, and pending until a backward pass ends), the verified entries, the warnings given,
    and the caches of routes kept elsewhere (each mixer's ``Calls``, held weakly)."""

    def __init__(self) -> None:
        self.env: _Env | None = None
        self.routes: dict[tuple, Route] = {}
        self.demoted: dict[BranchKey, dict[str, str]] = {}  # key -> {backend: error}
        self.pending: dict[BranchKey, dict[str, str]] = {}  # demoted during a backward pass
        # (key, backend, specialisation or None) that ran a guarded, verified forward (+ backward)
        self.verified: set[tuple[BranchKey, str, tuple | None]] = set()
        self.warned: set[str] = set()
        self.kept: weakref.WeakSet = weakref.WeakSet()


def _read_env() -> _Env:
    """The ``VIT3_*`` variables, checked (a ``ConfigError`` naming one whose value it does not take)."""
    get = os.environ.get
    backend = (get(BACKEND_ENV) or "").strip().lower() or "auto"
    if backend not in NAMES:
        raise ConfigError(f"${BACKEND_ENV} must be one of {', '.join(NAMES)}, got {backend!r}")
    recompute = (get(RECOMPUTE_ENV) or "").strip().lower() or "auto"
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"${RECOMPUTE_ENV} must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    strict = (get(STRICT_ENV) or "").strip().lower()
    if strict not in STRICT_VALUES:
        raise ConfigError(f"${STRICT_ENV} must be 0 or 1, got {strict!r}")
    return _Env(backend, STRICT_VALUES[strict], recompute)


# ``$VIT3_TTT_STRICT``'s values (unset: off).
STRICT_VALUES = {
    **dict.fromkeys(("", "0", "false", "no", "off"), False),
    **dict.fromkeys(("1", "true", "yes", "on"), True),
}


def refresh_env() -> None:
    """Forgets the ``VIT3_*`` variables read and the routes made under them: the next use reads them again
    (they are read once, on first use); call it after changing one in a running process."""
    _STATE.env = None
    forget_routes()


def env() -> _Env:
    """The snapshot of the ``VIT3_*`` variables (read on first use, where no route can have read them yet: a
    first use under ``torch.compile`` leaves no guard on the routes; :func:`refresh_env`)."""
    if _STATE.env is None:
        _STATE.env = _read_env()
    return _STATE.env


def keep_with_routes(cache: Any) -> None:
    """Has :func:`forget_routes` clear ``cache`` too (an object with ``clear()``, held weakly): a cache of
    routes then needs no key of its own telling whether they still hold."""
    _STATE.kept.add(cache)


def forget_routes() -> None:
    """Drops every cached route (after a demotion, a new environment), the kept caches' too
    (:func:`keep_with_routes`): the next calls re-route."""
    _STATE.routes.clear()
    for cache in list(_STATE.kept):
        cache.clear()


def strict() -> bool:
    """``$VIT3_TTT_STRICT``: 0 or 1 (``false`` / ``true``, ``no`` / ``yes``, ``off`` / ``on``)."""
    return env().strict


def requested_backend(cfg_backend: str) -> tuple[str, str]:
    """The backend asked for and who asked: the config (argument, checked: ``config.check_backend``) wins over
    ``$VIT3_TTT_BACKEND``."""
    if cfg_backend != "auto":
        return cfg_backend, f"TTTConfig.backend={cfg_backend!r}"
    name = env().backend
    return name, f"{BACKEND_ENV}={name}"


# What ``explain`` says of every branch of a mixer built scriptable (``scriptable_build``).
SCRIPTABLE_PATH = "scriptable: reference path"
SCRIPTABLE_WHY = (
    f"{SCRIPTABLE_PATH} (built under timm's set_scriptable(True): TorchScript compiles the generic inner "
    "loop)"
)


def scriptable_build(cfg_backend: str = "auto") -> bool:
    """Whether a layer built now takes the path TorchScript compiles (``torch.jit.script``): the reference
    math of every branch (``InnerModel.ttt``, the generic backend's) and the blocks' plain PyTorch layers, no
    kernel and no route. Decided once, when the layer is built, by timm's layer config:
    ``timm.layers.set_scriptable(True)`` / ``set_layer_config(scriptable=True)`` /
    ``timm.create_model(name, scriptable=True)``, under which timm's contract is that the model scripts.
    ``$VIT3_TTT_BACKEND`` is not read then (a warning says so when set).

    Args:
        cfg_backend: the layer's ``TTTConfig.backend``.

    Raises:
        ValueError: ``cfg_backend`` names a kernel backend, which a scripted model cannot run.
    """
    if not is_scriptable():
        return False
    if cfg_backend not in ("auto", "generic"):
        raise ValueError(
            f"TTTConfig.backend={cfg_backend!r}: a model built scriptable (timm's set_scriptable(True)) runs "
            "the generic reference path TorchScript compiles; use backend 'auto' or 'generic'"
        )
    name = env().backend
    if cfg_backend == "auto" and name not in ("auto", "generic"):
        warn_once(f"vit3: {BACKEND_ENV}={name} is not read by a model built scriptable ({SCRIPTABLE_WHY}).")
    return True


def warn_once(message: str) -> None:
    """Warns ``message`` (a ``BackendWarning``) the first time only, until ``reset``."""
    if message not in _STATE.warned:
        _STATE.warned.add(message)
        warnings.warn(message, BackendWarning, stacklevel=4)


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
            f"{self.name} branch{wrapped}, head dim {self.head_dim}, {self.dtype}, {self.tokens} tokens, "
            f"{mode}, loss {s.loss}, steps {s.steps}, mini_batches {s.mini_batches}, lr_mode {s.lr_mode}"
        )


class Route(NamedTuple):
    """A mixer call's route: the backend of each branch, whether they form one fused node, the keys,
    and whether the fused eager paths recompute the per-token pre-activations in the backward (and why)."""

    backends: tuple[str, ...]
    fused: bool
    keys: tuple[BranchKey, ...]
    tracing: str
    args: tuple  # what ``route`` was called with (to re-route after a demotion)
    recompute: bool = True
    recompute_why: str = ""


# Who set the recompute mode when neither the config nor the environment names one (``recompute_mode``).
LEAN_DEFAULT = "memory-lean default"


def recompute_mode(cfg_recompute: str = "auto") -> tuple[str, str]:
    """The recompute mode in force (``always``, ``never`` or ``qkv``; ``auto`` is ``always``) and who set it:
    ``TTTConfig.recompute`` (checked: ``config.check_recompute``) wins over ``$VIT3_TTT_RECOMPUTE``."""
    if cfg_recompute != "auto":
        return cfg_recompute, f"TTTConfig.recompute={cfg_recompute!r}"
    mode = env().recompute
    return ("always" if mode == "auto" else mode), (
        LEAN_DEFAULT if mode == "auto" else f"{RECOMPUTE_ENV}={mode}"
    )


def recompute_choice(cfg_recompute: str = "auto") -> tuple[bool, str]:
    """Whether the SwiGLU backward of the fused eager paths recomputes Z = k W, Y = q W', and why.

    ``auto`` (memory-lean) and ``always`` recompute, ``never`` saves them. ``qkv`` recomputes the mixer's qkv
    projection and inner loops in its backward (``ttt._RecomputedMix``): the mixer then saves only its input,
    at more training FLOPs; inside that recomputation Z, Y are kept (for one mixer at a time). What each mode
    costs, as measured: ``docs/design/dispatch.md`` (memory-lean training).

    Args:
        cfg_recompute: ``TTTConfig.recompute`` (it wins over ``$VIT3_TTT_RECOMPUTE``).
    """
    mode, source = recompute_mode(cfg_recompute)
    if mode == "qkv":
        return False, (
            f"the mixer recomputes its qkv projection and inner loops in the backward ({source}; saved per "
            "token: the mixer input)"
        )
    if source == LEAN_DEFAULT:
        source = "auto: memory-lean"
    if mode == "never":
        return False, f"saves Z = k W, Y = q W' ({source}; 4·d more values per token and head)"
    return True, f"recomputes Z = k W, Y = q W' ({source}; saved per token and head: q, k, v)"


_STATE = _State()


def reset() -> None:
    """Forgets every cached route, demotion, verified key and warning, and the fused node's layouts (tests; a
    new device; an op replaced in the table)."""
    for state in (_STATE.demoted, _STATE.pending, _STATE.verified, _STATE.warned):
        state.clear()
    mix_layout.cache_clear()
    forget_routes()


def branch_keys(settings: Settings, branches: tuple, x: Inputs) -> tuple[BranchKey, ...]:
    """The ``BranchKey`` of each branch ``(inner model, heads, head_dim, plain)`` of a call on ``x``."""
    return tuple(
        BranchKey(x.device, x.dtype, x.tokens, x.grad, settings, name, d, plain)
        for name, _, d, plain in branches
    )


class Chosen(NamedTuple):
    """A call's choices (``call_choices``): the branch keys, each branch's own choice (``chosen``), the
    call's backends after ``joined`` (``choices``) and why they are not the mixer op (``apart``, ``""``)."""

    keys: tuple[BranchKey, ...]
    chosen: list[Choice]
    choices: list[Choice]
    apart: str


def call_choices(
    settings: Settings, branches: tuple, x: Inputs, requested: str, source: str,
    demoted: Mapping[BranchKey, Mapping[str, str]],
) -> Chosen:  # fmt: skip
    """The backends of a call on ``x`` for ``branches`` ``(inner model, heads, head_dim, plain)``, with the
    backends ``demoted`` per key passed over: what ``resolve`` routes and ``explain_mixer`` reports."""
    keys = branch_keys(settings, branches, x)
    chosen = [
        choose(Branch(i, *branch), settings, x, requested, source, demoted.get(key, {}))
        for i, (branch, key) in enumerate(zip(branches, keys))
    ]
    choices, apart = joined(chosen, [name for name, *_ in branches], settings.loss, x.tracing)
    return Chosen(keys, chosen, choices, apart)


def demotions() -> dict[BranchKey, dict[str, str]]:
    """Every demotion, those waiting for the end of a backward pass too: ``{key: {backend: error}}``."""
    out: dict[BranchKey, dict[str, str]] = {}
    for m in (_STATE.demoted, _STATE.pending):
        for key, errors in m.items():
            out.setdefault(key, {}).update(errors)
    return out


def demote(key: BranchKey, backend: str, error: str, in_backward: bool) -> None:
    """Demotes ``backend`` for ``key`` (``error``: why). In a backward pass the demotion waits for its end
    (``apply_pending``: recomputations keep their route); else it applies now, once ``forget_routes`` ran."""
    (_STATE.pending if in_backward else _STATE.demoted).setdefault(key, {})[backend] = error


def apply_pending() -> None:
    """End of a backward pass: its demotions apply to the calls that follow."""
    for key, errors in _STATE.pending.items():
        _STATE.demoted.setdefault(key, {}).update(errors)
    _STATE.pending.clear()
    forget_routes()


def mark_verified(entry: tuple[BranchKey, str, tuple | None]) -> None:
    """Records that ``(key, backend, specialisation or None)`` ran a guarded, verified forward (+backward)."""
    _STATE.verified.add(entry)


def is_verified(entry: tuple[BranchKey, str, tuple | None]) -> bool:
    """Whether ``entry`` was verified (``mark_verified``) since the last ``reset``."""
    return entry in _STATE.verified


def resolve(args: tuple, demoted: Mapping[BranchKey, Mapping[str, str]], warn: bool) -> Route:
    """The route of a mixer call made with ``args`` (``route``'s arguments), with the backends ``demoted``
    passed over; ``warn``: say what a named backend or the hardware refused (once per message)."""
    settings, cfg_backend, branches, device, dtype, tokens, grad, tracing, cfg_recompute = args
    settings = Settings(*settings)
    x = Inputs(device, dtype, tokens, grad, tracing)
    requested, source = requested_backend(cfg_backend)
    keys, chosen, choices, apart = call_choices(settings, branches, x, requested, source, demoted)
    if warn and requested != "auto":
        raises = strict()
        impl = BACKENDS[requested].models
        if impl is not None and not any(name in impl for name, *_ in branches):
            problems = [f"mixer: {not_implemented(BACKENDS[requested], [name for name, *_ in branches])}"]
        else:
            problems = [
                f"{name!r} branch: {c.named_refused}; {c.backend!r} serves it"
                for (name, *_), c in zip(branches, choices)
                if c.named_refused
            ]
            served = BACKENDS[requested].path is not None and any(c.backend == requested for c in chosen)
            if apart and served:  # a fast path that served a branch, but the call runs generic
                problems.append(f"mixer op: {apart}; every branch runs 'generic'")
        for problem in problems:
            message = (
                f"vit3: backend {requested!r} ({source}) cannot serve the {problem} (on {device}, {dtype})"
            )
            if raises:
                raise ValueError(f"{message}; unset {STRICT_ENV} to fall back")
            warn_once(message + ".")
    if warn and requested == "auto":  # a kernel that cannot run on this hardware steps aside with a warning
        rank = order(device.type)
        for (name, *_), c in zip(branches, choices):
            for backend, why in c.unfit:
                if backend in rank and rank.index(backend) < rank.index(c.backend):
                    warn_once(
                        f"vit3: {BACKENDS[backend].what} cannot run the {name!r} branch on "
                        f"{device_name(device)} ({dtype}): {why}; {c.backend!r} serves it."
                    )
    names = tuple(c.backend for c in choices)
    recompute, why = recompute_choice(cfg_recompute)
    return Route(names, not apart, keys, tracing, args, recompute, why)


@torch.compiler.assume_constant_result  # traced once by torch.compile: the route is a constant of the graph
def route(
    settings: tuple,
    cfg_backend: str,
    branches: tuple,
    device: torch.device,
    dtype: torch.dtype,
    tokens: str,
    grad: bool,
    tracing: str,
    recompute: str = "auto",
) -> Route:
    """The cached route of a mixer call (plain values only, so that compilers can fold the call).

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
    routes = _STATE.routes
    found = routes.get(args)
    if found is None:
        found = routes[args] = resolve(args, _STATE.demoted, warn=True)
    return found


def cpu_block_kernel(x: Tensor, backend: str = "auto") -> bool:
    """Whether a block's op outside the mixer (the CPE ``x + dwconv3x3(x)``, the lean MLP's node) runs on the
    C++ CPU kernel: CPU float32/float64 tensors, no autocast, not tracing (FX, jit, ONNX, compile), the
    backend asked for ``auto`` or ``cpu`` (``backend``, the block's ``TTTConfig.backend``, which wins over
    ``$VIT3_TTT_BACKEND`` as for the mixer), and the kernel built (else the PyTorch path serves, as a failed
    build warns through the mixer's backends). :func:`cpu_block_reason` says why not."""
    return not cpu_block_reason(x, backend)


def cpu_block_reason(x: Tensor, backend: str = "auto") -> str:
    """Why a block's op outside the mixer does not run on the C++ CPU kernel for ``x``; ``""``: it does
    (:func:`cpu_block_kernel`'s rule)."""
    if not isinstance(x, Tensor):  # an FX proxy: traced code takes the plain path
        return "traced: the layers' own paths serve"
    if x.device.type != "cpu":  # before tracing_kind: a GPU host's every block call asks
        return f"{x.device.type} tensors: the C++ kernel runs on CPUs"
    if x.dtype not in (torch.float32, torch.float64):
        return f"{x.dtype} tensors: the C++ kernel takes float32 and float64"
    if tracing_kind():  # before a size a tracer would record: one graph whatever the grad mode
        return "traced or compiled: the layers' own paths serve"
    if not x.numel():
        return "an empty batch: PyTorch's layers take it"
    if torch.is_autocast_enabled("cpu"):
        return "autocast: the C++ kernel takes float32 and float64 as they are"
    asked, who = requested_backend(backend)
    if asked not in ("auto", "cpu"):
        return f"{who}: the C++ kernel serves backend auto or cpu"
    if cpu_ext.load()[0] is None:
        return "the C++ kernel is not built"
    return ""


def conv_pos_kernel(x: Tensor, weight: Tensor, backend: str = "auto") -> bool:
    """Whether a ``ConvPosEnc`` (CPE, ``x + dwconv3x3(x)``, outside the mixer) runs on the C++ kernel's
    depthwise op instead of oneDNN (faster at every grid measured, ``docs/design/dispatch.md``): a 3x3 weight
    of the input's dtype and ``cpu_block_kernel``'s rule."""
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor):  # an FX proxy: traced code takes the conv
        return False
    if tracing_kind():  # before the weight's size, which a tracer would record
        return False
    if weight.dtype != x.dtype or weight.shape[-2:] != (3, 3):
        return False
    return cpu_block_kernel(x, backend)


def device_name(device: torch.device) -> str:
    """``device`` for messages: a CUDA device with its model name where the driver tells it."""
    if device.type == "cuda":
        try:
            return f"{torch.cuda.get_device_name(device)} ({device})"
        except Exception:  # no driver: name the device only
            pass
    return str(device)
