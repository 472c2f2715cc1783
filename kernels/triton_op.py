"""The Triton path of the TTT ops: custom ``torch.library`` ops around the Triton kernels, autograd, launches.

``triton_ttt`` runs one full-batch inner step of an inner model (``"swiglu"``: the official ViT³ branch,
dot loss; ``"linear"``: dot or MSE loss; ``"dwconv"``: the official 3x3 depthwise-conv branch, dot loss)
per (sample, head) and applies the result to the
queries, forward and backward in Triton. It is registered as the custom ops ``vit3::triton_ttt_fwd`` /
``vit3::triton_ttt_bwd`` (``torch.library.triton_op``) so ``torch.compile`` sees the kernels without a
graph break. ``backend="reference"`` runs the pure-PyTorch reference formulation instead
(``vit3.kernels.reference``). Which implementation a mixer runs is decided by
``vit3.layers.backends``: this op reads no environment variable.

Launch set-up: ``launch_config`` sizes every kernel (tiles, column blocks, warps, pipeline stages, the split
of N) from the GPU (``Arch``: compute capability, opt-in shared memory per block, SM count) and the dot
precision; ``forward_plan`` / ``backward_plan`` turn it into the list of launches the custom ops execute,
and plan the same launches on meta tensors for the offline compiles of ``vit3.kernels.aot``.
``fits_device`` tells a caller whether a GPU can run a configuration at all. A plan's launches run with the
inputs' GPU current (``_launch_all``: Triton launches on the current device and its current stream). The
backward is differentiable for a double backward (``create_graph=True``): autograd through the reference.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.library import triton_op, wrap_triton

from . import reference
from . import triton_kernels as K

__all__ = [
    "ARCHS",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_DWCONV",
    "MIN_HEAD_DIM",
    "TRITON_LOSSES",
    "Arch",
    "Launch",
    "LaunchConfig",
    "Tiles",
    "backward_plan",
    "fits_device",
    "forward_plan",
    "fp32_uses_tf32",
    "head_dim_supported",
    "launch_config",
    "max_head_dim",
    "resolve_backend",
    "smem_need",
    "triton_runs_on",
    "triton_ttt",
]

TRITON_LOSSES = {"swiglu": ("dot",), "linear": ("dot", "mse"), "dwconv": ("dot",)}
# The inner models whose kernels multiply with ``tl.dot`` (the depthwise conv's are elementwise).
DOT_MODELS = ("swiglu", "linear")
WEIGHT_NAMES = {"swiglu": ("w1", "w2"), "linear": ("w",), "dwconv": ("weight",)}
# Head dims the kernels take. The matrix models' kernels keep [BLOCK_D, BLOCK_C] column blocks of the d x d
# weights and gradients on chip (``launch_config``: 16 columns at d = 128): whole 128 x 128 matrices would need
# 311-606 KB of shared memory in the backward kernels on sm_90, more than the 227 KB an H100/H200 block may
# use. Beyond 128 the full-width k/q tiles and the dq/dk accumulators outgrow it; the depthwise conv keeps
# only 9 x d weights and full-width tiles, up to 128 as well.
MIN_HEAD_DIM, MAX_HEAD_DIM, MAX_HEAD_DIM_DWCONV = 16, 128, 128


def max_head_dim(name: str) -> int:
    """The largest head dim the kernels of inner model ``name`` take.

    The same for every dtype: float64 (a checking mode) takes narrower column blocks where needed.
    """
    return MAX_HEAD_DIM_DWCONV if name == "dwconv" else MAX_HEAD_DIM


def head_dim_supported(name: str, head_dim: int) -> bool:
    """Whether the kernels of inner model ``name`` take heads of ``head_dim`` channels (any io dtype)."""
    return MIN_HEAD_DIM <= head_dim <= max_head_dim(name)


IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Test hook: when set (e.g. to NaN), every buffer the op allocates is filled with it, so any element a kernel
# fails to write shows up in the result.
DEBUG_FILL: float | None = None


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(DEBUG_FILL) if DEBUG_FILL is not None else out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA, or any device under ``TRITON_INTERPRET=1``."""
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


def resolve_backend(backend: str = "auto") -> str:
    """Checks ``backend``: ``"auto"``, ``"triton"`` or ``"reference"``."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    return backend


# --------------------------------------------------------------------------------------------------- devices

KB = 1024


@dataclass(frozen=True)
class Arch:
    """What the launch set-up needs to know of a GPU: compute capability, shared memory, SM count.

    ``Arch.of(device)`` reads it from the CUDA device (``torch.cuda.get_device_properties``); offline
    compiles and tests take one of ``ARCHS`` (or build one) for a GPU that is not there.
    """

    capability: int  # 10 * major + minor: 75, 80, 86, 89, 90, 100, 120
    smem: int  # opt-in shared memory one block may use, bytes
    sms: int  # streaming multiprocessors
    name: str = ""

    @property
    def sm(self) -> str:
        return f"sm_{self.capability}"

    @staticmethod
    def of(device: torch.device) -> Arch:
        """The arch of CUDA ``device`` (cached per device)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_arch(index)


