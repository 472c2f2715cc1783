"""A performance model on paper of the fused TTT op: bytes, FLOPs and predicted time of every launch, per GPU.

Reads each launch (kernel, grid, tiles, tensors) from the launcher's own plans on meta tensors and counts its
HBM bytes, tensor-core and element-wise FLOPs and latency floor, predicts its time per GPU, and adds the rest
of a training step's blocks from a simple model. No GPU is used. Method and assumptions: benchmarks/README.md.

    python benchmarks/roofline.py                                   # the design of this tree
    python benchmarks/roofline.py --kernels /tmp/main/kernels --design main-8fde993 \
        --out results/roofline_8fde993.csv

``--kernels`` loads the launch plans from another checkout's ``kernels/`` folder (before / after a change).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import CHUNK_TOKENS, RESULTS, print_table, write_csv

KB = 1024

# ------------------------------------------------------------------------------------------- the machines


@dataclass(frozen=True)
class GPU:
    """Dense peak throughputs and bandwidth of one GPU, and the launch set-up's view of it (capability,
    opt-in shared memory per block, SMs)."""

    name: str
    capability: int
    smem: int
    sms: int
    bf16: float  # FLOP/s, tensor cores, fp32 accumulation, dense
    tf32: float
    fp32: float  # CUDA cores (FMA = 2 FLOPs)
    hbm: float  # bytes/s
    source: str


GPUS = {
    g.name: g
    for g in (
        GPU("H100", 90, 227 * KB, 132, 989.4e12, 494.7e12, 66.9e12, 3.35e12,
            "NVIDIA H100 Tensor Core GPU datasheet, SXM5 (sparsity figures halved)"),
        GPU("H200", 90, 227 * KB, 132, 989.4e12, 494.7e12, 66.9e12, 4.8e12,
            "NVIDIA H200 Tensor Core GPU datasheet, SXM (sparsity figures halved)"),
        GPU("A100", 80, 163 * KB, 108, 312e12, 156e12, 19.5e12, 2.039e12,
            "NVIDIA A100 Tensor Core GPU datasheet, 80 GB SXM (sparsity figures halved)"),
        GPU("L4", 89, 99 * KB, 58, 121e12, 60e12, 30.3e12, 300e9,
            "NVIDIA L4 Tensor Core GPU datasheet (sparsity figures halved)"),
        GPU("RTX 4090", 89, 99 * KB, 128, 165.2e12, 82.6e12, 82.6e12, 1008e9,
            "NVIDIA Ada Lovelace GPU architecture whitepaper, GeForce RTX 4090 (fp32 accumulate, dense)"),
    )
}  # fmt: skip

# Model constants: assumptions, not measurements.
LAUNCH = 3e-6  # s per launch in one stream (launch + drain of a dependent kernel); CUDA graphs shrink it
LATENCY = 0.6e-6  # s, one dependent global-memory round trip (~1000 cycles at ~1.7 GHz)
MMA_SYNC_SM90 = 0.5  # fraction of sm_90's tensor peak that warp-level mma.sync reaches (wgmma: the peak)
GEMM_EFF = 0.7  # fraction of the roofline cuBLAS GEMMs of the rest of the block reach
# Element-wise FLOPs per element of a [BLOCK_N, BLOCK_C] tile (sigmoid ~ 4), per kernel and inner model.
EW = {
    ("grad", "swiglu"): 14, ("grad", "linear"): 2, ("readout", "swiglu"): 6, ("readout", "linear"): 0,
    ("readout_bwd", "swiglu"): 14, ("readout_bwd", "linear"): 0, ("grad_bwd", "swiglu"): 28,
    ("grad_bwd", "linear"): 3,
}  # fmt: skip
CONV_EW = {"conv_grad_partial_kernel": 36, "conv_readout_kernel": 27, "conv_readout_bwd_kernel": 63,
           "conv_grad_bwd_kernel": 54}  # fmt: skip


# -------------------------------------------------------------------------------------- the plans, priced


def load_triton_op(kernels: Path | None) -> ModuleType:
    """The launch plans (``vit3.kernels.triton.plan``) of this tree, or of the ``kernels/`` folder of another
    checkout (imported as a package of its own, so two designs never meet in one process's imports; an older
    checkout's ``triton_op``, which held them before the split)."""
    if kernels is None:
        from vit3.kernels.triton import plan

        return plan
    spec = importlib.util.spec_from_file_location(
        "other_kernels", kernels / "__init__.py", submodule_search_locations=[str(kernels)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["other_kernels"] = package
    spec.loader.exec_module(package)
    split = (kernels / "triton" / "plan.py").exists()
    return importlib.import_module("other_kernels.triton.plan" if split else "other_kernels.triton_op")


def plan(
    op: ModuleType,
    model: str,
    b: int,
    g: int,
    n: int,
    d: int,
    gpu: GPU,
    grid: tuple[int, int],
    chunk: int = 0,
) -> tuple:
    """``(forward, backward)`` launches of one bf16 call on ``gpu``, planned by ``op`` on meta tensors
    (``chunk``: tokens per program, as ``triton_ttt``'s; 0: the launcher chooses).

    q, k, v are views of one ``[B, N, 3*G*d]`` projection, the upstream gradient a contiguous ``[B, N, G*d]``.
    Takes either plan signature: separate weights (``w1``, ``w2``) or one stacked ``[1, G, NW, R, d]``.
    """
    arch = op.Arch(gpu.capability, gpu.smem, gpu.sms, gpu.name)
    qkv = torch.empty(b, n, 3 * g * d, dtype=torch.bfloat16, device="meta")
    q, k, v = (t.unflatten(-1, (g, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    nw, r = (2 if model == "swiglu" else 1), (9 if model == "dwconv" else d)
    if "w1" in inspect.signature(op.forward_plan).parameters:
        shape = (1, g * d, 3, 3) if model == "dwconv" else (1, g, d, d)
        weights = (torch.empty(shape, device="meta"), torch.empty(shape, device="meta") if nw == 2 else None)
    else:
        weights = (torch.empty(1, g, nw, r, d, device="meta"),)
    common = (model, "dot", *grid, 9**-0.5, 1.0, True, chunk)
    outs, fwd = op.forward_plan(q, k, v, *weights, *common, arch=arch, prec="tf32", interpret=False)
    dout = torch.empty(b, n, g, d, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    _, bwd = op.backward_plan(
        dout, q, k, v, *weights, *outs[1:], *common, arch=arch, prec="tf32", interpret=False
    )
    return fwd, bwd


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


@dataclass
class Cost:
    """What one launch moves and computes."""

    label: str
    programs: int
    hbm: float  # bytes
    tensor: float  # tensor-core FLOPs that can run as sm_90 wgmma (64-row dots under >= 4 warps)
    tensor_sync: float  # tensor-core FLOPs that cannot (warp-level mma.sync on sm_90)
    dot: str  # the dots' operand type: "bf16", "tf32", "ieee" or "-"
    ew: float  # CUDA-core FLOPs
    iters: int  # serial loop iterations of one program
    stages: int


TOKENS = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "o_ptr", "dq_ptr", "dk_ptr", "dv_ptr")
MATRIX_KERNELS = {"grad_partial_kernel": ("grad",), "forward_kernel": ("grad", "readout"),
                  "readout_kernel": ("readout",), "readout_bwd_kernel": ("readout_bwd",),
                  "grad_bwd_kernel": ("grad_bwd",)}  # fmt: skip


def _dots(role: str, a: dict, swiglu: bool, mse: bool) -> list[tuple[int, int, int]]:
    """The ``(M, K, N)`` of every dot one token tile of kernel role ``role`` makes (one column block)."""
    bn, bd, bc = a["BLOCK_N"], a["BLOCK_D"], a["BLOCK_C"]
    row, wgrad, back = (bn, bd, bc), (bd, bn, bc), (bn, bc, bd)
    if role == "grad":
        return [row, row, wgrad, wgrad] if swiglu else ([row, wgrad] if mse else [wgrad])
    if role == "readout":
        return [row, row] if swiglu else [row]
    cols, cross = a.get("COLS", True), a.get("CROSS", True)
    if role == "readout_bwd":
        dy, dq = ([row, row], [back, back]) if swiglu else ([], [back])
        return dy + (dq if cross else []) + ([wgrad] * (2 if swiglu else 1) if cols else [])
    fwd = [row] * (4 if swiglu else (2 if mse else 1))
    dk = [back] * (4 if swiglu else (2 if mse else 1))
    kdz = [wgrad] * (2 if swiglu else (1 if mse else 0)) if a.get("WGRAD", True) else []
    return fwd + (dk if cross else []) + (kdz if cols else [])


def _dot_kind(a: dict) -> str:
    dot = a.get("DOT")  # the operand dtype (this design); before it, every tile was upcast to fp32
    if dot is not None and "16" in str(dot):
        return "bf16"
    return "tf32" if a.get("PREC", "tf32") == "tf32" else "ieee"


def _state_bytes(kernel: str, a: dict, cols: bool) -> float:
    """Bytes of per-(sample, head) state (partials, G, W', norms, dG) a matrix kernel reads or writes."""
    part = a.get("part_ptr")
    slot = _nbytes(part) / part.shape[1] if isinstance(part, torch.Tensor) else 0
    fused, wgrad = a.get("FUSED", False), a.get("WGRAD", True)
    stepped = sum(_nbytes(a.get(n)) for n in ("g_ptr", "n_ptr", "wp_ptr"))  # W' recomputed, or W' itself
    if kernel == "grad_partial_kernel":
        return slot * part.shape[1]
    if kernel == "forward_kernel":
        return stepped if a.get("SAVE", True) else 0
    if kernel == "readout_kernel":
        return stepped
    if kernel == "readout_bwd_kernel":
        if not cols:
            return stepped
        return stepped + (slot + _nbytes(a["dg_ptr"]) if fused else slot * (part.shape[1] - 1))
    # grad_bwd: dG read; the kᵀdZ partials written where the inner gradient depends on W (always, before)
    written = (2 * slot if fused else slot * (part.shape[1] - 1)) if wgrad else 0
    return _nbytes(a["dg_ptr"]) + (written if cols else 0)


def price_launch(launch: Any, swiglu: bool) -> Cost:
    """The ``Cost`` of one planned launch, from its kernel's arguments (by name), constexprs and grid."""
    kernel = launch.kernel.fn.__name__
    a = dict(zip(launch.kernel.arg_names, launch.args)) | launch.kwargs
    programs = getattr(launch, "programs", 0) or math.prod(launch.grid)
    stages = a.get("num_stages", 1)
    if kernel == "wgrad_reduce_kernel":
        return _price_reduce(launch.label, a, programs)
    tokens = {n: a[n] for n in TOKENS if n in a}
    b, g, n, d = tokens.get("q_ptr", tokens.get("k_ptr")).shape
    chunk = min(a.get("CHUNK", n), n)
    s = math.ceil(n / chunk)
    tiles_bg = (s - 1) * math.ceil(chunk / a["BLOCK_N"]) + math.ceil((n - (s - 1) * chunk) / a["BLOCK_N"])
    per_program = math.ceil(chunk / a["BLOCK_N"])
    if kernel.startswith("conv_"):
        hbm = sum(_nbytes(t) for t in tokens.values())
        hbm += sum(_nbytes(a.get(n)) for n in ("part_ptr", "g_ptr", "n_ptr", "wp_ptr", "dg_ptr"))
        ew = CONV_EW[kernel] * b * g * tiles_bg * a["BLOCK_N"] * a["BLOCK_D"]
        return Cost(launch.label, programs, hbm, 0, 0, "-", ew, per_program, stages)
    col_launch, cross = a.get("COLS", True), a.get("CROSS", True)
    blocks = math.ceil(d / a["BLOCK_C"]) if col_launch else 1  # column blocks the launch's programs span
    walks = 1 if col_launch else math.ceil(d / a["BLOCK_C"])  # column blocks a program walks per tile
    old_grid = len(launch.grid) == 3 and launch.grid[2] > 1  # column blocks on the slowest grid axis
    written = {"o_ptr": True, "dq_ptr": cross, "dk_ptr": cross, "dv_ptr": col_launch}
    hbm = 0.0
    for name, t in tokens.items():
        if not written.get(name, True):
            continue
        again = blocks if old_grid and name in ("q_ptr", "k_ptr") else 1  # full-width reads per column block
        hbm += again * _nbytes(t) / t.numel() * b * g * n * d
    hbm += _state_bytes(kernel, a, col_launch)
    mse = a.get("MSE", False)
    dots = [dot for role in MATRIX_KERNELS[kernel] for dot in _dots(role, a, swiglu, mse)]
    scale = 2 * b * g * blocks * walks * tiles_bg
    tensor = scale * sum(m * k_ * n_ for m, k_, n_ in dots if m % 64 == 0 and a["num_warps"] % 4 == 0)
    total = scale * sum(m * k_ * n_ for m, k_, n_ in dots)
    inner = "swiglu" if swiglu else "linear"
    ew = sum(EW[(r, inner)] for r in MATRIX_KERNELS[kernel]) * b * g * blocks * walks * tiles_bg
    ew *= a["BLOCK_N"] * a["BLOCK_C"]
    iters = per_program * walks * len(MATRIX_KERNELS[kernel])
    return Cost(launch.label, programs, hbm, tensor, total - tensor, _dot_kind(a), ew, iters, stages)


def _price_reduce(label: str, a: dict, programs: int) -> Cost:
    part, out = a["part_ptr"], a.get("out_ptr", a.get("dw_ptr"))
    if "NUSE" in a:  # this design: runs of items over programs, BLOCK_T items a step
        read = a["B"] * a["G"] * a["NUSE"] * a["E"] * part.element_size()
        iters = math.ceil(a["PER"] / a["BLOCK_T"])
    else:  # before: one program per head and column block sums every slot of every sample in turn
        read = _nbytes(part)
        iters = a["B"] * a["SLOTS"] * a["NW"]
    return Cost(label, programs, read + _nbytes(out), 0, 0, "-", 0, iters, 1)


def predict(c: Cost, gpu: GPU) -> dict[str, float]:
    """Seconds of one launch on ``gpu``: memory, compute and latency bounds, and the total."""
    peak = {"bf16": gpu.bf16, "tf32": gpu.tf32, "ieee": gpu.fp32, "-": gpu.bf16}[c.dot]
    sync = MMA_SYNC_SM90 if gpu.capability == 90 and c.dot != "ieee" else 1.0
    t_mem = c.hbm / gpu.hbm
    t_compute = c.tensor / peak + c.tensor_sync / (peak * sync) + c.ew / gpu.fp32
    t_latency = c.iters * LATENCY / max(1, c.stages)
    util = min(1.0, c.programs / gpu.sms)
    return {"mem_us": t_mem * 1e6, "compute_us": t_compute * 1e6, "latency_us": t_latency * 1e6,
            "us": (LAUNCH + max(t_mem / util, t_compute / util, t_latency)) * 1e6}  # fmt: skip


def price(
    op: ModuleType, model: str, b: int, g: int, n: int, d: int, gpu: GPU, grid: tuple[int, int]
) -> list[dict]:
    """One row per launch of a forward + backward: what it moves and computes, and its predicted time."""
    fwd, bwd = plan(op, model, b, g, n, d, gpu, grid)
    rows = []
    for phase, launches in (("fwd", fwd), ("bwd", bwd)):
        for launch in launches:
            c = price_launch(launch, model == "swiglu")
            flops = c.tensor + c.tensor_sync
            wgmma = f"{c.tensor / flops:.0%}" if flops and gpu.capability == 90 else "-"
            rows.append({"phase": phase, "kernel": c.label, "programs": c.programs, "MB": c.hbm / 1e6,
                         "GFLOP": flops / 1e9, "dot": c.dot, "wgmma": wgmma, **predict(c, gpu)})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------- the training step


@dataclass(frozen=True)
class Stage:
    """Blocks of one resolution: width C, heads of the SwiGLU branch, head dim d, tokens h x w, depth."""

    dim: int
    heads: int
    side: int
    depth: int
    mlp: int  # hidden width / C
    conv_ffn: bool  # H-ViT³'s ConvFFN (fc1, GELU, x + dw3x3, GELU, fc2) instead of an MLP
    rope: bool

    @property
    def d(self) -> int:
        return self.dim // self.heads


# 224 x 224 inputs: ViT³-S (patch 16: 14 x 14 tokens), H-ViT³-T (stem /4, then /8, /16, /32).
MODELS = {
    "ViT3-S": ((Stage(384, 6, 14, 12, 4, False, False),), 4.82e9),
    "H-ViT3-T": (
        (Stage(64, 2, 56, 1, 4, True, True), Stage(128, 4, 28, 3, 4, True, True),
         Stage(320, 10, 14, 9, 4, True, True), Stage(512, 16, 7, 4, 4, True, True)),
        4.92e9,
    ),
}  # fmt: skip


def block_rest(st: Stage, b: int, gpu: GPU, rope_passes: bool) -> tuple[float, float]:
    """(seconds, FLOPs per image) of one block's forward + backward outside the TTT op, bf16 activations;
    ``rope_passes``: RoPE rotates q, k outside the op's kernels (designs before RoPE on load)."""
    t = b * st.side**2
    c, width = st.dim, st.dim + st.d  # the SwiGLU heads and the conv branch's d channels
    gemms = [(c, 3 * width), (width, c), (c, st.mlp * c), (st.mlp * c, c)]
    seconds = flops = 0.0
    for k, m in gemms:  # forward, and the two backward GEMMs (input and weight gradients)
        f = 2 * t * k * m
        moved = 2 * t * (k + m)  # bf16 input and output
        seconds += 3 * max(f / (GEMM_EFF * gpu.bf16), moved / (GEMM_EFF * gpu.hbm))
        flops += f / b
    act = 2 * t * c  # bytes of one bf16 [T, C] activation
    passes = 2 * 2 + 2 * 2 + 2  # two LayerNorms, two residual adds (read + write), the CPE (read + write)
    passes += 2 * st.mlp * (2 if not st.conv_ffn else 6)  # GELU (and the ConvFFN's dw conv + second GELU)
    passes += 2 * width / c + (4 if st.rope and rope_passes else 0)  # the branches' read-outs, RoPE on q, k
    seconds += 3 * passes * act / gpu.hbm  # backward ~ twice the forward's traffic
    return seconds, flops


def training_step(op: ModuleType, name: str, b: int, gpu: GPU) -> dict[str, Any]:
    """Predicted seconds of one training step (forward + backward) of ``name`` at batch ``b``, and its split.

    ``modelled_gmacs_fwd``: the forward multiply-adds per image the model covers (the blocks' GEMMs and the
    TTT op's dots), beside the paper's count (fvcore's, one per multiply-add): the rest is the stem, the
    downsampling layers, the head and the element-wise work.
    """
    stages, paper_flops = MODELS[name]
    mixer = rest = flops = 0.0
    for st in stages:
        grid = (st.side, st.side)
        rows = price(op, "swiglu", b, st.heads, st.side**2, st.d, gpu, grid)
        rows += price(op, "dwconv", b, 1, st.side**2, st.d, gpu, grid)
        on_load = "rope" in getattr(getattr(op, "PlanKey", None), "_fields", ())  # RoPE in the op's kernels
        other, f = block_rest(st, b, gpu, not on_load)
        mixer += st.depth * sum(r["us"] for r in rows) * 1e-6
        rest += st.depth * other
        flops += st.depth * (f + sum(r["GFLOP"] for r in rows if r["phase"] == "fwd") * 1e9 / b)
    return {"model": name, "batch": b, "step_ms": (mixer + rest) * 1e3, "ttt_op_ms": mixer * 1e3,
            "rest_ms": rest * 1e3, "ttt_share": mixer / (mixer + rest),
            "modelled_gmacs_fwd": flops / 2e9, "paper_gflops_fwd": paper_flops / 1e9}  # fmt: skip


# ----------------------------------------------------------------------------- calibrated on the H200 profile

# The H200 run's per-kernel profile of the fused op (bf16, d 64; N 196 / 3136, B*H 64 / 1024), the launches of
# the design it ran (``3faaef0``: each launch's kernel, label, programs and serial tile iterations, as that
# tree's plans made them; today's plans launch other kernels) and the offline compile rows (registers, warps,
# shared memory per kernel) of those kernels, sm_90 bf16 of the 2026-12-03 matrix: the calibration's inputs.
# The models are priced at this tree's plans and matrix.
PROFILE = RESULTS / "ttt_kernel_profile_cuda.csv"
PROFILED_LAUNCHES = RESULTS / "roofline_profiled_launches.csv"
PROFILED_MATRIX = RESULTS / "compile_matrix_h200_profiled.csv"
COMPILE_MATRIX = RESULTS / "compile_matrix.csv"
FIT_BH, CHECK_BH = 64, 1024  # the profile's B*H fitted on, and the one predicted from that fit


def occupancy(matrix: dict, model: str, d: int, label: str, kernel: str) -> int:
    """CTAs of a launch one sm_90 SM holds at once: by registers (64 K a SM), shared memory (227 KB) and
    warps (64 a SM), as the compile matrix has them (1 where it has no row)."""
    found = matrix.get((model, d, label)) or matrix.get((model, d, kernel))
    if found is None:
        return 1
    regs, warps, smem_kb = found
    by_regs = 65536 // ((regs + 7) // 8 * 8 * 32 * warps)
    return max(1, min(by_regs, int(227 // smem_kb) if smem_kb else 64, 64 // warps))


def read_profile(profile: Path) -> dict:
    """``{(N, B*H, kernel): us per launch}`` of the profile's fused path (a kernel launched twice a call: the
    mean)."""
    with profile.open() as f:
        return {
            (int(r["N"]), int(r["BH"]), r["kernel"]): float(r["us"]) / float(r["calls"])
            for r in csv.DictReader(f)
            if r["path"] == "fused" and r["kernel"].endswith("_kernel") and r["d"] == "64"
        }


def read_matrix(matrix: Path) -> dict:
    """``{(model, d, kernel): (registers, warps, shared KB)}`` of a compile matrix's sm_90 bf16 rows."""
    with matrix.open() as f:
        return {
            (r["model"], int(r["d"]), r["kernel"]): (int(r["regs"]), int(r["num_warps"]), float(r["smem_kb"]))
            for r in csv.DictReader(f)
            if r["arch"] == "sm_90" and r["mode"] == "bf16"
        }


def read_launches(path: Path, regs: dict) -> dict[tuple[int, int], list[tuple[str, str, int, int]]]:
    """``{(N, B*H): [(kernel, label, iters, waves)]}``: the profiled design's launches, each its programs in
    waves of the CTAs an H200 holds (``occupancy`` of ``regs``)."""
    sms = GPUS["H200"].sms
    found: dict[tuple[int, int], list[tuple[str, str, int, int]]] = {}
    with path.open() as f:
        for r in csv.DictReader(f):
            slots = sms * occupancy(regs, "swiglu", int(r["d"]), r["label"], r["kernel"])
            waves = math.ceil(int(r["programs"]) / slots)
            found.setdefault((int(r["N"]), int(r["BH"])), []).append(
                (r["kernel"], r["label"], int(r["iters"]), waves)
            )
    return found


def calibrate(measured: dict, launches: dict) -> dict[str, tuple[float, float]]:
    """Per kernel ``(P, L)``: a wave of programs takes ``P + iters * L`` µs (a prologue and one latency per
    serial tile iteration), fitted on the profile's B*H = ``FIT_BH`` rows at both N (two equations); where
    that gives a negative prologue, ``P = 0`` and L their mean. The one-launch forward (not split at
    B*H 64) takes the split pair's prologues and their mean latency per tile role."""
    seen: dict[str, list[tuple[int, int, float]]] = {}
    for n in sorted({k[0] for k in measured}):
        for kernel, _, iters, waves in launches[(n, FIT_BH)]:
            t = measured.get((n, FIT_BH, kernel))
            if t is not None:
                seen.setdefault(kernel, []).append((waves, iters, t - LAUNCH * 1e6))
    fit = {}
    for kernel, points in seen.items():
        (w1, i1, t1), (w2, i2, t2) = points[0], points[-1]
        slope = (t1 / w1 - t2 / w2) / (i1 - i2) if i1 != i2 else 0.0
        prologue = t1 / w1 - i1 * slope
        if prologue < 0 or slope <= 0:
            prologue, slope = 0.0, (t1 / (w1 * i1) + t2 / (w2 * i2)) / 2
        fit[kernel] = (prologue, slope)
    (p1, l1), (p2, l2) = fit["grad_partial_kernel"], fit["readout_kernel"]
    fit["forward_kernel"] = (p1 + p2, (l1 + l2) / 2)
    return fit


def calibrated_us(fit: dict, kernel: str, iters: int, waves: int) -> float | None:
    """A launch's µs by the calibrated latency model; ``None`` for a kernel the profile never had."""
    if kernel not in fit:
        return None
    prologue, slope = fit[kernel]
    return LAUNCH * 1e6 + waves * (prologue + iters * slope)


def check_calibration(measured: dict, launches: dict) -> tuple[list[dict], dict]:
    """The fit on the profile and its design's launches, and per launch and shape of the profile its
    prediction against the measured µs: the B*H ``FIT_BH`` rows in-sample, the ``CHECK_BH`` rows out of
    sample (a ``(total)`` row per shape)."""
    fit = calibrate(measured, launches)
    rows = []
    for bh in (FIT_BH, CHECK_BH):
        for n in sorted({k[0] for k in measured}):
            shape = {"N": n, "BH": bh, "d": 64, "sample": "fitted" if bh == FIT_BH else "predicted"}
            got = want = 0.0
            for kernel, label, iters, waves in launches[(n, bh)]:
                us = calibrated_us(fit, kernel, iters, waves) or 0.0
                meas = measured.get((n, bh, kernel), 0.0)  # per launch: a kernel's time over its launches
                got, want = got + us, want + meas
                rows.append(shape | {"kernel": label, "waves": waves, "iters": iters, "us": us,
                                     "measured_us": meas})  # fmt: skip
            rows.append(
                shape | {"kernel": "(total)", "us": got, "measured_us": want, "error": got / want - 1}
            )
    return rows, fit


# The models' own mixer shapes (bf16 training, H200): ViT³-T at 224 px, batch 128 (B*G 768 at N 196) and
# 1248 px, batch 32 (B*G 192 at N 6084), both branches (six SwiGLU heads of 32, one depthwise head of 32);
# ViT³-S at 224 px, batch 128 (heads of 64).
MODEL_SHAPES = (
    ("ViT3-T-224-b128", 128, 6, 196, 32),
    ("ViT3-T-1248-b32", 32, 6, 6084, 32),
    ("ViT3-S-224-b128", 128, 6, 196, 64),
)


def _wave_us(fit: dict, kernel: str, c: Cost, waves: int) -> tuple[float, bool]:
    """µs of one wave of a launch's programs, launch cost apart, and whether the calibrated model gave it
    (else ``predict``'s time spread over the waves)."""
    us = calibrated_us(fit, kernel, c.iters, waves)
    calibrated = us is not None
    if us is None:
        us = predict(c, GPUS["H200"])["us"]
    return (us - LAUNCH * 1e6) / max(1, waves), calibrated


def staged(op: ModuleType, branches: dict[str, tuple]) -> list[tuple[tuple[str, ...], Any]]:
    """Each branch's launches (``plan``'s forward, then its backward) as the launch program runs them
    (``program.mixer_stages``: one launch per stage where they fuse); branch after branch where ``op`` is
    another checkout's, which has no stages."""
    if op.__name__ != "vit3.kernels.triton.plan":
        return [
            ((name,), launch) for name, phases in branches.items() for phase in phases for launch in phase
        ]
    from vit3.kernels.triton.program import mixer_stages

    names = list(branches)
    return [
        (tuple(names[i] for i in group), launch) for group, launch in mixer_stages(list(branches.values()))
    ]


class _Part(NamedTuple):
    """One kernel of a launch, priced: its ``Cost``, µs per wave, whether calibrated, CTA slots, waves."""

    cost: Cost
    wave_us: float
    calibrated: bool
    slots: int
    waves: int


def price_models(
    op: ModuleType, fit: dict, regs: dict, shapes: tuple = MODEL_SHAPES, dwconv: bool = True, chunk: int = 0
) -> list[dict]:
    """The models' shapes priced launch by launch as the launch program runs them: the calibrated model where
    the kernel was profiled (its d = 64 latencies: d = 32 tiles are not slower), the uncalibrated one
    (``predict``) elsewhere. A fused launch (both branches' stage) holds the CTAs its compile row allows (else
    the fewest of its parts') and takes one launch cost and the programs' work spread over the GPU's CTA
    slots, at least its longest wave. ``shapes``: ``(label, B, G, N, d)`` rows; ``dwconv``: with the
    depthwise branch (else SwiGLU's alone, as ``ttt_kernel.py`` times it); ``chunk``: ``plan``'s."""
    rows, gpu = [], GPUS["H200"]
    for label, b, g, n, d in shapes:
        side = math.isqrt(n)
        branches = (("swiglu", g), ("dwconv", 1)) if dwconv else (("swiglu", g),)
        plans = {m: plan(op, m, b, h, n, d, gpu, (side, n // side), chunk) for m, h in branches}
        for models, launch in staged(op, plans):
            priced = []
            for model, part in zip(models, getattr(launch, "parts", ()) or (launch,)):
                c, kernel = price_launch(part, model == "swiglu"), part.kernel.fn.__name__
                slots = gpu.sms * occupancy(regs, model, d, c.label, kernel)
                waves = math.ceil(c.programs / slots)
                priced.append(_Part(c, *_wave_us(fit, kernel, c, waves), slots, waves))
            if len(priced) == 1:
                waves, us = priced[0].waves, LAUNCH * 1e6 + priced[0].waves * priced[0].wave_us
            else:
                fused = ("vit3", d, launch.label) in regs  # the fused kernel's own compile row
                own = gpu.sms * occupancy(regs, "vit3", d, launch.label, "")
                slots = own if fused else min(p.slots for p in priced)
                work = sum(p.cost.programs * p.wave_us for p in priced) / slots
                us = LAUNCH * 1e6 + max(work, max(p.wave_us for p in priced))
                waves = math.ceil(sum(p.cost.programs for p in priced) / slots)
            rows.append({"shape": label, "branch": "+".join(models), "kernel": launch.label, "waves": waves,
                         "iters": max(p.cost.iters for p in priced), "us": us,
                         "calibrated": all(p.calibrated for p in priced)})  # fmt: skip
    return rows


# The GPU check's kernel shapes (``ttt_kernel.py``: SwiGLU alone, 4 heads), priced whole and chunked as its
# ``fused`` and ``fused_chunked`` paths run them: the model's prediction for the split alone.
KERNEL_SHAPES = (
    ("kernel-d32-n196-bh768", 192, 4, 196, 32),
    ("kernel-d32-n6084-bh192", 48, 4, 6084, 32),
    ("kernel-d64-n3136-bh1024", 256, 4, 3136, 64),
)


def price_chunked(op: ModuleType, fit: dict, regs: dict) -> list[dict]:
    """``KERNEL_SHAPES`` priced by the calibrated model whole (the launcher's split) and chunked
    (``CHUNK_TOKENS`` a program): per shape and path its launches, waves and µs (fwd + bwd). The model keeps
    a kernel's latency per tile iteration whatever the split: chunking buys the waves' fill (shorter programs,
    a shorter last wave) and costs a prologue per wave and the partials' reduction."""
    rows = []
    for path, chunk in (("fused", 0), ("fused_chunked", CHUNK_TOKENS)):
        for shape in KERNEL_SHAPES:
            priced = price_models(op, fit, regs, (shape,), dwconv=False, chunk=chunk)
            waves, us = sum(r["waves"] for r in priced), sum(r["us"] for r in priced)
            rows.append({"shape": shape[0], "path": path, "launches": len(priced), "waves": waves, "us": us})
    return rows


# ---------------------------------------------------------------------------------------------------- main

# The kernel benchmark's shape (B*H = 64 at N = 3136: 16 images x 4 heads, 56 x 56 tokens) at ViT³-S's and
# H-ViT³'s head dims, and the training shapes of the two models' busiest blocks at batch 256 / 128.
SHAPES = (
    ("bench-d64", "swiglu", 16, 4, 56, 64),
    ("bench-d32", "swiglu", 16, 4, 56, 32),
    ("ViT3-S-b256", "swiglu", 256, 6, 14, 64),
    ("H-ViT3-T-stage1-b128", "swiglu", 128, 2, 56, 32),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=Path, default=None, help="another checkout's kernels/ folder")
    p.add_argument("--design", default="this tree", help="the name of the design in the table")
    p.add_argument("--gpus", nargs="+", default=list(GPUS), choices=list(GPUS))
    p.add_argument("--batch", type=int, nargs=2, default=(256, 128), help="ViT3-S and H-ViT3-T batch")
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--out", type=Path, default=RESULTS / "roofline.csv")
    p.add_argument("--calibrate", action="store_true", help="fit the latency model on the H200 profile")
    args = p.parse_args(argv)
    op = load_triton_op(args.kernels)
    if args.calibrate:
        return calibration_main(op, args.out)
    rows, steps = [], []
    print(f"design: {args.design}; model constants: LAUNCH={LAUNCH * 1e6:.1f} us, "
          f"LATENCY={LATENCY * 1e6:.1f} us, "
          f"MMA_SYNC_SM90={MMA_SYNC_SM90}, GEMM_EFF={GEMM_EFF}")  # fmt: skip
    for gname in args.gpus:
        gpu = GPUS[gname]
        for label, model, b, g, side, d in (s for s in SHAPES if s[0] in args.shapes):
            launches = price(op, model, b, g, side * side, d, gpu, (side, side))
            head = {"design": args.design, "gpu": gname, "shape": label,
                    "B": b, "G": g, "N": side * side, "d": d}  # fmt: skip
            rows += [head | r for r in launches]
            total = sum(r["us"] for r in launches)
            token_mb = 7 * 2 * b * g * side * side * d / 1e6 + 4 * 2 * b * g * side * side * d / 1e6
            rows.append(head | {"phase": "fwd+bwd", "kernel": f"(total, {len(launches)} launches)",
                                "programs": 0,
                                "MB": sum(r["MB"] for r in launches),
                                "GFLOP": sum(r["GFLOP"] for r in launches),
                                "dot": "", "wgmma": "", "mem_us": token_mb * 1e12 / gpu.hbm,
                                "compute_us": 0.0,
                                "latency_us": 0.0, "us": total})  # fmt: skip
        for name, b in zip(MODELS, args.batch):
            steps.append({"design": args.design, "gpu": gname} | training_step(op, name, b, gpu))
    print_table([r for r in rows if r["gpu"] == args.gpus[0]], floatfmt="{:.4g}")
    print(
        "\n(total) rows: mem_us is the roofline of the token traffic alone (11 bf16 N x d tensors per head)\n"
    )
    print_table([r for r in rows if r["kernel"].startswith("(total")], floatfmt="{:.4g}")
    print()
    print_table(steps, floatfmt="{:.4g}")
    for gname in args.gpus:
        print(f"{gname}: {GPUS[gname].source}")
    write_csv(rows + [s | {"kernel": "(training step)"} for s in steps], args.out)
    print(f"wrote {args.out}")
    return 0


def calibration_main(op: ModuleType, out: Path) -> int:
    """``--calibrate``: the fit checked against the profile, then the models' shapes priced by it."""
    launches = read_launches(PROFILED_LAUNCHES, read_matrix(PROFILED_MATRIX))
    rows, fit = check_calibration(read_profile(PROFILE), launches)
    print("per-kernel fit (µs): " + ", ".join(f"{k} P {p:.2f} L {lat:.3f}" for k, (p, lat) in fit.items()))
    print_table(rows, floatfmt="{:.4g}")
    regs = read_matrix(COMPILE_MATRIX)
    models = price_models(op, fit, regs)
    print_table(models, floatfmt="{:.4g}")
    for label, *_ in MODEL_SHAPES:
        total = sum(r["us"] for r in models if r["shape"] == label)
        print(f"{label}: {total:.1f} µs per mixer call (fwd + bwd, both branches)")
    chunked = price_chunked(op, fit, regs)
    print_table(chunked, floatfmt="{:.4g}")
    tables = {"check": rows, "models": models, "chunked": chunked}
    write_csv([{"table": name} | r for name, table in tables.items() for r in table], out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
