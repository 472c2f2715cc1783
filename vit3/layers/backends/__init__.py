"""Which implementation runs each branch of a TTT mixer, and why: the one place that decides.

A *backend* is one implementation of a branch's inner loop + read-out. All but the generic one run one fast
path of the ops in the table ``vit3.kernels.ops.OPS`` (the ops that have it, ``vit3.kernels.ops_with``), whose
``supports(branch, cfg, x) -> (ok, reason)`` and ``run`` are the branch's op's; each has a priority per
device type:

========  ==========================================================  ===========================
backend   what runs                                                   auto order
========  ==========================================================  ===========================
triton    the Triton op ``vit3.kernels.triton_ttt``                    CUDA: first
cpu       the C++ CPU kernel (``vit3.kernels.cpp``)                   CPU: first (SwiGLU from 32 tokens)
eager     the eager paths (``swiglu.eager``, ``dwconv.eager``)        CPU: second; CUDA: last
generic   closed-form ``inner_loop`` + ``apply_to`` (every config)    CPU: last; CUDA: second
========  ==========================================================  ===========================

``TTTConfig.backend`` names one (it wins over ``$VIT3_TTT_BACKEND``; both default to ``auto``); a named
backend that cannot serve a branch it implements falls back with a warning (an error under
``VIT3_TTT_STRICT=1``); branches it does not implement take the auto order silently. When every branch runs
on ``cpu`` / ``eager`` / ``triton`` (Triton outside tracing; ``registry.fuses``), all branches form one
eager node (``vit3.layers.eager_mix``; Triton's hooks take 16-bit q, k, v as they are); a branch that fails
inside it is demoted alone.

The mixer resolves its plan once per key (device, dtype, the inner-loop settings, each branch's inner model
and head dim, the token-count class, grad mode, tracing, the backend asked for) and caches it; each mixer
keeps the plans of its own calls too (one tuple per call to look up), cleared with the others (a demotion,
``reset``, ``refresh_env``: ``keep_with_plans``). The ``VIT3_*`` variables are read once, on first use: a
process that changes one later calls ``refresh_env()``.

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

A layer built under timm's ``set_scriptable(True)`` takes no plan (``scriptable_build``): the reference math,
which ``torch.jit.script`` compiles.

``TTTMixer.explain``, ``vit3.explain(model, input)`` and ``vit3-explain <model>`` report the
backend of every branch and why each other one was passed over, and what the backward recomputes.

Modules, bottom up: ``interface`` (what a backend sees, ``Backend``), ``registry`` (the backends, their order,
the choice), ``planner`` (keys, the plan cache, the ``VIT3_*`` environment, the recompute policy, the CPE rule),
``verify`` and ``guard`` (guarded first calls, demotion, ``KernelFault``), ``explain``.
"""

from .explain import BranchExplanation, MixerExplanation, ModelExplanation, explain_mixer
from .guard import KernelFault, run, run_branch, settled
from .interface import (
    MIN_CPU_KERNEL_TOKENS,
    Backend,
    Branch,
    Inputs,
    Settings,
    Step,
    legacy_onnx_dynamic_axes,
    token_class,
    tracing_kind,
)
from .planner import (
    RECOMPUTE_ENV,
    RECOMPUTE_MODES,
    REMOVED_ENV,
    SCRIPTABLE_PATH,
    STRICT_ENV,
    BackendWarning,
    Plan,
    conv_pos_kernel,
    cpu_block_kernel,
    keep_with_plans,
    plan,
    recompute_choice,
    recompute_mode,
    refresh_env,
    reset,
    scriptable_build,
)
from .registry import BACKEND_ENV, BACKENDS, NAMES, order
from .verify import VERIFY_RTOL, VerificationError

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "MIN_CPU_KERNEL_TOKENS",
    "NAMES",
    "RECOMPUTE_ENV",
    "RECOMPUTE_MODES",
    "REMOVED_ENV",
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
    "Plan",
    "Settings",
    "Step",
    "VerificationError",
    "conv_pos_kernel",
    "cpu_block_kernel",
    "explain_mixer",
    "keep_with_plans",
    "legacy_onnx_dynamic_axes",
    "order",
    "plan",
    "recompute_choice",
    "recompute_mode",
    "refresh_env",
    "reset",
    "run",
    "run_branch",
    "scriptable_build",
    "settled",
    "token_class",
    "tracing_kind",
]
