"""Launch plans of the Triton kernels: each kernel launch of a forward or backward (``Launch``), built once
per key on meta tensors (``forward_template`` / ``backward_template``) as a ``LaunchPlan`` whose calls
allocate its buffers and bind its tensors; ``forward_plan`` / ``backward_plan`` give the bound launches to the
offline compiles (``vit3.kernels.aot``) and the roofline. A plan's launches run with the inputs' GPU current
(``LaunchPlan.run``: Triton launches on the current device and its current stream).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from triton.runtime import driver

from ..common import NO_CONTEXT
from ..dwconv import triton as dwconv_kernels
from . import matrix as matrix_kernels
from . import step as step_kernels
from . import tiles
from .device import Arch, acc_dtype, gpu_dot_precision, interpreting
from .tiles import INTERPRET_TILES, LaunchConfig, cdiv, launch_config, next_pow2

__all__ = [
    "DEBUG_FILL",
    "GRID_X_MAX",
    "Buffer",
    "Launch",
    "LaunchPlan",
    "PlanKey",
    "backward_plan",
    "backward_template",
    "counters",
    "debug_filled",
    "fold_grid",
    "forward_plan",
    "forward_template",
    "launcher",
    "plan_key",
    "reduce_split",
    "reset_counters",
    "slotted",
    "stat_shape",
    "tensor_meta",
    "weight_grad_shape",
]

# Test hook: when set (e.g. to NaN), every buffer the op allocates, and the node's output and qkv gradient its
# kernels write into, is filled with it first, so any element a kernel fails to write shows up in the result.
DEBUG_FILL: float | None = None


# The weight-gradient reduction (``wgrad_reduce_kernel``): BLOCK_T items of BLOCK_E numbers per step (BLOCK_E
# halved down to REDUCE_MIN_BLOCK_E where the output blocks are too few to give every SM a program), and the
# programs it aims at per SM (its runs are cut so that about this many programs per SM share the work).
REDUCE_BLOCK_T, REDUCE_BLOCK_E, REDUCE_MIN_BLOCK_E, REDUCE_WARPS, REDUCE_PROGRAMS_PER_SM = 4, 512, 128, 4, 2

# The largest grid axis 0 (CUDA: 2^31 - 1 blocks). Every launch numbers its programs on one flat axis and
# folds it onto axis 1 only beyond this (``fold_grid``), so B*G never meets the 65,535 cap of axes 1 and 2.
# Tests lower it to run the folded path.
GRID_X_MAX = 2**31 - 1


def fold_grid(programs: int) -> tuple[int, int]:
    """The 2-D grid of ``programs`` flat program ids: ``(x, y)``, ``x * y >= programs``; the kernels map
    ``(pid_x, pid_y)`` to ``pid_y * x + pid_x`` and return where it is past the last program."""
    x = min(programs, GRID_X_MAX)
    return x, cdiv(programs, x)


def launcher(kernel: Any) -> Any:
    """What launches ``kernel[grid](...)``: Triton's own launcher (a hook: tests put a recorder in its place).
    Compiled graphs call the custom ops as opaque ops (``triton.op``), so a launch always runs on real
    tensors."""
    return kernel


def stat_shape(model: str, d: int) -> tuple[int, int]:
    """``(NW, R)`` of the saved statistics ``G`` ``[B*G, NW, R, c]`` and ``||G||`` ``[B*G, NW, c]``: NW
    weights (SwiGLU's two, else one) of R rows (the conv's 9 taps, else ``c``)."""
    return (2 if model == "swiglu" else 1), (9 if model == "dwconv" else d)


def stat_shapes(model: str, bgn: Any, d: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The shapes of the saved statistics of ``bgn`` (sample, head) pairs: ``G`` ``[B*G, NW, R, c]`` and
    ``||G||`` ``[B*G, NW, c]`` (``stat_shape``; sizes may be symbolic)."""
    nw, r = stat_shape(model, d)
    return (bgn, nw, r, d), (bgn, nw, d)


def weight_grad_shape(model: str, g: int, d: int) -> tuple[int, ...]:
    """The shape of the backward's ``dW`` (accumulator dtype): SwiGLU's pair ``[2, 1, G, c, c]``, the linear
    model's ``[1, G, c, c]``, the conv's ``[1, G*c, 3, 3]``."""
    if model == "dwconv":
        return (1, g * d, 3, 3)
    return (2, 1, g, d, d) if model == "swiglu" else (1, g, d, d)


