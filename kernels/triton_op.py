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
import math
import os
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import triton.language as tl
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.library import triton_op, wrap_triton

from . import reference
from .common import autocast_backward, autocast_forward, grad_flows
from .dwconv import triton as dwconv_kernels
from .triton import matrix as matrix_kernels
from .triton import step as step_kernels

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


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
              torch.float64: tl.float64}  # fmt: skip


def native_half(dtype: torch.dtype, arch: Arch) -> bool:
    """Whether 16-bit inputs meet ``tl.dot`` as they are (fp16 / bf16 MMA with fp32 accumulation, sm_80+).

    sm_75 has no bf16 MMA: its kernels upcast every operand to fp32 (FMA dots), as for IEEE fp32.
    """
    return dtype in (torch.float16, torch.bfloat16) and arch.capability >= 80


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

    ``tiles`` holds one ``Tiles`` per kernel role: ``"forward"`` (``forward_kernel``, the whole forward in
    one launch when N is not split), ``"grad"`` (``grad_partial_kernel``), ``"readout"``,
    ``"readout_bwd"`` / ``"grad_bwd"`` (their column or fused launch) and ``"readout_bwd_cross"`` /
    ``"grad_bwd_cross"`` (the cross launch, used where the column launch has more than one block),
    ``"conv"`` (the four depthwise-conv kernels) and ``"small"`` (step and step backward).
    """

    block_d: int  # the head dim padded to a power of two
    block_r: int  # rows of the weights: BLOCK_D, or 16 for the 9 taps of the depthwise conv
    chunk: int  # tokens per program along N (a multiple of every token tile)
    s: int  # chunks: cdiv(N, chunk)
    prec: str  # ``tl.dot`` input precision of fp32 operands
    dot: Any  # the dtype of the ``tl.dot`` operands (triton): the input's (16-bit on sm_80+), else ACC's
    emulate: bool  # bf16 operands on the interpreter: rounded to bf16, multiplied in fp32
    transposed: bool  # the SwiGLU gradient backward of one column block on transposed tiles (``TRANS``)
    tiles: dict[str, Tiles]

    def cols(self, role: str, d: int) -> int:
        """Column blocks of role ``role`` at head dim ``d``."""
        return _cdiv(d, self.tiles[role].block_c)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _tensor_cores(dtype: torch.dtype, prec: str, arch: Arch) -> bool:
    """Whether the dots run on tensor cores (bf16 / fp16 / TF32 MMA, sm_80+), or as FMA loops (IEEE fp32,
    fp64, sm_75). FMA dots keep both operands in registers and need narrower tiles to stay clear of spills."""
    return native_half(dtype, arch) or (prec == "tf32" and dtype != torch.float64 and arch.capability >= 80)


# A SwiGLU backward stage at d = 64 in one launch keeps W1, W2, dG1, dG2 (and the transposes its dk / dq dots
# read) on chip: 132-192 KB of shared memory with TF32 dots (sm_80: 144-168 KB plus register spills; sm_90 and
# sm_100: up to 192 KB, spill-free). Parts with at least this much per block take it; the others split the
# columns into 32-wide blocks (a column and a cross launch per stage), which need at most ~60 KB.
FUSED_BACKWARD_SMEM = 200 * KB
# The same stage with 16-bit operands (W1, W2, dG1, dG2 and the k / v tiles in bf16 / fp16): 72-84 KB, within
# the 99 KB of sm_86/89/120.
HALF_BACKWARD_SMEM = 96 * KB


def warp_group_mma(arch: Arch) -> bool:
    """Whether ``arch``'s tensor cores are driven by warp groups (sm_90 ``wgmma``, sm_100 ``tcgen05``): 64-row
    dots, accumulators that leave the general registers lighter. sm_80/86/89/120: warp-level ``mma.sync``."""
    return arch.capability in (90, 100)


def _half_tiles(model: str, loss: str, role: str, block_d: int, arch: Arch) -> Tiles:
    """Tiles of 16-bit operands on tensor cores (sm_80+): 64-token tiles, so the token-row dots (``k W``,
    ``q W'``, ``dY W'ᵀ``, ``P dGᵀ`` ...) have the 64 rows sm_90's ``wgmma`` needs (a warp group of 4 warps
    per 64 rows), and so do the weight-gradient dots (``kᵀ P``, ``qᵀ dY``, ``kᵀ dZ``) from d = 64 on.

    The SwiGLU gradient backward with all columns in one block (d <= 64) takes 32-token tiles: at 64 its
    tiles need more than the 255 registers a thread has (sm_90: ~700 bytes spilled per thread at d = 64,
    a reload inside the token loop at d = 32); at d = 64 it runs on transposed tiles
    (``LaunchConfig.transposed``), whose dots all have 64 rows (``wgmma`` on sm_90; on ``mma.sync`` parts
    the orientation that keeps its fragments out of local memory: the other spills 1.3-12 KB per thread).
    On ``mma.sync`` parts the other SwiGLU kernels at d = 64 also hold their fragments in registers: 32-token
    tiles, and the one-launch forward in two column blocks of 32. At d = 128: 16 or 32 columns a block,
    32-token tiles in the gradient cross launch.
    """
    backward = role.startswith(("readout_bwd", "grad_bwd"))
    if model == "swiglu" and role == "grad_bwd" and block_d in (32, 64):
        return Tiles(32, block_d, 4 if block_d == 32 else 8, 2)
    if block_d <= 32:
        return Tiles(64, block_d, 8 if backward and block_d == 32 else 4, 2)
    if block_d == 128:
        if role == "grad_bwd_cross":
            return Tiles(32, 16, 8, 2)
        return Tiles(64, 16 if backward else 32, 8, 2)
    if model == "swiglu" and not warp_group_mma(arch) and role != "readout":
        return Tiles(64, 32, 8, 2) if role == "forward" else Tiles(32, 64, 8, 2)
    return Tiles(64, 64, 8, 2)


def _matrix_tiles(
    model: str, loss: str, role: str, block_d: int, dtype: torch.dtype, prec: str, arch: Arch
) -> Tiles:
    """Tiles of one matrix-kernel role: ``launch_config``'s table.

    ``tests/test_kernels_compile.py`` compiles it for every arch, inner model, head dim and dtype mode and
    holds each kernel to the arch's shared memory and to a spill bound (``vit3.kernels.aot.spill_bound``);
    where the table has a choice, it is the one those compiles found spill-free. 16-bit inputs on sm_80+:
    ``_half_tiles``. fp32 on tensor cores (TF32): column blocks of the whole head up to d = 32, 16 columns at
    d = 128, and at d = 64 the whole head except in the SwiGLU backward (and its gradient pass) on parts
    without ``FUSED_BACKWARD_SMEM``, in SwiGLU's one-launch forward without ``wgmma`` and in the linear MSE
    backward, which take 32 columns; two pipeline
    stages; 16-token tiles where full-width k / dk tiles share the registers with many live column tiles
    (d = 32, the backward at d = 128, the linear MSE backward). FMA dots (IEEE fp32, fp64, every dot on sm_75)
    hold both operands in registers: 16-token tiles over 8 warps, 32 columns at most, no pipelining (its
    extra stage of k / v tiles pushes them into spills).
    """
    if dtype == torch.float64:
        return Tiles(16, 16, 8, 1)
    if native_half(dtype, arch):
        return _half_tiles(model, loss, role, block_d, arch)
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
    if model == "swiglu" and role == "forward" and not warp_group_mma(arch):
        return Tiles(32, 32, 8, 2)  # the whole head in one launch spills ~140 B a thread on mma.sync parts
    if arch.smem >= FUSED_BACKWARD_SMEM or role in ("readout", "grad", "forward"):
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
    """The step and step-backward kernels: ``[BLOCK_R, cols]`` tiles of at most 2048 fp32 (1024 fp64)
    elements (4096, the d = 64 matrices, make them spill registers)."""
    elems = 1024 if dtype == torch.float64 else 2048
    return Tiles(0, min(block_d, max(16, elems // block_r)), 4, 1)


# The weight-gradient reduction (``wgrad_reduce_kernel``): BLOCK_T items of BLOCK_E numbers per step (BLOCK_E
# halved down to REDUCE_MIN_BLOCK_E where the output blocks are too few to give every SM a program), and the
# programs it aims at per SM (its runs are cut so that about this many programs per SM share the work).
REDUCE_BLOCK_T, REDUCE_BLOCK_E, REDUCE_MIN_BLOCK_E, REDUCE_WARPS, REDUCE_PROGRAMS_PER_SM = 4, 512, 128, 4, 2
MATRIX_ROLES = ("forward", "grad", "readout", "readout_bwd", "readout_bwd_cross", "grad_bwd", "grad_bwd_cross")  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _launch_config(model: str, n_tok: int, d: int, bg: int, dtype: torch.dtype, arch: Arch, loss: str,
                   prec: str, chunk: int | None, interpret: bool, tiles_as: tuple | None) -> LaunchConfig:  # fmt: skip
    block_d = max(16, _pow2(d))
    block_r = 16 if model == "dwconv" else block_d
    tile_arch, tile_prec = tiles_as or (INTERPRET_TILES if interpret else (arch, prec))
    if model == "dwconv":
        tiles = {"conv": _conv_tiles(block_d, dtype)}
    else:
        tiles = {r: _matrix_tiles(model, loss, r, block_d, dtype, tile_prec, tile_arch) for r in MATRIX_ROLES}
    tiles["small"] = _small_tiles(block_r, block_d, dtype)
    if interpret:
        big = min(256, max(16, _pow2(n_tok)))
        tiles = {
            role: replace(t, block_n=big if role != "small" else 0, num_warps=4) for role, t in tiles.items()
        }
        want = n_tok
    else:
        want = _cdiv(n_tok, max(1, _cdiv(2 * arch.sms, bg)))  # about two programs per SM
    if chunk is not None:
        cap = max(16, _pow2(chunk))
        tiles = {role: replace(t, block_n=min(t.block_n, cap)) for role, t in tiles.items()}
        want = chunk
    step = max(t.block_n for t in tiles.values())
    size = _cdiv(max(want, 1), step) * step
    _, acc_tl = _acc_dtype(dtype)
    native = model != "dwconv" and native_half(dtype, tile_arch)
    dot = _TL_DTYPES[dtype] if native else acc_tl
    emulate = native and interpret and dtype == torch.bfloat16
    # 16-bit operands at d = 64: the one-block gradient backward on transposed 32-token tiles (``_half_tiles``)
    transposed = native and block_d == 64 and tiles["grad_bwd"].block_c == block_d
    return LaunchConfig(block_d, block_r, size, _cdiv(n_tok, size), prec, dot, emulate, transposed, tiles)


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
        bg: samples x heads.
        dtype: the q/k/v dtype.
        arch: the GPU (``Arch.of(device)``, or one of ``ARCHS`` for offline compiles).
        loss: ``"dot"`` or ``"mse"`` (the linear model's MSE backward keeps more tiles live).
        prec: ``tl.dot`` input precision (default: what ``triton_ttt`` picks for ``dtype`` now).
        chunk: tokens per program (tests force a split of N with it); ``None`` chooses.
        interpret: size for Triton's interpreter (default: ``$TRITON_INTERPRET``): the GPU's column blocks,
            dot operands and launch structure, but large token tiles and a single chunk, since it runs
            programs one after another.

    Returns:
        The ``LaunchConfig`` (cached per arguments and ``TILES_AS``).
    """
    interpret = _interpreting() if interpret is None else interpret
    prec = prec or _precision(dtype)
    return _launch_config(model, n_tok, d, bg, dtype, arch, loss, prec, chunk, interpret, TILES_AS)


