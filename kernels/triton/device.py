"""What the Triton path knows of the device and the op's inputs before any tile is sized.

The inner models the kernels take (``TRITON_LOSSES``), their head dims and io dtypes; where the kernels run
(``triton_runs_on``: CUDA, or the CPU under ``TRITON_INTERPRET=1``); the GPU (``Arch``, ``ARCHS``: compute
capability, opt-in shared memory per block, SM count), the ``tl.dot`` input precision of a launch and the
accumulator dtype; ROCm's dot precisions (``hip_dot_precisions``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton.language as tl

__all__ = [
    "ARCHS",
    "DOT_MODELS",
    "IO_DTYPES",
    "KB",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_DWCONV",
    "MIN_CAPABILITY",
    "MIN_HEAD_DIM",
    "TL_DTYPES",
    "TRITON_LOSSES",
    "WEIGHT_NAMES",
    "Arch",
    "acc_dtype",
    "dot_precision",
    "fp32_uses_tf32",
    "gpu_dot_precision",
    "head_dim_supported",
    "hip_arch",
    "hip_dot_precisions",
    "interpreting",
    "max_head_dim",
    "native_half",
    "triton_runs_on",
    "warp_group_mma",
]

TRITON_LOSSES = {"swiglu": ("dot",), "linear": ("dot", "mse"), "dwconv": ("dot",)}
# The inner models whose kernels multiply with ``tl.dot`` (the depthwise conv's are elementwise).
DOT_MODELS = ("swiglu", "linear")
WEIGHT_NAMES = {"swiglu": ("w1", "w2"), "linear": ("w",), "dwconv": ("weight",)}
# Head dims the kernels take. The matrix models' kernels keep [BLOCK_D, BLOCK_C] column blocks of the d x d
# weights and gradients on chip (``launch_config``: 16 columns at d = 128): whole 128 x 128 matrices would
# need more shared memory in the backward kernels than an H100/H200 block may use (docs/design/kernels.md,
# tile sizes). Beyond 128 the full-width k/q tiles and the dq/dk accumulators outgrow it; the depthwise conv
# keeps only 9 x d weights and full-width tiles, up to 128 as well.
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


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA, or any device under ``TRITON_INTERPRET=1``."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


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


# ``torch.backends.cuda.matmul``'s attributes walk a chain of name tests before they call these getters (once
# per eager call of fp32 inputs): read directly where this PyTorch has them.
_FP32_PRECISION = getattr(torch._C, "_get_fp32_precision_getter", None)
_ALLOW_TF32 = getattr(torch._C, "_get_cublas_allow_tf32", None)


def fp32_uses_tf32() -> bool:
    """Whether PyTorch lets fp32 matmuls use TF32 (``fp32_precision``, or the legacy ``allow_tf32``).

    Reading ``allow_tf32`` raises once the ``fp32_precision`` API (PyTorch 2.9+) has been set, so the new
    API is asked first; ``"none"`` defers to the legacy flag.
    """
    matmul = torch.backends.cuda.matmul
    prec = _FP32_PRECISION("cuda", "matmul") if _FP32_PRECISION else getattr(matmul, "fp32_precision", "none")
    if prec in ("tf32", "ieee"):
        return prec == "tf32"
    try:
        return bool(_ALLOW_TF32() if _ALLOW_TF32 else matmul.allow_tf32)
    except RuntimeError:  # a mix of the two APIs, which PyTorch refuses to reconcile
        return False


def gpu_dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision on a GPU: TF32 for 16-bit inputs (fp32 where PyTorch allows), else IEEE."""
    if dtype == torch.float64 or (dtype == torch.float32 and not fp32_uses_tf32()):
        return "ieee"
    return "tf32"


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision of a launch: the GPU's, or IEEE on the interpreter (exact fp32 dots)."""
    return "ieee" if interpreting() else gpu_dot_precision(dtype)


def acc_dtype(dtype: torch.dtype) -> tuple[torch.dtype, Any]:
    """Accumulator dtype (torch, triton) for inputs of ``dtype``: float64 for float64, else float32."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
             torch.float64: tl.float64}  # fmt: skip


def native_half(dtype: torch.dtype, arch: Arch) -> bool:
    """Whether 16-bit inputs meet ``tl.dot`` as they are (fp16 / bf16 MMA with fp32 accumulation, sm_80+).

    sm_75 has no bf16 MMA: its kernels upcast every operand to fp32 (FMA dots), as for IEEE fp32.
    """
    return dtype in (torch.float16, torch.bfloat16) and arch.capability >= 80


def warp_group_mma(arch: Arch) -> bool:
    """Whether ``arch``'s tensor cores are driven by warp groups (sm_90 ``wgmma``, sm_100 ``tcgen05``): 64-row
    dots, accumulators that leave the general registers lighter. sm_80/86/89/120: warp-level ``mma.sync``."""
    return arch.capability in (90, 100)


# The oldest arch the kernels are compiled and checked for (tests/kernels/test_kernels_compile.py).
MIN_CAPABILITY = 75


@functools.cache
def hip_arch(index: int) -> tuple[str, tuple[str, ...]]:
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