class Launch(NamedTuple):
    """One kernel launch of a plan: ``kernel[grid](*args, **constexprs, **options)``.

    The one place a launch executes: the custom ops and the eager node run each of a plan's launches by
    calling it on the plan's tensors (``slots``: which argument positions take which of them; a launch of
    ``forward_plan`` / ``backward_plan`` has its tensors bound already, no slots).
    """

    label: str  # the kernel's name, with ``[cols]`` / ``[cross]`` for the two launches of a split stage
    kernel: Any  # a ``triton.JITFunction``
    grid: tuple[int, ...]
    args: tuple  # ``None`` at the positions ``slots`` fills
    kwargs: dict[str, Any]  # constexprs and launch options (num_warps, num_stages)
    programs: int = 0  # the programs that do work (``fold_grid``'s grid may round them up)
    slots: tuple[tuple[int, int], ...] = ()  # (argument position, index into the plan's tensors)
    parts: tuple[Launch, ...] = ()  # the launches a fused launch runs side by side (``fuse``)

    def bound(self, tensors: Sequence[Tensor]) -> tuple:
        """The launch's arguments with the plan's ``tensors`` in their slots."""
        if not self.slots:
            return self.args
        args = list(self.args)
        for pos, i in self.slots:
            args[pos] = tensors[i]
        return tuple(args)

    def __call__(self, tensors: Sequence[Tensor] = ()) -> None:
        launcher(self.kernel)[self.grid](*self.bound(tensors), **self.kwargs)


class Buffer(NamedTuple):
    """A buffer a plan allocates per call: ``shape`` (``perm`` of its memory order) and ``stride``."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(shape: tuple[int, ...], dtype: torch.dtype, perm: tuple[int, ...] | None) -> Buffer:
        """A contiguous ``shape`` seen through ``perm`` (``None``: as it is)."""
        t = torch.empty(shape, device="meta")
        t = t.permute(perm) if perm else t
        return Buffer(tuple(t.shape), t.stride(), dtype)

    def alloc(self, device: torch.device) -> Tensor:
        return debug_filled(torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device))


_COUNTERS: dict[tuple[torch.device, int], Tensor] = {}
_RETIRED: list[Tensor] = []


def counters(device: torch.device, n: int) -> Tensor:
    """At least ``n`` int32 counters of ``jit.last_to_arrive`` on ``device``, zero: the same for every launch
    on the current stream (each launch leaves them zero; a failed one, ``reset_counters``). While a CUDA graph
    is captured the stream's own are not made: its launches take the device's first (those of the warm-up
    before it), so a replay reads no memory of the capture's pool."""
    key = (device, current_stream(device))
    found = _COUNTERS.get(key)
    if found is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        found = next((t for (dev, _), t in _COUNTERS.items() if dev == device), None)
    if found is None or found.numel() < n:
        if found is not None:  # a captured graph may hold its address: never freed, never reused
            _RETIRED.append(found)
        found = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return found


def current_stream(device: torch.device) -> int:
    """The handle of ``device``'s current stream, as Triton's launcher takes it; 0 off a GPU. Triton's
    driver asks PyTorch directly (``torch.cuda.current_stream`` builds a ``Stream`` object first)."""
    if device.type != "cuda":
        return 0
    return driver.active.get_current_stream(device.index)


def reset_counters(device: torch.device) -> None:
    """Zeroes ``device``'s counters: after a launch that failed midway (its programs may have counted)."""
    for (dev, _), t in _COUNTERS.items():
        if dev == device:
            t.zero_()


def debug_filled(t: Tensor) -> Tensor:
    """``t`` filled with ``DEBUG_FILL`` where that is set."""
    return t if DEBUG_FILL is None else t.fill_(DEBUG_FILL)


