"""The launch set-up of the Triton kernels: tiles per kernel role (``Tiles``, ``LaunchConfig``,
``launch_config``: the one place that sizes them from the GPU and the dot precision) and whether a GPU can
run a configuration at all (``smem_need``, ``fits_device``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from .device import (
    ARCHS,
    DOT_MODELS,
    IO_DTYPES,
    KB,
    MIN_CAPABILITY,
    MIN_HEAD_DIM,
    TL_DTYPES,
    TRITON_LOSSES,
    Arch,
    acc_dtype,
    dot_precision,
    gpu_dot_precision,
    head_dim_supported,
    hip_arch,
    interpreting,
    max_head_dim,
    native_half,
    warp_group_mma,
)

__all__ = [
    "FUSED_BACKWARD_SMEM",
    "HALF_BACKWARD_SMEM",
    "INTERPRET_TILES",
    "MATRIX_ROLES",
    "STACK",
    "TILES_AS",
    "LaunchConfig",
    "Tiles",
    "cdiv",
    "clear",
    "fits_arch",
    "fits_device",
    "launch_config",
    "next_pow2",
    "smem_need",
]

# The (arch, dot precision) whose tiles the interpreter takes: its column blocks and launch structure are
# a GPU's (token tiles and the split of N are its own, see ``launch_config``); its dots are exact.
INTERPRET_TILES: tuple[Arch, str] = (ARCHS["sm_90"], "tf32")
# Test hook: when set, every launch takes the tiles of this (arch, dot precision), on the interpreter or a
# GPU, so tests run each configuration of the table on the hardware at hand.
TILES_AS: tuple[Arch, str] | None = None
# Benchmark hook: ``False`` keeps SwiGLU's weight-gradient dots apart and its gradient backward at d = 32 on
# 32-token tiles (``_stacked``), the design before the stack, so both run side by side in one process
# (``benchmarks/ttt_kernel.py``, path ``fused_unstacked``).
STACK: bool = True


def table_hooks() -> tuple:
    """The hooks the tables read (``TILES_AS``, ``STACK``): part of the key of every launch configuration,
    plan and launch program."""
    return TILES_AS, STACK


@dataclass(frozen=True)
class Tiles:
    """One kernel's tile constexprs and launch options."""

    block_n: int  # tokens per tile
    block_c: int  # output columns per program (matrix kernels), or per tile of the small kernels
    num_warps: int
    num_stages: int  # Triton's software pipelining of the token loops (1: none)
    trans: bool = False  # token tiles held transposed, channels x tokens (``TRANS``; one column block only)
    stack: bool = False  # SwiGLU's two weight-gradient products as one dot of 2 x block_c rows (``STACK``)

    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class LaunchConfig:
    """Everything the launches of one ``triton_ttt`` call are sized by (``launch_config``).

    ``tiles`` holds one ``Tiles`` per kernel role: ``"forward"`` (``forward_kernel``, the whole forward in
    one launch when N is not split), ``"grad"`` (``grad_partial_kernel``), ``"readout"``,
    ``"readout_bwd"`` / ``"grad_bwd"`` (their column or fused launch) and ``"readout_bwd_cross"`` /
    ``"grad_bwd_cross"`` (the cross launch, used where the column launch has more than one block)
    and ``"conv"`` (the four depthwise-conv kernels).
    """

    block_d: int  # the head dim padded to a power of two
    chunk: int  # tokens per program along N (a multiple of every token tile)
    s: int  # chunks: cdiv(N, chunk)
    prec: str  # ``tl.dot`` input precision of fp32 operands
    dot: Any  # the dtype of the ``tl.dot`` operands (triton): the input's (16-bit on sm_80+), else ACC's
    emulate: bool  # bf16 operands on the interpreter: rounded to bf16, multiplied in fp32
    tiles: dict[str, Tiles]

    def cols(self, role: str, d: int) -> int:
        """Column blocks of role ``role`` at head dim ``d``."""
        return cdiv(d, self.tiles[role].block_c)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def _tensor_cores(dtype: torch.dtype, prec: str, arch: Arch) -> bool:
    """Whether the dots run on tensor cores (bf16 / fp16 / TF32 MMA, sm_80+), or as FMA loops (IEEE fp32,
    fp64, sm_75). FMA dots keep both operands in registers and need narrower tiles to stay clear of spills."""
    return native_half(dtype, arch) or (prec == "tf32" and dtype != torch.float64 and arch.capability >= 80)


