"""Which implementation runs each branch of a TTT mixer, and why: the one place that decides it.

A *backend* is one implementation of a branch's inner loop + read-out: ``triton``, ``cpu`` (C++),
``eager`` or ``generic`` (the closed-form inner loop, every config). ``TTTConfig.backend`` names one (over
``$VIT3_TTT_BACKEND``; both default to ``auto``, an order per device type). A call's route is cached per key;
a key's first calls run guarded and a backend that fails is demoted with one warning (``VIT3_TTT_STRICT=1``
raises). A call runs the mixer op (every branch on a fast path) or the generic path for every branch
(``registry.joined``); ``TTTMixer.explain`` says why.

Modules, bottom up: ``interface``, ``registry``, ``routes``, ``verify``, ``guard``, ``explain``. The rules
in full: ``docs/design/dispatch.md``.
"""

from .explain import BranchExplanation, MixerExplanation, ModelExplanation, explain_mixer
from .guard import KernelFault, guarded, settled, unguarded
from .interface import (
    MIN_CPU_KERNEL_TOKENS,
    Backend,
    Branch,
    Inputs,
    Settings,
    legacy_onnx_dynamic_axes,
    token_class,
)
from .registry import BACKEND_ENV, BACKENDS, NAMES, order
from .routes import (
    LEAN_DEFAULT,
    RECOMPUTE_ENV,
    RECOMPUTE_MODES,
    SCRIPTABLE_PATH,
    STRICT_ENV,
    BackendWarning,
    Route,
    conv_pos_kernel,
    cpu_block_kernel,
    cpu_block_reason,
    keep_with_routes,
    recompute_choice,
    recompute_mode,
    refresh_env,
    reset,
    route,
    scriptable_build,
)
from .verify import VERIFY_RTOL, VerificationError, specialisation

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "LEAN_DEFAULT",
    "MIN_CPU_KERNEL_TOKENS",
    "NAMES",
    "RECOMPUTE_ENV",
    "RECOMPUTE_MODES",
    "SCRIPTABLE_PATH",
    "STRICT_ENV",
    "VERIFY_RTOL",
    "Backend",
    "BackendWarning",
    "Branch",
    "BranchExplanation",
    "Inputs",
    "KernelFault",
    "MixerExplanation",
    "ModelExplanation",
    "Route",
    "Settings",
    "VerificationError",
    "conv_pos_kernel",
    "cpu_block_kernel",
    "cpu_block_reason",
    "explain_mixer",
    "guarded",
    "keep_with_routes",
    "legacy_onnx_dynamic_axes",
    "order",
    "recompute_choice",
    "recompute_mode",
    "refresh_env",
    "reset",
    "route",
    "scriptable_build",
    "settled",
    "specialisation",
    "token_class",
    "unguarded",
]