class _Builder:
    """Builds a plan on meta tensors, recording the buffers it allocates and the launches it makes."""

    def __init__(self, inputs: tuple[Tensor | None, ...]) -> None:
        self.tensors = list(inputs)
        self.buffers: list[Buffer] = []
        self.counted: list[int] = []
        self.launches: list[Launch] = []

    def buffer(self, *shape: int, dtype: torch.dtype, perm: tuple[int, ...] | None = None) -> Tensor:
        self.buffers.append(Buffer.of(shape, dtype, perm))
        self.tensors.append(self.buffers[-1].alloc(torch.device("meta")))
        return self.tensors[-1]

    def counters(self, n: int) -> Tensor:
        """``n`` int32 counters for ``jit.last_to_arrive``: zero when a launch starts, and left zero."""
        self.counted.append(len(self.buffers))
        return self.buffer(max(n, 1), dtype=torch.int32)

    def launch(self, label: str, kernel: Any, programs: int, args: tuple, kwargs: dict[str, Any]) -> None:
        self.launches.append(Launch(label, kernel, fold_grid(programs), args, kwargs, programs))

    def plan(self, outputs: tuple[Tensor, ...]) -> LaunchPlan:
        launches = tuple(slotted(launch, self.tensors) for launch in self.launches)
        ids = {id(t): i for i, t in enumerate(self.tensors) if t is not None}
        outs = tuple(ids[id(t)] for t in outputs)
        return LaunchPlan(tuple(self.buffers), launches, outs, tuple(self.counted))


def slotted(launch: Launch, tensors: Sequence[Tensor | None]) -> Launch:
    """``launch`` with its tensor arguments left out as slots: each the index of the same object in
    ``tensors``."""
    ids = {id(t): i for i, t in enumerate(tensors) if t is not None}
    slots = tuple((p, ids[id(a)]) for p, a in enumerate(launch.args) if isinstance(a, Tensor))
    return launch._replace(args=tuple(None if isinstance(a, Tensor) else a for a in launch.args), slots=slots)


