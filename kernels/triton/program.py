"""The whole fused mixer call on Triton as one launch program, its tensors bound by address.

Where every branch of the fused node (``vit3.layers.fused_mix``) runs on Triton, a call is one
:class:`MixProgram`: every branch's launch plans (``plan.py``), each tensor argument an address ``base +
offset`` over a few bases (qkv, the output, the weights, the workspaces, the counters, the RoPE tables, the
gradients). One stage's launches of the branches run as one (``fuse``). A call allocates two or three
buffers, reads one pointer per base and launches: each compiled kernel takes its addresses as integers (under
the interpreter: one-element tensors on the base's storage, ``at_address``).

The bases one by one and why addresses: ``docs/design/kernels.md``.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from triton.runtime import driver
from triton.runtime.jit import JITFunction, KernelInterface

from ..ops import NodeCall, tag_branch
from . import fuse, plan
from .device import acc_dtype, interpreting
from .node import checked_entry, state_of
from .plan import Buffer, backward_template, forward_template, on_device, tensor_meta

__all__ = ["Address", "MixProgram", "at_address", "backward", "bound_arguments", "clear", "forward",
           "mixer_stages", "program_key", "saved_like", "stages", "state"]  # fmt: skip

# Whether a GPU host calls each launch's compiled kernel itself (``_Launches.direct``); False: through
# Triton's JIT launcher, as the per-branch plans do (benchmarks/launcher_overhead.py's switch; a way back).
BIND_COMPILED = True

# Whether the launches of a program's branches at the same stage run as one launch (``fuse``); False: one
# launch each, branch after branch.
FUSE_BRANCHES = True

# Each buffer of a workspace starts on a multiple of this many bytes (Triton specialises pointers on 16-byte
# alignment; 256 keeps every buffer on its own cache lines).
ALIGN = 256


class Address:
    """A typed device address, what a Triton kernel takes for a tensor argument; ``shape`` and ``stride`` (in
    elements) say what the kernel reads there, for those who look (the kernels take strides as numbers)."""

    __slots__ = ("address", "dtype", "shape", "stride")

    def __init__(
        self, address: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> None:
        self.address, self.dtype, self.shape, self.stride = address, dtype, shape, stride

    def data_ptr(self) -> int:
        return self.address


class _Where(NamedTuple):
    """Where a plan's tensor lies: ``offset`` bytes past base number ``base`` of the call, as a ``dtype``
    tensor of ``shape`` and ``stride``."""

    base: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(base: int, offset: int, like: Tensor | tuple) -> _Where:
        """At ``offset`` bytes past ``base``, laid out as ``like``: a tensor, or its ``plan.tensor_meta`` / a
        ``Buffer`` (both ``(shape, stride, dtype)``)."""
        shape, stride, dtype = tensor_meta(like) if isinstance(like, Tensor) else like
        return _Where(base, offset, dtype, tuple(shape), tuple(stride))


def at_address(base: tuple[Any, int], where: _Where) -> Tensor:
    """The interpreter's form of an address: the tensor ``where`` on ``base``'s storage ``(storage, byte
    start)`` (the interpreter reads tensors' storages, not raw addresses)."""
    storage, start = base
    at = start + where.offset
    size = where.dtype.itemsize
    if at % size:
        raise ValueError(f"an address {at} bytes into a storage is not aligned to {where.dtype}")
    end = at + _nbytes(where)
    if end > storage.nbytes():  # ``set_`` would grow the storage: a GPU would write past its allocation
        raise ValueError(f"an address reaches byte {end} of a storage of {storage.nbytes()} bytes")
    t = torch.empty(0, dtype=where.dtype, device=storage.device)
    return t.set_(storage, at // size, where.shape, where.stride)


def _nbytes(buf: Buffer) -> int:
    if any(s == 0 for s in buf.shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(buf.shape, buf.stride))) * buf.dtype.itemsize


class _Workspace:
    """Lays buffers out one after another in one byte buffer (``base``), each on an ``ALIGN`` boundary."""

    def __init__(self, base: int) -> None:
        self.base, self.size = base, 0

    def place(self, buf: Buffer) -> _Where:
        offset = -(-self.size // ALIGN) * ALIGN
        self.size = offset + _nbytes(buf)
        return _Where.of(self.base, offset, buf)


def _offset(t: Tensor, base: Tensor) -> int:
    """Bytes from ``base``'s first element to ``t``'s (a view of the same storage)."""
    return (t.storage_offset() - base.storage_offset()) * t.element_size()


_UNBOUND = object()  # no compiled kernels bound yet for a device and alignment


class _Step(NamedTuple):
    """One launch of a ``_Launches``: its branch (``None``: branches fused) and label, Triton's launcher,
    grid and keyword arguments, ``runner`` (the launcher with the grid and keyword arguments bound, made
    once) and ``take``, which picks its arguments from a call's values (one per place, then the
    constants)."""

    branch: int | None
    label: str
    launcher: Any
    grid: tuple[int, ...]
    kwargs: dict[str, Any]
    runner: Callable[..., Any]
    take: Callable[[Sequence[Any]], tuple]
    parts: tuple[_Step, ...] = ()  # a fused launch's parts, each of its own branch (``fuse``)

    def bound(self, values: Sequence[Any]) -> tuple[int | None, Callable[..., Any], tuple]:
        """``(branch, runner, arguments)`` on ``values``: what ``_run`` calls."""
        return self.branch, self.runner, self.take(values)


class _Launches:
    """The launches of a forward or a backward: the distinct places its tensors lie at, its constant arguments
    and its ``steps`` (``_Step``); on a GPU also the addresses and each launch bound to them once (``gpu``),
    and each launch's compiled kernel bound to them (``direct``, per device and alignment of the bases:
    Triton's JIT launcher, its binder and cache lookup, skipped)."""

    def __init__(self) -> None:
        self._wheres: list[_Where] = []
        self._launches: list[tuple[int, plan.Launch]] = []

    def add(self, branch: int, template: plan.LaunchPlan, wheres: Sequence[_Where]) -> None:
        """``template``'s launches with their tensors at ``wheres`` (by the plan's tensor index)."""
        first = len(self._wheres)
        self._wheres += wheres
        for launch in template.launches:
            self._launches.append(
                (branch, launch._replace(slots=tuple((p, first + i) for p, i in launch.slots)))
            )

    def _stages(self) -> list[tuple[tuple[int, ...], plan.Launch]]:
        if not FUSE_BRANCHES:
            return [((branch,), launch) for branch, launch in self._launches]
        by_branch: dict[int, list[plan.Launch]] = {}
        for branch, launch in self._launches:
            by_branch.setdefault(branch, []).append(launch)
        return stages(by_branch)

    def build(self) -> None:
        """Fixes the places, constants and launches (after every ``add``)."""
        places: dict[_Where, int] = {}
        consts: list[Any] = []

        def picks(launch: plan.Launch) -> list[int]:  # a place's index, or -1 - a constant's
            slots, found = dict(launch.slots), []
            for pos, arg in enumerate(launch.args):
                if pos in slots:
                    found.append(places.setdefault(self._wheres[slots[pos]], len(places)))
                else:
                    found.append(-1 - len(consts))
                    consts.append(arg)
            return found

        staged = [
            (branches, launch, picks(launch), [picks(part) for part in launch.parts])
            for branches, launch in self._stages()
        ]
        self.places = tuple(places)
        self.consts = tuple(consts)
        first = len(self.places)

        def step(branch: int | None, launch: plan.Launch, found: list[int], parts: tuple = ()) -> _Step:
            index = [pick if pick >= 0 else first - 1 - pick for pick in found]
            take = operator.itemgetter(*index) if len(index) > 1 else (lambda v, i=index[0]: (v[i],))
            launcher = plan.launcher(launch.kernel)
            runner = _runner(launcher, launch.grid, launch.kwargs)
            return _Step(branch, launch.label, launcher, launch.grid, launch.kwargs, runner, take, parts)

        self.steps = tuple(
            step(
                branches[0] if len(branches) == 1 else None,
                launch,
                found,
                tuple(step(b, part, p) for b, part, p in zip(branches, launch.parts, part_picks)),
            )
            for branches, launch, found, part_picks in staged
        )
        self.addresses = [Address(0, w.dtype, w.shape, w.stride) for w in self.places]
        self.offsets = tuple((w.base, w.offset) for w in self.places)
        self.values = [*self.addresses, *self.consts]
        self.gpu = tuple(step.bound(self.values) for step in self.steps)
        self.direct: dict[Any, _Direct | None] = {}
        self.lock = threading.Lock()  # the addresses are bound in place for Triton's JIT launcher
        del self._wheres, self._launches

    def _split(self, steps: tuple[_Step, ...], values: Sequence[Any], index: int, exc: Exception) -> None:
        """After fused launch ``index`` of ``steps`` (``self.steps`` as the call began) raised ``exc``: runs
        its parts one by one on ``values`` (Triton's JIT launcher). A part that raises names its branch
        (``BRANCH_ATTR``); where none does (the fused kernel alone failed, say to compile), this and every
        later call launch the parts instead."""
        fused = steps[index]
        for part in fused.parts:
            branch, run, args = part.bound(values)
            try:
                run(*args)
            except Exception as failed:
                tag_branch(failed, branch)
                raise failed from exc
        now = list(self.steps)
        at = now.index(fused)
        now[at : at + 1] = fused.parts
        self.steps = tuple(now)
        self.gpu = tuple(step.bound(self.values) for step in self.steps)
        self.direct.clear()

    def run(self, bases: Sequence[Any], interpret: bool, device: torch.device) -> None:
        """Launches on ``bases`` (device pointers, or ``(storage, byte start)`` under the interpreter), with
        ``device`` current where it is a GPU (``plan.on_device``); an exception names its branch
        (``BRANCH_ATTR``); the device's counters are zeroed after a failed launch
        (``plan.reset_counters``)."""
        try:
            if interpret:
                values = [at_address(bases[where.base], where) for where in self.places]
                values += self.consts
                steps = self.steps
                _run(tuple(step.bound(values) for step in steps), steps, values, self._split)
                return
            with on_device(device):
                # the compiled kernels bound for the bases' device and 16-byte alignment (Triton
                # specialises pointers on it), bound the first time; ``None``: Triton's JIT launcher
                misaligned = functools.reduce(operator.or_, bases) & 15
                key = (device.index, *(b & 15 for b in bases)) if misaligned else device.index
                direct = self.direct.get(key, _UNBOUND) if BIND_COMPILED else None
                if direct is _UNBOUND:
                    direct = self._direct(bases, key)
                if direct is None:
                    self._run_bound(bases)
                else:  # the stream Triton's launcher would ask for at every launch, asked once
                    self._run_direct(direct, bases, driver.active.get_current_stream(device.index))
        except Exception:
            plan.reset_counters(device)
            raise

    def _bind(self, bases: Sequence[int]) -> None:
        for address, (base, offset) in zip(self.addresses, self.offsets):
            address.address = bases[base] + offset

    def _run_bound(self, bases: Sequence[int]) -> None:
        """Every launch through Triton's JIT launcher, on the ``Address`` es bound to ``bases``."""
        with self.lock:
            self._bind(bases)
            _run(self.gpu, self.steps, self.values, self._split)

    def _run_direct(self, direct: _Direct, bases: Sequence[int], stream: Any) -> None:
        """Every launch's compiled kernel called on the addresses as integers (Triton's launcher reads an
        integer as it is; an ``Address`` through its ``data_ptr`` and a driver query), on ``stream`` (the
        device's current one). A fused launch that raises runs as its parts (``_split``), through Triton's
        JIT launcher."""
        values = [bases[base] + offset for base, offset in self.offsets]
        values += direct.consts
        for i, (branch, run, take) in enumerate(direct.steps):
            try:
                run(*take(values), stream=stream)
            except Exception as exc:
                if branch is not None:
                    tag_branch(exc, branch)
                    raise
                with self.lock:
                    self._bind(bases)
                    self._split(direct.launches, self.values, i, exc)

    def _direct(self, bases: Sequence[int], key: Any) -> _Direct | None:
        """The compiled kernels bound for ``bases`` (``_bind_compiled``), kept under ``key`` (their device and
        alignment); ``None``: launch through Triton's JIT launcher."""
        try:
            with self.lock:
                self._bind(bases)
                direct = self._bind_compiled()
        except Exception:  # e.g. another Triton's API: its JIT launcher compiles and reports
            direct = None
        self.direct[key] = direct
        return direct

    def _bind_compiled(self) -> _Direct | None:
        """Each launch's kernel compiled for the addresses as they are bound now (``JITFunction.warmup``:
        compiled, not launched), with what Triton's JIT launcher would hand it: every parameter of the kernel
        in order, each address an integer; ``None`` where a launcher is not Triton's JIT (a test hook), has
        pre-run hooks or compiles nothing (a JIT hook that skips it): those launch through Triton's JIT
        launcher, as every launch does where this raises (a kernel that fails to compile then raises
        there)."""
        places = {id(a): i for i, a in enumerate(self.addresses)}
        consts: list[Any] = []
        known: dict[tuple[type, Any], int] = {}  # a constant's index, each value once
        found = []
        for step, (branch, _, args) in zip(self.steps, self.gpu):
            launcher, grid, kwargs = step.launcher, step.grid, step.kwargs
            if type(launcher) is not JITFunction or launcher.pre_run_hooks:
                return None
            kernel = launcher.warmup(*args, grid=grid, **kwargs)
            kernel = kernel.result() if hasattr(kernel, "result") else kernel  # an asynchronous compile
            if kernel is None:
                return None
            index = []
            for arg in bound_arguments(launcher, args, kwargs):
                if type(arg) is Address:
                    index.append(places[id(arg)])
                    continue
                key = (type(arg), arg)
                if key not in known:
                    known[key] = len(self.places) + len(consts)
                    consts.append(arg)
                index.append(known[key])
            take = operator.itemgetter(*index) if len(index) > 1 else (lambda v, i=index[0]: (v[i],))
            found.append((branch, kernel[(*grid, 1, 1)[:3]], take))
        return _Direct(self.steps, tuple(found), consts)


class _Direct(NamedTuple):
    """A ``_Launches``' compiled kernels bound for one device and alignment: per launch ``(branch, runner,
    take)``, ``take`` picking its arguments from a call's addresses followed by ``consts``; ``launches``: the
    ``_Launches.steps`` they were bound from."""

    launches: tuple[_Step, ...]
    steps: tuple[tuple[int | None, Callable[..., Any], Callable[[Sequence[Any]], tuple]], ...]
    consts: list[Any]


def stages(branches: dict[int, Sequence[plan.Launch]]) -> list[tuple[tuple[int, ...], plan.Launch]]:
    """Each branch's launches (in order; the branches' work does not overlap) in stages, ``(branches,
    launch)``: at each stage the next launch of every branch as one launch where ``fuse.fusable`` allows;
    else the next one of the branch with the most launches left, with those the others have next that fuse
    with it. A fused launch names its parts' branches, in the order of its ``parts``."""
    left = {b: list(ls) for b, ls in branches.items() if ls}
    staged: list[tuple[tuple[int, ...], plan.Launch]] = []
    while left:
        first = max(left, key=lambda b: len(left[b]))  # the first such branch, in branch order
        group = [first]
        for b in left:
            if b != first and fuse.fusable([left[x][0] for x in (*group, b)]):
                group.append(b)
        group.sort()
        parts = [left[b].pop(0) for b in group]
        staged.append((tuple(group), parts[0] if len(parts) == 1 else fuse.fuse(parts)))
        left = {b: ls for b, ls in left.items() if ls}
    return staged


def mixer_stages(
    plans: Sequence[tuple[Sequence[plan.Launch], Sequence[plan.Launch]]],
) -> list[tuple[tuple[int, ...], plan.Launch]]:
    """Each branch's ``(forward, backward)`` launches as a program runs them: the forward's ``stages``, then
    the backward's."""
    return [staged for phase in zip(*plans) for staged in stages(dict(enumerate(phase)))]


def _runner(launcher: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``launcher[grid](*args, **kwargs)`` as one callable of ``args``: a Triton kernel's ``run`` with the
    grid and the constexprs bound (what ``kernel[grid]`` calls, without its proxy), another launcher's (the
    test hooks) through its ``[grid]``."""
    if isinstance(launcher, KernelInterface):
        return functools.partial(launcher.run, grid=grid, warmup=False, **kwargs)
    return functools.partial(launcher[grid], **kwargs)


def bound_arguments(launcher: JITFunction, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What Triton's JIT launcher hands a compiled kernel for ``launcher[grid](*args, **kwargs)``: every
    parameter of the kernel in its order, constexprs and defaults included (the options, such as
    ``num_warps``, apart)."""
    sig = launcher.signature
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def _run(
    launches: Sequence[tuple[int | None, Callable[..., Any], tuple]],
    steps: tuple[_Step, ...],
    values: Sequence[Any],
    split: Callable[[tuple[_Step, ...], Sequence[Any], int, Exception], None],
) -> None:
    """Runs ``launches`` (``steps`` bound to ``values``) in order; an exception names its branch, and a fused
    launch (branch ``None``) that raises is ``split(steps, values, index, exc)``."""
    for i, (branch, run, args) in enumerate(launches):
        try:
            run(*args)
        except Exception as exc:
            if branch is None:
                split(steps, values, i, exc)
                continue
            tag_branch(exc, branch)
            raise


def program_key(qkv: Tensor, weights: Sequence[Tensor]) -> tuple:
    """What a program depends on besides the node's route: the programs' generation (``clear``), qkv's and
    every weight's shape, strides and dtype, the device, and the module state the plan key reads
    (interpreter, TF32, the test hooks)."""
    dtype, device = qkv.dtype, qkv.device
    key = [_GENERATION[0], qkv.shape, qkv.stride(), dtype, device, *state_of(dtype, device)]
    for w in weights:
        key += (w.shape, w.stride(), w.dtype)
    return tuple(key)


# The bases of a forward call, then the weights, then each RoPE branch's (cos, sin) table; of a backward
# call, then each branch's dW, the weights and the tables.
# Both: the counters of ``jit.last_to_arrive`` (``plan.counters``), each branch's own.
QKV, OUT, SAVED, SCRATCH, COUNT = range(5)
D_OUT, B_QKV, B_SAVED, B_SCRATCH, B_COUNT, D_QKV = range(6)


class MixProgram:
    """Every branch's forward and backward launches of one fused Triton node, bound by address.

    Built from the first call's branch calls (``NodeCall`` s: views of that call's qkv and the output) and
    each branch's RoPE table, checked as the per-branch hooks check them; later calls of the same
    ``program_key`` take only qkv, the output and the weights. A RoPE branch's kernels rotate q, k as they
    load them and dq, dk back as they store them (``plan.PlanKey.rope``): no rotated pair is made or saved.
    """

    def __init__(
        self, names: Sequence[str], qkv: Tensor, out: Tensor, calls: Sequence[NodeCall],
        tables: Sequence[Tensor | None],
    ) -> None:  # fmt: skip
        self.names, self.interpret = tuple(names), interpreting()
        self.counts = tuple(len(call.weights) for call in calls)
        self.entries, self.inputs, self.tables = [], [], []
        for i, (name, call, rope) in enumerate(zip(names, calls, tables)):
            try:
                self.entries.append(checked_entry(name, call, rope))
            except Exception as exc:
                tag_branch(exc, i)
                raise
            where = [_Where.of(QKV, _offset(t, qkv), t) for t in (call.q, call.k, call.v)]
            at = None if rope is None else len(self.tables)  # its table's index
            self.inputs.append((where, _Where.of(OUT, _offset(call.dest, out), call.dest), at))
            self.tables += [] if rope is None else [rope]
        base = _storage_base if self.interpret else Tensor.data_ptr
        self.fixed = [base(t) for t in self.tables]  # the tables' bases, the same every call
        self._forwards: dict[bool, tuple] = {}
        self._backwards: dict[tuple, tuple] = {}

    def _weights(self, first: int) -> list[list[_Where]]:
        """Each branch's (W1, W2 or W1) as bases from ``first`` on."""
        found, at = [], first
        for count, (_, metas) in zip(self.counts, self.entries):
            w = [_Where.of(at + j, 0, metas[3 + j]) for j in range(count)]
            found.append(w if count == 2 else w + w)
            at += count
        return found

    def _tables(self, at: int | None, first: int) -> list[_Where]:
        """A RoPE branch's table (``at``: its index in ``tables``) as a base from ``first`` on; none without
        RoPE."""
        return [] if at is None else [_Where.of(first + at, 0, self.tables[at])]

    def _forward(self, save: bool) -> tuple:
        """The forward's launches, its saved workspace's and scratch's sizes and where each branch's ``G``
        and ``||G||`` lie in the saved workspace."""
        found = self._forwards.get(save)
        if found is not None:
            return found
        saved, scratch, count = _Workspace(SAVED), _Workspace(SCRATCH), _Workspace(COUNT)
        launches, kept = _Launches(), []
        first_table = COUNT + 1 + sum(self.counts)
        for i, ((key, metas), (qkv_at, out_at, table), w_at) in enumerate(
            zip(self.entries, self.inputs, self._weights(COUNT + 1))
        ):
            template = forward_template(key, save, metas[:5], metas[5])
            wheres = [*qkv_at, *w_at, out_at, *self._tables(table, first_table)]
            outs = set(template.outputs[1:])
            for j, buf in enumerate(template.buffers):  # inference: all in the scratch
                at = len(wheres)  # the buffer's index among the plan's tensors
                if j in template.counted:
                    wheres.append(count.place(buf))
                else:
                    wheres.append((saved if save and at in outs else scratch).place(buf))
            kept.append(tuple(wheres[j] for j in template.outputs[1:]))
            launches.add(i, template, wheres)
        launches.build()
        found = self._forwards[save] = (launches, saved.size, scratch.size, tuple(kept), count.size)
        return found

    def forward(self, qkv: Tensor, out: Tensor, weights: Sequence[Tensor], save: bool) -> tuple[Tensor, Any]:
        """Writes every branch's read-out into ``out``; returns the saved workspace (``G`` and ``||G||``;
        empty unless ``save``) and where in it each branch's lie, for the backward."""
        launches, n_saved, n_scratch, kept, n_count = self._forwards.get(save) or self._forward(save)
        if plan.DEBUG_FILL is not None:
            plan.debug_filled(out)
        device = qkv.device
        scratch = _alloc(n_scratch, device)
        ws = _alloc(n_saved, device) if save else scratch  # inference saves nothing (n_saved 0): no workspace
        bases = self._bases((qkv, out, ws, scratch), n_count, device, weights)
        launches.run(bases, self.interpret, device)
        return ws, kept

    def _backward(
        self, kept: tuple, views: Sequence[tuple[Tensor, ...]], d_out: Tensor, dqkv: Tensor
    ) -> tuple:
        """The backward's launches for the gradients' layout, its scratch size and each branch's dW buffer;
        ``views``: each branch's (dout, dq, dk, dv) views of that call's ``d_out`` and ``dqkv``."""
        scratch, count = _Workspace(B_SCRATCH), _Workspace(B_COUNT)
        launches, dws = _Launches(), []
        first_w = D_QKV + 1 + len(self.entries)
        first_table = first_w + sum(self.counts)
        branches = zip(self.entries, self.inputs, self._weights(first_w), kept, views)
        for i, ((key, metas), (qkv_at, _, table), w_at, stats, call) in enumerate(branches):
            dout, *grads = call
            template = backward_template(key, metas[:5], tensor_meta(dout), tuple(map(tensor_meta, grads)))
            wheres = [_Where.of(D_OUT, _offset(dout, d_out), dout)]
            wheres += [w._replace(base=B_QKV) for w in qkv_at]
            wheres += w_at + [w._replace(base=B_SAVED) for w in stats]
            wheres += [_Where.of(D_QKV, _offset(t, dqkv), t) for t in grads]
            wheres += self._tables(table, first_table)
            dw = template.outputs[3]
            for j, buf in enumerate(template.buffers):
                if len(wheres) == dw:
                    dws.append(buf)
                    wheres.append(_Where.of(D_QKV + 1 + i, 0, buf))
                else:
                    wheres.append((count if j in template.counted else scratch).place(buf))
            launches.add(i, template, wheres)
        launches.build()
        return launches, scratch.size, tuple(dws), count.size

    def backward(
        self, d_out: Tensor, dqkv: Tensor, qkv: Tensor, weights: Sequence[Tensor], ws: Tensor, kept: tuple,
        calls: Callable[[], Sequence[tuple[Tensor, ...]]],
    ) -> list[Tensor]:  # fmt: skip
        """Writes dq, dk, dv of every branch into ``dqkv``; returns each branch's initial weights' gradients
        as one tensor (SwiGLU's two stacked). ``calls``: makes each branch's (dout, dq, dk, dv) views (the
        first time of a layout)."""
        layout = d_out.stride()  # dqkv: made by the node, of qkv's shape (the key), contiguous
        found = self._backwards.get(layout)
        if found is None:
            found = self._backwards[layout] = self._backward(kept, calls(), d_out, dqkv)
        launches, n_scratch, dw_bufs, n_count = found
        if plan.DEBUG_FILL is not None:
            plan.debug_filled(dqkv)
        device = d_out.device
        dws = [buf.alloc(device) for buf in dw_bufs]
        scratch = _alloc(n_scratch, device)
        bases = self._bases((d_out, qkv, ws, scratch), n_count, device, (dqkv, *dws, *weights))
        launches.run(bases, self.interpret, device)
        return dws

    def _bases(
        self, first: Sequence[Tensor], n_count: int, device: torch.device, rest: Sequence[Tensor]
    ) -> list[Any]:
        """A call's bases: ``first`` (the call's tensors before the counters), the counters of ``n_count``
        bytes, ``rest``, then the RoPE tables'; device pointers, or ``(storage, byte start)`` under the
        interpreter."""
        base = _storage_base if self.interpret else Tensor.data_ptr
        return [*map(base, first), _counters(n_count, device, base), *map(base, rest), *self.fixed]

    def saved_places(self) -> tuple:
        """Where each branch's ``G`` and ``||G||`` lie in a training forward's saved workspace (what
        ``backward`` takes back)."""
        return (self._forwards.get(True) or self._forward(True))[3]

    def labels(self, save: bool = True) -> list[tuple[int, str]]:
        """The forward's launches as (branch, kernel label), in order."""
        return [(step.branch, step.label) for step in self._forward(save)[0].steps]


def _storage_base(t: Tensor) -> tuple[Any, int]:
    return t.untyped_storage(), t.storage_offset() * t.element_size()


def _counters(nbytes: int, device: torch.device, base: Callable[[Tensor], Any]) -> Any:
    """The counters' base for ``nbytes`` of them (``plan.counters``); 0 where no launch counts."""
    return base(plan.counters(device, nbytes // 4)) if nbytes else 0


def _alloc(nbytes: int, device: torch.device) -> Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return t if plan.DEBUG_FILL is None else t.fill_(255)  # all bits set: a NaN of every float type


# Bumped by ``clear``: the programs cached before are not found again.
_GENERATION = [0]
MAX_PROGRAMS = 64  # per node route; then its cache is forgotten at once


def clear() -> None:
    """Forgets every program (``op.clear_plans``)."""
    _GENERATION[0] += 1


def _program(
    cache: dict, spec: Any, qkv: Tensor, weights: Sequence[Tensor],
    calls: Callable[[], tuple[Tensor, Sequence[NodeCall], Sequence[Tensor | None]]],
) -> MixProgram:  # fmt: skip
    """The program of ``(qkv, weights)`` found in ``cache`` or made from ``calls()`` (the output, each
    branch's ``NodeCall`` and RoPE tables)."""
    key = program_key(qkv, weights)
    return cache.get(key) or _made(cache, key, spec, qkv, calls)


def _made(
    cache: dict, key: tuple, spec: Any, qkv: Tensor,
    calls: Callable[[], tuple[Tensor, Sequence[NodeCall], Sequence[Tensor | None]]],
) -> MixProgram:  # fmt: skip
    """A new program of ``key`` for ``spec``'s branches, kept in ``cache`` (forgotten at once where it is
    full)."""
    if len(cache) >= MAX_PROGRAMS:
        cache.clear()
    program = cache[key] = MixProgram([br.op for br in spec.branches], qkv, *calls())
    return program


def forward(
    cache: dict, spec: Any, qkv: Tensor, out: Tensor, weights: Sequence[Tensor], save: bool,
    calls: Callable[[], tuple[Sequence[NodeCall], Sequence[Tensor | None]]],
) -> tuple[list[Tensor], Any]:  # fmt: skip
    """``Whole.forward`` of the Triton path: the program of ``(qkv, weights)`` found in ``cache`` or made from
    ``calls()``, run; saves its workspace (every branch's ``G`` and ``||G||``)."""
    key = program_key(qkv, weights)
    program = cache.get(key) or _made(cache, key, spec, qkv, lambda: (out, *calls()))
    ws, kept = program.forward(qkv, out, weights, save)
    return ([ws] if save else []), (program, kept)


def state(
    cache: dict, spec: Any, qkv: Tensor, weights: Sequence[Tensor],
    calls: Callable[[], tuple[Tensor, Sequence[NodeCall], Sequence[Tensor | None]]],
) -> Any:  # fmt: skip
    """``Whole.state`` of the Triton path: what ``forward`` handed its backward for a training call on
    ``(qkv, weights)``, found again (the program, where its statistics lie)."""
    program = _program(cache, spec, qkv, weights, calls)
    return program, program.saved_places()


def _dense(shape: Sequence[Any], dtype: torch.dtype) -> Buffer:
    """A contiguous ``shape`` (sizes may be symbolic)."""
    stride = [1]
    for size in reversed(shape[1:]):
        stride.insert(0, stride[0] * size)
    return Buffer(tuple(shape), tuple(stride), dtype)


def saved_like(spec: Any, qkv: Tensor) -> list[Tensor]:
    """``Whole.saved_like`` of the Triton path: an empty workspace laid out as a training ``forward`` of
    ``spec`` saves it, every branch's statistics; sizes may be symbolic (``torch.compile``'s fake
    tensors)."""
    b = qkv.shape[0]
    acc = acc_dtype(qkv.dtype)[0]
    ws = _Workspace(SAVED)
    for br in spec.branches:
        for shape in plan.stat_shapes(br.op, b * br.heads, br.head_dim):
            ws.place(_dense(shape, acc))
    return [qkv.new_empty(ws.size, dtype=torch.uint8)]


def backward(
    d_out: Tensor, dqkv: Tensor, saved: Sequence[Tensor], state: Any,
    calls: Callable[[], Sequence[tuple[Tensor, ...]]],
) -> list[Tensor]:  # fmt: skip
    """``Whole.backward`` of the Triton path: the program's backward on what ``forward`` saved."""
    program, kept = state
    ws, qkv, *weights = saved
    return program.backward(d_out, dqkv, qkv, weights, ws, kept, calls)
