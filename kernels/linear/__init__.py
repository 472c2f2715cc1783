"""The linear op (non-causal linear attention): ``reference``; its fast path is the Triton kernels
(``vit3.kernels.triton_op``, shared with the SwiGLU op)."""

# The fast paths this op has (what the backend registry, ``vit3.layers.backends``, may run it on).
PATHS = ("triton",)
