"""The SwiGLU op (the official ViT³ inner model): ``reference`` (the one definition), ``eager`` (the tiled
PyTorch path with a hand-written backward), ``cpp`` (the same passes in the C++ CPU kernel,
``csrc/swiglu.cpp``, built by ``vit3.kernels.cpp``) and the Triton kernels (``vit3.kernels.triton``, shared
with the other ops)."""

from ..ops import Op, Path
from ..paths import cpu_supports, eager_supports
from ..triton_path import triton_path
from . import cpp, eager
from .reference import op_reference

OP = Op(
    name="swiglu",
    reference=op_reference,
    weights=("w1", "w2"),
    rope=True,
    paths={
        "triton": triton_path("swiglu"),
        "cpu": Path(supports=cpu_supports, prefers=cpp.prefers, node=cpp.NODE),
        "eager": Path(supports=eager_supports, node=eager.NODE),
    },
)