# The oldest arch the kernels are compiled and checked for (tests/test_kernels_compile.py).
MIN_CAPABILITY = 75


def smem_need(model: str, d: int, dtype: torch.dtype, prec: str, arch: Arch) -> int:
    """Shared memory per block (bytes) the kernels of ``launch_config``'s choice are held to on ``arch``.

    An upper bound the compile matrix checks for every kernel, arch and dtype mode: 64 KB with FMA dots
    (the T4's limit, which every other part exceeds), 80 KB on tensor cores, 96 KB for SwiGLU in fp64 at
    d = 128 (full-width fp64 tiles of four weights), ``FUSED_BACKWARD_SMEM`` for the fused SwiGLU backward
    at d = 64 in fp32 and ``HALF_BACKWARD_SMEM`` for SwiGLU at d = 64 with 16-bit operands.
    """
    block_d = max(16, _pow2(d))
    if model == "swiglu" and block_d == 64 and native_half(dtype, arch):
        return HALF_BACKWARD_SMEM
    if model == "swiglu" and block_d == 64:
        cfg = launch_config(model, 4096, block_d, 64, dtype, arch, prec=prec, interpret=False)
        if cfg.cols("grad_bwd", block_d) == 1:
            return FUSED_BACKWARD_SMEM
    if model == "swiglu" and dtype == torch.float64 and block_d == 128:
        return 96 * KB
    # 80 KB on tensor cores: SwiGLU's fp32 (TF32) read-out cross launch at d = 64 takes 76 KB.
    return (80 if _tensor_cores(dtype, prec, arch) else 64) * KB


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
    block_d = max(16, _pow2(head_dim))
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


