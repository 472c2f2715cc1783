"""The backends, their order per device type, the choice of one for a branch (``choose``) and of the call.

Each ``Backend`` but the generic one runs one fast path of the ops (``vit3.kernels.ops``) in the mixer op: it
implements the ops that have that path, and its checks are the branch's op's (``_on_path``). ``choose`` takes
the named one when it serves, else the first of the auto order that does, and says why each other one was
passed over; ``joined`` makes a call the mixer op or the generic inner loop for every branch. Who asks
(config or environment) and what was demoted is the route's (``routes``): the choice reads neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from vit3.kernels.ops import OPS

from ..config import BACKEND_NAMES
from .interface import Backend, Branch, Inputs, Settings

BACKEND_ENV = (
    "VIT3_TTT_BACKEND"  # names a backend for every mixer whose config says "auto" (read by ``routes``)
)


def _on_path(path: str) -> dict[str, Callable[..., Any]]:
    """A backend's ``supports`` / ``prefers`` / ``fits``: those of fast path ``path`` of the branch's op
    (``OPS[name].paths[path]``, looked up per call: an op registered later is served too). A path without
    ``prefers`` / ``fits`` passes them."""

    def supports(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
        return OPS[branch.name].paths[path].supports(branch, cfg, x)

    def prefers(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
        check = OPS[branch.name].paths[path].prefers
        return check(branch, cfg, x) if check is not None else (True, "")

    def fits(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
        check = OPS[branch.name].paths[path].fits
        return check(branch, cfg, x) if check is not None else (True, "")

    return {"supports": supports, "prefers": prefers, "fits": fits}


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
        ),
    )
}
NAMES = BACKEND_NAMES  # what a config may name (vit3.layers.config): "auto" and these backends
# Backends whose SwiGLU backward in the fused node may recompute Z = k W, Y = q W' (``Route.recompute``).
LEAN_BACKENDS = ("cpu", "eager")


def apart(names: Sequence[str], branches: Sequence[str], loss: str, tracing: str) -> str:
    """Why a mixer call whose branches (inner models ``branches``) run on backends ``names`` is not the mixer
    op (``fused_mix``), ``""`` where it is: every backend runs a fast path (each has the op's hooks), on the
    dot loss the op takes; compiled, the op runs one path for every branch or for none."""
    if loss != "dot":
        return f"the mixer op takes the dot loss only (loss {loss!r})"
    for i, (name, model) in enumerate(zip(names, branches)):
        if BACKENDS[name].path is None:
            return f"branch {i} ({model!r}) has no fast path here, and the mixer op runs every branch or none"
    paths = {BACKENDS[name].path for name in names}
    if tracing and len(paths) > 1:
        return f"compiled, the mixer op runs one path for every branch or for none, not {sorted(paths)}"
    return ""


def joined(
    choices: Sequence[Choice], branches: Sequence[str], loss: str, tracing: str
) -> tuple[list[Choice], str]:
    """The backends of a mixer call from its branches' choices, and why they do not form the mixer op (``""``
    where they do): a call runs the op or the generic inner loop, never branch by branch. Where the choices
    do not form the op (``apart``), every branch takes ``generic``, each fast backend that could serve it
    passed over with that reason."""
    why = apart([c.backend for c in choices], branches, loss, tracing)
    if not why:
        return list(choices), ""
    out = []
    for c in choices:
        if c.backend == "generic":
            out.append(c)
            continue
        others = ((n, why if n in c.serving else r) for n, r in c.passed_over if n != "generic")
        out.append(c._replace(backend="generic", passed_over=((c.backend, why), *others)))
    return out, why


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
    serving: tuple[str, ...] = ()  # the backends that could serve the branch, the chosen one among them


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
    serving = tuple(name for name, why in verdicts.items() if not why)
    return Choice(chosen, tuple(passed), refused, tuple(unfit), serving)
