"""Fused Triton kernels for the TTT inner loop (installed as ``vit3.kernels``)."""
