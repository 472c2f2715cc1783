"""The backends, their order per device type, and the choice of one for a branch (``choose``).

Each ``Backend`` but the generic one runs one fast path of the ops (``vit3.kernels.ops``): it implements the
ops that have that path, and its ``supports`` / ``run`` are the branch's op's (``_on_path``);
``choose`` takes the named one when it serves, else the first of the auto order that does, and says why
each other one was passed over. Who asks (config or environment) and what was demoted is the plan's
(``planner``): the choice reads neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from vit3.kernels.ops import OPS
from vit3.kernels.paths import compute_inputs

from ..config import BACKEND_NAMES
from ..fused_mix import WHOLE_PATH, MixBranch, MixSpec, fused_mix
from .interface import Backend, Branch, Inputs, Settings, Step

BACKEND_ENV = (
    "VIT3_TTT_BACKEND"  # names a backend for every mixer whose config says "auto" (read by ``planner``)
)


def _on_path(path: str) -> dict[str, Callable[..., Any]]:
    """A backend's ``supports`` / ``prefers`` / ``fits`` / ``run``: those of fast path ``path`` of the
    branch's op (``OPS[name].paths[path]``, looked up per call: an op registered later is served too). A path
    without ``prefers`` / ``fits`` passes them; one without ``run`` runs as a one-branch fused node."""

    def supports(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
        return OPS[branch.name].paths[path].supports(branch, cfg, x)

    def prefers(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
        check = OPS[branch.name].paths[path].prefers
        return check(branch, cfg, x) if check is not None else (True, "")

    def fits(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
        check = OPS[branch.name].paths[path].fits
        return check(branch, cfg, x) if check is not None else (True, "")

    def run(step: Step, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], gate: Any) -> Tensor:
        found = OPS[step.name].paths[path]
        if found.run is not None:
            return found.run(step, q, k, v, params, gate)
        return _run_node(step, path, *compute_inputs(q, k, v, params))

    return {"supports": supports, "prefers": prefers, "fits": fits, "run": run}


def _run_node(step: Step, path: str, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor]) -> Tensor:
    """One branch as a one-branch fused node (``fused_mix``) on the op's path ``path``; q, k, v
    ``[B, G, N, d]`` (RoPE, where it applies, already on q and k) -> ``[B, G, N, d]``."""
    c = step.cfg
    b, g, n, d = q.shape
    qkv = torch.cat([t.transpose(1, 2).reshape(b, n, g * d) for t in (q, k, v)], dim=-1)  # [B, N, 3*G*d]
    spec = MixSpec(
        (MixBranch(step.name, 0, g, d, False, path),),
        step.grid,
        step.scale,
        c.inner_lr,
        c.grad_norm,
        c.rope_base,
        step.recompute,
    )
    weights = [params[name] for name in OPS[step.name].weights]
    return fused_mix(qkv, spec, weights).unflatten(-1, (g, d)).transpose(1, 2)


def _run_generic(step: Step, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], gate: Any) -> Tensor:
    """The branch's inner model's own reference step (``InnerModel.ttt``: the inner loop, the read-out on q),
    which a model built scriptable runs under TorchScript too."""
    c = step.cfg
    return step.model.ttt(
        q, k, v, params, step.grid, gate, c.loss, step.scale, c.inner_lr, c.steps, c.mini_batches, c.grad_norm
    )


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "triton",
            what="the Triton kernels",
            path="triton",
            priority={"cuda": 3},
            native=True,
            specialises=True,
            **_on_path("triton"),
        ),
        Backend(
            "cpu", what="the C++ CPU kernel", path="cpu", priority={"cpu": 3}, native=True, **_on_path("cpu")
        ),
        # The tiled walk is tuned for CPU caches: elsewhere auto prefers the generic path.
        Backend(
            "eager",
            what="the fused eager path",
            path="eager",
            priority={"cpu": 2, "*": 1},
            **_on_path("eager"),
        ),
        # The generic inner loop (``vit3.layers.inner``) is no op's path: it trains every inner model.
        Backend(
            "generic",
            what="the generic inner loop",
            path=None,
            priority={"cpu": 1, "*": 2},
            supports=lambda branch, cfg, x: (True, ""),
            run=_run_generic,
        ),
    )
}
NAMES = BACKEND_NAMES  # what a config may name (vit3.layers.config): "auto" and these backends
# Backends whose SwiGLU backward in the fused node may recompute Z = k W, Y = q W' (``Plan.recompute``).
LEAN_BACKENDS = ("cpu", "eager")


def fuses(names: Sequence[str], branches: Sequence[str], loss: str, tracing: str) -> bool:
    """Whether a mixer call whose branches (inner models ``branches``) run on backends ``names`` is one fused
    node (``fused_mix``): every backend runs a path with node hooks for its branch's op, on the dot
    loss the node takes. Traced, branches on Triton fuse only all together: the mixer op
    (``fused_mix.mix_op``) runs them, as one op of the graph."""
    if loss != "dot":
        return False
    paths = [BACKENDS[name].path for name in names]
    if any(path is None or OPS[model].paths[path].node is None for path, model in zip(paths, branches)):
        return False
    return not tracing or all(p == WHOLE_PATH for p in paths) or WHOLE_PATH not in paths


def order(device_type: str) -> list[str]:
    """The backends auto tries on ``device_type``, first to last."""
    ranked = [(b.rank(device_type), b.name) for b in BACKENDS.values() if b.rank(device_type) is not None]
    return [name for _, name in sorted(ranked, key=lambda r: -r[0])]


def not_implemented(b: Backend, names: list[str]) -> str:
    """Why ``b`` cannot serve inner models ``names`` it does not implement."""
    return f"no {', '.join(map(repr, dict.fromkeys(names)))} in {b.what} ({', '.join(b.models or ())} only)"


class Choice(NamedTuple):
    backend: str
    passed_over: tuple[tuple[str, str], ...]  # (backend, reason), in the order they were considered
    named_refused: str  # why the named backend cannot serve this branch it implements ("" if it can / n.a.)
    unfit: tuple[tuple[str, str], ...] = ()  # (backend, reason): refused by its ``fits`` (the hardware)


def choose(
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
            verdicts[b.name] = not_implemented(b, [branch.name])
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