# A SwiGLU backward stage at d = 64 in one launch keeps W1, W2, dG1, dG2 (and the transposes its dk / dq dots
# read) on chip. Parts with at least this much shared memory per block take it; the others split the columns
# into 32-wide blocks (a column and a cross launch per stage). The compiled needs behind both thresholds:
# docs/design/kernels.md (tile sizes).
FUSED_BACKWARD_SMEM = 200 * KB
# The same stage with 16-bit operands (W1, W2, dG1, dG2 and the k / v tiles in bf16 / fp16), which fits the
# shared memory of sm_86/89/120.
HALF_BACKWARD_SMEM = 96 * KB


def _half_tiles(model: str, loss: str, role: str, block_d: int, arch: Arch, rope: bool, stack: bool) -> Tiles:
    """Tiles of 16-bit operands on tensor cores (sm_80+): 64-token tiles, so the token-row dots (``k W``,
    ``q W'``, ``dY W'ᵀ``, ``P dGᵀ`` ...) have the 64 rows sm_90's ``wgmma`` needs (a warp group of 4 warps
    per 64 rows), and so do the weight-gradient dots (``kᵀ P``, ``qᵀ dY``, ``kᵀ dZ``) from d = 64 on.

    SwiGLU's one-block stages at d = 64 (the one-launch forward, both backward stages) run on transposed tiles
    (``Tiles.trans``), whose dots all have 64 rows whatever the token tile: on ``wgmma`` parts one warp group
    with 16- or 32-token tiles, two blocks per SM (sm_100's forward keeps two warp groups on 64-token tiles);
    on ``mma.sync`` parts the gradient backward on 32-token tiles over two warp groups, the orientation that
    keeps its fragments out of local memory. At d = 32 SwiGLU's weight-gradient dots are stacked on sm_90
    (``stack``, from ``_stacked``) and its gradient backward takes 64-token tiles there, 32 elsewhere (a
    reload inside the token loop at 64 without the stack). The other SwiGLU kernels at d = 64 on ``mma.sync``
    parts also hold their fragments in registers: 32-token tiles, and the one-launch forward in two column
    blocks of 32. At d = 128: 16 or 32 columns a block, 32-token tiles in the gradient cross launch. On
    ``wgmma`` parts every other kernel launched at d <= 64 runs on one warp group (the cross launches, at
    d = 64 never launched, keep the default). With RoPE in the kernels (``rope``): ``_rope_half_tiles``. The
    spills and registers measured: docs/design/kernels.md (tile sizes).
    """
    if rope:
        return _rope_half_tiles(
            model, role, block_d, arch, _half_tiles(model, loss, role, block_d, arch, False, stack)
        )
    backward = role.startswith(("readout_bwd", "grad_bwd"))
    if model == "swiglu" and block_d == 64 and role in ("forward", "readout_bwd", "grad_bwd"):
        if warp_group_mma(arch) and not (role == "forward" and arch.capability == 100):
            return Tiles(16 if role == "grad_bwd" else 32, 64, 4, 2, trans=True)
        if role == "grad_bwd":
            return Tiles(32, 64, 8, 2, trans=True)
    if model == "swiglu" and role == "grad_bwd" and block_d == 32:
        return Tiles(64 if stack else 32, 32, 4, 2)
    one_group = warp_group_mma(arch) and (
        block_d <= 32 or (block_d == 64 and (model == "linear" or role in ("grad", "readout")))
    )
    if one_group:
        return Tiles(64, block_d, 4, 2)
    if block_d <= 32:
        return Tiles(64, block_d, 8 if backward and block_d == 32 else 4, 2)
    if block_d == 128:
        if role == "grad_bwd_cross":
            return Tiles(32, 16, 8, 2)
        return Tiles(64, 16 if backward else 32, 8, 2)
    if model == "swiglu" and not warp_group_mma(arch) and role != "readout":
        return Tiles(64, 32, 8, 2) if role == "forward" else Tiles(32, 64, 8, 2)
    return Tiles(64, 64, 8, 2)


