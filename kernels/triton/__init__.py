"""The Triton path of the TTT ops: ``device`` (inputs, GPU, dot precision), ``tiles`` (launch set-up,
``fits_device``), ``plan`` (launch plans), ``op`` (custom ops, autograd, ``triton_ttt``)."""
