"""Memory-lean training, shared by the layers: when a lean path may run, and the convolution stacks that
recompute their full-resolution maps in the backward instead of saving them (the H-ViT³ stem and
downsampling). What each lean path saves, and what it costs: ``docs/mixer.md`` (training memory)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module_hooks
from torch.utils.checkpoint import checkpoint

from . import backends
from .config import check_recompute
from .inner_math import tracing

__all__ = ["RecomputedStack", "hooked", "lean_eligible"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def lean_eligible(x: Tensor) -> bool:
    """Gradients flow and the call is eager: not traced (jit, FX, ONNX) nor compiled, where plain ops serve,
    and the batch is not empty (plain ops take it)."""
    return torch.is_grad_enabled() and not tracing() and not isinstance(x, torch.fx.Proxy) and x.numel() > 0


def hooked(*modules: nn.Module) -> bool:
    """Whether calling one of ``modules`` would run more than its ``forward``: hooks (its own or global) or a
    compiled call (``Module.compile``); a lean path that calls around them would skip or repeat those."""
    g = _module_hooks
    if (
        g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
    ):
        return True
    for m in modules:  # a loop, not any() over a generator: this runs on every block call
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
        if m._compiled_call_impl is not None:
            return True
    return False


class RecomputedStack(nn.Sequential):
    """A stack of layers that, in training, saves only its input: the backward reruns the stack (a
    non-reentrant ``torch.utils.checkpoint``) for the gradients, so its wide intermediate maps are not kept
    alive between the forward and the backward.

    The rerun normalises by the batch as the forward did and leaves every BatchNorm's running statistics and
    batch count as the forward left them (the state after a step is the plain stack's). Lean when gradients
    flow, eager, no hooks on its layers (the stack's own run once), and ``recompute`` (the model's
    ``TTTConfig.recompute``, or ``$VIT3_TTT_RECOMPUTE`` under ``auto``) is not ``"never"``; else the plain
    stack.

    Args:
        *layers: the layers, applied in order.
        recompute: the model's ``TTTConfig.recompute``.
    """

    def __init__(self, *layers: nn.Module, recompute: str = "auto") -> None:
        super().__init__(*layers)
        self.recompute = check_recompute(recompute)

    def _lean(self, x: Tensor) -> bool:
        return (
            lean_eligible(x)
            and not hooked(*itertools.islice(self.modules(), 1, None))  # the layers: a rerun calls them
            and backends.recompute_mode(self.recompute)[0] != "never"
        )

    @contextlib.contextmanager
    def _rerun(self) -> Iterator[None]:
        """The rerun's context: the BatchNorms' running statistics and batch counts as they were before it
        (the rerun saves what the forward saved, so they run as in the forward, then get their state back)."""
        kept = [
            (t, t.clone())
            for m in self.modules()
            if isinstance(m, _BATCH_NORMS) and m.training and m.track_running_stats
            for t in (m.running_mean, m.running_var, m.num_batches_tracked)
            if t is not None
        ]
        try:
            yield
        finally:
            with torch.no_grad():
                for t, before in kept:
                    t.copy_(before)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), self._rerun()

    def _plain(self, x: Tensor) -> Tensor:
        for layer in self:
            x = layer(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        """The layers in order on ``x``; in training, saving ``x`` alone (the class docstring)."""
        if not torch.jit.is_scripting():  # TorchScript compiles the layers as they are
            if self._lean(x):
                return checkpoint(
                    self._plain, x, use_reentrant=False, preserve_rng_state=False, context_fn=self._contexts
                )
        return self._plain(x)