# ------------------------------------------------------------------------------------------------ launches

# The largest grid axis 0 (CUDA: 2^31 - 1 blocks). Every launch numbers its programs on one flat axis and
# folds it onto axis 1 only beyond this (``fold_grid``), so B*G never meets the 65,535 cap of axes 1 and 2.
# Tests lower it to run the folded path.
GRID_X_MAX = 2**31 - 1


def fold_grid(programs: int) -> tuple[int, int]:
    """The 2-D grid of ``programs`` flat program ids: ``(x, y)``, ``x * y >= programs``; the kernels map
    ``(pid_x, pid_y)`` to ``pid_y * x + pid_x`` and return where it is past the last program."""
    x = min(programs, GRID_X_MAX)
    return x, _cdiv(programs, x)


class Launch(NamedTuple):
    """One kernel launch of a plan: ``kernel[grid](*args, **constexprs, **options)``.

    The one place a launch executes: the custom ops run each of a plan's launches by calling it.
    """

    label: str  # the kernel's name, with ``[cols]`` / ``[cross]`` for the two launches of a split stage
    kernel: Any  # a ``triton.JITFunction``
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]  # constexprs and launch options (num_warps, num_stages)
    programs: int = 0  # the programs that do work (``fold_grid``'s grid may round them up)

    def __call__(self) -> None:
        wrap_triton(self.kernel)[self.grid](*self.args, **self.kwargs)


