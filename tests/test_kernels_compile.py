"""The kernels compile for a real GPU target (sm_90, H100/H200) and fit its shared memory, with no GPU.

The interpreter checks what the kernels compute, not whether Triton can compile them for a GPU (types,
``tl.dot`` shapes, layouts) or whether they fit on chip. Triton compiles ahead of time without a driver
(``triton.compile`` with an explicit ``GPUTarget``; ptxas ships with Triton). The compile runs in a fresh
process without ``TRITON_INTERPRET`` (the interpreter, once used, leaves Triton's code generator unusable
in this process), which also imports ``vit3.kernels`` the way a GPU machine does (``triton_op`` ops).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from vit3.kernels import MAX_HEAD_DIM, MAX_HEAD_DIM_DWCONV, ttt_fused, ttt_fused_kernels

pytestmark = [pytest.mark.triton, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SMEM_LIMIT = 227 * 1024  # bytes one block may use on sm_90
TOKEN_PTRS = {"q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr"}
MATRIX = ("grad_partial_kernel", "readout_kernel", "readout_bwd_kernel", "grad_bwd_kernel")
CONV = ("conv_grad_partial_kernel", "conv_readout_kernel", "conv_readout_bwd_kernel", "conv_grad_bwd_kernel")
SMALL = ("step_kernel", "step_bwd_kernel", "wgrad_reduce_kernel")


def compile_all(model: str, d: int, io: str) -> dict[str, int]:
    """Compiles every kernel ``model`` launches for sm_90; returns the shared memory (bytes) of each.

    Runs in the child process (see the module docstring); launch sizes as ``fused_ttt`` picks on a GPU.
    """
    from triton.backends.compiler import GPUTarget  # absent from old Triton: the test then skips
    from triton.compiler import ASTSource

    block_d = max(16, triton.next_power_of_2(d))
    block_n, warps = ttt_fused.gpu_tiles(block_d)
    base = {"BLOCK_N": block_n, "BLOCK_D": block_d, "ACC": tl.float32}
    if model == "dwconv":
        names, small = CONV, {"NW": 1, "BLOCK_R": 16}
    else:
        swiglu = model == "swiglu"
        io_dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(io, torch.bfloat16)
        nw = 2 if swiglu else 1
        base |= {"SWIGLU": swiglu, "MSE": not swiglu, "NW": nw, "PREC": ttt_fused._precision(io_dtype)}
        names, small = MATRIX, {"NW": base["NW"], "BLOCK_R": block_d}
    small |= {"BLOCK_D": block_d, "ACC": tl.float32, "GRAD_NORM": True}
    smem = {}
    for name in names + SMALL:
        fn = getattr(ttt_fused_kernels, name)
        consts = {k: v for k, v in (base if name in names else small).items() if k in fn.arg_names}
        sig = {}
        for arg in fn.arg_names:
            if arg in consts:
                sig[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                sig[arg] = "*" + (io if arg in TOKEN_PTRS else "fp32")
            else:
                sig[arg] = "fp32" if arg in ("coef", "lr") else "i32"
        opts = {"num_warps": warps if name in names else 4}
        compiled = triton.compile(
            ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=opts
        )
        smem[name] = compiled.metadata.shared
    return smem


CASES = [
    pytest.param("swiglu", MAX_HEAD_DIM, "bf16", id="swiglu-d64-bf16"),
    pytest.param("swiglu", 32, "fp32", id="swiglu-d32-fp32-ieee"),
    pytest.param("linear", MAX_HEAD_DIM, "fp16", id="linear-mse-d64-fp16"),
    pytest.param("dwconv", MAX_HEAD_DIM_DWCONV, "bf16", id="dwconv-d128-bf16"),
]


@pytest.mark.parametrize(("model", "d", "io"), CASES)
def test_kernels_compile_for_sm90_within_shared_memory(model, d, io):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, tests.test_kernels_compile as t; print(json.dumps(t.compile_all({model!r}, {d}, {io!r})))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode and "GPUTarget" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton cannot compile ahead of time")
    assert proc.returncode == 0, proc.stderr[-3000:]
    smem = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(smem) == 7
    for name, nbytes in smem.items():
        assert nbytes <= SMEM_LIMIT, f"{name} needs {nbytes} B of shared memory (sm_90 allows {SMEM_LIMIT})"
