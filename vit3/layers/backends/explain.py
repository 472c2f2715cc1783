"""Why each branch of a mixer takes its backend: the explanation types and ``explain_mixer``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vit3.kernels.ops import OPS

from ..fused_mix import whole_path
from .interface import Inputs, Settings, token_class
from .registry import BACKENDS, LEAN_BACKENDS
from .routes import (
    SCRIPTABLE_PATH,
    SCRIPTABLE_WHY,
    Route,
    call_choices,
    demotions,
    recompute_choice,
    recompute_mode,
    requested_backend,
)


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
    # the fused node runs every branch in one call of their path's whole-node hooks (Triton's launch program,
    # the C++ kernel's whole-mixer op; under torch.compile the mixer op ``vit3::mix`` runs them)
    program: bool = False
    # settled calls run as the whole-mixer C++ op (``torch.ops.vit3_cpu.mix``), no node in Python
    cpp_op: bool = False

    def __str__(self) -> str:
        mode = "training" if self.grad else "inference"
        lines = [
            f"TTTMixer dim={self.dim} heads={self.num_heads} | {self.device} {self.dtype} | N={self.tokens} "
            f"({self.grid[0]}x{self.grid[1]}) | {mode} | backend {self.requested}",
            "  " + "; ".join(self._route()),
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

    def _route(self) -> list[str]:
        """How the call runs: the node, then, where they apply, the settled C++ op and the compiled op."""
        parts = ["one fused node runs every branch" if self.fused else "the generic inner loop, every branch"]
        if self.program:
            parts[0] += f", as one {self._whole()}"
        if self.cpp_op:
            parts.append("settled (after its first calls, run guarded): as one C++ op, vit3_cpu::mix")
        if self.program:
            parts.append("under torch.compile: the graph's one op vit3::mix")
        return parts

    def _whole(self) -> str:
        """What runs the branches' whole-node hooks: Triton's launch program or the C++ whole-mixer op."""
        return "C++ call" if self.branches[0].backend == "cpu" else "launch program"

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
            "whole_call": self.program,
            "cpp_op": self.cpp_op,
            "recompute": self.recompute,
            "branches": [b.to_dict() for b in self.branches],
        }


def explain_mixer(
    mixer: nn.Module, device: torch.device, dtype: torch.dtype, grid: tuple[int, int], grad: bool
) -> MixerExplanation:
    """The route a call of ``mixer`` (a ``TTTMixer``: this registry stands below the mixer, which calls it)
    would take, with reasons (no warnings, nothing cached); a mixer built scriptable (``scriptable_build``)
    runs the reference path, every branch on ``generic``."""
    cfg = mixer.cfg
    settings = Settings(cfg.loss, cfg.steps, cfg.mini_batches, cfg.lr_mode)
    n = grid[0] * grid[1]
    if mixer.scriptable:
        return _scriptable(mixer, device, dtype, grid, grad)
    x = Inputs(device, dtype, token_class(n), grad, "")
    requested, source = requested_backend(cfg.backend)
    branches = mixer.route_branches
    found = call_choices(settings, branches, x, requested, source, demotions())
    fused = not found.apart
    out = [
        BranchExplanation(i, name, heads, d, c.backend, c.passed_over)
        for i, ((name, heads, d, _), c) in enumerate(zip(branches, found.choices))
    ]
    program = fused and _one_program(mixer, out, grid)
    # asked of the mixer (its call's rule) where every branch takes the C++ kernel at all
    cpp_op = (
        fused and all(b.backend == "cpu" for b in out) and mixer.runs_cpp_op(_fused_route(out), grid, dtype)
    )
    lean = grad and (
        recompute_mode(cfg.recompute)[0] == "qkv"
        or any(b.name == "swiglu" and b.backend in LEAN_BACKENDS for b in out)
    )
    return MixerExplanation(
        *_call_of(mixer, device, dtype, grid, grad),
        "auto" if requested == "auto" else source,
        fused,
        tuple(out),
        recompute_choice(cfg.recompute)[1] if lean else "",
        program,
        cpp_op,
    )


def _scriptable(
    mixer: nn.Module, device: torch.device, dtype: torch.dtype, grid: tuple[int, int], grad: bool
) -> MixerExplanation:
    """``explain_mixer`` of a mixer built scriptable: every branch on the generic reference path, by build."""
    others = tuple((name, SCRIPTABLE_WHY) for name in BACKENDS if name != "generic")
    branches = tuple(
        BranchExplanation(i, name, heads, d, "generic", others)
        for i, (name, heads, d, _) in enumerate(mixer.route_branches)
    )
    return MixerExplanation(*_call_of(mixer, device, dtype, grid, grad), SCRIPTABLE_PATH, False, branches)


def _call_of(
    mixer: nn.Module, device: torch.device, dtype: torch.dtype, grid: tuple[int, int], grad: bool
) -> tuple:
    """The fields a ``MixerExplanation`` opens with: the mixer and the call (width, heads, device, dtype,
    tokens, grid, gradients)."""
    return mixer.dim, mixer.num_heads, str(device), str(dtype), grid[0] * grid[1], tuple(grid), grad


def _fused_route(out: list[BranchExplanation]) -> Route:
    """The fused ``Route`` of the branches' backends (what the mixer's rules read of a route)."""
    return Route(tuple(b.backend for b in out), True, (), "", ())


def _one_program(mixer: nn.Module, out: list[BranchExplanation], grid: tuple[int, int]) -> bool:
    """Whether the fused node runs every branch in one call of their path's whole-node hooks (``Node.whole``),
    as the mixer's call would (``fused_mix.whole_path`` of its ``MixSpec`` on these backends); ``False``
    without asking the mixer where a branch's path has none."""
    if not all(OPS[b.name].paths[b.backend].node.whole for b in out):
        return False
    return whole_path(mixer.mix_spec(_fused_route(out), grid))


@dataclass(frozen=True)
class ModelExplanation:
    """``explain(model, input)``: each distinct mixer route, with the mixers (module names) that take it, and
    whether the blocks that hold them run as one op (``blocks``: the block names by the reason they run layer
    by layer, ``""`` where they run as one op; blocks that can say so: ``TTTBlock.explain_one_op``)."""

    groups: tuple[tuple[tuple[str, ...], MixerExplanation], ...]
    blocks: tuple[tuple[tuple[str, ...], str], ...] = ()

    def __str__(self) -> str:
        if not self.groups:
            return "no TTT mixers ran"
        parts = [f"{_names(names, 'mixers')}:\n{expl}" for names, expl in self.groups]
        for names, why in self.blocks:
            how = (
                "layer by layer: " + why
                if why
                else "one C++ op each (vit3_cpu::ttt_block) once settled (after the mixer's first calls)"
            )
            parts.append(f"{_names(names, 'blocks')}: {how}")
        return "\n\n".join(parts)

    def to_dict(self) -> list[dict[str, Any]]:
        return [{"mixers": list(names), **expl.to_dict()} for names, expl in self.groups]

    def blocks_to_dict(self) -> list[dict[str, Any]]:
        return [{"blocks": list(names), "one_op": not why, "why": why} for names, why in self.blocks]


def _names(names: tuple[str, ...], what: str) -> str:
    """``names`` for a heading: the one name, or the first and last and how many ``what``."""
    return names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]} ({len(names)} {what})"
