"""The TTT inner-loop ops of ViT³ (installed as ``vit3.kernels``), one folder per op, and the table of them.

Each op (``swiglu``, ``linear``, ``dwconv``) has one pure-PyTorch ``reference``, the definition every fast
path is tested against, and beside it its fast paths (``<op>.eager``, ``<op>.cpp``, and the Triton path of all
three, ``triton_path`` over the package ``triton``); ``cpp`` builds and loads the one C++ extension. Each op's
folder builds its :class:`~vit3.kernels.ops.Op` (``<op>.OP``), the table :data:`OPS` below registers them one
line per op, and the mixer's backend registry (``vit3.layers.backends``) decides which path runs. Triton is
imported only when a Triton name is used, so the references and the C++ kernel load without it.

The modules one by one, and why they are so: ``docs/design/kernels.md``.
"""

from __future__ import annotations

from typing import Any

from . import dwconv, linear, swiglu
from .dwconv.reference import dwconv_ttt_ref
from .linear.reference import linear_ttt_ref
from .ops import OPS, ops_with, register
from .swiglu.reference import swiglu_ttt_ref

# The table of ops, one line each (in this order: the backends list them so).
register(swiglu.OP)
register(linear.OP)
register(dwconv.OP)

# Names of the Triton path (``triton.op``, ``triton.tiles``, ``triton.device``) re-exported here, imported
# (with Triton) on first use; the op's module first, whose copies of the device checks are the ones it calls.
_TRITON_NAMES = (
    "IO_DTYPES",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_DWCONV",
    "MIN_HEAD_DIM",
    "TRITON_LOSSES",
    "fits_device",
    "head_dim_supported",
    "max_head_dim",
    "resolve_backend",
    "triton_runs_on",
    "triton_ttt",
)

__all__ = ["OPS", "dwconv_ttt_ref", "linear_ttt_ref", "ops_with", "swiglu_ttt_ref", *_TRITON_NAMES]


def __getattr__(name: str) -> Any:
    if name in _TRITON_NAMES:
        from .triton import device, op, tiles

        return getattr(next(m for m in (op, tiles, device) if hasattr(m, name)), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
