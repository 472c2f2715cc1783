"""The SwiGLU op's C++ CPU kernel (``csrc/swiglu_cpu.cpp``): build and load it.

The kernel runs the tiled eager path's passes (``vit3.kernels.swiglu.eager``) and the step between them as
``torch.ops.vit3_swiglu_cpu.*``, one call per direction, the weights side by side (``w = [W1 | W2]``
``[B, H, d, 2d]``, built inside from ``w1, w2`` ``[1|B, H, d, d]``):

- ``ttt_forward(q, k, v, w1, w2, out, z, y, c, lr, grad_norm, block) -> [w, g, norm, w_new]``: ``Z = k W``,
  ``G = -c kᵀ [v ⊙ A | v ⊙ Z1 ⊙ A']``, the step ``W' = W - lr G / (||G|| + 1)``, ``out = Y1 ⊙ silu(Y2)`` with
  ``Y = q W'``; ``z``, ``y`` buffers to save the pre-activations in, or ``None`` (the memory-lean backward
  recomputes them);
- ``ttt_backward(d_out, q, k, v, z, y, w, g, norm, w_new, dq, dk, dv, c, lr, grad_norm, block) -> dw``: the
  read-out's backward (dq, dW'), the step's backward (dG), the inner pass's (dk, dv, kᵀ dZ);

and the 3x3 depthwise ops of the official mixer's other branch and of ``ConvPosEnc`` on token rows
``[B, N, C]``: ``dwconv(x, taps, out, h, w, bias, residual)``, ``dwconv_weight_grad(g, x, taps_grad, h, w)``
(per-sample or shared taps ``[B|1, 9, C]``; ``dwconv`` also reads a shared conv weight ``[C, 1, 3, 3]`` as it is),
and the branch's step built on them, ``dwconv_ttt_forward`` /
``dwconv_ttt_backward`` (``vit3.kernels.dwconv.cpp``).

Each op walks every (sample, head) inside C++ (the heads of a sample grouped into batched matmuls when their
tokens fit a cache-sized block of rows, larger problems in token blocks), so a branch costs one Python call per
direction instead of ~40 ops, and each elementwise chain is one vectorised loop instead of ~7 passes.

It is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~30-60 s once, then
loaded from the build cache in ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). The build
targets the CPU's vector unit as PyTorch reports it (AVX512, AVX2 or portable code). Its name and folder are
keyed by a hash of what makes the binary (``build_target``: the source's content, the flags, the PyTorch
build and the Python ABI), and it compiles a copy of the source kept in that folder: two checkouts, or a wheel
beside a clone, with different sources build apart, with the same source share one build, and never rebuild
each other (a shared name made each load of the other one's source a full rebuild).

The mixer's backend registry (``vit3.layers.backends``, backend ``cpu``) decides when it runs. When the build
fails (no compiler), ``cpu_kernel_ops`` raises with the error, and the registry demotes the backend with a
warning: the tiled PyTorch path serves. Loading it needs no Triton. It is tested, forward and every gradient,
against the op's reference ``vit3.kernels.swiglu.reference`` (``tests/test_op_swiglu.py``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..ops import Branch, Inputs, Settings
from ..paths import FEW_TOKENS, MIN_CPU_KERNEL_TOKENS

__all__ = ["LDFLAGS", "SOURCE", "build_target", "cpu_kernel_ops", "load", "prefers_kernel"]

SOURCE = Path(__file__).with_name("csrc") / "swiglu_cpu.cpp"
LDFLAGS = ["-fopenmp"]
_DTYPES = (torch.float32, torch.float64)
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


def _cpp_extension() -> Any:
    """``torch.utils.cpp_extension``, imported without the warning that the import logs on machines without a
    GPU ("No CUDA runtime is found, using CUDA_HOME=..."): this kernel is CPU code."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension as cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def build_target(source: Path, suffix: str, flags: list[str]) -> tuple[str, Path]:
    """The extension's name ``vit3_swiglu_cpu_<suffix>_<key>`` and build folder for ``source`` built with
    ``flags``: the key hashes the source's content, the compile and link flags, the PyTorch build (version and
    install folder, whose headers it includes) and the Python ABI; the folder is the name under
    ``$TORCH_EXTENSIONS_DIR`` (default: PyTorch's build root, ``~/.cache/torch_extensions``)."""
    digest = hashlib.sha256(source.read_bytes())
    env = (torch.__version__, os.path.dirname(torch.__file__), sys.version, os.environ.get("CXX", ""))
    for part in (*flags, "|", *LDFLAGS, "|", *env):
        digest.update(part.encode() + b"\0")
    name = f"vit3_swiglu_cpu_{suffix}_{digest.hexdigest()[:16]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or _cpp_extension().get_default_build_root()
    return name, Path(root) / name


def _staged_source(source: Path, folder: Path) -> Path:
    """``source`` copied into the build folder (written only when missing or different, atomically): the
    build reads the copy, so its ninja file is the same whichever checkout loads it."""
    folder.mkdir(parents=True, exist_ok=True)
    copy, text = folder / source.name, source.read_bytes()
    if not copy.is_file() or copy.read_bytes() != text:
        tmp = copy.with_name(f".{copy.name}.{os.getpid()}")
        tmp.write_bytes(text)
        os.replace(tmp, copy)
    return copy


@functools.cache
def load() -> tuple[Any, str]:
    """Builds (once per machine and source) and loads the kernel: the ``torch.ops`` namespace, or ``None`` and
    why not."""
    cpp_extension = _cpp_extension()
    if shutil.which("ninja") is None:  # the PyPI ninja package's binary, when its scripts dir is not on PATH
        try:
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        except ImportError:
            pass
    suffix, flags = _build_flags()
    _log.info("loading the C++ CPU kernel (the first use on a machine builds it: 10-30 s)")
    try:
        name, folder = build_target(SOURCE, suffix, flags)
        cpp_extension.load(
            name,
            [str(_staged_source(SOURCE, folder))],
            extra_cflags=flags,
            extra_ldflags=LDFLAGS,
            build_directory=str(folder),
            is_python_module=False,
        )
    except Exception as exc:  # no compiler or ninja, an unsupported platform: the PyTorch path serves
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {first}"
    return torch.ops.vit3_swiglu_cpu, ""


def cpu_kernel_ops(like: Tensor) -> Any:
    """The kernel's ops (``torch.ops.vit3_swiglu_cpu``) for tokens like ``like`` ``[B, H, N, d]``.

    Raises:
        ValueError: ``like`` is not a float32/float64 CPU tensor.
        RuntimeError: the kernel could not be built (the error names why).
    """
    if like.device.type != "cpu" or like.dtype not in _DTYPES:
        raise ValueError(
            f"the CPU kernel runs float32/float64 CPU tensors, got {like.dtype} on {like.device.type}"
        )
    ops, why = load()
    if ops is None:
        raise RuntimeError(f"the C++ CPU kernel could not be built ({why})")
    return ops


def prefers_kernel(branch: Branch, cfg: Settings, x: Inputs) -> tuple[bool, str]:
    """The C++ path's ``prefers``: auto keeps the tiled path below ``MIN_CPU_KERNEL_TOKENS`` tokens per head."""
    if x.tokens == FEW_TOKENS:
        return False, (
            f"fewer than {MIN_CPU_KERNEL_TOKENS} tokens per head: the tiled path, which folds every sample's "
            "problems into one tile, is faster"
        )
    return True, ""