# The current NVIDIA architectures (opt-in shared memory per block from the CUDA programming guide; the SM
# count of one common part, used only to size the split of N).
ARCHS: dict[str, Arch] = {
    a.sm: a
    for a in (
        Arch(75, 64 * KB, 40, "Tesla T4"),
        Arch(80, 163 * KB, 108, "A100"),
        Arch(86, 99 * KB, 82, "RTX 3090"),
        Arch(89, 99 * KB, 142, "L40S"),
        Arch(90, 227 * KB, 132, "H100 SXM"),
        Arch(100, 227 * KB, 148, "B200"),
        Arch(120, 99 * KB, 170, "RTX 5090"),
    )
}


@functools.cache
def _cuda_arch(index: int) -> Arch:
    props = torch.cuda.get_device_properties(index)
    cap = 10 * props.major + props.minor
    known = next((a.smem for a in ARCHS.values() if a.capability == cap), 48 * KB)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or known  # older PyTorch lacks the field
    return Arch(cap, int(smem), props.multi_processor_count, props.name)


# The (arch, dot precision) whose tiles the interpreter takes: its column blocks and launch structure are
# a GPU's (token tiles and the split of N are its own, see ``launch_config``); its dots are exact.
INTERPRET_TILES: tuple[Arch, str] = (ARCHS["sm_90"], "tf32")
# Test hook: when set, every launch takes the tiles of this (arch, dot precision), on the interpreter or a
# GPU, so tests run each configuration of the table on the hardware at hand.
TILES_AS: tuple[Arch, str] | None = None


def fp32_uses_tf32() -> bool:
    """Whether PyTorch lets fp32 matmuls use TF32 (``fp32_precision``, or the legacy ``allow_tf32``).

    Reading ``allow_tf32`` raises once the ``fp32_precision`` API (PyTorch 2.9+) has been set, so the new
    API is asked first; ``"none"`` defers to the legacy flag.
    """
    matmul = torch.backends.cuda.matmul
    prec = getattr(matmul, "fp32_precision", "none")
    if prec in ("tf32", "ieee"):
        return prec == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # a mix of the two APIs, which PyTorch refuses to reconcile
        return False


def _gpu_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision on a GPU: TF32 for half inputs (and fp32 when PyTorch allows TF32), else IEEE."""
    if dtype == torch.float64 or (dtype == torch.float32 and not fp32_uses_tf32()):
        return "ieee"
    return "tf32"


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision of a launch: the GPU's, or IEEE on the interpreter (exact fp32 dots)."""
    return "ieee" if _interpreting() else _gpu_precision(dtype)


# ---------------------------------------------------------------------------------------------- launch set-up


def _acc_dtype(dtype: torch.dtype) -> tuple[torch.dtype, Any]:
    """Accumulator dtype (torch, triton) for inputs of ``dtype``: float64 for float64, else float32."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


@dataclass(frozen=True)
class Tiles:
    """One kernel's tile constexprs and launch options."""

    block_n: int  # tokens per tile
    block_c: int  # output columns per program (matrix kernels), or per tile of the small kernels
    num_warps: int
    num_stages: int  # Triton's software pipelining of the token loops (1: none)

    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class LaunchConfig:
    """Everything the launches of one ``triton_ttt`` call are sized by (``launch_config``).

    ``tiles`` holds one ``Tiles`` per kernel role: ``"grad"`` (``grad_partial_kernel``), ``"readout"``,
    ``"readout_bwd"`` / ``"grad_bwd"`` (their column or fused launch) and ``"readout_bwd_cross"`` /
    ``"grad_bwd_cross"`` (the cross launch, used where the column launch has more than one block),
    ``"conv"`` (the four depthwise-conv kernels) and ``"small"`` (step, step backward, reduction).
    """

    block_d: int  # the head dim padded to a power of two
    block_r: int  # rows of the weights: BLOCK_D, or 16 for the 9 taps of the depthwise conv
    chunk: int  # tokens per program along N (a multiple of every token tile)
    s: int  # chunks: cdiv(N, chunk)
    prec: str  # ``tl.dot`` input precision
    tiles: dict[str, Tiles]

    def cols(self, role: str, d: int) -> int:
        """Column blocks of role ``role`` at head dim ``d``."""
        return triton.cdiv(d, self.tiles[role].block_c)


def _tensor_cores(dtype: torch.dtype, prec: str, arch: Arch) -> bool:
    """Whether the dots run on tensor cores (TF32 MMA, sm_80+), or as FMA loops (IEEE fp32, fp64, sm_75).

    Every tile is fp32 (fp64) by the time it meets ``tl.dot`` (the kernels upcast on load), so the only
    tensor-core path is TF32: half and TF32-allowed fp32 inputs on sm_80 and newer. FMA dots keep both
    operands in registers and need narrower tiles to stay clear of spills.
    """
    return prec == "tf32" and dtype != torch.float64 and arch.capability >= 80


# A SwiGLU backward stage at d = 64 in one launch keeps W1, W2, dG1, dG2 (and the transposes its dk / dq dots
# read) on chip: 132-192 KB of shared memory with TF32 dots (sm_80: 144-168 KB plus register spills; sm_90 and
# sm_100: up to 192 KB, spill-free). Parts with at least this much per block take it; the others split the
# columns into 32-wide blocks (a column and a cross launch per stage), which need at most ~60 KB.
FUSED_BACKWARD_SMEM = 200 * KB


