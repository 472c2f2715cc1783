"""The 3x3 depthwise-conv op (the official ViT³ second branch): ``reference`` (the one definition),
``eager`` (the closed form, one native convolution call per stage), ``cpp`` (the same stages on token rows in
the C++ CPU kernel's depthwise ops) and ``triton`` (its Triton kernels, launched by ``vit3.kernels.triton``).
RoPE does not apply (a grid model sees the positions itself)."""

from ..ops import Op, Path
from ..paths import cpu_supports, eager_supports
from ..triton_path import triton_path
from . import cpp, eager
from .reference import op_reference

OP = Op(
    name="dwconv",
    reference=op_reference,
    weights=("weight",),
    rope=False,
    paths={
        "triton": triton_path("dwconv"),
        "cpu": Path(supports=cpu_supports, node=cpp.NODE),
        "eager": Path(supports=eager_supports, node=eager.NODE),
    },
)
