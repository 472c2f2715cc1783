"""CPU runtime settings for vit3's entry points (train.py, eval.py, benchmarks).

On CPUs a large share of eager PyTorch time goes to first-touch page faults: glibc serves every allocation
above its mmap threshold (at most 32 MiB by default) with fresh pages and returns them on free, so each
N-sized activation of a high-resolution image is faulted in again on every use. Raising the thresholds lets
freed blocks be reused instead; measured here, the TTT mixer's time per token then stays flat from 1k to 16k
tokens instead of growing ~1.5x. This changes process-wide allocator behaviour, so the library never does it
on import: applications opt in (vit3's scripts do on CPU runs, ``cpu_malloc: false`` in a config turns it
off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_log = logging.getLogger(__name__)


def tune_malloc(
    mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 32, top_pad: int = 64 << 20
) -> bool:
    """Keeps large freed blocks in the heap for reuse (glibc ``mallopt``); a no-op elsewhere.

    Args:
        mmap_threshold: allocations above this still get their own mapping (bytes; glibc caps it at 32 MiB
            on its own dynamic adjustment, not when set explicitly).
        trim_threshold: free memory at the heap top kept before it is returned to the system (bytes).
        top_pad: extra bytes requested whenever the heap grows.

    Returns:
        Whether the settings were applied (False where the C library is not glibc).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(
        mallopt(param, min(value, 2**31 - 1)) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold),
            (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_TOP_PAD, top_pad),
        )
    )
    _log.debug("glibc malloc tuned for large tensors: %s", ok)
    return ok