class _Buffer(NamedTuple):
    """A buffer a plan allocates per call: ``shape`` (``perm`` of its memory order) and ``stride``."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(shape: tuple[int, ...], dtype: torch.dtype, perm: tuple[int, ...] | None) -> _Buffer:
        """A contiguous ``shape`` seen through ``perm`` (``None``: as it is)."""
        t = torch.empty(shape, device="meta")
        t = t.permute(perm) if perm else t
        return _Buffer(tuple(t.shape), t.stride(), dtype)

    def alloc(self, device: torch.device) -> Tensor:
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        return out if DEBUG_FILL is None else out.fill_(DEBUG_FILL)


class _Builder:
    """Builds a plan on meta tensors, recording the buffers it allocates and the launches it makes."""

    def __init__(self, inputs: tuple[Tensor | None, ...]) -> None:
        self.tensors = list(inputs)
        self.buffers: list[_Buffer] = []
        self.launches: list[Launch] = []

    def buffer(self, *shape: int, dtype: torch.dtype, perm: tuple[int, ...] | None = None) -> Tensor:
        self.buffers.append(_Buffer.of(shape, dtype, perm))
        self.tensors.append(self.buffers[-1].alloc(torch.device("meta")))
        return self.tensors[-1]

    def launch(self, label: str, kernel: Any, programs: int, args: tuple, kwargs: dict[str, Any]) -> None:
        self.launches.append(Launch(label, kernel, fold_grid(programs), args, kwargs, programs))

    def plan(self, outputs: tuple[Tensor, ...]) -> _Plan:
        ids = {id(t): i for i, t in enumerate(self.tensors) if t is not None}
        templates = []
        for launch in self.launches:
            slots = tuple((p, ids[id(a)]) for p, a in enumerate(launch.args) if isinstance(a, Tensor))
            args = tuple(None if isinstance(a, Tensor) else a for a in launch.args)
            templates.append((launch._replace(args=args), slots))
        return _Plan(tuple(self.buffers), tuple(templates), tuple(ids[id(t)] for t in outputs))


class _Plan(NamedTuple):
    """The cached launch plan of one key: buffers to allocate, launches (with their tensor arguments left out:
    ``slots`` maps argument positions to the plan's tensors, inputs then buffers), which tensors it returns."""

    buffers: tuple[_Buffer, ...]
    templates: tuple[tuple[Launch, tuple[tuple[int, int], ...]], ...]
    outputs: tuple[int, ...]

    def bind(self, inputs: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], list[Launch]]:
        """Allocates the buffers on the inputs' device; returns the outputs and the launches on them."""
        device = inputs[0].device
        tensors = [*inputs, *(b.alloc(device) for b in self.buffers)]
        launches = []
        for launch, slots in self.templates:
            args = list(launch.args)
            for pos, i in slots:
                args[pos] = tensors[i]
            launches.append(launch._replace(args=tuple(args)))
        return tuple(tensors[i] for i in self.outputs), launches


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
        out |= {"BLOCK_C": t.block_c, "DOT": cfg.dot, "EMU": cfg.emulate, "PREC": cfg.prec}
    return out


def _small_kwargs(cfg: LaunchConfig, acc_tl: Any, nw: int) -> dict[str, Any]:
    t = cfg.tiles["small"]
    return {"NW": nw, "BLOCK_R": cfg.block_r, "BLOCK_C": t.block_c, "ACC": acc_tl, **t.options()}


def _weight_strides(model: str, w: Tensor, d: int) -> tuple[int, int, int]:
    """(head, row, column) strides of the initial weights as the kernels read them: ``[1, G, d, d]``, or the
    depthwise conv's ``[1, G*d, 3, 3]`` as ``[G, 9 taps, d channels]`` (taps ``3 ty + tx`` one stride apart)."""
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
    flags = flags | {"FUSED": False} | ({"TRANS": False} if "TRANS" in flags else {})  # COLS-only switches
    cross = _tile_kwargs(cfg, role + "_cross", acc_tl, COLS=False, CROSS=True, **flags)
    bld.launch(label("cols", *tag), kernel, bg * cfg.s * c, args, cols)
    bld.launch(label("cross"), kernel, bg * cfg.s, args, cross)


