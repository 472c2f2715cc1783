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
IO_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


def variants(model: str, d: int, io: str) -> list[tuple[str, str, dict, int]]:
    """Every kernel variant ``model`` launches at head dim ``d``: ``(label, kernel, constexprs, num_warps)``.

    Launch sizes as ``fused_ttt`` picks on a GPU; the backward matrix kernels appear once per launch
    (``COLS`` / ``CROSS``): fused for one column block, else as ``[cols]`` and ``[cross]``.
    """
    dtype = IO_DTYPES[io]
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    block_d = max(16, triton.next_power_of_2(d))
    block_n, block_c, warps = ttt_fused.gpu_tiles(block_d, dtype, model)
    base = {"BLOCK_N": block_n, "BLOCK_D": block_d, "ACC": acc}
    block_r = 16 if model == "dwconv" else block_d
    small = {"BLOCK_R": block_r, "BLOCK_C": ttt_fused.small_tile(block_r, block_d, dtype), "ACC": acc}
    small |= {"GRAD_NORM": True, "NW": 2 if model == "swiglu" else 1}
    out = []
    if model == "dwconv":
        out += [(name, name, base, warps) for name in CONV]
    else:
        base |= {"SWIGLU": model == "swiglu", "MSE": model != "swiglu", "NW": small["NW"], "BLOCK_C": block_c}
        base |= {"PREC": ttt_fused._precision(dtype)}
        passes = ttt_fused._backward_passes(triton.cdiv(d, block_c))
        for name in MATRIX:
            if "bwd" not in name:
                out.append((name, name, base, warps))
                continue
            for p in passes:
                tag = "" if len(passes) == 1 else ("[cols]" if p["COLS"] else "[cross]")
                out.append((name + tag, name, base | p, warps))
    return out + [(name, name, small, 4) for name in SMALL]


def compile_all(model: str, d: int, io: str) -> dict[str, int]:
    """Compiles every kernel variant ``model`` launches for sm_90; returns the shared memory (bytes) of each.

    Runs in the child process (see the module docstring).
    """
    from triton.backends.compiler import GPUTarget  # absent from old Triton: the test then skips
    from triton.compiler import ASTSource

    acc_ptr = "*fp64" if io == "fp64" else "*fp32"
    smem = {}
    for label, name, constexprs, warps in variants(model, d, io):
        fn = getattr(ttt_fused_kernels, name)
        consts = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        sig = {}
        for arg in fn.arg_names:
            if arg in consts:
                sig[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                sig[arg] = "*" + io if arg in TOKEN_PTRS else acc_ptr
            else:
                sig[arg] = "fp32" if arg in ("coef", "lr") else "i32"
        compiled = triton.compile(
            ASTSource(fn, sig, constexprs=consts),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps},
        )
        smem[label] = compiled.metadata.shared
    return smem


CASES = [
    pytest.param("swiglu", 64, "bf16", id="swiglu-d64-bf16"),
    pytest.param("swiglu", 32, "fp32", id="swiglu-d32-fp32-ieee"),
    pytest.param("linear", 64, "fp16", id="linear-mse-d64-fp16"),
    pytest.param("swiglu", MAX_HEAD_DIM, "bf16", id="swiglu-d128-bf16"),
    pytest.param("linear", MAX_HEAD_DIM, "fp16", id="linear-mse-d128-fp16"),
    pytest.param("swiglu", MAX_HEAD_DIM, "fp64", id="swiglu-d128-fp64"),
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
    split = model != "dwconv" and d > 64  # column blocks: two launches per backward matrix stage
    assert len(smem) == (9 if split else 7), sorted(smem)
    for name, nbytes in smem.items():
        assert nbytes <= SMEM_LIMIT, f"{name} needs {nbytes} B of shared memory (sm_90 allows {SMEM_LIMIT})"