def _matrix_tiles(
    model: str, loss: str, role: str, block_d: int, dtype: torch.dtype, prec: str, arch: Arch
) -> Tiles:
    """Tiles of one matrix-kernel role: ``launch_config``'s table.

    ``tests/test_kernels_compile.py`` compiles it for every arch, inner model, head dim and dtype mode and
    holds each kernel to the arch's shared memory and to a spill bound (``vit3.kernels.aot.spill_bound``);
    where the table has a choice, it is the one those compiles found spill-free. Column blocks: the whole
    head up to d = 32, 16 columns at d = 128, and at d = 64 on tensor cores the whole head except in the
    SwiGLU backward (and its gradient pass) on parts without ``FUSED_BACKWARD_SMEM`` and in the linear MSE
    backward, which take 32 columns. FMA dots (IEEE fp32, fp64, every dot on sm_75) hold both operands in
    registers: 16-token tiles over 8 warps, 32 columns at most, no pipelining (its extra stage of k / v tiles
    pushes them into spills). Tensor cores: two pipeline stages; 16-token tiles where full-width k / dk tiles
    share the registers with many live column tiles (d = 32, the backward at d = 128, the linear MSE backward).
    """
    if dtype == torch.float64:
        return Tiles(16, 16, 8, 1)
    if not _tensor_cores(dtype, prec, arch):
        return Tiles(16, min(block_d, 32 if block_d <= 64 else 16), 8, 1)
    backward = role.startswith(("readout_bwd", "grad_bwd"))
    if block_d <= 16:
        return Tiles(32, block_d, 4, 2)
    if block_d == 32:
        return Tiles(16, 32, 8, 2)
    if block_d == 128:
        return Tiles(16 if backward else 32, 16, 8, 2)
    if model == "linear":
        return Tiles(16, 32, 8, 2) if backward and loss == "mse" else Tiles(32, 64, 4, 2)
    if arch.smem >= FUSED_BACKWARD_SMEM or role == "readout":
        return Tiles(32, 64, 8, 2)
    return Tiles(32, 32, 8, 2)


def _conv_tiles(block_d: int, dtype: torch.dtype) -> Tiles:
    """The depthwise-conv kernels: full-width ``[BLOCK_N, BLOCK_D]`` tiles (their weights are only 9 x d), no
    dots; the token tile per head dim that the compile matrix found spill-free (16 for fp64)."""
    if dtype == torch.float64:
        return Tiles(16, block_d, 4 if block_d <= 32 else 8, 2)
    block_n = {16: 32, 32: 16, 64: 32}.get(block_d, 16)
    return Tiles(block_n, block_d, 4 if block_d <= 32 else 8, 2)