def reduce_split(items: int, blocks: int, arch: Arch) -> tuple[int, int]:
    """How ``wgrad_reduce_kernel`` cuts ``items`` per output block over ``blocks`` output blocks: ``(split,
    per)``, runs of ``per`` items, enough of them that ``blocks * split`` programs give each SM
    ``REDUCE_PROGRAMS_PER_SM``, but at most ``4 sqrt(items)`` runs (so that the second stage, one program per
    block summing the runs, stays short) and at least two items a run (``split == 1``: one stage)."""
    cap = min(items // 2, math.ceil(4 * math.sqrt(items)))
    split = max(1, min(_cdiv(REDUCE_PROGRAMS_PER_SM * arch.sms, blocks), cap))
    per = _cdiv(items, split)
    return _cdiv(items, per), per


def _reduce(bld: _Builder, part: Tensor, dw: Tensor, b: int, g: int, e: int, d: int, slots: tuple[int, int, int],
            conv: bool, arch: Arch, interpret: bool, acc: torch.dtype, acc_tl: Any) -> None:  # fmt: skip
    """The weight-gradient reduction of ``part`` ``[B, G, L, E]`` (slots ``lo .. lo + nuse - 1`` of ``L``) into
    ``dw``: one launch, or two (runs of items, then the runs) where the first would leave the GPU idle, on
    narrower blocks of numbers where the runs alone cannot give every SM a program. The interpreter, which
    runs programs one after another, takes blocks of up to 8192 numbers (fewer programs, the same runs)."""
    length, lo, nuse = slots

    def programs(width: int) -> int:
        return g * _cdiv(e, width) * reduce_split(b * nuse, g * _cdiv(e, width), arch)[0]

    gpu_e = REDUCE_BLOCK_E
    while gpu_e > REDUCE_MIN_BLOCK_E and programs(gpu_e) < arch.sms:
        gpu_e //= 2
    block_e = min(8192, max(gpu_e, _pow2(e))) if interpret else gpu_e
    blocks = g * _cdiv(e, block_e)
    split, per = reduce_split(b * nuse, g * _cdiv(e, gpu_e), arch)
    kw = {"BLOCK_T": REDUCE_BLOCK_T, "BLOCK_E": block_e, "ACC": acc_tl, "num_warps": REDUCE_WARPS,
          "num_stages": 1}  # fmt: skip
    final = (1, 9) if conv else (d, 1)  # the conv weight [G*d, 3, 3]: element (tap, c) at c * 9 + tap
    kernel = step_kernels.wgrad_reduce_kernel
    if split == 1:
        args = (part, dw, b, g, e, d, length, lo, nuse, per, 1, *final)
        bld.launch("wgrad_reduce_kernel", kernel, blocks, args, kw)
        return
    runs = bld.buffer(split, g, e, dtype=acc)
    args = (part, runs, b, g, e, d, length, lo, nuse, per, split, d, 1)
    bld.launch("wgrad_reduce_kernel[runs]", kernel, blocks * split, args, kw)
    args = (runs, dw, split, g, e, d, 1, 0, 1, split, 1, *final)
    bld.launch("wgrad_reduce_kernel[final]", kernel, blocks, args, kw)


class _Key(NamedTuple):
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
    tiles_as: tuple | None
    grid_x: int


def _meta(t: Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype)


def _key(q: Tensor, model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
         arch: Arch | None = None, prec: str | None = None, interpret: bool | None = None) -> _Key:  # fmt: skip
    interpret = _interpreting() if interpret is None else interpret
    if prec is None:
        prec = "ieee" if interpret else (_gpu_precision(q.dtype) if q.dtype == torch.float32 else "tf32")
    return _Key(model, loss, h, wd, scale, lr, grad_norm, chunk, arch or _device_arch(q.device), prec,
                interpret, TILES_AS, GRID_X_MAX)  # fmt: skip


def _on_meta(meta: tuple | None) -> Tensor | None:
    return None if meta is None else torch.empty_strided(meta[0], meta[1], dtype=meta[2], device="meta")


def _config(key: _Key, q: Tensor) -> LaunchConfig:
    b, g, n_tok, d = q.shape
    return launch_config(key.model, n_tok, d, b * g, q.dtype, key.arch, loss=key.loss, prec=key.prec,
                         chunk=key.chunk or None, interpret=key.interpret)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _forward_template(key: _Key, save: bool, metas: tuple) -> _Plan:
    q, k, v, w1, w2 = (_on_meta(m) for m in metas)
    bld = _Builder((q, k, v, w1, w2))
    b, g, n_tok, d = q.shape
    cfg = _config(key, q)
    acc, acc_tl = _acc_dtype(q.dtype)
    nw, r, bgn, s = (2 if key.model == "swiglu" else 1), (9 if key.model == "dwconv" else d), b * g, cfg.s
    w2 = w1 if w2 is None else w2
    coef, ws = key.scale / n_tok, _weight_strides(key.model, w1, d)
    out = bld.buffer(b, n_tok, g, d, dtype=q.dtype, perm=(0, 2, 1, 3))  # [B, G, N, c], token-major
    gbuf = bld.buffer(bgn, nw, r, d, dtype=acc)
    nbuf = bld.buffer(bgn, nw, d, dtype=acc)
    flags = {"SWIGLU": key.model == "swiglu", "NW": nw}
    if key.model != "dwconv" and s == 1:
        kw = _tile_kwargs(cfg, "forward", acc_tl, MSE=key.loss == "mse", GRAD_NORM=key.grad_norm,
                          SAVE=save, **flags)  # fmt: skip
        args = (q, k, v, w1, w2, out, gbuf, nbuf, bgn, g, n_tok, d, *q.stride(), *k.stride(), *v.stride(),
                *out.stride(), *ws, coef, key.lr)  # fmt: skip
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
        args = (k, v, w1, w2, part, *sizes, *k.stride(), *v.stride(), *ws, coef)
        bld.launch(
            "grad_partial_kernel", matrix_kernels.grad_partial_kernel, bgn * s * cfg.cols("grad", d), args, kw
        )
    args = (part, gbuf, nbuf, bgn, r, d, s)
    bld.launch(
        "step_kernel",
        step_kernels.step_kernel,
        bgn * cfg.cols("small", d),
        args,
        _small_kwargs(cfg, acc_tl, nw),
    )
    if key.model == "dwconv":
        args = (q, w1, gbuf, nbuf, out, *sizes, key.h, key.wd, *q.stride(), *out.stride(), *ws, key.lr)
        kw = _tile_kwargs(cfg, "conv", acc_tl, GRAD_NORM=key.grad_norm)
        bld.launch("conv_readout_kernel", dwconv_kernels.conv_readout_kernel, bgn * s, args, kw)
    else:
        args = (q, w1, w2, gbuf, nbuf, out, *sizes, *q.stride(), *out.stride(), *ws, key.lr)
        kw = _tile_kwargs(cfg, "readout", acc_tl, GRAD_NORM=key.grad_norm, **flags)
        bld.launch(
            "readout_kernel", matrix_kernels.readout_kernel, bgn * s * cfg.cols("readout", d), args, kw
        )
    return bld.plan((out, gbuf, nbuf))


@functools.lru_cache(maxsize=256)
def _backward_template(key: _Key, metas: tuple, dout_meta: tuple) -> _Plan:
    """The backward plan after the forward of ``(key, metas)`` (q, k, v, W1, W2), for an upstream gradient
    ``dout_meta``; its inputs are ``dout, q, k, v, W1, W2 (or W1), G, ||G||``."""
    q, k, v, w1, w2 = (_on_meta(m) for m in metas)
    b, g, n_tok, d = q.shape
    nw, r = (2 if key.model == "swiglu" else 1), (9 if key.model == "dwconv" else d)
    acc, acc_tl = _acc_dtype(q.dtype)
    gbuf = torch.empty(b * g, nw, r, d, dtype=acc, device="meta")
    nbuf = torch.empty(b * g, nw, d, dtype=acc, device="meta")
    dout = _on_meta(dout_meta)
    bld = _Builder((dout, q, k, v, w1, w2, gbuf, nbuf))
    cfg = _config(key, q)
    conv = key.model == "dwconv"
    bgn, s = b * g, cfg.s
    w2 = w1 if w2 is None else w2
    coef, ws = key.scale / n_tok, _weight_strides(key.model, w1, d)
    fused = s == 1 and not conv  # one program holds a (sample, head)'s whole dW' and kᵀdZ per column block
    wgrad = key.model == "swiglu" or key.loss == "mse"  # kᵀdZ != 0: the inner gradient depends on W
    # Slots 0..S-1: per-chunk partials (first of the read-out's dW', then, reused, of kᵀdZ); slot S: dW'.
    part = bld.buffer(bgn, s + 1, nw, r, d, dtype=acc)
    dgbuf = bld.buffer(bgn, nw, r, d, dtype=acc)
    dq, dk, dv = (bld.buffer(b, n_tok, g, d, dtype=t.dtype, perm=(0, 2, 1, 3)) for t in (q, k, v))
    dw = bld.buffer(*((1, g * d, 3, 3) if conv else (1, g, nw, d, d) if nw == 2 else (1, g, d, d)), dtype=acc)
    sizes = (bgn, g, n_tok, d, cfg.chunk, s)
    io = (*q.stride(), *dout.stride(), *dq.stride())
    kv = (*k.stride(), *v.stride(), *dk.stride(), *dv.stride())
    flags = {"SWIGLU": key.model == "swiglu", "NW": nw}
    if conv:
        args = (q, dout, w1, gbuf, nbuf, dq, part, *sizes, key.h, key.wd, *io, *ws, key.lr)
        kw = _tile_kwargs(cfg, "conv", acc_tl, GRAD_NORM=key.grad_norm)
        bld.launch("conv_readout_bwd_kernel", dwconv_kernels.conv_readout_bwd_kernel, bgn * s, args, kw)
    else:
        args = (q, dout, w1, w2, gbuf, nbuf, dq, part, dgbuf, *sizes, *io, *ws, key.lr)
        rflags = flags | {"GRAD_NORM": key.grad_norm, "FUSED": fused}
        _stage(bld, cfg, "readout_bwd", matrix_kernels.readout_bwd_kernel, bgn, d, args, acc_tl, rflags)
    if not fused:
        args = (part, gbuf, nbuf, dgbuf, bgn, r, d, s, key.lr)
        kw = _small_kwargs(cfg, acc_tl, nw) | {"GRAD_NORM": key.grad_norm}
        bld.launch("step_bwd_kernel", step_kernels.step_bwd_kernel, bgn * cfg.cols("small", d), args, kw)
    if conv:
        args = (k, v, dgbuf, dk, dv, *sizes, key.h, key.wd, *kv, coef)
        bld.launch(
            "conv_grad_bwd_kernel",
            dwconv_kernels.conv_grad_bwd_kernel,
            bgn * s,
            args,
            _tile_kwargs(cfg, "conv", acc_tl),
        )
    else:
        args = (k, v, w1, w2, dgbuf, dk, dv, part, *sizes, *kv, *ws, coef)
        trans = key.model == "swiglu" and cfg.transposed
        gflags = flags | {"MSE": key.loss == "mse", "FUSED": fused, "WGRAD": wgrad, "TRANS": trans}
        _stage(bld, cfg, "grad_bwd", matrix_kernels.grad_bwd_kernel, bgn, d, args, acc_tl, gflags)
    # The weight gradient sums, per head, every sample's slots that hold a part of it: all S + 1 (the kᵀdZ
    # partials and dW'), only slot 0 when the fused gradient pass added dW' to it, only dW' without kᵀdZ.
    slots = (s + 1, 0, 1) if fused and wgrad else ((s + 1, 0, s + 1) if wgrad else (s + 1, s, 1))
    _reduce(bld, part, dw, b, g, nw * r * d, d, slots, conv, key.arch, key.interpret, acc, acc_tl)
    return bld.plan((dq, dk, dv, dw))


def forward_plan(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str, h: int, wd: int,
    scale: float, lr: float, grad_norm: bool, chunk: int, *, save: bool = True, arch: Arch | None = None,
    prec: str | None = None, interpret: bool | None = None,
) -> tuple[tuple[Tensor, Tensor, Tensor], list[Launch]]:  # fmt: skip
    """The forward's outputs ``(out, G, ||G||)`` (allocated, unwritten) and the launches that write them.

    Arguments as ``_fwd_op``'s; ``save=False`` (inference) lets the one-launch forward skip storing ``G`` and
    ``||G||``; ``arch``, ``prec`` and ``interpret`` as ``launch_config``'s (default: ``q``'s device, what
    PyTorch allows now, ``$TRITON_INTERPRET``). The plan is built once per key (settings, shapes, strides,
    dtypes, arch) on meta tensors and cached; each call allocates its buffers and binds its tensors. Tensors
    may live on the meta device: the offline compiles (``vit3.kernels.aot``) and the roofline
    (``benchmarks/roofline.py``) read the launches a GPU would run from shapes and strides alone.
    """
    key = _key(q, model, loss, h, wd, scale, lr, grad_norm, chunk, arch, prec, interpret)
    plan = _forward_template(key, save, tuple(_meta(t) for t in (q, k, v, w1, w2)))
    return plan.bind((q, k, v, w1, w1 if w2 is None else w2))


def backward_plan(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, gbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int, *,
    arch: Arch | None = None, prec: str | None = None, interpret: bool | None = None,
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], list[Launch]]:  # fmt: skip
    """The backward's gradients ``(dq, dk, dv, dW)`` (allocated, unwritten) and the launches that write them
    (as ``forward_plan``). ``dW`` is SwiGLU's ``[1, G, 2, c, c]``, the linear model's ``[1, G, c, c]`` or the
    depthwise conv's ``[1, G*c, 3, 3]``."""
    key = _key(q, model, loss, h, wd, scale, lr, grad_norm, chunk, arch, prec, interpret)
    plan = _backward_template(key, tuple(_meta(t) for t in (q, k, v, w1, w2)), _meta(dout))
    return plan.bind((dout, q, k, v, w1, w1 if w2 is None else w2, gbuf, nbuf))


