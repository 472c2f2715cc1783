"""The host time of Triton's JIT launcher against a launch program's pre-bound compiled kernels, per launch.

A GPU host's launch program (``vit3.kernels.triton.program``) compiles each launch once per device and
alignment and then calls the compiled kernel itself; before, every launch went through ``JITFunction.run``
(binder, cache key, globals check). Both are Triton's own code here, on CPU tensors: only the compile and
the driver's launch are stubbed (a fake driver and compiled kernel), so the difference is what a GPU host
saves. One fused-node training call (forward and backward) of the official mixer at a model's per-block
shape, the program's pre-bound path against the JIT path (``program.BIND_COMPILED``), interleaved, median
(p10) µs per call and per launch. Method: benchmarks/README.md.

    python benchmarks/launcher_overhead.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

if os.environ.pop("TRITON_INTERPRET", None) == "1":  # before Triton is imported: a GPU host's kernels
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
import triton
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, GpuDriver, print_table, time_samples, write_csv
from vit3.kernels.triton import checks, device, program, tiles
from vit3.layers import fused_mix

# (name, SwiGLU heads, head dim, grid): a model's mixer per block
SHAPES = {"vit3_tiny": (6, 32, (14, 14)), "vit3_small": (6, 64, (14, 14))}


class _Compiled:
    """A compiled kernel whose launch does nothing; ``[grid]`` and ``launch_metadata`` are Triton's own."""

    function = packed_metadata = src = None
    name = "stub"
    launched = 0  # launches of every stubbed kernel, counted
    __getitem__ = CompiledKernel.__getitem__
    launch_metadata = CompiledKernel.launch_metadata

    def _init_handles(self) -> None:
        pass

    def run(self, *args: Any) -> None:
        _Compiled.launched += 1


def _compile_nothing(self: JITFunction, key: Any, *args: Any, **kwargs: Any) -> _Compiled:
    kernel = self.device_caches[0][0][key] = _Compiled()  # the JIT launcher's cache, as a compile fills it
    return kernel


def gpu_host() -> None:
    """The CPU taken for a GPU by the Triton path and Triton's launchers, compiling and launching nothing."""
    driver.set_active(GpuDriver())
    JITFunction._do_compile = _compile_nothing
    for module in (device, checks):
        module.triton_runs_on = lambda where: True
    sys.modules["vit3.kernels"].triton_runs_on = device.triton_runs_on
    tiles.fits_device = lambda *args: (True, "")


def _spec(heads: int, d: int, grid: tuple[int, int]) -> fused_mix.MixSpec:
    branches = (
        fused_mix.MixBranch("swiglu", 0, heads, d, False, "triton"),
        fused_mix.MixBranch("dwconv", 3 * heads * d, 1, d, False, "triton"),
    )
    return fused_mix.MixSpec(branches, grid, 1 / 3, 1.0, True, 10000.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=2, help="the host work does not depend on it")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "launcher_overhead_cpu.csv")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gpu_host()
    rows = []
    for model in args.models:
        heads, d, grid = SHAPES[model]
        spec = _spec(heads, d, grid)
        n = grid[0] * grid[1]
        qkv = torch.randn(args.batch, n, 3 * (heads + 1) * d, dtype=torch.bfloat16, requires_grad=True)
        weights = [torch.randn(1, heads, d, d, requires_grad=True) for _ in range(2)]
        weights.append(torch.randn(1, d, 3, 3, requires_grad=True))
        dout = torch.randn(args.batch, n, (heads + 1) * d, dtype=torch.bfloat16)

        def call(bind: bool) -> None:
            program.BIND_COMPILED = bind
            out = fused_mix.fused_mix(qkv, spec, weights)
            torch.autograd.grad(out, [qkv, *weights], dout)

        call(True)  # compiled and bound; then one call's launches, counted
        before = _Compiled.launched
        call(True)
        launches = _Compiled.launched - before
        fns = {"pre-bound": lambda: call(True), "JIT launcher": lambda: call(False)}
        samples = time_samples(fns, torch.device("cpu"), repeats=args.repeats, warmup=20, alternate=True)
        med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        p10 = {k: statistics.quantiles(v, n=10)[0] * 1e6 for k, v in samples.items()}
        diffs = sorted((j - b) * 1e6 for b, j in zip(samples["pre-bound"], samples["JIT launcher"]))
        saved = statistics.median(diffs)
        rows.append({
            "model": model, "triton": triton.__version__, "launches per call": launches,
            "JIT launcher us": med["JIT launcher"], "JIT launcher p10 us": p10["JIT launcher"],
            "pre-bound us": med["pre-bound"], "pre-bound p10 us": p10["pre-bound"],
            "saved us per call": saved, "saved us per launch": saved / launches,
        })  # fmt: skip
    print_table(rows)
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
