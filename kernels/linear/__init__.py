"""The linear op (non-causal linear attention): ``reference``; its fast path is the Triton kernels
(``vit3.kernels.triton``, shared with the other ops)."""

from ..ops import Op
from ..triton_path import triton_path
from .reference import op_reference

OP = Op(
    name="linear", reference=op_reference, weights=("w",), rope=True, paths={"triton": triton_path("linear")}
)
