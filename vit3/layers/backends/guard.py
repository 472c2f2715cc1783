"""Failures demote, never kill: the guarded first calls of a key, verification, demotion, ``KernelFault``.

See the package docstring (``vit3.layers.backends``) for the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from vit3.kernels.common import grad_flows

from ..fused_mix import BRANCH_ATTR
from . import verify
from .registry import BACKENDS
from .routes import (
    BACKEND_ENV,
    STRICT_ENV,
    Route,
    apply_pending,
    demote,
    demotions,
    device_name,
    forget_routes,
    is_verified,
    mark_verified,
    resolve,
    strict,
    warn_once,
)
from .verify import VerificationError, compare, sliced, specialisation, synchronize


@contextmanager
def _no_autocast(device: torch.device) -> Iterator[None]:
    with torch.autocast(device_type=device.type, enabled=False):
        yield


class KernelFault(RuntimeError):
    """A backend's kernel faulted on a GPU and the CUDA context went with it: the fault is sticky, so no other
    backend can take over in this process."""


def _entry(route: Route, i: int, shapes: tuple | None) -> tuple:
    """Branch ``i``'s entry among the verified ones (``mark_verified``): its key and backend, and the
    specialisation if it has them."""
    name = route.backends[i]
    return route.keys[i], name, shapes if BACKENDS[name].specialises else None


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


class _Guard:
    """One guarded mixer call: its branches (``units``) computed by ``compute(route, *tensors)``; ``shapes``
    the inputs' specialisation (``verify.specialisation``) where a branch's backend specialises on it, else
    ``None``."""

    def __init__(self, route: Route, compute: Callable[..., Tensor], shapes: tuple | None) -> None:
        self.route, self.compute, self.shapes = route, compute, shapes
        self.units = tuple(range(len(route.backends)))
        self.first = route  # whose kernels a sticky fault is laid to, even where it surfaces in a fallback

    def checks(self) -> bool:
        """Whether this call is verified against the generic path: a unit's backend specialises per input
        (and ``verify.COMPARE`` is on)."""
        return (
            verify.COMPARE
            and self.shapes is not None
            and any(BACKENDS[self.route.backends[i]].specialises for i in self.units)
        )

    def forward(self, *tensors: Tensor) -> Tensor:
        """``compute`` on the current route; where ``checks``, synchronised (an asynchronous fault surfaces
        here, inside the guard) and the output of the first and last sample compared with the generic
        path's."""
        out = self.compute(self.route, *tensors)
        if self.checks():
            synchronize(out.device)
            with torch.no_grad():  # nothing recorded: activation checkpointing counts the saved tensors
                want = self.compute(self._reference_route(), *self._slice(tensors))
                self._compare("output", self._slice([out])[0], want)
        return out

    def check_backward(
        self, leaves: Sequence[Tensor], grads: Sequence[Tensor | None], grad_out: Tensor
    ) -> None:
        """The gradients of the batched inputs (first and last sample) against the generic path's; the others
        (the initial weights, summed over the batch) must be finite."""
        synchronize(grad_out.device)
        b = leaves[0].shape[0]
        sliced = [s.detach().requires_grad_(t.requires_grad) for s, t in zip(self._slice(leaves), leaves)]
        with torch.enable_grad():
            out = self.compute(self._reference_route(), *sliced)
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

    def _reference_route(self) -> Route:
        p = self.route
        return p._replace(backends=("generic",) * len(p.backends), fused=False)

    def _slice(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        return sliced(tensors, self.shapes[0][0][0])

    def _compare(self, what: str, got: Tensor, want: Tensor) -> None:
        compare(what, got, want, self.shapes[0][0][0])

    def demote(self, exc: Exception, phase: str, in_backward: bool) -> None:
        """Demotes the backend(s) that raised ``exc`` for their keys and re-routes; re-raises when strict,
        for out-of-memory errors and when only the generic path was left. A sticky GPU fault raises
        ``KernelFault`` naming the kernels that ran first: no backend can compute on that GPU any more."""
        p = self.route
        device = p.keys[self.units[0]].device
        if _context_lost(device):
            raise self._fault(exc, phase, device) from exc
        if isinstance(exc, torch.cuda.OutOfMemoryError) or strict():
            raise exc
        live = [i for i in self.units if p.backends[i] != "generic"]
        # The branch whose hooks raised in a fused node (``BRANCH_ATTR``, its index among ``units``); else
        # the kernels are the likeliest culprits.
        failed = getattr(exc, BRANCH_ATTR, None)
        if failed is not None and failed < len(self.units) and self.units[failed] in live:
            culprits = [self.units[failed]]
        else:
            culprits = [i for i in live if BACKENDS[p.backends[i]].native] or live
        if not culprits:
            raise exc
        error = _error_line(exc)
        fresh, known = [], demotions()
        for i in culprits:
            key, name = p.keys[i], p.backends[i]
            if name not in known.get(key, {}):
                fresh.append((i, key, name))
            # A forward that fails fails with or without gradients: both keys are demoted.
            for k in (key, key._replace(grad=not key.grad)) if phase == "forward" else (key,):
                demote(k, name, f"{error} ({phase})", in_backward)
        if in_backward:
            try:  # the demotion applies once this backward pass is over (recomputations keep their route)
                torch.autograd.Variable._execution_engine.queue_callback(apply_pending)
            except RuntimeError:
                apply_pending()
        else:
            forget_routes()
        self.route = resolve(p.args, demotions(), warn=False)
        for i, key, name in fresh:
            warn_once(
                f"vit3: backend {name!r} failed in the {phase} on {device_name(key.device)} for the {key}: "
                f"{error}. It is demoted for this key; {self.route.backends[i]!r} computes the result "
                f"(set {STRICT_ENV}=1 to raise instead)."
            )

    def _fault(self, exc: Exception, phase: str, device: torch.device) -> KernelFault:
        p = self.first
        ran = [p.backends[i] for i in self.units]
        names = list(dict.fromkeys([n for n in ran if BACKENDS[n].native] or ran))
        return KernelFault(
            f"vit3: backend {', '.join(map(repr, names))} faulted on {device_name(device)} "
            f"in the {phase} for the {p.keys[self.units[0]]}: {_error_line(exc)}. "
            "A GPU fault is sticky: this process cannot use the GPU any more, so no other backend can take "
            f"over. Run with {BACKEND_ENV}=generic to keep the kernels out, and report the fault with this "
            "message."
        )

    def verify(self) -> None:
        for i in self.units:
            mark_verified(_entry(self.route, i, self.shapes))


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
                if out is None:  # re-run the forward on the saved inputs with the demoted route
                    with torch.enable_grad(), _no_autocast(grad_out.device):
                        out = ctx.out = guard.compute(guard.route, *leaves)
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
                    out = guard.compute(guard.route, *inputs)
                grads = torch.autograd.grad(out, wanted, grad_out, create_graph=True, allow_unused=True)
                break
            except Exception as exc:
                guard.demote(exc, "backward", in_backward=True)
        it = iter(grads)
        return [next(it) if t.requires_grad else None for t in inputs]


def settled(route: Route) -> bool:
    """Whether a mixer call on ``route`` runs unguarded on every call from now on: traced, on the generic
    path, or verified on backends that do not specialise per input. It holds until the routes are forgotten (a
    demotion, ``reset``, ``refresh_env``), so callers may cache it with the route in a cache that
    ``keep_with_routes`` clears with the routes (``TTTMixer``'s ``Calls``)."""
    if route.tracing or not route.fused:
        return True
    units = range(len(route.backends))
    return not any(BACKENDS[route.backends[i]].specialises for i in units) and all(
        is_verified(_entry(route, i, None)) for i in units
    )


def unguarded(route: Route, tensors: Sequence[Tensor]) -> tuple | None:
    """What a mixer call on ``route`` with ``tensors`` (``guarded``'s) runs unguarded on: ``()`` where the
    route is ``settled``, the input specialisation (``verify.specialisation``) where every branch has verified
    it on a backend that specialises; ``None``: the call runs ``guarded``. Asked once per call."""
    if settled(route):
        return ()
    units = range(len(route.backends))
    if not any(BACKENDS[route.backends[i]].specialises for i in units):
        return None
    shapes = specialisation(tensors)
    return shapes if all(is_verified(_entry(route, i, shapes)) for i in units) else None


def guarded(route: Route, compute: Callable[..., Tensor], tensors: Sequence[Tensor]) -> Tensor:
    """``compute(route, *tensors)`` guarded: a mixer call that does not run ``unguarded``, a key's first calls
    and the first call of each new input specialisation of a backend that specialises (Triton).

    Args:
        route: the call's route.
        compute: ``(route, *tensors) -> Tensor``, run again with the re-routed backends after a failure.
        tensors: every tensor input gradients may flow to (qkv and the initial weights).
    """
    units = range(len(route.backends))
    shapes = specialisation(tensors) if any(BACKENDS[route.backends[i]].specialises for i in units) else None
    guard = _Guard(route, compute, shapes)
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
