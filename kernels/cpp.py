"""The C++ CPU extension ``vit3_cpu``: build and load it (one extension, its sources split per op).

The sources live in the ops' folders (``swiglu/csrc``, ``dwconv/csrc``, ``mix/csrc``) and the block's
(``block/csrc``: its nodes outside the mixer and the block op) around the shared header ``csrc/vit3_cpu.h``;
the ops are ``torch.ops.vit3_cpu.*``. The extension is compiled on first use with
``torch.utils.cpp_extension`` into a folder keyed by a hash of what makes the binary (``build_target``), one
process building under a lock while the others wait (``build_once``). The backend registry
(``vit3.layers.backends``, backend ``cpu``) decides when it runs; a failed build raises from
``cpu_kernel_ops`` and the backends' guard demotes the backend with a warning.

The sources one by one, the build cache and why it is keyed so: ``docs/design/kernels.md``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import flops

__all__ = ["BUILDING", "FILES", "LDFLAGS", "build_once", "build_target", "cpu_kernel_ops", "load"]

_HERE = Path(__file__).parent
# What makes the extension: each op's source and the header they share (staged side by side to build).
FILES = (
    _HERE / "swiglu" / "csrc" / "swiglu.cpp",
    _HERE / "dwconv" / "csrc" / "dwconv.cpp",
    _HERE / "mix" / "csrc" / "mix.cpp",
    _HERE / "block" / "csrc" / "cpe.cpp",
    _HERE / "block" / "csrc" / "lean_mlp.cpp",
    _HERE / "block" / "csrc" / "ttt_block.cpp",
    _HERE / "csrc" / "vit3_cpu.h",
)
LDFLAGS = ["-fopenmp"]
# The line a process that builds the kernel writes to stderr first (the build takes a minute or more).
BUILDING = "vit3: building the C++ CPU kernel (first use, about a minute)..."
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


def build_target(files: Sequence[Path], suffix: str, flags: list[str]) -> tuple[str, Path]:
    """The extension's name ``vit3_cpu_<suffix>_<key>`` and build folder for ``files`` (sources and headers)
    built with ``flags``: the key hashes the files' names and content, the compile and link flags, the PyTorch
    build (version and install folder, whose headers it includes) and the Python ABI; the folder is the name
    under ``$TORCH_EXTENSIONS_DIR`` (default: PyTorch's build root, ``~/.cache/torch_extensions``)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    env = (torch.__version__, os.path.dirname(torch.__file__), sys.version, os.environ.get("CXX", ""))
    for part in (*flags, "|", *LDFLAGS, "|", *env):
        digest.update(part.encode() + b"\0")
    name = f"vit3_cpu_{suffix}_{digest.hexdigest()[:16]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or _cpp_extension().get_default_build_root()
    return name, Path(root) / name


def _staged(source: Path, folder: Path) -> Path:
    """``source`` copied into the build folder (written only when missing or different, atomically): the
    build reads the copies (a source includes the header beside it), so its ninja file is the same whichever
    checkout loads it."""
    folder.mkdir(parents=True, exist_ok=True)
    copy, text = folder / source.name, source.read_bytes()
    if not copy.is_file() or copy.read_bytes() != text:
        tmp = copy.with_name(f".{copy.name}.{os.getpid()}")
        tmp.write_bytes(text)
        os.replace(tmp, copy)
    return copy


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``folder`` (``fcntl.flock`` on its ``build.lock``; released by the OS when
    the holder dies) while the body runs; where there is no ``fcntl``, PyTorch's own lock around the build
    alone."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(folder: Path, library: Path, build: Callable[[], None]) -> bool:
    """Runs ``build`` (which builds ``library`` in ``folder`` unless it is there, then loads it) under a lock
    on the folder, so that processes that load together wait for one build, then load it. Says so on stderr
    when ``library`` is missing (this call builds it). Returns whether it did.

    The lock also holds the staging of the sources: no process rewrites a copy that another is compiling."""
    with _folder_lock(folder):
        building = not library.is_file()
        if building:
            print(BUILDING, file=sys.stderr, flush=True)
        build()
    return building


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
    try:
        name, folder = build_target(FILES, suffix, flags)
        _log.info("loading the C++ CPU kernel from %s", folder)

        def build() -> None:
            staged = [_staged(f, folder) for f in FILES]
            cpp_extension.load(
                name,
                [str(f) for f in staged if f.suffix == ".cpp"],
                extra_cflags=flags,
                extra_ldflags=LDFLAGS,
                build_directory=str(folder),
                is_python_module=False,
            )

        build_once(folder, folder / f"{name}{getattr(cpp_extension, 'LIB_EXT', '.so')}", build)
        flops.register("vit3_cpu")
    except Exception as exc:  # no compiler or ninja, an unsupported platform: the PyTorch path serves
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {first}"
    return torch.ops.vit3_cpu, ""


def cpu_kernel_ops(like: Tensor) -> Any:
    """The extension's ops (``torch.ops.vit3_cpu``) for tokens like ``like`` (``[B, H, N, d]``,
    ``[B, N, C]``).

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
