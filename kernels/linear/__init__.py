"""The linear op (non-causal linear attention): ``reference``; its fast path is the Triton kernels
(``vit3.kernels.triton_op``, shared with the SwiGLU op)."""
