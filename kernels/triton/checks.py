"""The checks of a Triton call, shared by the custom ops (``op.py``) and the fused node's hooks (``node.py``):
which implementation runs it, on which token grid, and a ``ValueError`` naming what is wrong."""

from __future__ import annotations

from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from .device import (
    IO_DTYPES,
    MIN_HEAD_DIM,
    TRITON_LOSSES,
    WEIGHT_NAMES,
    head_dim_supported,
    max_head_dim,
    triton_runs_on,
)

__all__ = [
    "check_call",
    "is_live",
    "not_in_place",
    "resolve_backend",
]


def resolve_backend(backend: str = "auto") -> str:
    """Checks ``backend``: ``"auto"``, ``"triton"`` or ``"reference"``."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    return backend


def not_in_place(name: str, weights: list[Tensor]) -> str:
    """What keeps the kernels from reading op ``name``'s initial weights in place (``""``: nothing): SwiGLU's
    w1, w2 must share one layout and dtype, the conv weight's 3 x 3 taps lie one stride apart."""
    if name == "swiglu" and (
        weights[0].stride() != weights[1].stride() or weights[0].dtype != weights[1].dtype
    ):
        return "the SwiGLU weights w1, w2 in one layout and dtype"
    if name == "dwconv" and weights[0].stride(2) != 3 * weights[0].stride(3):
        return "the conv weight's 3 x 3 taps one stride apart"
    return ""


def is_live(t: Tensor) -> bool:
    """False for fake tensors (shape propagation only: nothing to launch)."""
    return not isinstance(t, FakeTensor)


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


def check_call(
    name: str, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], grid: tuple[int, int] | None,
    loss: str, backend: str, chunk: int | None,
) -> tuple[str, tuple[int, int]]:  # fmt: skip
    """Checks a ``triton_ttt`` call: which implementation runs it (``"triton"`` or ``"reference"``) on which
    token grid ``(h, w)``; a ``ValueError`` naming what is wrong."""
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
        return which, grid
    if not triton_runs_on(q.device):
        raise ValueError(f"the Triton kernel cannot run on {q.device} (CUDA, or CPU with TRITON_INTERPRET=1)")
    if not head_dim_supported(name, d):
        top = max_head_dim(name)
        why = " (wider tiles exceed on-chip shared memory)" if d > top else ""
        raise ValueError(
            f"the Triton kernel for {name!r} with {q.dtype} supports head dims {MIN_HEAD_DIM}..{top}, "
            f"got {d}{why}"
        )
    return which, grid
