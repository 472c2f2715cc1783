"""The C++ CPU kernel of the SwiGLU inner model's TTT step (``csrc/swiglu_cpu.cpp``): build, load and choose it.

The kernel provides the four N-sized passes of the fused PyTorch path (``vit3.layers.fast_swiglu``, which is
its pure-PyTorch reference and does the small step between the passes) as ``torch.ops.vit3_swiglu_cpu.*``:

- ``inner_grad(k, v, w, g, z)``: ``Z = k W``, ``G += kᵀ [v ⊙ A | v ⊙ Z1 ⊙ A']``;
- ``readout(q, w_new, out, y)``: ``Y = q W'``, ``out = Y1 ⊙ silu(Y2)``;
- ``readout_backward(d_out, q, y, w_new, dq, dw)`` and ``inner_backward(k, v, z, w, dg, dk, dv, dw)``.

Each op walks every (sample, head) in cache-sized token blocks inside C++, so a step costs 4 Python calls
instead of ~40 ops per block, and each elementwise chain is one vectorised loop instead of ~7 passes.

It is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~30-60 s once, then
loaded from the build cache in ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). The build
targets the CPU's vector unit as PyTorch reports it (AVX512, AVX2 or portable code), one build per kind.

Choosing: an explicit argument wins, else ``$VIT3_CPU_KERNEL`` (``auto``, ``1`` or ``0``); ``auto`` uses the
kernel for float32/float64 CPU tensors with at least ``MIN_AUTO_TOKENS`` tokens per head (below that the tiled
path, which batches small problems together, is faster). When the build fails (no compiler), a warning names the error once and
the PyTorch path serves.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["CPU_KERNEL_ENV", "MIN_AUTO_TOKENS", "SOURCE", "cpu_kernel_ops", "load", "use_cpu_kernel"]

CPU_KERNEL_ENV = "VIT3_CPU_KERNEL"
SOURCE = Path(__file__).with_name("csrc") / "swiglu_cpu.cpp"
_DTYPES = (torch.float32, torch.float64)
# Fewer tokens per head than this and ``auto`` keeps the tiled path: it folds many small (sample, head)
# problems into batched matmuls, where the kernel pays a few ATen calls per problem (measured: the kernel is
# 0.7-0.8x the tiled path at 4-16 tokens with B*H = 256, even at 64, 1.15-1.45x from 144 tokens on).
MIN_AUTO_TOKENS = 100
_log = logging.getLogger(__name__)
# Vector-unit flags per capability (``torch.backends.cpu.get_cpu_capability()``); ATen's vector headers pick
# their implementation from the CPU_CAPABILITY macros.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def _build_flags() -> tuple[str, list[str]]:
    """The build's name suffix and compiler flags for this CPU."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp"]
    if capability in _ISA_FLAGS:
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *_ISA_FLAGS[capability]]
        return capability.lower(), flags
    return "portable", flags


@functools.cache
def load() -> tuple[Any, str]:
    """Builds (once per machine) and loads the kernel: the ``torch.ops`` namespace, or ``None`` and why not."""
    from torch.utils.cpp_extension import load as load_extension

    if shutil.which("ninja") is None:  # the PyPI ninja package's binary, when its scripts dir is not on PATH
        try:
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        except ImportError:
            pass
    suffix, flags = _build_flags()
    _log.info("loading the C++ CPU kernel (the first use on a machine builds it: 10-30 s)")
    try:
        load_extension(
            f"vit3_swiglu_cpu_{suffix}",
            [str(SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler or ninja, an unsupported platform: the PyTorch path serves
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {first}"
    return torch.ops.vit3_swiglu_cpu, ""


def use_cpu_kernel(flag: bool | None, like: Tensor) -> bool:
    """Whether to run the kernel for tokens like ``like`` ``[B, H, N, d]``: ``flag`` if given, else
    ``$VIT3_CPU_KERNEL``.

    ``auto`` (the default) means float32/float64 CPU tensors with at least ``MIN_AUTO_TOKENS`` tokens per head.
    Forcing it on for other tensors is an error.
    """
    if flag is None:
        env = os.environ.get(CPU_KERNEL_ENV, "auto").strip().lower() or "auto"
        if env not in ("auto", "1", "0"):
            raise ValueError(f"${CPU_KERNEL_ENV} must be 'auto', '1' or '0', got {env!r}")
        if env == "0":
            return False
        flag = None if env == "auto" else True
    fits = like.device.type == "cpu" and like.dtype in _DTYPES
    if flag and not fits:
        raise ValueError(
            f"the CPU kernel runs float32/float64 CPU tensors, got {like.dtype} on {like.device.type}"
        )
    return (fits and like.shape[-2] >= MIN_AUTO_TOKENS) if flag is None else flag


_warned: list[str] = []


def cpu_kernel_ops(flag: bool | None, like: Tensor) -> Any:
    """The kernel's ops when they should run for ``like`` (``use_cpu_kernel``) and could be built, else None."""
    if not use_cpu_kernel(flag, like):
        return None
    ops, why = load()
    if ops is None and not _warned:
        _warned.append(why)
        warnings.warn(
            f"vit3: the C++ CPU kernel could not be built ({why}); using the PyTorch path "
            f"(set {CPU_KERNEL_ENV}=0 to skip the attempt).",
            stacklevel=3,
        )
    return ops