def clear_plans() -> None:
    """Forgets every cached plan and launch configuration (tests that change a module-level hook)."""
    _forward_template.cache_clear()
    _backward_template.cache_clear()
    _launch_config.cache_clear()


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


def _run(plan: _Plan, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Binds ``plan`` to ``inputs``, runs its launches in order (none on fake tensors) and returns its outputs."""
    outs, launches = plan.bind(inputs)
    if _live(inputs[0]):
        _launch_all(launches, inputs[0].device)
    return outs


def _forward(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str, h: int, wd: int,
    scale: float, lr: float, grad_norm: bool, chunk: int, save: bool = True,
) -> tuple[tuple[Tensor, Tensor, Tensor], _Key, tuple]:  # fmt: skip
    """Runs the forward: ``(out [B, G, N, c], G [B*G, NW, R, c], ||G||)``, and the plan's key and tensor
    metadata (what the backward's plan is looked up by)."""
    key = _key(q, model, loss, h, wd, scale, lr, grad_norm, chunk)
    metas = (_meta(q), _meta(k), _meta(v), _meta(w1), _meta(w2))
    return _run(_forward_template(key, save, metas), (q, k, v, w1, w1 if w2 is None else w2)), key, metas


def _backward_grads(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, gbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Runs the backward: ``dq``, ``dk``, ``dv`` ``[B, G, N, c]`` and ``dW`` (accumulator dtype)."""
    key = _key(q, model, loss, h, wd, scale, lr, grad_norm, chunk)
    plan = _backward_template(key, tuple(_meta(t) for t in (q, k, v, w1, w2)), _meta(dout))
    return _run(plan, (dout, q, k, v, w1, w1 if w2 is None else w2, gbuf, nbuf))


@_kernel_op("vit3::triton_ttt_fwd")
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str, h: int, wd: int,
    scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Forward: ``out [B, G, N, c]`` and the saved statistics ``G`` ``[B*G, NW, R, c]`` and ``||G||``.

    ``w1`` (and ``w2``, SwiGLU only) are the initial weights ``[1, G, c, c]``, or the depthwise conv's
    ``[1, G*c, 3, 3]`` on the ``h x wd`` grid (``R`` = 9 taps); ``chunk <= 0`` picks the split of N.
    """
    return _forward(q, k, v, w1, w2, model, loss, h, wd, scale, lr, grad_norm, chunk)[0]


@_kernel_op("vit3::triton_ttt_bwd")
def _bwd_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, gbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Backward: ``dq``, ``dk``, ``dv`` ``[B, G, N, c]`` and ``dW`` (``backward_plan``, accumulator dtype)."""
    return _backward_grads(dout, q, k, v, w1, w2, gbuf, nbuf, model, loss, h, wd, scale, lr, grad_norm, chunk)


def _weight_grads(dw: Tensor, two: bool) -> tuple[Tensor, Tensor | None]:
    """``dW`` of the plan as the weights' gradients: SwiGLU's ``[1, G, 2, c, c]`` in two, else as it is."""
    return dw.unbind(2) if two else (dw, None)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, w1, w2, *cfg = inputs
    ctx.save_for_backward(q, k, v, w1, w2, *output[1:])  # G and ||G||: W' is recomputed from them
    ctx.cfg = cfg
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx: Any, dout: Tensor, *_stats: Tensor) -> tuple:
    q, k, v, w1, w2, gbuf, nbuf = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable themselves
        grads = _reference_backward(dout, q, k, v, w1, w2, *ctx.cfg)
    else:
        dq, dk, dv, dw = _bwd_op(dout, q, k, v, w1, w2, gbuf, nbuf, *ctx.cfg)
        grads = (dq, dk, dv, *_weight_grads(dw, w2 is not None))
    return (*grads, *(None,) * len(ctx.cfg))


def _reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, model: str, loss: str, h: int,
    wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor | None, ...]:  # fmt: skip
    """The backward as a differentiable graph, for a double backward: autograd through the op's reference on
    the saved inputs, in the kernels' accumulator dtype (the kernels' backward has no derivative of its own).
    Gradients of ``(q, k, v, w1, w2)``, ``None`` where an input does not require one."""
    inputs = (q, k, v, w1, w2)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    if not wanted:
        return (None,) * len(inputs)
    acc = _acc_dtype(q.dtype)[0]
    params = {name: t.to(acc) for name, t in zip(WEIGHT_NAMES[model], (w1, w2))}
    kw = {"grid": (h, wd), "scale": scale, "lr": lr, "grad_norm": grad_norm, "loss": loss}
    out = reference.reference_ttt(model, *(t.to(acc) for t in (q, k, v)), params, **kw)
    grads = iter(torch.autograd.grad(out, wanted, dout.to(acc), create_graph=True, allow_unused=True))
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in inputs)


torch.library.register_autograd("vit3::triton_ttt_fwd", _backward, setup_context=_setup_context)


class _TritonTTT(torch.autograd.Function):
    """The eager path of the op: the custom ops' plans and launches, without the dispatcher's custom-op
    machinery (tens of microseconds a call in eager mode; ``torch.compile`` traces the custom ops instead).
    The backward finds its plan by the forward's key: no second look at the settings; it runs under the
    forward's autocast state (``autocast_backward``), and through the reference where it must be differentiable
    itself (``create_graph=True``: ``_reference_backward``)."""

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor | None, *cfg: Any
    ) -> Tensor:
        (out, gbuf, nbuf), ctx.key, ctx.metas = _forward(q, k, v, w1, w2, *cfg)
        ctx.save_for_backward(q, k, v, w1, w2, gbuf, nbuf)  # G and ||G||: W' is recomputed from them
        ctx.cfg = cfg
        return out

    @staticmethod
    @autocast_backward
    def backward(ctx: Any, dout: Tensor) -> tuple:
        q, k, v, w1, w2, gbuf, nbuf = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable themselves
            grads = _reference_backward(dout, q, k, v, w1, w2, *ctx.cfg)
        else:
            plan = _backward_template(ctx.key, ctx.metas, _meta(dout))
            dq, dk, dv, dw = _run(plan, (dout, q, k, v, w1, w1 if w2 is None else w2, gbuf, nbuf))
            grads = (dq, dk, dv, *_weight_grads(dw, w2 is not None))
        return (*grads, *(None,) * len(ctx.cfg))


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
    if len(params) != len(names) or any(key not in params for key in names):
        raise ValueError(f"inner model {name!r} takes the weights {names}, got {sorted(params)}")
    _, g, _, d = q.shape
    for key in names:
        p = params[key]
        shape = (1, g * d, 3, 3) if name == "dwconv" else (1, g, d, d)
        if p.shape != shape:
            raise ValueError(
                f"weight {key!r} must be {list(shape)} (shared initial weights), got {list(p.shape)}"
            )
        if p.device != q.device or not p.is_floating_point():
            raise ValueError(
                f"weight {key!r} must be a floating tensor on {q.device}, got {p.dtype} on {p.device}"
            )


def _weights_of(name: str, params: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    """The initial weights as the kernels read them, in place: ``(W1, W2)`` of SwiGLU (one layout: copied
    only if their strides differ), ``(W, None)`` of the linear model, the conv weight (copied only if its
    3 x 3 taps are not one stride apart)."""
    if name == "swiglu":
        w1, w2 = params["w1"], params["w2"]
        if w1.stride() != w2.stride() or w1.dtype != w2.dtype:
            w1, w2 = w1.contiguous(), w2.to(w1.dtype).contiguous()
        return w1, w2
    if name == "dwconv":
        w = params["weight"]
        return (w if w.stride(2) == 3 * w.stride(3) else w.contiguous()), None
    return params["w"], None


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
            ``{"weight": [1, G*c, 3, 3]}`` (depthwise conv, channel ``g*c + i`` = head g, channel i); read
            where they are, in their own dtype.
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
    w1, w2 = _weights_of(name, params)
    cfg = (name, loss, grid[0], grid[1], float(scale), float(lr), bool(grad_norm), chunk or 0)
    if torch.compiler.is_compiling():
        return _fwd_op(q, k, v, w1, w2, *cfg)[0]
    if not grad_flows(q, k, v, w1, w2):  # inference: nothing saved, no autograd node
        return _forward(q, k, v, w1, w2, *cfg, save=False)[0][0]
    return _TritonTTT.apply(q, k, v, w1, w2, *cfg)