def _small_tiles(block_r: int, block_d: int, dtype: torch.dtype) -> Tiles:
    """The step, step-backward and reduction kernels: ``[BLOCK_R, cols]`` tiles of at most 2048 fp32
    (1024 fp64) elements (4096, the d = 64 matrices, make them spill registers)."""
    elems = 1024 if dtype == torch.float64 else 2048
    return Tiles(0, min(block_d, max(16, elems // block_r)), 4, 1)


def launch_config(
    model: str,
    n_tok: int,
    d: int,
    bg: int,
    dtype: torch.dtype,
    arch: Arch,
    *,
    loss: str = "dot",
    prec: str | None = None,
    chunk: int | None = None,
    interpret: bool | None = None,
) -> LaunchConfig:
    """The launch configuration of inner model ``model``'s kernels on ``arch``: the one place that sizes them.

    Args:
        model: ``"swiglu"``, ``"linear"`` or ``"dwconv"``.
        n_tok: tokens N per (sample, head).
        d: the head dim.
        bg: samples x heads (programs along the second grid axis).
        dtype: the q/k/v dtype.
        arch: the GPU (``Arch.of(device)``, or one of ``ARCHS`` for offline compiles).
        loss: ``"dot"`` or ``"mse"`` (the linear model's MSE backward keeps more tiles live).
        prec: ``tl.dot`` input precision (default: what ``triton_ttt`` picks for ``dtype`` now).
        chunk: tokens per program (tests force a split of N with it); ``None`` chooses.
        interpret: size for Triton's interpreter (default: ``$TRITON_INTERPRET``): the GPU's column blocks
            and warps, but large token tiles and a single chunk, since it runs programs one after another.

    Returns:
        The ``LaunchConfig``.
    """
    interpret = _interpreting() if interpret is None else interpret
    prec = prec or _precision(dtype)
    block_d = max(16, triton.next_power_of_2(d))
    block_r = 16 if model == "dwconv" else block_d
    tile_arch, tile_prec = TILES_AS or (INTERPRET_TILES if interpret else (arch, prec))
    if model == "dwconv":
        tiles = {"conv": _conv_tiles(block_d, dtype)}
    else:
        tiles = {r: _matrix_tiles(model, loss, r, block_d, dtype, tile_prec, tile_arch) for r in MATRIX_ROLES}
    tiles["small"] = _small_tiles(block_r, block_d, dtype)
    if interpret:
        big = min(256, max(16, triton.next_power_of_2(n_tok)))
        tiles = {
            role: replace(t, block_n=big if role != "small" else 0, num_warps=4) for role, t in tiles.items()
        }
        want = n_tok
    else:
        want = triton.cdiv(n_tok, max(1, triton.cdiv(2 * arch.sms, bg)))  # about two programs per SM
    if chunk is not None:
        cap = max(16, triton.next_power_of_2(chunk))
        tiles = {role: replace(t, block_n=min(t.block_n, cap)) for role, t in tiles.items()}
        want = chunk
    step = max(t.block_n for t in tiles.values())
    size = triton.cdiv(max(want, 1), step) * step
    return LaunchConfig(block_d, block_r, size, triton.cdiv(n_tok, size), prec, tiles)


# The oldest arch the kernels are compiled and checked for (tests/test_kernels_compile.py).
MIN_CAPABILITY = 75


def smem_need(model: str, d: int, dtype: torch.dtype, prec: str, arch: Arch) -> int:
    """Shared memory per block (bytes) the kernels of ``launch_config``'s choice are held to on ``arch``.

    An upper bound the compile matrix checks for every kernel, arch and dtype mode: 64 KB with FMA dots
    (the T4's limit, which every other part exceeds), 72 KB on tensor cores, 96 KB for SwiGLU in fp64 at
    d = 128 (full-width fp64 tiles of four weights), ``FUSED_BACKWARD_SMEM`` for the fused SwiGLU backward
    at d = 64.
    """
    block_d = max(16, triton.next_power_of_2(d))
    if model == "swiglu" and block_d == 64:
        cfg = launch_config(model, 4096, block_d, 64, dtype, arch, prec=prec, interpret=False)
        if cfg.cols("grad_bwd", block_d) == 1:
            return FUSED_BACKWARD_SMEM
    if model == "swiglu" and dtype == torch.float64 and block_d == 128:
        return 96 * KB
    return (72 if _tensor_cores(dtype, prec, arch) else 64) * KB


def fits_device(name: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether the kernels of inner model ``name`` have a launch configuration that fits ``device``.

    On a CUDA device: its compute capability (the kernels are checked from sm_75 on) and its opt-in shared
    memory per block against what ``launch_config`` picks for this head dim, dtype and, for fp32, the dots
    PyTorch allows now (TF32 or IEEE): ``smem_need``. On ROCm (``torch.version.hip``), first whether Triton's
    AMD backend takes the dots' input precision on this GPU (most parts reject TF32; ``DOT_MODELS``). Cheap:
    cached per (model, head-dim class, dtype, precision, device). On a CPU the interpreter (``TRITON_INTERPRET=1``) runs any configuration. A CUDA
    device asked about where no GPU is present (a plan explained ahead of time) passes: the check is made
    where the GPU is.

    Args:
        name: ``"swiglu"``, ``"linear"`` or ``"dwconv"`` (the loss does not change the shared memory).
        head_dim: channels per head.
        dtype: the q/k/v dtype.
        device: where q, k, v live.

    Returns:
        ``(True, "")``, or ``(False, reason)`` naming the GPU and what it lacks.
    """
    if name not in TRITON_LOSSES:
        return False, f"no Triton kernel for the inner model {name!r} (kernels: {', '.join(TRITON_LOSSES)})"
    if dtype not in IO_DTYPES:
        return False, f"the Triton kernels take {', '.join(str(t) for t in IO_DTYPES)} inputs, not {dtype}"
    if not head_dim_supported(name, head_dim):
        top = max_head_dim(name)
        return False, f"the Triton kernels take head dims {MIN_HEAD_DIM}..{top}, not {head_dim}"
    if device.type != "cuda":
        if device.type == "cpu" and _interpreting():
            return True, ""
        return (
            False,
            f"the Triton kernels run on CUDA GPUs (or on CPU with TRITON_INTERPRET=1), not on {device}",
        )
    if not torch.cuda.is_available():  # a CUDA plan explained where there is no GPU to inspect
        return True, ""
    prec = _gpu_precision(dtype)
    if torch.version.hip and name in DOT_MODELS:
        index = device.index if device.index is not None else torch.cuda.current_device()
        arch, allowed = _hip_arch(index)
        if prec not in allowed:
            return False, (
                f"ROCm {arch}: Triton's AMD backend takes {', '.join(allowed)} dots there, not the {prec} dots "
                f"the kernels take for {dtype} inputs"
            )
    block_d = max(16, triton.next_power_of_2(head_dim))
    return _fits_arch(name, block_d, dtype, prec, Arch.of(device))


@functools.cache
def _hip_arch(index: int) -> tuple[str, tuple[str, ...]]:
    """The ROCm GPU ``index``'s architecture (``gfx942`` ...) and the ``tl.dot`` input precisions Triton's AMD
    backend takes on it (``hip_dot_precisions``)."""
    arch = torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    return arch, hip_dot_precisions(arch)


def hip_dot_precisions(arch: str) -> tuple[str, ...]:
    """The ``tl.dot`` input precisions Triton's AMD backend accepts on ``arch``, as Triton's own option parser
    says (``tf32`` on some parts only, e.g. ``gfx942``); only ``ieee`` where this Triton cannot be asked."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        options = make_backend(GPUTarget("hip", arch, 64)).parse_options({})
        return tuple(options.allowed_dot_input_precisions)
    except Exception:  # another Triton's API, or no AMD backend in this build
        return ("ieee",)


@functools.cache
def _fits_arch(name: str, block_d: int, dtype: torch.dtype, prec: str, arch: Arch) -> tuple[bool, str]:
    gpu = f"{arch.sm} ({arch.name})" if arch.name else arch.sm
    if arch.capability < MIN_CAPABILITY:
        return False, f"the Triton kernels are built and checked for sm_{MIN_CAPABILITY}+; this GPU is {gpu}"
    need = smem_need(name, block_d, dtype, prec, arch)
    if need > arch.smem:
        dots = f" ({prec} dots)" if dtype == torch.float32 else ""
        return False, (
            f"{name} kernels at head dim {block_d} in {dtype}{dots} need {need // KB} KB of shared memory "
            f"per block; this GPU ({gpu}) allows {arch.smem // KB} KB"
        )
    return True, ""


MATRIX_ROLES = ("grad", "readout", "readout_bwd", "readout_bwd_cross", "grad_bwd", "grad_bwd_cross")


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan: ``kernel[grid](*args, **constexprs, **options)``."""

    label: str  # the kernel's name, with ``[cols]`` / ``[cross]`` for the two launches of a split stage
    kernel: Any  # a ``triton.JITFunction``
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]  # constexprs and launch options (num_warps, num_stages)

    def __call__(self) -> None:
        wrap_triton(self.kernel)[self.grid](*self.args, **self.kwargs)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a plan's launches run in: ``device`` current on a GPU. Triton launches on the current CUDA
    device and its current stream: a tensor of another GPU would hand that GPU's pointers to a kernel on the
    current one (an illegal, sticky memory fault), on tiles sized for the wrong part. Compiled graphs guard
    their devices themselves."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _launch_all(launches: list[Launch], device: torch.device) -> None:
    """Runs a plan's launches in order on ``device``, the inputs' (``_on_device``)."""
    with _on_device(device):
        for launch in launches:
            launch()


def _device_arch(device: torch.device) -> Arch:
    return Arch.of(device) if device.type == "cuda" else INTERPRET_TILES[0]


def _tile_kwargs(cfg: LaunchConfig, role: str, acc_tl: Any, **flags: Any) -> dict[str, Any]:
    t = cfg.tiles[role]
    out = {"BLOCK_N": t.block_n, "BLOCK_D": cfg.block_d, "ACC": acc_tl, **flags, **t.options()}
    if role != "conv":
        out["BLOCK_C"] = t.block_c
    return out


def _small_kwargs(cfg: LaunchConfig, acc_tl: Any, nw: int) -> dict[str, Any]:
    t = cfg.tiles["small"]
    return {"NW": nw, "BLOCK_R": cfg.block_r, "BLOCK_C": t.block_c, "ACC": acc_tl, **t.options()}


def _stage(
    cfg: LaunchConfig, role: str, kernel: Any, d: int, args: tuple, acc_tl: Any, flags: dict[str, Any]
) -> list[Launch]:
    """The launches of a backward matrix stage: one fused launch for a single column block, else the column
    launch (per-column outputs) and the cross launch (``dq`` / ``dk``, every column block in turn)."""
    b_g = args[0].shape[0] * args[0].shape[1]
    name = kernel.fn.__name__
    c = cfg.cols(role, d)
    if c == 1:
        kw = _tile_kwargs(cfg, role, acc_tl, COLS=True, CROSS=True, **flags)
        return [Launch(name, kernel, (cfg.s, b_g, 1), args, kw)]
    cols = _tile_kwargs(cfg, role, acc_tl, COLS=True, CROSS=False, **flags)
    cross = _tile_kwargs(cfg, role + "_cross", acc_tl, COLS=False, CROSS=True, **flags)
    return [
        Launch(name + "[cols]", kernel, (cfg.s, b_g, c), args, cols),
        Launch(name + "[cross]", kernel, (cfg.s, b_g, 1), args, cross),
    ]


def _plan_setup(
    q: Tensor, w: Tensor, model: str, loss: str, chunk: int, arch: Arch | None, prec: str | None,
    interpret: bool | None,
) -> tuple[int, int, torch.dtype, Any, LaunchConfig, tuple, tuple, dict[str, Any]]:  # fmt: skip
    """What both plans start from: weights per head ``NW``, weight rows ``R``, the accumulator dtype (torch,
    triton), the ``LaunchConfig``, the size and weight-stride arguments and the matrix kernels' flags."""
    b, g, n_tok, d = q.shape
    nw, r = w.shape[2], w.shape[3]
    acc, acc_tl = _acc_dtype(q.dtype)
    arch = arch or _device_arch(q.device)
    cfg = launch_config(
        model, n_tok, d, b * g, q.dtype, arch, loss=loss, prec=prec, chunk=chunk or None, interpret=interpret
    )
    w_strides = (w.stride(1), w.stride(3), w.stride(4), w.stride(2))
    flags = {"SWIGLU": model == "swiglu", "NW": nw, "PREC": cfg.prec}
    return nw, r, acc, acc_tl, cfg, (g, n_tok, d, cfg.chunk), w_strides, flags


def forward_plan(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, model: str, loss: str, h: int, wd: int, scale: float,
    lr: float, grad_norm: bool, chunk: int, *, arch: Arch | None = None, prec: str | None = None,
    interpret: bool | None = None,
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], list[Launch]]:  # fmt: skip
    """The forward's outputs (allocated, unwritten) and the launches that write them, in order.

    Arguments as ``_fwd_op``'s; ``arch``, ``prec`` and ``interpret`` as ``launch_config``'s (default: ``q``'s
    device, what PyTorch allows now, ``$TRITON_INTERPRET``). Tensors may live on the meta device: the offline
    compiles (``vit3.kernels.aot``) plan the launches a GPU would run from shapes and strides alone.
    """
    b, g, n_tok, d = q.shape
    nw, r, acc, acc_tl, cfg, sizes, w_strides, flags = _plan_setup(
        q, w, model, loss, chunk, arch, prec, interpret
    )
    s, coef, dev = cfg.s, scale / n_tok, q.device
    part = _empty(b * g, s, nw, r, d, dtype=acc, device=dev)
    gbuf, wpbuf = (_empty(b * g, nw, r, d, dtype=acc, device=dev) for _ in range(2))
    nbuf = _empty(b * g, nw, d, dtype=acc, device=dev)
    out = _empty(b, n_tok, g, d, dtype=q.dtype, device=dev).transpose(1, 2)  # [B, G, N, c], token-major
    launches = []
    if model == "dwconv":
        kw = _tile_kwargs(cfg, "conv", acc_tl)
        args = (k, v, part, *sizes, h, wd, *k.stride(), *v.stride(), coef)
        launches.append(Launch("conv_grad_partial_kernel", K.conv_grad_partial_kernel, (s, b * g), args, kw))
    else:
        kw = _tile_kwargs(cfg, "grad", acc_tl, MSE=loss == "mse", **flags)
        args = (k, v, w, part, *sizes, *k.stride(), *v.stride(), *w_strides, coef)
        grid = (s, b * g, cfg.cols("grad", d))
        launches.append(Launch("grad_partial_kernel", K.grad_partial_kernel, grid, args, kw))
    args = (w, part, gbuf, wpbuf, nbuf, g, r, d, s, *w_strides, lr)
    kw = _small_kwargs(cfg, acc_tl, nw) | {"GRAD_NORM": grad_norm}
    launches.append(Launch("step_kernel", K.step_kernel, (b * g, cfg.cols("small", d)), args, kw))
    if model == "dwconv":
        args = (q, wpbuf, out, *sizes, h, wd, *q.stride(), *out.stride())
        kw = _tile_kwargs(cfg, "conv", acc_tl)
        launches.append(Launch("conv_readout_kernel", K.conv_readout_kernel, (s, b * g), args, kw))
    else:
        args = (q, wpbuf, out, *sizes, *q.stride(), *out.stride())
        grid = (s, b * g, cfg.cols("readout", d))
        kw = _tile_kwargs(cfg, "readout", acc_tl, **flags)
        launches.append(Launch("readout_kernel", K.readout_kernel, grid, args, kw))
    return (out, gbuf, wpbuf, nbuf), launches


def backward_plan(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor, gbuf: Tensor, wpbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int, *,
    arch: Arch | None = None, prec: str | None = None, interpret: bool | None = None,
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], list[Launch]]:  # fmt: skip
    """The backward's gradients (allocated, unwritten) and the launches that write them (as ``forward_plan``)."""
    b, g, n_tok, d = q.shape
    nw, r, acc, acc_tl, cfg, sizes, w_strides, flags = _plan_setup(
        q, w, model, loss, chunk, arch, prec, interpret
    )
    s, coef, dev = cfg.s, scale / n_tok, q.device
    # Slots 0..S-1: per-chunk partials (first of the read-out's dW', then, reused, of kᵀdZ); slot S: dW'.
    part = _empty(b * g, s + 1, nw, r, d, dtype=acc, device=dev)
    dgbuf = _empty(b * g, nw, r, d, dtype=acc, device=dev)
    dw = _empty(1, g, nw, r, d, dtype=acc, device=dev)
    dq, dk, dv = (_empty(b, n_tok, g, d, dtype=t.dtype, device=dev).transpose(1, 2) for t in (q, k, v))
    io = (*q.stride(), *dout.stride(), *dq.stride())
    kv = (*k.stride(), *v.stride(), *dk.stride(), *dv.stride())
    small = _small_kwargs(cfg, acc_tl, nw)
    launches = []
    if model == "dwconv":
        conv = _tile_kwargs(cfg, "conv", acc_tl)
        args = (q, dout, wpbuf, dq, part, *sizes, h, wd, *io)
        launches.append(Launch("conv_readout_bwd_kernel", K.conv_readout_bwd_kernel, (s, b * g), args, conv))
    else:
        args = (q, dout, wpbuf, dq, part, *sizes, *io)
        launches += _stage(cfg, "readout_bwd", K.readout_bwd_kernel, d, args, acc_tl, flags)
    args = (part, gbuf, nbuf, dgbuf, r, d, s, lr)
    kw = small | {"GRAD_NORM": grad_norm}
    launches.append(Launch("step_bwd_kernel", K.step_bwd_kernel, (b * g, cfg.cols("small", d)), args, kw))
    if model == "dwconv":
        args = (k, v, dgbuf, dk, dv, part, *sizes, h, wd, *kv, coef)
        launches.append(Launch("conv_grad_bwd_kernel", K.conv_grad_bwd_kernel, (s, b * g), args, conv))
    else:
        args = (k, v, w, dgbuf, dk, dv, part, *sizes, *kv, *w_strides, coef)
        launches += _stage(
            cfg, "grad_bwd", K.grad_bwd_kernel, d, args, acc_tl, flags | {"MSE": loss == "mse"}
        )
    args = (part, dw, b, g, r, d, s + 1)
    launches.append(
        Launch("wgrad_reduce_kernel", K.wgrad_reduce_kernel, (g, cfg.cols("small", d)), args, small)
    )
    return (dq, dk, dv, dw), launches


# ------------------------------------------------------------------------------------------- custom ops


def _kernel_op(name: str) -> Any:
    """Registers ``fn`` as custom op ``name``: a ``triton_op`` (kernels visible to ``torch.compile``).

    Under ``TRITON_INTERPRET=1`` kernels are interpreted Python functions that ``torch.compile`` cannot
    trace, so the op is an opaque ``custom_op`` instead, with ``fn`` (which launches nothing on fake
    tensors) as its fake implementation: compiled graphs still hold the op, without graph breaks.
    """

    def register(fn: Any) -> Any:
        if _interpreting():
            op = torch.library.custom_op(name, fn, mutates_args=())
            op.register_fake(fn)
            return op
        return triton_op(name, fn, mutates_args=())

    return register


def _live(t: Tensor) -> bool:
    """False for fake tensors (shape propagation only: nothing to launch)."""
    return not isinstance(t, FakeTensor)


@_kernel_op("vit3::triton_ttt_fwd")
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, model: str, loss: str, h: int, wd: int, scale: float,
    lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Forward: ``out [B, G, N, c]`` and the saved statistics ``G``, ``W'`` ``[B*G, NW, R, c]``, ``||G||``.

    ``w`` is ``[1, G, NW, R, c]`` (``NW`` = 2 for SwiGLU; ``R`` = c, or 9 taps for the depthwise conv on
    the ``h x wd`` grid); ``chunk <= 0`` picks the split of N automatically.
    """
    outs, launches = forward_plan(q, k, v, w, model, loss, h, wd, scale, lr, grad_norm, chunk)
    if _live(q):
        _launch_all(launches, q.device)
    return outs


@_kernel_op("vit3::triton_ttt_bwd")
def _bwd_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor, gbuf: Tensor, wpbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Backward: ``dq``, ``dk``, ``dv`` ``[B, G, N, c]`` and ``dw [1, G, NW, R, c]`` (accumulator dtype)."""
    grads, launches = backward_plan(
        dout, q, k, v, w, gbuf, wpbuf, nbuf, model, loss, h, wd, scale, lr, grad_norm, chunk
    )
    if _live(q):
        _launch_all(launches, q.device)
    return grads


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, w, *cfg = inputs
    _, gbuf, wpbuf, nbuf = output
    ctx.save_for_backward(q, k, v, w, gbuf, wpbuf, nbuf)
    ctx.cfg = cfg
    ctx.mark_non_differentiable(gbuf, wpbuf, nbuf)


def _backward(ctx: Any, dout: Tensor, *_stats: Tensor) -> tuple:
    q, k, v, w, gbuf, wpbuf, nbuf = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable themselves
        grads = _reference_backward(dout, q, k, v, w, *ctx.cfg)
    else:
        grads = _bwd_op(dout, q, k, v, w, gbuf, wpbuf, nbuf, *ctx.cfg)
    return (*grads, *(None,) * len(ctx.cfg))


def _unpack_weights(w: Tensor, model: str, g: int, d: int) -> dict[str, Tensor]:
    """The initial weights by name from the kernels' weight buffer ``w`` (``triton_ttt``'s packing undone)."""
    if model == "dwconv":  # [1, G, 1, 9, c] -> [1, G*c, 3, 3]
        return {"weight": w[:, :, 0].transpose(-1, -2).reshape(1, g * d, 3, 3)}
    return {key: w[:, :, i] for i, key in enumerate(WEIGHT_NAMES[model])}  # [1, G, c, c] each


def _reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor, model: str, loss: str, h: int, wd: int,
    scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor | None, ...]:  # fmt: skip
    """The backward as a differentiable graph, for a double backward: autograd through the op's reference on
    the saved inputs, in the kernels' accumulator dtype (the kernels' backward has no derivative of its own)."""
    inputs = (q, k, v, w)
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        return (None,) * len(inputs)
    acc = w.dtype
    q_, k_, v_ = (t.to(acc) for t in (q, k, v))
    params = _unpack_weights(w, model, q.shape[1], q.shape[3])
    kw = {"grid": (h, wd), "scale": scale, "lr": lr, "grad_norm": grad_norm, "loss": loss}
    out = reference.reference_ttt(model, q_, k_, v_, params, **kw)
    grads = iter(torch.autograd.grad(out, wanted, dout.to(acc), create_graph=True, allow_unused=True))
    return tuple(next(grads) if t.requires_grad else None for t in inputs)


torch.library.register_autograd("vit3::triton_ttt_fwd", _backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------- public op


def _validate(name: str, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], loss: str) -> None:
    if name not in TRITON_LOSSES:
        raise ValueError(f"triton_ttt supports the inner models {tuple(TRITON_LOSSES)}, got {name!r}")
    if loss not in TRITON_LOSSES[name]:
        raise ValueError(f"triton_ttt supports the losses {TRITON_LOSSES[name]} for {name!r}, got {loss!r}")
    if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"q, k, v must all be [B, G, N, c], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] < 1:
        raise ValueError("triton_ttt needs at least one token (N >= 1)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in IO_DTYPES:
        raise ValueError(f"q, k, v must share one dtype of {IO_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    names = WEIGHT_NAMES[name]
    if set(params) != set(names):
        raise ValueError(f"inner model {name!r} takes the weights {names}, got {sorted(params)}")
    _, g, _, d = q.shape
    for key in names:
        p = params[key]
        shape = (1, g * d, 3, 3) if name == "dwconv" else (1, g, d, d)
        if tuple(p.shape) != shape:
            raise ValueError(
                f"weight {key!r} must be {list(shape)} (shared initial weights), got {list(p.shape)}"
            )
        if p.device != q.device or not p.is_floating_point():
            raise ValueError(
                f"weight {key!r} must be a floating tensor on {q.device}, got {p.dtype} on {p.device}"
            )


def triton_ttt(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: dict[str, Tensor],
    *,
    grid: tuple[int, int] | None = None,
    scale: float,
    lr: float = 1.0,
    grad_norm: bool = True,
    loss: str = "dot",
    backend: str = "auto",
    chunk: int | None = None,
) -> Tensor:
    """One full-batch inner step of inner model ``name`` on ``(k, v)``, applied to ``q``, fused.

    Equals ``vit3.layers.inner_loop`` (one step, one mini-batch, fixed lr) followed by ``apply_to``.

    Args:
        name: ``"swiglu"``, ``"linear"`` or ``"dwconv"`` (3x3 depthwise conv over the grid).
        q, k, v: ``[B, G, N, c]``, any strides (e.g. views of one qkv projection; read in place), float16,
            bfloat16, float32 or float64; accumulation in float32 (float64 for float64).
        params: initial weights ``{"w1", "w2"}`` (SwiGLU) or ``{"w"}`` (linear), each ``[1, G, c, c]``, or
            ``{"weight": [1, G*c, 3, 3]}`` (depthwise conv, channel ``g*c + i`` = head g, channel i).
        grid: the raster token grid ``(h, w)``, ``h * w == N`` (needed by ``"dwconv"``, else only checked).
        scale: loss scale s (the loss is ``(s / N) Σ_n l_n``).
        lr: inner learning rate.
        grad_norm: the official ``G / (||G||_col + 1)``.
        loss: ``"dot"`` (both models) or ``"mse"`` (linear only).
        backend: ``"triton"``, ``"reference"`` or ``"auto"`` (Triton where it runs and takes the head dim,
            16..128, else the reference).
        chunk: tokens per program (tests force a split of N with it); ``None`` chooses.

    Returns:
        ``[B, G, N, c]`` in q's dtype (token-major memory, so ``transpose(1, 2)`` to ``[B, N, G*c]`` is free).
    """
    _validate(name, q, k, v, params, loss)
    if grid is None and name == "dwconv":
        raise ValueError("the depthwise-conv inner model needs the token grid (h, w)")
    grid = grid or (1, q.shape[2])
    if grid[0] < 1 or grid[1] < 1 or grid[0] * grid[1] != q.shape[2]:
        raise ValueError(f"grid {grid[0]}x{grid[1]} does not fit N={q.shape[2]}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    d = q.shape[-1]
    which = resolve_backend(backend)
    if which == "auto":
        which = "triton" if triton_runs_on(q.device) and head_dim_supported(name, d) else "reference"
    if q.shape[0] * q.shape[1] == 0:  # nothing to launch
        which = "reference"
    if which == "reference":
        return reference.reference_ttt(
            name, q, k, v, params, grid=grid, scale=scale, lr=lr, grad_norm=grad_norm, loss=loss
        )
    if not triton_runs_on(q.device):
        raise ValueError(f"the Triton kernel cannot run on {q.device} (CUDA, or CPU with TRITON_INTERPRET=1)")
    if not head_dim_supported(name, d):
        top = max_head_dim(name)
        why = " (wider tiles exceed on-chip shared memory)" if d > top else ""
        raise ValueError(
            f"the Triton kernel for {name!r} with {q.dtype} supports head dims {MIN_HEAD_DIM}..{top}, got {d}{why}"
        )
    acc, _ = _acc_dtype(q.dtype)
    if name == "dwconv":  # [1, G*c, 3, 3] -> [1, G, 1, 9, c]: taps as rows, channels as columns
        w = params["weight"].reshape(1, q.shape[1], d, 9).transpose(-1, -2).unsqueeze(2)
    else:  # [1, G, NW, c, c]
        w = torch.stack([params[key][0] for key in WEIGHT_NAMES[name]], dim=1).unsqueeze(0)
    w = w.to(acc).contiguous()  # tiny copy: the kernels see one fp32 (fp64) weight buffer
    out, _, _, _ = _fwd_op(
        q, k, v, w, name, loss, grid[0], grid[1], float(scale), float(lr), bool(grad_norm), chunk or 0
    )
    return out
