"""Ahead-of-time compiles of the fused TTT kernels for NVIDIA GPUs that are not there.

``compile_case`` compiles every kernel launch ``triton_ttt`` makes for one case (inner model, loss, head dim,
dtype mode, GPU arch) and reports each binary's shared memory, registers and spills. The launches are the
launcher's own (``triton.plan.forward_plan`` / ``backward_plan`` on meta tensors), bound through Triton's JIT
binder, so each binary has a real launch's specialisation. Needs a Triton with the NVIDIA backend (ptxas ships
with it) and no ``TRITON_INTERPRET=1`` in the process.

Where the figures come from (Triton's metadata, ``ptxas -v``): ``docs/design/kernels.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import multiprocessing
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .triton import fuse, plan, program, tiles
from .triton.device import ARCHS, Arch
from .triton.plan import Launch

__all__ = [
    "ARCHS",
    "MIXERS",
    "MODELS",
    "MODES",
    "Case",
    "Compiled",
    "compile_case",
    "compile_cases",
    "compile_launch",
    "fits",
    "kernel_name",
    "loop_spills",
    "matrix",
    "plan_case",
    "plan_launches",
    "smem_bound",
    "specialise",
    "spill_bound",
    "strict_spills",
]

# Dtype modes: q/k/v dtype and tl.dot input precision (fp32 runs TF32 or IEEE dots as PyTorch allows).
MODES: dict[str, tuple[torch.dtype, str]] = {
    "bf16": (torch.bfloat16, "tf32"),
    "fp16": (torch.float16, "tf32"),
    "fp32-tf32": (torch.float32, "tf32"),
    "fp32-ieee": (torch.float32, "ieee"),
    "fp64": (torch.float64, "ieee"),
}


MODELS = (
    ("swiglu", "dot"), ("linear", "dot"), ("linear", "mse"), ("dwconv", "dot"), ("vit3", "dot"),
    ("h_vit3", "dot"),
)  # fmt: skip
# The mixers whose branches' launches a launch program fuses stage by stage (``triton.program.stages``):
# compiled as those fused launches, each branch as ``(model, loss, rope)``. ViT³'s: SwiGLU and the 3x3
# depthwise conv; H-ViT³'s: the same with RoPE on SwiGLU's q, k (rotated by its kernels).
MIXERS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "vit3": (("swiglu", "dot", False), ("dwconv", "dot", False)),
    "h_vit3": (("swiglu", "dot", True), ("dwconv", "dot", False)),
}
HEAD_DIMS = (16, 32, 64, 128)


@dataclass(frozen=True)
class Case:
    """One compile case: what ``triton_ttt`` would launch for these inputs on ``arch``.

    The token count and heads only size the grid and the split of N; ``n_tok`` = 3136 (56 x 56, a
    multiple of 16 as most training grids are) with B = 2 and G = 4 heads of a ``[B, N, 3*G*d]`` qkv
    projection is a representative training launch.
    """

    model: str  # "swiglu", "linear", "dwconv", or a mixer of ``MIXERS``
    loss: str  # "dot", or "mse" (linear)
    d: int
    mode: str  # a key of MODES
    arch: Arch
    n_tok: int = 3136
    batch: int = 2
    heads: int = 4
    rope: bool = False  # the kernels rotate q, k by RoPE (a mixer's branch)

    @property
    def label(self) -> str:
        model = self.model if self.model != "linear" else f"linear-{self.loss}"
        return f"{self.arch.sm}/{model}/d{self.d}/{self.mode}"


@dataclass(frozen=True)
class Compiled:
    """What one compiled launch needs on chip."""

    kernel: str  # launch label, e.g. "grad_bwd_kernel[cols]"
    smem: int  # bytes of shared memory per block
    regs: int  # registers per thread
    spill_stores: int  # bytes per thread
    spill_loads: int
    stack: int  # stack frame bytes per thread
    loop_spills: int  # spill instructions (SASS ``STL`` / ``LDL``) inside a loop: run once per token tile
    wgmma: int  # sm_90's warp-group MMAs (``wgmma.mma_async``) in the PTX
    tcgen05: int  # sm_100's tensor-memory MMAs (``tcgen05.mma``) in the PTX
    mma: int  # warp-level MMAs (``mma.sync``) in the PTX
    num_warps: int
    num_stages: int
    block_n: int
    block_c: int


def plan_launches(case: Case, batch: int | None = None) -> tuple[list[Launch], list[Launch]]:
    """The forward's and the backward's launches of ``case`` at ``batch`` samples (default ``case.batch``),
    planned on meta tensors by ``triton.plan.forward_plan`` / ``backward_plan``."""
    dtype, prec = MODES[case.mode]
    b, g, n, d = batch or case.batch, case.heads, case.n_tok, case.d
    side = int(n**0.5)
    grid = (side, n // side) if side * (n // side) == n else (1, n)
    qkv = torch.empty(b, n, 3 * g * d, dtype=dtype, device="meta")
    q, k, v = (t.unflatten(-1, (g, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # [B, G, N, d] views
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # the parameters' dtype
    shape = (1, g * d, 3, 3) if case.model == "dwconv" else (1, g, d, d)
    w1 = torch.empty(shape, dtype=acc, device="meta")
    w2 = torch.empty(shape, dtype=acc, device="meta") if case.model == "swiglu" else None
    common = (case.model, case.loss, *grid, 9**-0.5, 1.0, True, 0)
    tables = plan.rope_table_like(q) if case.rope else None
    outs, fwd = plan.forward_plan(
        q, k, v, w1, w2, *common, arch=case.arch, prec=prec, interpret=False, rope=tables
    )
    # The upstream gradient of the token-major read-out: [B, N, G*d] contiguous, seen as [B, G, N, d].
    dout = torch.empty(b, n, g, d, dtype=dtype, device="meta").transpose(1, 2)
    _, bwd = plan.backward_plan(dout, q, k, v, w1, w2, *outs[1:], *common, arch=case.arch, prec=prec,
                                interpret=False, rope=tables)  # fmt: skip
    return fwd, bwd


def plan_case(case: Case) -> list[Launch]:
    """Every distinct launch (by label) ``triton_ttt`` makes for ``case``, planned by its own set-up: at
    ``case.batch`` samples (N split over programs) and at enough samples for two programs per SM (N whole:
    the one-launch forward and the fused backward stages). A mixer's: its branches' launches in a launch
    program's stages."""
    whole = -(-2 * case.arch.sms // case.heads)
    launches: dict[str, Launch] = {}
    for batch in (case.batch, whole):
        if case.model in MIXERS:
            plans = [
                plan_launches(replace(case, model=m, loss=loss, rope=rope), batch)
                for m, loss, rope in MIXERS[case.model]
            ]
            found = [launch for _, launch in program.mixer_stages(plans)]
        else:
            found = [launch for side in plan_launches(case, batch) for launch in side]
        for launch in found:
            launches.setdefault(launch.label, launch)
    return list(launches.values())


def _ptxas_usage(log: str) -> tuple[int, int, int, int]:
    """(registers, spill store bytes, spill load bytes, stack frame bytes) from a ``ptxas -v`` log."""

    def num(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    if "Used" not in log:
        raise RuntimeError(f"no register count in the ptxas log:\n{log}")
    return (
        num(r"Used (\d+) registers"),
        num(r"(\d+) bytes spill stores"),
        num(r"(\d+) bytes spill loads"),
        num(r"(\d+) bytes stack frame"),
    )


_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*)")


def loop_spills(sass: str) -> int:
    """Spill instructions (``STL`` / ``LDL``) inside a loop of a disassembled kernel (``nvdisasm -c``):
    between a label and a later branch back to it. Spills outside every loop (a register parked across the
    token loop) run once per program; inside, once per iteration."""
    labels: dict[str, int] = {}
    insns: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in sass.splitlines():
        if m := _SASS_LABEL.match(line.strip()):
            pending.append(m.group(1))
        elif m := _SASS_INSN.search(line):
            addr = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, addr))
            pending = []
            insns.append((addr, m.group(2)))
    loops = []
    for addr, text in insns:
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), addr + 1) <= addr:
            loops.append((labels[target.group(1)], addr))
    spills = [addr for addr, text in insns if re.search(r"\b(STL|LDL)\b", text)]
    return sum(any(lo <= a <= hi for lo, hi in loops) for a in spills)


