"""Launches of independent kernels as one launch: each kernel's programs side by side on one grid.

``fuse`` turns launches that do not depend on each other (the branches of a mixer at the same stage) into
one launch of a kernel written here (``fused_kernel``): program ids ``[start_i, start_i+1)`` run kernel
``i``, which numbers its programs from its ``PID0`` argument (``jit.program``). The fused kernel takes every
kernel's arguments (renamed ``k<i>_<name>``), the starts, the most warps and stages any of them asks for.

Why and when: ``docs/design/kernels.md`` (one launch per stage).
"""

from __future__ import annotations

import inspect
import itertools
import linecache
from collections.abc import Sequence
from typing import Any

import triton
import triton.language as tl

from .device import interpreting
from .plan import Launch, fold_grid

__all__ = ["OPTIONS", "PREFIX", "fusable", "fuse", "fused_kernel", "kernel_names", "param_name"]

# The launch options that the fused kernel takes as the largest of its parts'; any other option (such as
# ``enable_fp_fusion``) must be the same in every part.
OPTIONS = ("num_warps", "num_stages")

# A fused kernel's name: this, then its parts' names joined by ``SEP`` (``kernel_names`` reads it back).
PREFIX, SEP = "fused__", "__"

_KERNELS: dict[tuple[Any, ...], Any] = {}
_COUNTER = itertools.count()


def _parameters(kernel: Any) -> list[inspect.Parameter]:
    """``kernel``'s parameters before its last, ``PID0`` (which every kernel that can be fused ends with)."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    if not params or params[-1].name != "PID0":
        raise ValueError(f"{kernel.fn.__name__} takes no PID0 as its last parameter: it cannot be fused")
    return params[:-1]


def param_name(i: int, name: str) -> str:
    """The fused kernel's name of parameter ``name`` of its ``i``-th kernel."""
    return f"k{i}_{name}"


def _annotation(p: inspect.Parameter) -> str:
    """``p``'s annotation as the text Triton reads (``"tl.constexpr"``, ``"tl.float64"``), or ``""``: the
    fused kernel's source keeps annotations unevaluated (this module's ``from __future__ import
    annotations``), as Triton's interpreter does when it compiles a kernel's source again."""
    ann = p.annotation
    if ann is inspect.Parameter.empty:
        return ""
    if isinstance(ann, str):
        return ann
    return "tl.constexpr" if ann is tl.constexpr else f"tl.{ann.name}"  # a dtype: Triton reads its name


def _constexpr(p: inspect.Parameter) -> bool:
    return "constexpr" in _annotation(p)


def fused_kernel(kernels: Sequence[Any]) -> Any:
    """The Triton kernel that runs ``kernels`` (``JITFunction`` s ending in ``PID0``) side by side. Its
    parameters are each kernel's, renamed ``k<i>_<name>``: first the run-time ones, kernel by kernel, then
    ``START1 ..``, then the constexprs; kernel ``i`` runs the program ids from ``START<i>`` (0 for the first)
    to the next start (or the grid's end). Made once per tuple and ``TRITON_INTERPRET`` setting (which
    decides what ``triton.jit`` makes)."""
    kernels = tuple(kernels)
    key = (kernels, interpreting())
    found = _KERNELS.get(key)
    if found is not None:
        return found
    name = PREFIX + SEP.join(k.fn.__name__ for k in kernels)
    runtime, constexprs, calls = [], [], []
    scope: dict[str, Any] = {"tl": tl}
    for i, kernel in enumerate(kernels):
        scope[f"K{i}"] = kernel
        own = _parameters(kernel)
        for p in own:
            text = _annotation(p)
            param = param_name(i, p.name) + (f": {text}" if text else "")
            (constexprs if _constexpr(p) else runtime).append(param)
        start = "0" if i == 0 else f"START{i}"
        calls.append(f"K{i}({', '.join(param_name(i, p.name) for p in own)}, {start})")
    params = runtime + [f"START{i}" for i in range(1, len(kernels))] + constexprs
    lines = [f"def {name}(", *(f"    {p}," for p in params), "):"]
    lines.append("    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)")
    for i, call in enumerate(calls):
        if i == len(calls) - 1:
            lines.append("    else:")
        else:
            lines.append(f"    {'if' if i == 0 else 'elif'} pid < START{i + 1}:")
        lines.append(f"        {call}")
    source = "\n".join(lines) + "\n"
    filename = f"<vit3 fused kernel {next(_COUNTER)}: {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for getsource
    exec(compile(source, filename, "exec"), scope)  # this module's future import: annotations as text
    fn = scope[name]
    fn.__module__ = __name__
    found = _KERNELS[key] = triton.jit(fn)
    return found


def kernel_names(name: str) -> list[str]:
    """The kernels a launched kernel of this ``name`` runs: its parts' names for a fused kernel, else
    itself."""
    return name.removeprefix(PREFIX).split(SEP) if name.startswith(PREFIX) else [name]


def fusable(launches: Sequence[Launch]) -> bool:
    """Whether ``launches`` can be one launch: each kernel ends in ``PID0`` and every option outside
    ``OPTIONS`` is the same in all."""
    try:
        for launch in launches:
            _parameters(launch.kernel)
    except ValueError:
        return False
    extra = [{k: v for k, v in _options(launch).items() if k not in OPTIONS} for launch in launches]
    return all(e == extra[0] for e in extra)


def _options(launch: Launch) -> dict[str, Any]:
    """The launch options of ``launch`` (its keyword arguments that are not the kernel's parameters)."""
    names = set(inspect.signature(launch.kernel.fn).parameters)
    return {k: v for k, v in launch.kwargs.items() if k not in names}


def fuse(launches: Sequence[Launch]) -> Launch:
    """``launches`` (``fusable``, tensor arguments bound or as slots) as one launch of ``fused_kernel``: the
    run-time arguments of each by position, then the starts; the constexprs and the options by keyword;
    ``slots`` shifted to the new positions."""
    if len(launches) == 1:
        return launches[0]
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    slots: list[tuple[int, int]] = []
    starts, at = [], 0
    for i, launch in enumerate(launches):
        own = _parameters(launch.kernel)
        if len(launch.args) > len(own):
            raise ValueError(f"{launch.label} passes PID0 itself: it cannot be fused")
        given = dict(launch.slots)
        for pos, p in enumerate(own):
            if pos < len(launch.args):
                value = launch.args[pos]
            elif p.name in launch.kwargs:
                value = launch.kwargs[p.name]
            elif p.default is not inspect.Parameter.empty:
                value = p.default
            else:
                raise ValueError(f"{launch.label} leaves {p.name} unset")
            if _constexpr(p):
                if pos in given:
                    raise ValueError(f"{launch.label} passes a tensor as constexpr {p.name}")
                kwargs[param_name(i, p.name)] = value
            else:
                if pos in given:
                    slots.append((len(args), given[pos]))
                args.append(value)
        for key, value in _options(launch).items():
            kwargs[key] = max(kwargs.get(key, value), value) if key in OPTIONS else value
        if i:
            starts.append(at)
        at += launch.programs
    args += starts
    kernel = fused_kernel([launch.kernel for launch in launches])
    label = "+".join(launch.label for launch in launches)
    return Launch(label, kernel, fold_grid(at), tuple(args), kwargs, at, tuple(slots), tuple(launches))
