"""The 3x3 depthwise-conv op (the official ViT³ second branch): ``reference`` (the one definition),
``eager`` (the closed form, one native convolution call per stage), ``cpp`` (the same stages on token rows in
the C++ CPU kernel's depthwise ops) and the Triton kernels
(``vit3.kernels.triton_op``)."""

# The fast paths this op has (what the backend registry, ``vit3.layers.backends``, may run it on).
PATHS = ("triton", "cpp", "eager")
