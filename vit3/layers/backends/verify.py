"""Verification of a backend's first call of a new input specialisation against the generic path.

A backend compiled per input specialisation (``Backend.specialises``: Triton's JIT) is held to the generic
path's output and input gradients on the first and last sample (``samples``) of that call, within
``VERIFY_RTOL`` (``_Guard`` in ``guard`` runs both); a mismatch raises ``VerificationError``, which demotes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class VerificationError(RuntimeError):
    """A backend's first call of a new input specialisation disagreed with the generic path."""


# Relative RMS error (per tensor) above which a verified call counts as wrong, by io dtype: far above
# rounding and TF32 dots (~1e-3), far below what a wrong pointer or an unwritten tile gives (~1, or NaN).
VERIFY_RTOL = {torch.float64: 1e-6}
VERIFY_RTOL_DEFAULT = 0.1
# Whether the guarded call of a new input specialisation is compared with the generic path (``guard``). Off,
# the call is taken as verified: for benchmarks whose kernel launches are stubbed out and compute nothing.
COMPARE = True


def specialisation(tensors: Sequence[Tensor]) -> tuple:
    """What a JIT-compiled backend specialises on beyond the route key, as far as its inputs decide it: the
    shape, strides and storage offset of the first three of a mixer call's ``tensors`` (``[qkv, *weights]``:
    qkv and the first two initial weights; Triton: sizes and strides equal to 1 or multiples of 16, 16-byte
    aligned pointers; and the grid). The weights' shapes and dtype are the key's; a gate's follow qkv's."""
    return tuple((t.shape, t.stride(), t.storage_offset()) for t in tensors[:3])


def synchronize(device: torch.device) -> None:
    """Waits for ``device``'s kernels (CUDA; nothing elsewhere): an asynchronous fault surfaces here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _samples(b: int) -> list[int]:
    """The samples a verification recomputes: the first and the last (where a grid or stride error shows)."""
    return [0, b - 1] if b > 1 else [0]


def _rel_rms(got: Tensor, want: Tensor) -> float:
    """Relative RMS error of ``got`` against ``want`` (infinite where ``got`` is not finite, ``want`` is)."""
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(want).all():
        return 0.0  # non-finite inputs: nothing to hold the backend to
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def sliced(tensors: Sequence[Tensor], b: int) -> list[Tensor]:
    """The first and last sample of every batched tensor (leading dim ``b``); the others (the initial weights,
    leading dim 1) whole. The inner loops are per sample."""
    if b == 1:
        return list(tensors)
    idx = _samples(b)
    return [t[idx] if t.shape[0] == b else t for t in tensors]


def compare(what: str, got: Tensor, want: Tensor, b: int) -> None:
    """Raises ``VerificationError`` where ``got`` is further than ``VERIFY_RTOL`` from ``want`` (batch b)."""
    tol = VERIFY_RTOL.get(got.dtype, VERIFY_RTOL_DEFAULT)
    err = _rel_rms(got, want)
    if err > tol:
        raise VerificationError(
            f"the {what} of samples {_samples(b)} differs from the generic path's on the first call of this "
            f"input specialisation (batch {b}): relative RMS error {err:.3g} > {tol:g}"
        )
