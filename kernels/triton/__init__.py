"""The Triton path of the TTT ops (installed as ``vit3.kernels.triton``). The launcher: ``device`` (inputs,
GPU, dot precision, ROCm), ``tiles`` (launch set-up, ``fits_device``), ``plan`` (launch plans), ``op`` (custom
ops, autograd, ``triton_ttt``). The kernels the ops share: ``jit``, the jit helpers of every kernel (programs,
tiles, dot operands, the step); ``step``, the kernels every op launches (the step, its backward, the
weight-gradient reduction); ``matrix``, the kernels of the two inner models with ``d x d`` weights, SwiGLU and
linear. Those are one code whose ``SWIGLU`` constexpr picks the model, so they stand here rather than in
either op's folder; an op with kernels of its own keeps them in its folder (``dwconv/triton.py``).
"""
