"""The SwiGLU op (the official ViT³ inner model): ``reference`` (the one definition), ``eager`` (the tiled
PyTorch path with a hand-written backward) and ``cpp`` (its passes in the C++ CPU kernel, ``csrc/``); the
Triton kernels are ``vit3.kernels.triton_op`` (shared with the linear op)."""

# The fast paths this op has (what the backend registry, ``vit3.layers.backends``, may run it on).
PATHS = ("triton", "cpp", "eager")