class LaunchPlan(NamedTuple):
    """The cached launch plan of one key: buffers to allocate, launches (with their tensor arguments left out:
    ``Launch.slots`` maps argument positions to the plan's tensors, inputs then buffers), which tensors it
    returns, which buffers are counters (``counters``: not allocated, the device's shared ones)."""

    buffers: tuple[Buffer, ...]
    launches: tuple[Launch, ...]
    outputs: tuple[int, ...]
    counted: tuple[int, ...] = ()

    def _tensors(self, inputs: tuple[Tensor, ...], launch: bool) -> list[Tensor]:
        device = inputs[0].device
        shared = launch and not is_fake(inputs[0])  # fake tensors (a trace): counters of their own
        made = []
        for i, b in enumerate(self.buffers):
            if i in self.counted and shared:  # one launch after another: each may use the same counters
                made.append(counters(device, b.shape[0])[: b.shape[0]])
            else:
                made.append(
                    debug_filled(torch.empty_strided(b.shape, b.stride, dtype=b.dtype, device=device))
                )
        return [*inputs, *made]

    def bind(self, inputs: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], list[Launch]]:
        """Allocates the buffers on the inputs' device; returns the outputs and the launches on them."""
        tensors = self._tensors(inputs, inputs[0].device.type != "meta")
        launches = [launch._replace(args=launch.bound(tensors), slots=()) for launch in self.launches]
        return tuple(tensors[i] for i in self.outputs), launches

    def run(self, inputs: tuple[Tensor, ...], launch: bool = True) -> tuple[Tensor, ...]:
        """Allocates the buffers on the inputs' device, runs the launches on them in order (``launch=False``:
        none, for fake tensors) under ``on_device`` and returns the outputs."""
        tensors = self._tensors(inputs, launch)
        if launch:
            with on_device(inputs[0].device):
                try:
                    for one in self.launches:
                        one(tensors)
                except Exception:
                    reset_counters(inputs[0].device)
                    raise
        return tuple([tensors[i] for i in self.outputs])


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a plan's or a program's launches run in: ``device`` current on a GPU. Triton launches on
    the current CUDA device and its current stream: a tensor of another GPU would hand that GPU's pointers to
    a kernel on the current one (an illegal, sticky memory fault), on tiles sized for the wrong part. Off a
    GPU, or where ``device`` is current already, a context that does nothing: launch programs call this per
    launch list, and ``torch.cuda.device`` costs several times the check (asked once CUDA is initialised:
    fake tensors of a GPU can reach here on a host without one)."""
    if device.type != "cuda":
        return NO_CONTEXT
    if torch.cuda.is_initialized() and device.index == torch.cuda.current_device():
        return NO_CONTEXT
    return torch.cuda.device(device)


def _device_arch(device: torch.device) -> Arch:
    return Arch.of(device) if device.type == "cuda" else INTERPRET_TILES[0]


def _tile_kwargs(cfg: LaunchConfig, role: str, acc_tl: Any, **flags: Any) -> dict[str, Any]:
    t = cfg.tiles[role]
    out = {"BLOCK_N": t.block_n, "BLOCK_D": cfg.block_d, "ACC": acc_tl, **flags, **t.options()}
    if role != "conv":
        out |= {"BLOCK_C": t.block_c, "TRANS": t.trans, "STACK": t.stack}
        out |= {"DOT": cfg.dot, "EMU": cfg.emulate, "PREC": cfg.prec}
    return out


def _weight_strides(model: str, w: Tensor, d: int) -> tuple[int, int, int]:
    """(head, row, column) strides of the initial weights as the kernels read them: ``[1, G, d, d]``, or the
    depthwise conv's ``[1, G*d, 3, 3]`` as ``[G, 9 taps, d channels]`` (taps ``3 ty + tx`` one stride
    apart)."""
    if model == "dwconv":
        return d * w.stride(1), w.stride(3), w.stride(1)
    return w.stride(1), w.stride(2), w.stride(3)


def _stage(
    bld: _Builder, cfg: LaunchConfig, role: str, kernel: Any, bg: int, d: int, args: tuple, acc_tl: Any,
    flags: dict[str, Any],
) -> None:  # fmt: skip
    """The launches of a backward matrix stage: one launch for a single column block, else the column launch
    (per-column outputs) and the cross launch (``dq`` / ``dk``, every column block in turn). Labels name the
    kernel and, in brackets, the launch (``cols``, ``cross``) and ``fused`` (``FUSED``: N not split)."""
    name, c = kernel.fn.__name__, cfg.cols(role, d)
    tag = ["fused"] if flags["FUSED"] else []

    def label(*parts: str) -> str:
        return f"{name}[{','.join(parts)}]" if parts else name

    if c == 1:
        kw = _tile_kwargs(cfg, role, acc_tl, COLS=True, CROSS=True, **flags)
        bld.launch(label(*tag), kernel, bg * cfg.s, args, kw)
        return
    cols = _tile_kwargs(cfg, role, acc_tl, COLS=True, CROSS=False, **flags)
    flags = flags | {"FUSED": False}  # a COLS-only switch
    cross = _tile_kwargs(cfg, role + "_cross", acc_tl, COLS=False, CROSS=True, **flags)
    bld.launch(label("cols", *tag), kernel, bg * cfg.s * c, args, cols)
    bld.launch(label("cross"), kernel, bg * cfg.s, args, cross)


def reduce_split(items: int, blocks: int, arch: Arch) -> tuple[int, int]:
    """How ``wgrad_reduce_kernel`` cuts ``items`` per output block over ``blocks`` output blocks: ``(split,
    per)``, runs of ``per`` items, enough of them that ``blocks * split`` programs give each SM
    ``REDUCE_PROGRAMS_PER_SM``, but at most ``4 sqrt(items)`` runs (so that the second stage, one program per
    block summing the runs, stays short) and at least two items a run (``split == 1``: one stage)."""
    cap = min(items // 2, math.ceil(4 * math.sqrt(items)))
    split = max(1, min(cdiv(REDUCE_PROGRAMS_PER_SM * arch.sms, blocks), cap))
    per = cdiv(items, split)
    return cdiv(items, per), per


def _reduce(bld: _Builder, part: Tensor, dw: Tensor, b: int, g: int, e: int, d: int,
            slots: tuple[int, int, int], conv: bool, arch: Arch, interpret: bool, acc: torch.dtype,
            acc_tl: Any) -> None:  # fmt: skip
    """The weight-gradient reduction of ``part`` ``[B, G, L, E]`` (slots ``lo .. lo + nuse - 1`` of ``L``)
    into ``dw``: one launch, in runs of items (their sum taken by the last program of each block) where one
    program per block would leave the GPU idle, on narrower blocks of numbers where the runs alone cannot
    give every SM a program. The interpreter, which runs programs one after another, takes blocks of up to
    8192 numbers (fewer programs, the same runs)."""
    length, lo, nuse = slots

    def programs(width: int) -> int:
        return g * cdiv(e, width) * reduce_split(b * nuse, g * cdiv(e, width), arch)[0]

    gpu_e = REDUCE_BLOCK_E
    while gpu_e > REDUCE_MIN_BLOCK_E and programs(gpu_e) < arch.sms:
        gpu_e //= 2
    block_e = min(8192, max(gpu_e, next_pow2(e))) if interpret else gpu_e
    blocks = g * cdiv(e, block_e)
    split, per = reduce_split(b * nuse, g * cdiv(e, gpu_e), arch)
    kw = {"BLOCK_T": REDUCE_BLOCK_T, "BLOCK_E": block_e, "ACC": acc_tl, "num_warps": REDUCE_WARPS,
          "num_stages": 1}  # fmt: skip
    # (head stride, weight stride, rows per weight, row stride, column stride) of dW: the conv weight
    # [G*d, 3, 3], element (tap, c) at c * 9 + tap; W1, W2 [(2,) 1, G, d, d], each contiguous
    final = (e, 0, e // d, 1, 9) if conv else (d * d, g * d * d, d, d, 1)
    # one stage (split 1): dw stands in for the runs and the counters, which the kernel does not read then
    runs = bld.buffer(split, g, e, dtype=acc) if split > 1 else dw
    count = bld.counters(g * cdiv(e, gpu_e)) if split > 1 else dw  # enough for the interpreter's blocks too
    args = (part, runs, dw, count, b, g, e, d, length, lo, nuse, per, split, *final)
    bld.launch("wgrad_reduce_kernel", step_kernels.wgrad_reduce_kernel, blocks * split, args, kw)


class PlanKey(NamedTuple):
    """What a plan depends on besides the tensors' shapes, strides and dtypes."""

    model: str
    loss: str
    h: int
    wd: int
    scale: float
    lr: float
    grad_norm: bool
    chunk: int
    arch: Arch
    prec: str
    interpret: bool
    table: tuple  # ``tiles.table_hooks``
    grid_x: int
    rope: bool = False  # q, k rotated on load, dq, dk back on store (the table: the plan's last input)