def _disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` of a cubin (the disassembler that ships with Triton)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cubin"
        src.write_bytes(cubin)
        cmd = [knobs.nvidia.nvdisasm.path, "-c", str(src)]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _rerun_ptxas(ptx: str, capability: int) -> str:
    """``ptxas -v`` on ``ptx`` with the flags Triton's own run uses; returns the log."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(capability)}", str(src),
               "-o", str(Path(tmp) / "k.o")]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def specialise(launch: Launch, arch: Arch) -> tuple[Any, dict, dict, dict]:
    """``(options, signature, constexprs, attrs)`` of ``launch`` on ``arch``, by ``JITFunction.run``'s own
    steps: its binder specialises each argument (``native_specialize_impl``: int width, ints equal to 1 as
    constants, divisibility by 16 of ints and of tensors' data pointers), then ``_pack_args`` packs them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1): compile in a fresh process")
    backend = make_backend(GPUTarget("cuda", arch.capability, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs, debug=False, instrumentation_mode="")
    bound, specialization, options = binder(*launch.args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, options)


_MEASURED: dict[Any, tuple[int, ...]] = {}  # one process's compiles (the matrix repeats many)


def compile_launch(launch: Launch, arch: Arch) -> Compiled:
    """Compiles one planned launch for ``arch`` as Triton's JIT would at that launch; measures it."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, target = launch.kernel, GPUTarget("cuda", arch.capability, 32)
    options, signature, constexprs, attrs = specialise(launch, arch)
    key = (kernel.cache_key, str(signature), str(constexprs), str(attrs), options.hash(), arch.capability)
    if key not in _MEASURED:
        log = io.StringIO()
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # printed only when ptxas runs (not for a cached binary)
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)  # fmt: skip
        text = log.getvalue()
        if "Used" not in text:
            text = _rerun_ptxas(compiled.asm["ptx"], arch.capability)
        ptx = compiled.asm["ptx"]
        mmas = (ptx.count("wgmma.mma_async"), ptx.count("tcgen05.mma"), ptx.count("mma.sync"))
        usage = _ptxas_usage(text)
        in_loops = loop_spills(_disassemble(compiled.asm["cubin"])) if usage[1] or usage[2] else 0
        _MEASURED[key] = (int(compiled.metadata.shared), *usage, in_loops, *mmas)
    kw = launch.kwargs
    # a fused launch: its first part's
    tile = {k: kw.get(k, kw.get(fuse.param_name(0, k), 0)) for k in ("BLOCK_N", "BLOCK_C")}
    return Compiled(
        launch.label, *_MEASURED[key], kw["num_warps"], kw["num_stages"], tile["BLOCK_N"], tile["BLOCK_C"],
    )  # fmt: skip


def compile_case(case: Case) -> list[Compiled]:
    """Every launch of ``case`` compiled and measured (``Compiled`` per launch, in launch order)."""
    return [compile_launch(launch, case.arch) for launch in plan_case(case)]


def _compile_or_error(case: Case) -> tuple[Case, list[Compiled] | str]:
    try:
        return case, compile_case(case)
    except Exception as e:  # a compile error is a result of the matrix, reported with its case
        return case, f"{type(e).__name__}: {e}"


def compile_cases(cases: list[Case], jobs: int = 1) -> list[tuple[Case, list[Compiled] | str]]:
    """``compile_case`` of every case (a message instead of the list where the compile fails), in order.

    ``jobs > 1`` spreads the cases over that many worker processes (started fresh, without the parent's
    modules: run the whole call without ``TRITON_INTERPRET=1`` in the environment).
    """
    if jobs <= 1:
        return [_compile_or_error(case) for case in cases]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(pool.map(_compile_or_error, cases, chunksize=4))


# The kernels that reduce over the batch, not over the tokens (their own spill bound: ``spill_bound``).
SMALL_KERNELS = ("wgrad_reduce_kernel",)


def kernel_name(label: str) -> str:
    """The kernel of a launch label, the first of a fused launch's (``"grad_bwd_kernel[cols,fused]"``,
    ``"grad_bwd_kernel[fused]+conv_grad_bwd_kernel"`` -> ``"grad_bwd_kernel"``)."""
    return label.partition("+")[0].partition("[")[0]


def spill_bound(case: Case, kernel: str) -> int:
    """Spill bytes per thread (ptxas "spill stores") the compile tests allow launch ``kernel`` of ``case``.

    2048 for fp64 (a checking mode: FMA dots on twice the registers; the SwiGLU backward at d = 128 spills
    there); 64 bytes for every other kernel: the registers ptxas's allocator now and then parks across a loop
    (one store and one load per program), and for the weight-gradient reduction. The token kernels of
    16-bit inputs at d <= 64 (the training configurations) may not spill inside a loop (``strict_spills``).
    The spills measured: ``docs/design/kernels.md`` (tile sizes).
    """
    return 2048 if case.mode == "fp64" and kernel_name(kernel) not in SMALL_KERNELS else 64


def strict_spills(case: Case, kernel: str) -> bool:
    """Whether launch ``kernel`` of ``case`` must keep every spill out of its loops (``loop_spills == 0``):
    the token kernels of 16-bit inputs at d <= 64."""
    return kernel_name(kernel) not in SMALL_KERNELS and case.d <= 64 and case.mode in ("bf16", "fp16")


def _branch_models(case: Case) -> list[str]:
    """The inner models whose kernels ``case`` compiles: its own, or its mixer's branches'."""
    return [m for m, _, _ in MIXERS[case.model]] if case.model in MIXERS else [case.model]


def smem_bound(case: Case) -> int:
    """Shared memory (bytes) each kernel of ``case`` is held to: ``triton.tiles.smem_need``, what
    ``fits_device`` compares with the GPU's limit."""
    dtype, prec = MODES[case.mode]
    return max(tiles.smem_need(m, case.d, dtype, prec, case.arch) for m in _branch_models(case))


def fits(case: Case) -> tuple[bool, str]:
    """``fits_device``'s answer for ``case`` on its arch (no GPU needed)."""
    dtype, prec = MODES[case.mode]
    block_d = max(16, 1 << (case.d - 1).bit_length())
    for model in _branch_models(case):
        ok, why = tiles.fits_arch(model, block_d, dtype, prec, case.arch)
        if not ok:
            return ok, why
    return True, ""


def matrix(kind: str = "full") -> list[Case]:
    """The compile cases: ``"full"``, every arch x inner model x head dim x dtype mode; ``"default"``, the
    worst cases of each arch in the full matrix (most shared memory, most spill-prone), the CI subset.
    """
    if kind == "full":
        cases = []
        for arch in ARCHS.values():
            for model, loss in MODELS:
                for d in HEAD_DIMS:
                    cases += [Case(model, loss, d, mode, arch) for mode in MODES]
        return cases
    if kind != "default":
        raise ValueError(f"the compile matrix is 'full' or 'default', got {kind!r}")
    cases = []
    for arch in ARCHS.values():
        # Every arch: the SwiGLU d = 64 kernels (ViT³-S/B) in bf16, the zero-spill case, fused or split as the
        # arch's shared memory allows; fp32 with TF32 dots, the most shared memory on most parts; IEEE dots,
        # the case that spilled most before (docs/design/kernels.md, tile sizes).
        cases += [Case("swiglu", "dot", 64, mode, arch) for mode in ("bf16", "fp32-tf32", "fp32-ieee")]
    sm = ARCHS
    cases += [
        Case("dwconv", "dot", 128, "bf16", sm["sm_75"]),  # the most spilled bytes of a token kernel
        Case("swiglu", "dot", 128, "fp32-ieee", sm["sm_75"]),
        Case("swiglu", "dot", 128, "fp64", sm["sm_75"]),  # does not fit: fits_device says so
        Case("swiglu", "dot", 128, "fp64", sm["sm_80"]),  # the fp64 shared-memory bound
        Case("swiglu", "dot", 128, "fp32-tf32", sm["sm_86"]),  # near sm_86's shared memory
        Case("dwconv", "dot", 64, "fp32-ieee", sm["sm_86"]),
        Case("linear", "mse", 64, "fp16", sm["sm_89"]),
        Case("linear", "mse", 128, "fp32-ieee", sm["sm_90"]),
        Case("linear", "dot", 64, "bf16", sm["sm_100"]),
        Case("swiglu", "dot", 32, "bf16", sm["sm_90"]),  # H-ViT³'s head dim on an H100: wgmma where 64 rows
        Case("vit3", "dot", 32, "bf16", sm["sm_90"]),  # ViT³-T's mixer on an H100: its fused launches
        Case("h_vit3", "dot", 32, "bf16", sm["sm_90"]),  # H-ViT³-T's: RoPE in the SwiGLU kernels
        Case("linear", "dot", 64, "fp16", sm["sm_90"]),
        Case("swiglu", "dot", 32, "bf16", sm["sm_120"]),  # H-ViT³'s head dim
        Case("h_vit3", "dot", 32, "bf16", sm["sm_120"]),  # RoPE on halved token tiles (spills on whole ones)
        Case("h_vit3", "dot", 32, "fp16", sm["sm_100"]),
        Case("swiglu", "dot", 32, "fp32-tf32", sm["sm_120"]),
        Case("swiglu", "dot", 128, "fp64", sm["sm_120"]),  # near its shared memory, the most fp64 spills
        Case("linear", "dot", 16, "fp16", sm["sm_120"]),
    ]
    return cases
