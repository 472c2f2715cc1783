"""The backends, their order per device type, and the choice of one for a branch (``_choose``).

Each ``Backend`` implements the inner models of the ops that declare its fast path (``vit3.kernels.ops_with``);
``_choose`` takes the named one when it serves, else the first of the auto order that does, and says why
each other one was passed over. Who asks (config or environment) and what was demoted is the plan's
(``plan``): the choice reads neither.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from vit3.kernels import ops_with
from vit3.kernels.swiglu.eager import swiglu_ttt

from ..config import BACKEND_NAMES
from ..eager_mix import KINDS, MixBranch, MixPlan, eager_mix
from ..inner import inner_loop
from .interface import _FEW_TOKENS, MIN_CPU_KERNEL_TOKENS, Backend, Branch, Inputs, Settings, Step

BACKEND_ENV = (
    "VIT3_TTT_BACKEND"  # names a backend for every mixer whose config says "auto" (read by ``plan``)
)


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
            models=ops_with("cpp"),
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