def tensor_meta(t: Tensor | None) -> tuple | None:
    """What a plan reads of a tensor: its shape, strides and dtype (``None`` for no tensor)."""
    return None if t is None else (t.shape, t.stride(), t.dtype)


def plan_key(
    q: Tensor, model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
    arch: Arch | None = None, prec: str | None = None, interpret: bool | None = None, rope: bool = False,
) -> PlanKey:  # fmt: skip
    """The ``PlanKey`` of a call on ``q`` (arch, dot precision and interpreter: those of now by default;
    ``rope``: RoPE applied in the kernels)."""
    if rope and model == "dwconv":
        raise ValueError("RoPE does not apply to the depthwise conv (it sees positions itself)")
    interpret = interpreting() if interpret is None else interpret
    if prec is None:
        prec = "ieee" if interpret else gpu_dot_precision(q.dtype)
    return PlanKey(model, loss, h, wd, scale, lr, grad_norm, chunk, arch or _device_arch(q.device), prec,
                   interpret, tiles.table_hooks(), GRID_X_MAX, rope)  # fmt: skip


def _on_meta(meta: tuple | None) -> Tensor | None:
    return None if meta is None else torch.empty_strided(meta[0], meta[1], dtype=meta[2], device="meta")


def _config(key: PlanKey, q: Tensor) -> LaunchConfig:
    b, g, n_tok, d = q.shape
    return launch_config(key.model, n_tok, d, b * g, q.dtype, key.arch, loss=key.loss, prec=key.prec,
                         chunk=key.chunk or None, interpret=key.interpret, rope=key.rope)  # fmt: skip


