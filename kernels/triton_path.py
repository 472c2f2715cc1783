"""The Triton path of every op: its ``supports``, ``fits`` and fused-node hooks
(``triton_path(name)``, one :class:`~vit3.kernels.ops.Path` per op).

Built only on the public Triton names of ``vit3.kernels`` (``triton_ttt``, ``TRITON_LOSSES``, ``IO_DTYPES``,
``triton_runs_on``, ``max_head_dim``, ``MIN_HEAD_DIM``, ``fits_device``) and the node hooks of
``triton/node.py``, which import Triton on first use: the ops' tables and the other paths load without it.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

from torch import Tensor

from .ops import Branch, Hyper, Inputs, Node, NodeCall, Path, Settings, Whole
from .paths import bare_why, one_step_why

__all__ = ["triton_path"]


@functools.cache
def _kernels() -> tuple[Any, str]:
    """``vit3.kernels`` with its Triton names importable, or ``None`` and why Triton cannot be imported.

    Cached: a failing import (no Triton) would otherwise be retried by every mixer call.
    """
    kernels = sys.modules[__package__]
    try:
        kernels.triton_ttt  # noqa: B018  (the first Triton name imports the Triton op)
    except Exception as exc:  # Triton missing or broken: the other paths serve
        return None, f"the Triton kernels cannot be imported ({type(exc).__name__}: {exc})"
    return kernels, ""


def _supports(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    kernels, why = _kernels()
    if kernels is None:
        return False, why
    if why := bare_why(branch) or one_step_why(cfg):
        return False, why
    if cfg.loss != "dot":  # the mixer op's loss; ``triton_ttt`` runs a branch alone on TRITON_LOSSES
        losses = ", ".join(kernels.TRITON_LOSSES[branch.name])
        return False, f"loss {cfg.loss!r} is not fused in the mixer op (dot; triton_ttt alone: {losses})"
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


def _fits(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    """Whether this GPU can run the kernels (shared memory, compute capability, ROCm's dot precisions)."""
    return _kernels()[0].fits_device(branch.name, branch.head_dim, x.dtype, x.device)


@functools.cache
def _triton(name: str) -> Any:
    """``vit3.kernels.triton.<name>`` (imports Triton: on the first node call, not with the table)."""
    return importlib.import_module(f"{__package__}.triton.{name}")


def _node_backward(
    d_out: Tensor, saved: tuple[Tensor, ...], tag: str, dq: Tensor, dk: Tensor, dv: Tensor, hyper: Hyper
) -> tuple[Tensor, ...]:
    return _triton("node").backward(d_out, saved, tag, dq, dk, dv, hyper)


@functools.cache
def _whole() -> Whole:
    """A node whose branches are all on Triton: one launch program for all of them (``triton/program.py``),
    its functions called directly (a mixer call's host time counts on a GPU). Made once: a test that watches
    the program patches ``MixProgram``'s methods, not these functions."""
    program = _triton("program")
    return Whole(program.forward, program.backward, program.state, program.saved_like)


def triton_path(name: str) -> Path:
    """Op ``name``'s Triton path: its hooks in the fused node (heads views, float16 / bfloat16 inputs as they
    are, a backward differentiable through the reference; a node of Triton branches alone runs as one launch
    program)."""

    def forward(call: NodeCall) -> tuple[list[Tensor], str]:
        return _triton("node").forward(name, call)

    node = Node(
        heads=True,
        forward=forward,
        backward=_node_backward,
        low_precision=True,
        twice=True,
        whole=_whole,
    )
    return Path(supports=_supports, fits=_fits, node=node)