def _rope_half_tiles(model: str, role: str, block_d: int, arch: Arch, plain: Tiles) -> Tiles:
    """16-bit tiles with RoPE in the kernels, whose rotation keeps its tiles live beside the others: on
    ``wgmma`` parts SwiGLU's gradient backward at d = 32 on transposed 16-token tiles (on 64, fused with the
    conv branch, it spills under Triton 3.6) and its gradient partials at d = 64 on 32-token tiles; then, but
    on sm_90 up to d = 64, every token tile of ``plain`` halved (16 tokens at least)."""
    t = plain
    if model == "swiglu" and warp_group_mma(arch):
        if role == "grad_bwd" and block_d == 32:
            t = Tiles(16, 32, 4, 2, trans=True)
        elif role == "grad" and block_d == 64:
            t = Tiles(32, 64, 4, 2)
    if arch.capability == 90 and block_d <= 64:
        return t
    return replace(t, block_n=max(16, t.block_n // 2))


def _stacked(model: str, role: str, block_d: int, arch: Arch) -> bool:
    """Whether a SwiGLU stage with weight-gradient dots takes both weights' as one (``Tiles.stack``): at
    d = 32 on sm_90, where each alone has 32 rows and the pair the 64 a ``wgmma`` needs (sm_100's gradient
    backward spills on the 64-token tiles that go with it)."""
    wgrad = role in ("forward", "grad", "readout_bwd", "grad_bwd")
    return STACK and model == "swiglu" and block_d == 32 and wgrad and arch.capability == 90


def _matrix_tiles(
    model: str, loss: str, role: str, block_d: int, dtype: torch.dtype, prec: str, arch: Arch, rope: bool
) -> Tiles:
    """Tiles of one matrix-kernel role: ``launch_config``'s table.

    ``tests/kernels/test_kernels_compile.py`` compiles it for every arch, inner model, head dim and dtype mode
    and holds each kernel to the arch's shared memory and to a spill bound (``vit3.kernels.aot.spill_bound``);
    where the table has a choice, it is the one those compiles found spill-free. 16-bit inputs on sm_80+:
    ``_half_tiles``. fp32 on tensor cores (TF32): column blocks of the whole head up to d = 32, 16 columns at
    d = 128, and at d = 64 the whole head except in the SwiGLU backward (and its gradient pass) on parts
    without ``FUSED_BACKWARD_SMEM``, in SwiGLU's one-launch forward without ``wgmma`` and in the linear MSE
    backward, which take 32 columns; two pipeline stages; 16-token tiles where full-width k / dk tiles share
    the registers with many live column tiles (d = 32, the backward at d = 128, the linear MSE backward). FMA
    dots (IEEE fp32, fp64, every dot on sm_75) hold both operands in registers: 16-token tiles over 8 warps,
    32 columns at most, no pipelining (its extra stage of k / v tiles pushes them into spills).
    """
    if dtype == torch.float64:
        return Tiles(16, 16, 8, 1)
    if native_half(dtype, arch):
        stack = _stacked(model, role, block_d, arch)
        t = _half_tiles(model, loss, role, block_d, arch, rope, stack)
        return replace(t, stack=True) if stack else t
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
        return Tiles(32, 32, 8, 2)  # the whole head in one launch spills on mma.sync parts
    if arch.smem >= FUSED_BACKWARD_SMEM or role in ("readout", "grad", "forward"):
        return Tiles(32, 64, 8, 2)
    return Tiles(32, 32, 8, 2)


def _conv_tiles(block_d: int, dtype: torch.dtype, arch: Arch) -> Tiles:
    """The depthwise-conv kernels: full-width ``[BLOCK_N, BLOCK_D]`` tiles (their weights are only 9 x d), no
    dots; the token tile and warps per head dim that the compile matrix found spill-free under Triton 3.6 and
    3.8 (16 tokens for fp64; at d = 32, 16 tokens over 4 warps spill under 3.6). One warp group holds a tile
    up to d = 64 within 1024 registers x warps (two blocks per SM), except 16-bit tiles on ``mma.sync`` parts,
    which spill there on 4 warps (sm_80's fp16 read-out backward at d = 32) and take 8 from d = 32. 16-bit
    tiles at d = 64 on ``wgmma`` parts take 16 tokens: room for SwiGLU's stages beside them in one launch."""
    if dtype == torch.float64:
        return Tiles(16, block_d, 4 if block_d <= 32 else 8, 2)
    one_group = 64 if warp_group_mma(arch) or dtype == torch.float32 else 16
    short = block_d == 128 or (block_d == 64 and warp_group_mma(arch) and native_half(dtype, arch))
    return Tiles(16 if short else 32, block_d, 4 if block_d <= one_group else 8, 2)


MATRIX_ROLES = (
    "forward", "grad", "readout", "readout_bwd", "readout_bwd_cross", "grad_bwd", "grad_bwd_cross",
)  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _launch_config(model: str, n_tok: int, d: int, bg: int, dtype: torch.dtype, arch: Arch, loss: str,
                   prec: str, chunk: int | None, interpret: bool, hooks: tuple,
                   rope: bool) -> LaunchConfig:  # fmt: skip
    block_d = max(16, next_pow2(d))
    tile_arch, tile_prec = hooks[0] or (INTERPRET_TILES if interpret else (arch, prec))
    if model == "dwconv":
        tiles = {"conv": _conv_tiles(block_d, dtype, tile_arch)}
    else:
        tiles = {
            r: _matrix_tiles(model, loss, r, block_d, dtype, tile_prec, tile_arch, rope) for r in MATRIX_ROLES
        }
    if interpret:
        big = min(256, max(16, next_pow2(n_tok)))
        tiles = {role: replace(t, block_n=big, num_warps=4) for role, t in tiles.items()}
        want = n_tok
    else:
        want = cdiv(n_tok, max(1, cdiv(2 * arch.sms, bg)))  # about two programs per SM
    if chunk is not None:
        cap = max(16, next_pow2(chunk))
        tiles = {role: replace(t, block_n=min(t.block_n, cap)) for role, t in tiles.items()}
        want = chunk
    if model != "swiglu" and any(t.stack for t in tiles.values()):
        raise ValueError(f"{model}: stacked weight-gradient dots are SwiGLU's (two weights)")
    if any(t.trans or t.stack for role, t in tiles.items() if role.endswith("_cross")):
        raise ValueError(
            f"{model} d={d}: a cross launch runs untransposed and unstacked tiles (the kernels' rule)"
        )
    if any(t.trans and t.block_c < block_d for t in tiles.values()):
        raise ValueError(f"{model} d={d}: transposed tiles need one column block (block_c {block_d})")
    step = max(t.block_n for t in tiles.values())
    size = cdiv(max(want, 1), step) * step
    _, acc_tl = acc_dtype(dtype)
    native = model != "dwconv" and native_half(dtype, tile_arch)
    dot = TL_DTYPES[dtype] if native else acc_tl
    emulate = native and interpret and dtype == torch.bfloat16
    return LaunchConfig(block_d, size, cdiv(n_tok, size), prec, dot, emulate, tiles)


def clear() -> None:
    """Forgets the cached launch configurations (``op.clear_plans``)."""
    _launch_config.cache_clear()


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
    rope: bool = False,
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
        rope: the kernels rotate q, k by RoPE (``plan.PlanKey.rope``).

    Returns:
        The ``LaunchConfig`` (cached per arguments and ``table_hooks``).
    """
    interpret = interpreting() if interpret is None else interpret
    prec = prec or dot_precision(dtype)
    return _launch_config(model, n_tok, d, bg, dtype, arch, loss, prec, chunk, interpret, table_hooks(), rope)


def smem_need(model: str, d: int, dtype: torch.dtype, prec: str, arch: Arch) -> int:
    """Shared memory per block (bytes) the kernels of ``launch_config``'s choice are held to on ``arch``.

    An upper bound the compile matrix checks for every kernel, arch and dtype mode: 64 KB with FMA dots
    (the T4's limit, which every other part exceeds), 80 KB on tensor cores, 96 KB for SwiGLU in fp64 at
    d = 128 (full-width fp64 tiles of four weights), ``FUSED_BACKWARD_SMEM`` for the fused SwiGLU backward
    at d = 64 in fp32 and ``HALF_BACKWARD_SMEM`` for SwiGLU at d = 64 with 16-bit operands.
    """
    block_d = max(16, next_pow2(d))
    if model == "swiglu" and block_d == 64 and native_half(dtype, arch):
        return HALF_BACKWARD_SMEM
    if model == "swiglu" and block_d == 64:
        cfg = launch_config(model, 4096, block_d, 64, dtype, arch, prec=prec, interpret=False)
        if cfg.cols("grad_bwd", block_d) == 1:
            return FUSED_BACKWARD_SMEM
    if model == "swiglu" and dtype == torch.float64 and block_d == 128:
        return 96 * KB
    # 80 KB on tensor cores: SwiGLU's fp32 (TF32) read-out cross launch at d = 64 comes closest.
    return (80 if _tensor_cores(dtype, prec, arch) else 64) * KB


def fits_device(name: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether the kernels of inner model ``name`` have a launch configuration that fits ``device``.

    On a CUDA device: its compute capability (the kernels are checked from sm_75 on) and its opt-in shared
    memory per block against what ``launch_config`` picks for this head dim, dtype and, for fp32, the dots
    PyTorch allows now (TF32 or IEEE): ``smem_need``. On ROCm (``torch.version.hip``), first whether Triton's
    AMD backend takes the dots' input precision on this GPU (most parts reject TF32; ``DOT_MODELS``). Cheap:
    cached per (model, head-dim class, dtype, precision, device). On a CPU the interpreter
    (``TRITON_INTERPRET=1``) runs any configuration. A CUDA device asked about where no GPU is present (a
    route explained ahead of time) passes: the check is made where the GPU is.

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
        if device.type == "cpu" and interpreting():
            return True, ""
        return (
            False,
            f"the Triton kernels run on CUDA GPUs (or on CPU with TRITON_INTERPRET=1), not on {device}",
        )
    if not torch.cuda.is_available():  # a CUDA route explained where there is no GPU to inspect
        return True, ""
    prec = gpu_dot_precision(dtype)
    if torch.version.hip and name in DOT_MODELS:
        index = device.index if device.index is not None else torch.cuda.current_device()
        arch, allowed = hip_arch(index)
        if prec not in allowed:
            return False, (
                f"ROCm {arch}: Triton's AMD backend takes {', '.join(allowed)} dots there, "
                f"not the {prec} dots the kernels take for {dtype} inputs"
            )
    block_d = max(16, next_pow2(head_dim))
    return fits_arch(name, block_d, dtype, prec, Arch.of(device))


@functools.cache
def fits_arch(name: str, block_d: int, dtype: torch.dtype, prec: str, arch: Arch) -> tuple[bool, str]:
    """Whether ``arch`` runs inner model ``name``'s kernels at padded head dim ``block_d``
    (``(ok, why not)``): ``fits_device``'s rule without a device, as the offline compiles ask it."""
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