def rope_table_like(q: Tensor) -> Tensor:
    """An empty meta tensor laid out as the RoPE table the kernels take for heads ``q`` ``[B, G, N, d]``:
    ``[N, G d / 2, 2]``, each channel pair's cos and sin in the accumulation dtype
    (``vit3.layers.rope.rope_cos_sin``)."""
    _, g, n_tok, d = q.shape
    return torch.empty(n_tok, g * d // 2, 2, dtype=acc_dtype(q.dtype)[0], device="meta")


def _tables(key: PlanKey, q: Tensor) -> tuple[Tensor, ...]:
    """The RoPE table a plan of ``key`` takes as its last input (``rope_table_like``); none without
    ``key.rope``."""
    return (rope_table_like(q),) if key.rope else ()


@functools.lru_cache(maxsize=256)
def forward_template(key: PlanKey, save: bool, metas: tuple, out_meta: tuple | None = None) -> LaunchPlan:
    """The forward plan of ``(key, metas)`` (q, k, v, W1, W2); its inputs are ``q, k, v, W1, W2 (or W1)``,
    with ``out_meta`` the output ``[B, G, N, c]`` it writes (the fused node's view, else it allocates it),
    and with ``key.rope`` the RoPE table (``_tables``)."""
    q, k, v, w1, w2 = (_on_meta(m) for m in metas)
    given = _on_meta(out_meta)
    tables = _tables(key, q)
    bld = _Builder((q, k, v, w1, w2, *(() if given is None else (given,)), *tables))
    cs = tables or (q,)  # q stands in for a table the kernels do not read
    b, g, n_tok, d = q.shape
    cfg = _config(key, q)
    acc, acc_tl = acc_dtype(q.dtype)
    (nw, r), bgn, s = stat_shape(key.model, d), b * g, cfg.s
    w2 = w1 if w2 is None else w2
    coef, ws = key.scale / n_tok, _weight_strides(key.model, w1, d)
    out = (
        bld.buffer(b, n_tok, g, d, dtype=q.dtype, perm=(0, 2, 1, 3)) if given is None else given
    )  # token-major
    one = key.model != "dwconv" and s == 1  # the whole forward in one launch
    # Without a backward, the one launch (and the conv's read-out, which takes the step) stores neither G nor
    # ||G||: q stands in for both, nothing is allocated.
    if (one or key.model == "dwconv") and not save:
        gbuf = nbuf = q
    else:
        g_shape, n_shape = stat_shapes(key.model, bgn, d)
        gbuf, nbuf = bld.buffer(*g_shape, dtype=acc), bld.buffer(*n_shape, dtype=acc)
    flags = {"SWIGLU": key.model == "swiglu", "NW": nw, "ROPE": key.rope}
    if one:
        kw = _tile_kwargs(cfg, "forward", acc_tl, MSE=key.loss == "mse", GRAD_NORM=key.grad_norm,
                          SAVE=save, **flags)  # fmt: skip
        args = (q, k, v, w1, w2, out, gbuf, nbuf, *cs, bgn, g, n_tok, d, *q.stride(), *k.stride(),
                *v.stride(), *out.stride(), *ws, coef, key.lr)  # fmt: skip
        bld.launch("forward_kernel", matrix_kernels.forward_kernel, bgn * cfg.cols("forward", d), args, kw)
        return bld.plan((out, gbuf, nbuf))
    part = bld.buffer(bgn, s, nw, r, d, dtype=acc)
    sizes = (bgn, g, n_tok, d, cfg.chunk, s)
    if key.model == "dwconv":
        conv = _tile_kwargs(cfg, "conv", acc_tl)
        args = (k, v, part, *sizes, key.h, key.wd, *k.stride(), *v.stride(), coef)
        bld.launch("conv_grad_partial_kernel", dwconv_kernels.conv_grad_partial_kernel, bgn * s, args, conv)
    else:
        kw = _tile_kwargs(cfg, "grad", acc_tl, MSE=key.loss == "mse", **flags)
        count = bld.counters(bgn * cfg.cols("grad", d))
        args = (k, v, w1, w2, part, gbuf, nbuf, count, *cs, *sizes, *k.stride(), *v.stride(), *ws, coef)
        bld.launch(
            "grad_partial_kernel", matrix_kernels.grad_partial_kernel, bgn * s * cfg.cols("grad", d), args, kw
        )
    if key.model == "dwconv":  # its read-out programs take the step themselves (9 taps x channels)
        args = (q, w1, part, gbuf, nbuf, out, *sizes, key.h, key.wd, *q.stride(), *out.stride(), *ws, key.lr)
        kw = _tile_kwargs(cfg, "conv", acc_tl, GRAD_NORM=key.grad_norm, SAVE=save)
        bld.launch("conv_readout_kernel", dwconv_kernels.conv_readout_kernel, bgn * s, args, kw)
    else:  # the step: taken by the gradient's programs
        args = (q, w1, w2, gbuf, nbuf, out, *cs, *sizes, *q.stride(), *out.stride(), *ws, key.lr)
        kw = _tile_kwargs(cfg, "readout", acc_tl, GRAD_NORM=key.grad_norm, **flags)
        bld.launch(
            "readout_kernel", matrix_kernels.readout_kernel, bgn * s * cfg.cols("readout", d), args, kw
        )
    return bld.plan((out, gbuf, nbuf))


@functools.lru_cache(maxsize=256)
def backward_template(
    key: PlanKey, metas: tuple, dout_meta: tuple, grad_metas: tuple | None = None
) -> LaunchPlan:
    """The backward plan after the forward of ``(key, metas)`` (q, k, v, W1, W2), for an upstream gradient
    ``dout_meta``; its inputs are ``dout, q, k, v, W1, W2 (or W1), G, ||G||``, with ``grad_metas`` the
    ``dq, dk, dv`` it writes (the fused node's views of its qkv gradient, else it allocates them), and with
    ``key.rope`` the RoPE table (``_tables``)."""
    q, k, v, w1, w2 = (_on_meta(m) for m in metas)
    b, g, n_tok, d = q.shape
    nw, r = stat_shape(key.model, d)
    acc, acc_tl = acc_dtype(q.dtype)
    gbuf, nbuf = (torch.empty(shape, dtype=acc, device="meta") for shape in stat_shapes(key.model, b * g, d))
    dout = _on_meta(dout_meta)
    given = None if grad_metas is None else tuple(_on_meta(m) for m in grad_metas)
    tables = _tables(key, q)
    cs = tables or (q,)  # q stands in for a table the kernels do not read
    bld = _Builder((dout, q, k, v, w1, w2, gbuf, nbuf, *(given or ()), *tables))
    cfg = _config(key, q)
    conv = key.model == "dwconv"
    bgn, s = b * g, cfg.s
    w2 = w1 if w2 is None else w2
    coef, ws = key.scale / n_tok, _weight_strides(key.model, w1, d)
    fused = s == 1 and not conv  # one program holds a (sample, head)'s whole dW' and kᵀdZ per column block
    wgrad = key.model == "swiglu" or key.loss == "mse"  # kᵀdZ != 0: the inner gradient depends on W
    # Slots 0..S-1: per-chunk partials (first of the read-out's dW', then, reused, of kᵀdZ); slot S: dW'.
    part = bld.buffer(bgn, s + 1, nw, r, d, dtype=acc)
    dgbuf = None if conv else bld.buffer(bgn, nw, r, d, dtype=acc)  # the conv's programs keep dG in registers
    dq, dk, dv = given or (bld.buffer(b, n_tok, g, d, dtype=t.dtype, perm=(0, 2, 1, 3)) for t in (q, k, v))
    dw = bld.buffer(*weight_grad_shape(key.model, g, d), dtype=acc)
    sizes = (bgn, g, n_tok, d, cfg.chunk, s)
    io = (*q.stride(), *dout.stride(), *dq.stride())
    kv = (*k.stride(), *v.stride(), *dk.stride(), *dv.stride())
    flags = {"SWIGLU": key.model == "swiglu", "NW": nw, "ROPE": key.rope}
    if conv:
        args = (q, dout, w1, gbuf, nbuf, dq, part, *sizes, key.h, key.wd, *io, *ws, key.lr)
        kw = _tile_kwargs(cfg, "conv", acc_tl, GRAD_NORM=key.grad_norm)
        bld.launch("conv_readout_bwd_kernel", dwconv_kernels.conv_readout_bwd_kernel, bgn * s, args, kw)
    else:
        # the step's backward, by the last of a block's programs; fused: one program a block, dw stands in
        count = dw if fused else bld.counters(bgn * cfg.cols("readout_bwd", d))
        args = (q, dout, w1, w2, gbuf, nbuf, dq, part, dgbuf, count, *cs, *sizes, *io, *ws, key.lr)
        rflags = flags | {"GRAD_NORM": key.grad_norm, "FUSED": fused}
        _stage(bld, cfg, "readout_bwd", matrix_kernels.readout_bwd_kernel, bgn, d, args, acc_tl, rflags)
    if conv:
        args = (k, v, part, gbuf, nbuf, dk, dv, *sizes, key.h, key.wd, *kv, coef, key.lr)
        kw = _tile_kwargs(cfg, "conv", acc_tl, GRAD_NORM=key.grad_norm)
        bld.launch("conv_grad_bwd_kernel", dwconv_kernels.conv_grad_bwd_kernel, bgn * s, args, kw)
    else:
        args = (k, v, w1, w2, dgbuf, dk, dv, part, *cs, *sizes, *kv, *ws, coef)
        gflags = flags | {"MSE": key.loss == "mse", "FUSED": fused, "WGRAD": wgrad}
        _stage(bld, cfg, "grad_bwd", matrix_kernels.grad_bwd_kernel, bgn, d, args, acc_tl, gflags)
    # The weight gradient sums, per head, every sample's slots that hold a part of it: all S + 1 (the kᵀdZ
    # partials and dW'), only slot 0 when the fused gradient pass added dW' to it, only dW' without kᵀdZ.
    slots = (s + 1, 0, 1) if fused and wgrad else ((s + 1, 0, s + 1) if wgrad else (s + 1, s, 1))
    _reduce(bld, part, dw, b, g, nw * r * d, d, slots, conv, key.arch, key.interpret, acc, acc_tl)
    return bld.plan((dq, dk, dv, dw))


def forward_plan(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str, h: int, wd: int,
    scale: float, lr: float, grad_norm: bool, chunk: int, *, save: bool = True, arch: Arch | None = None,
    prec: str | None = None, interpret: bool | None = None, rope: Tensor | None = None,
) -> tuple[tuple[Tensor, Tensor, Tensor], list[Launch]]:  # fmt: skip
    """The forward's outputs ``(out, G, ||G||)`` (allocated, unwritten) and the launches that write them.

    Arguments as ``_fwd_op``'s; ``save=False`` (inference) lets the one-launch forward skip storing ``G`` and
    ``||G||`` (q stands in for them); ``arch``, ``prec`` and ``interpret`` as ``launch_config``'s (default:
    ``q``'s device, what PyTorch allows now, ``$TRITON_INTERPRET``); ``rope``: the RoPE table the kernels
    rotate q, k by (``_tables``). The plan is built once per key (settings, shapes, strides, dtypes, arch) on
    meta tensors and cached; each call allocates its buffers and binds its tensors. Tensors may live on the
    meta device: the offline compiles (``vit3.kernels.aot``) and the roofline (``benchmarks/roofline.py``)
    read the launches a GPU would run from shapes and strides alone.
    """
    key = plan_key(
        q, model, loss, h, wd, scale, lr, grad_norm, chunk, arch, prec, interpret, rope is not None
    )
    plan = forward_template(key, save, tuple(tensor_meta(t) for t in (q, k, v, w1, w2)))
    return plan.bind((q, k, v, w1, w1 if w2 is None else w2, *(() if rope is None else (rope,))))


def backward_plan(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, gbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int, *,
    arch: Arch | None = None, prec: str | None = None, interpret: bool | None = None,
    rope: Tensor | None = None,
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], list[Launch]]:  # fmt: skip
    """The backward's gradients ``(dq, dk, dv, dW)`` (allocated, unwritten) and the launches that write them
    (as ``forward_plan``). ``dW`` is SwiGLU's ``[2, 1, G, c, c]``, the linear model's ``[1, G, c, c]`` or the
    depthwise conv's ``[1, G*c, 3, 3]``."""
    key = plan_key(
        q, model, loss, h, wd, scale, lr, grad_norm, chunk, arch, prec, interpret, rope is not None
    )
    plan = backward_template(key, tuple(tensor_meta(t) for t in (q, k, v, w1, w2)), tensor_meta(dout))
    return plan.bind(
        (dout, q, k, v, w1, w1 if w2 is None else w2, gbuf, nbuf, *(() if rope is None else (rope,)))
    )
