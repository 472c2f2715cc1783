"""Times the SwiGLU-branch TTT inner loop: fused Triton op vs compiled and eager PyTorch vs official vs SDPA.

Per (N tokens, head dim d, B*H sample-heads, dtype) and mode (forward; forward + backward) it times the paths
``fused``, ``fused_unstacked`` (the same op with ``triton.tiles.STACK`` off: the design before),
``fused_chunked`` (the same op with N split into chunks of ``CHUNK_TOKENS`` per program, their partials summed
by the last program to arrive, at every size: the chunk-parallel split, where ``fused`` splits N only for
fewer than about two programs per SM), ``compiled``,
``compiled_official``, ``torch_fast`` (CPU), ``torch_loop``, ``official``, ``sdpa`` and ``dwconv``, and prints
times, speed-ups over ``official``, GB/s, TFLOP/s, ``peak_mib`` and ``rel_err``.
``--profile`` adds a per-kernel profile of ``--profile-paths``. Method: benchmarks/README.md.

    python benchmarks/ttt_kernel.py --quick            # small CPU run (reference paths only)
    python benchmarks/ttt_kernel.py                    # GPU: all paths, N in {196 .. 12544}, d in {32, 64}
    python benchmarks/ttt_kernel.py --n 3136 196 --d 64 32 --bh 64 1024 --profile --tag cuda   # the GPU check
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    CHUNK_TOKENS,
    RESULTS,
    CsvRows,
    peak_tensor_memory,
    print_table,
    save_figure,
    sync,
    time_interleaved,
)
from benchmarks.official_baseline import official_swiglu_branch
from vit3.layers import DWConvInner, SwiGLUInner, inner_loop

SCALE = 9**-0.5
# Dense bf16 tensor-core TFLOP/s and HBM GB/s of common accelerators (vendor datasheets).
PEAKS = {"H200": (989.0, 4800.0), "H100": (989.0, 3350.0), "A100": (312.0, 2039.0), "L40S": (362.0, 864.0)}
PATHS = (
    "fused", "fused_unstacked", "fused_chunked", "compiled", "compiled_official", "torch_fast", "torch_loop",
    "official", "sdpa", "dwconv",
)  # fmt: skip
COMPILED = {"compiled": "torch_loop", "compiled_official": "official"}  # path -> the path it compiles
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def split_heads(qkv: Tensor, heads: int) -> list[Tensor]:
    """``[B, N, 3*H*d]`` -> q, k, v ``[B, H, N, d]`` as strided views (the mixer's layout)."""
    return [t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1)]


def official_eager(qkv: Tensor, w1: Tensor, w2: Tensor, heads: int) -> Tensor:
    """The official code's head split (reshape + permute), its eager inner step and read-out, head merge."""
    b, n, _ = qkv.shape
    q, k, v = qkv.reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)  # [B, H, N, d] each
    return official_swiglu_branch(q, k, v, w1, w2).transpose(1, 2).reshape(b, n, -1)


def official_mixed(qkv: Tensor, w1: Tensor, w2: Tensor, heads: int) -> Tensor:
    """``official_eager`` as the official code runs on half inputs: under autocast to their dtype.

    The inner weights stay fp32 parameters; autocast runs each matmul in the half dtype (``k @ w1`` would
    otherwise mix bf16 and fp32 operands and fail) and keeps the elementwise ops in their inputs' dtypes.
    """
    if qkv.dtype not in (torch.float16, torch.bfloat16):
        return official_eager(qkv, w1, w2, heads)
    with torch.autocast(qkv.device.type, dtype=qkv.dtype):
        return official_eager(qkv, w1, w2, heads)


def build_paths(
    heads: int, d: int, device: torch.device, compile_backend: str = "inductor"
) -> dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """Each path maps ``(qkv [B, N, 3*H*d], w1, w2 [1, H, d, d])`` to ``[B, N, H*d]``."""
    model = SwiGLUInner(heads, d).to(device)

    def merge(y: Tensor, dtype: torch.dtype) -> Tensor:
        return y.transpose(1, 2).flatten(2).to(dtype)  # [B, H, N, d] -> [B, N, H*d]

    def torch_loop(qkv, w1, w2):
        ct = torch.promote_types(qkv.dtype, torch.float32)  # the mixer runs the inner loop in fp32 at least
        q, k, v = (t.to(ct) for t in split_heads(qkv, heads))
        grid = (1, q.shape[2])
        p = inner_loop(model, {"w1": w1.to(ct), "w2": w2.to(ct)}, k, v, grid, scale=SCALE)
        return merge(model.apply_to(p, q, grid), qkv.dtype)

    def sdpa(qkv, w1, w2):
        return merge(F.scaled_dot_product_attention(*split_heads(qkv, heads)), qkv.dtype)

    conv = DWConvInner(1, d).to(device)

    def dwconv(qkv, w1, w2):
        # Head 0 of q, k, v as the branch's d channels on a 1 x N grid (the cost does not depend on the
        # shape).
        ct = torch.promote_types(qkv.dtype, torch.float32)
        q, k, v = (t[:, :1].to(ct) for t in split_heads(qkv, heads))  # [B, 1, N, d]
        grid = (1, q.shape[2])
        p = inner_loop(conv, conv.initial_params(), k, v, grid, scale=SCALE)
        return merge(conv.apply_to(p, q, grid), qkv.dtype)

    paths = {
        "dwconv": dwconv,
        "torch_loop": torch_loop,
        "official": lambda qkv, w1, w2: official_mixed(qkv, w1, w2, heads),
        "sdpa": sdpa,
    }
    if device.type == "cpu":  # its tiles are sized for CPU caches: on a GPU auto never takes it
        from vit3.kernels.swiglu.cpp import PASSES
        from vit3.kernels.swiglu.eager import swiglu_ttt

        def torch_fast(qkv, w1, w2):
            ct = torch.promote_types(qkv.dtype, torch.float32)
            q, k, v = (t.to(ct) for t in split_heads(qkv, heads))
            return merge(swiglu_ttt(q, k, v, w1.to(ct), w2.to(ct), scale=SCALE, passes=PASSES), qkv.dtype)

        paths["torch_fast"] = torch_fast
    for name, source in COMPILED.items():  # compiled on first call (per shape, then with dynamic shapes)
        paths[name] = torch.compile(paths[source], backend=compile_backend)
    from vit3.kernels import triton_runs_on

    if triton_runs_on(device):
        from vit3.kernels import triton_ttt

        def fused(qkv, w1, w2, chunk=None):
            q, k, v = split_heads(qkv, heads)
            params = {"w1": w1, "w2": w2}
            y = triton_ttt("swiglu", q, k, v, params, scale=SCALE, backend="triton", chunk=chunk)
            return y.transpose(1, 2).flatten(2)  # token-major output: a free view

        paths["fused"] = fused
        paths["fused_chunked"] = functools.partial(fused, chunk=CHUNK_TOKENS)
        from vit3.kernels.triton import tiles

        def fused_unstacked(qkv, w1, w2):  # the design before the stacked weight-gradient dots (d = 32)
            tiles.STACK = False
            try:
                return fused(qkv, w1, w2)
            finally:
                tiles.STACK = True

        paths["fused_unstacked"] = fused_unstacked
    return {name: paths[name] for name in PATHS if name in paths}


def step(fn: Callable, mode: str, qkv: Tensor, w1: Tensor, w2: Tensor, dout: Tensor) -> object:
    """One measured call: the forward under ``no_grad``, or forward + backward to qkv and the weights."""
    if mode == "fwd":
        with torch.no_grad():
            return fn(qkv, w1, w2)
    out = fn(qkv, w1, w2)
    return torch.autograd.grad(out, [qkv, w1, w2], dout[..., : out.shape[-1]], allow_unused=True)


def work(path: str, mode: str, n: int, d: int, bh: int, heads: int, esize: int) -> tuple[float, float]:
    """(bytes, FLOPs) the computation needs (the note's model), summed over ``bh`` sample-heads."""
    elems = 4 * n * d if mode == "fwd" else 11 * n * d
    if path == "dwconv":  # one head per sample; 3x3 taps per output element
        bh //= heads
        return float(elems * esize * bh), float((36 if mode == "fwd" else 108) * n * d * bh)
    if path == "sdpa":
        flops = 4 * n * n * d if mode == "fwd" else 14 * n * n * d
    else:
        flops = 12 * n * d * d if mode == "fwd" else 44 * n * d * d
    return float(elems * esize * bh), float(flops * bh)


def detect_peaks(
    device: torch.device, tflops: float | None, gbs: float | None
) -> tuple[str, float | None, float | None]:
    """Device name and its (TFLOP/s, GB/s) peaks: flags win, else the table for known GPUs, else unknown."""
    if device.type != "cuda":
        return "cpu", tflops, gbs
    name = torch.cuda.get_device_name(device)
    known = next((v for k, v in PEAKS.items() if k in name), (None, None))
    return name, tflops if tflops is not None else known[0], gbs if gbs is not None else known[1]


def first_call(path: str, call: Callable[[], object], device: torch.device) -> tuple[object, str]:
    """Runs ``call`` once (a compiled path compiles here): its result and ``""``, or ``None`` and the
    error."""
    try:
        result = call()
        sync(device)
    except Exception as exc:  # a compile error, out of memory: reported, the other paths still timed
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return (
            None,
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}",
        )
    return result, ""


def rel_errors(results: dict[str, object], reference: str = "torch_loop") -> dict[str, float]:
    """Each path's error against ``reference`` on the same input, from the paths' first-call ``results`` (an
    output, or the gradients to qkv and the inner weights), as ``max |got - want| / max |want|`` over those
    tensors; paths that compute something else (``sdpa``, ``dwconv``) are left out. Why: a timing of a kernel
    that computes the wrong thing is no figure, and the first run on a new device is where that shows."""
    if reference not in results:
        return {}

    def tensors(result: object) -> tuple[Tensor | None, ...]:
        return (result,) if isinstance(result, Tensor) else tuple(result)

    want = tensors(results[reference])
    out = {}
    for path, result in results.items():
        if path in ("sdpa", "dwconv"):
            continue
        errs = [
            ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
            for g, w in zip(tensors(result), want)
            if g is not None and w is not None
        ]
        out[path] = max(errs, default=math.nan)
    return out


def kernel_profile(call: Callable[[], object], device: torch.device, steps: int = 3) -> list[tuple]:
    """``(name, launches per call, µs per call)`` of every GPU kernel one call of ``call`` runs (on a CPU:
    every op's self CPU time), by the PyTorch profiler over ``steps`` calls after the warm ones."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            call()
        sync(device)
    out = []
    for e in prof.key_averages():
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None) if cuda else e.self_cpu_time_total
        if us is None:  # PyTorch < 2.4
            us = e.self_cuda_time_total
        if us > 0:
            out.append((e.key, e.count / steps, us / steps))
    return sorted(out, key=lambda r: -r[2])


def run(args: argparse.Namespace, csv: CsvRows, profile_csv: CsvRows | None = None) -> list[dict]:
    """Times every path on every (d, N, B*H, mode), in that order; returns one row per measurement (each
    configuration's rows also go to ``csv`` as it finishes, its kernel profile to ``profile_csv``)."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    dev_name, peak_tflops, peak_gbs = detect_peaks(device, args.peak_tflops, args.peak_gbs)
    heads = args.heads
    for bh in args.bh:
        if bh % heads:
            raise ValueError(f"--bh {bh} must be a multiple of --heads {heads}")
    print(f"device: {dev_name}  dtype: {args.dtype}  B*H: {args.bh} ({heads} heads)  peaks: "
          f"{peak_tflops or '?'} TFLOP/s, {peak_gbs or '?'} GB/s")  # fmt: skip
    rows = []
    for d in args.d:
        paths = {
            k: fn
            for k, fn in build_paths(heads, d, device, args.compile_backend).items()
            if k not in args.skip
        }
        for n in args.n:
            for bh in args.bh:
                batch = bh // heads
                qkv = torch.randn(batch, n, 3 * heads * d, device=device, dtype=dtype, requires_grad=True)
                w1, w2 = (
                    (0.02 * torch.randn(1, heads, d, d, device=device)).requires_grad_(True) for _ in range(2)
                )
                dout = torch.randn(batch, n, heads * d, device=device, dtype=dtype)
                for mode in ("fwd", "fwd+bwd"):
                    calls = {
                        path: functools.partial(step, fn, mode, qkv, w1, w2, dout)
                        for path, fn in paths.items()
                    }
                    results = {}
                    for path in list(calls):
                        results[path], error = first_call(path, calls[path], device)
                        if error:
                            print(f"  d={d} N={n} BH={bh} {mode}: {path} left out ({error})", file=sys.stderr)
                            del calls[path], results[path]
                    errors = rel_errors(results)
                    del (
                        results
                    )  # before the timing and the peak memory: nothing of the first calls stays live
                    seconds = time_interleaved(calls, device, repeats=args.repeats, warmup=1)
                    peaks = {path: peak_tensor_memory(call, device) for path, call in calls.items()}
                    group = []
                    for path, sec in seconds.items():
                        nbytes, flops = work(path, mode, n, d, bh, heads, esize)
                        row = {"device": dev_name, "dtype": args.dtype, "mode": mode, "path": path, "N": n,
                               "d": d, "BH": bh, "ms": 1e3 * sec, "GB/s": nbytes / sec / 1e9,
                               "TFLOP/s": flops / sec / 1e12, "peak_mib": peaks[path],
                               "rel_err": errors.get(path, math.nan)}  # fmt: skip
                        row["%HBM"] = 100 * row["GB/s"] / peak_gbs if peak_gbs else math.nan
                        row["%peak_FLOP"] = 100 * row["TFLOP/s"] / peak_tflops if peak_tflops else math.nan
                        group.append(row)
                    base = seconds.get("official")
                    for row in group:  # dwconv is other work
                        ok = base and row["path"] != "dwconv"
                        row["x_official"] = 1e3 * base / row["ms"] if ok else math.nan
                    rows += group
                    csv.add(*group)
                    print(f"  d={d} N={n} BH={bh} {mode}: "
                          + ", ".join(f"{k} {1e3 * t:.3f} ms" for k, t in seconds.items()),
                          file=sys.stderr, flush=True)  # fmt: skip
                    if profile_csv is not None and mode == "fwd+bwd":
                        for path in (p for p in args.profile_paths if p in calls):
                            for name, count, us in kernel_profile(calls[path], device):
                                profile_csv.add({"device": dev_name, "dtype": args.dtype, "mode": mode,
                                                 "path": path, "N": n, "d": d, "BH": bh, "kernel": name,
                                                 "calls": count, "us": us,
                                                 "share": us / (1e6 * seconds[path])})  # fmt: skip
                del qkv, w1, w2, dout, calls
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Time against N (log-log), one panel per (mode, d), one line per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = sorted({r["d"] for r in rows})
    bhs = sorted({r["BH"] for r in rows})
    modes = ("fwd", "fwd+bwd")
    fig, axes = plt.subplots(len(modes), len(ds), figsize=(5 * len(ds), 4 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, d in enumerate(ds):
            ax = axes[i][j]
            for name in PATHS:
                for bh in bhs:
                    pts = sorted(
                        (r["N"], r["ms"])
                        for r in rows
                        if (r["mode"], r["d"], r["path"], r["BH"]) == (mode, d, name, bh)
                    )
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=name if len(bhs) == 1 else f"{name} B·H={bh}")
            ax.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="ms", title=f"{mode}, d={d}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    r0 = rows[0]
    fig.suptitle(f"TTT SwiGLU inner loop: {r0['device']}, {r0['dtype']}, B·H={'/'.join(map(str, bhs))}")
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--n", type=int, nargs="+", default=[196, 784, 3136, 12544], help="token counts")
    p.add_argument("--d", type=int, nargs="+", default=[32, 64], help="head dims")
    p.add_argument(
        "--bh", type=int, nargs="+", default=None, help="batch x heads sizes (default 64 on CUDA, 4 on CPU)"
    )
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--skip", nargs="*", default=[], choices=PATHS, help="paths not to time")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per path (default 20 CUDA, 3 CPU)")
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of the compiled paths"
    )
    p.add_argument("--profile", action="store_true", help="per-kernel profile of each fwd+bwd configuration")
    p.add_argument(
        "--profile-paths",
        nargs="+",
        default=["fused", "fused_unstacked", "fused_chunked", "compiled", "official"],
        choices=PATHS,
        help="profiled",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak (dense bf16) TFLOP/s")
    p.add_argument("--peak-gbs", type=float, default=None, help="device peak memory bandwidth GB/s")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier on shared machines)")
    p.add_argument(
        "--quick", action="store_true", help="small CPU-sized run: N in {196, 784}, d = 32, B*H = 4"
    )
    p.add_argument("--tag", default=None, help="output name tag (default: cpu, or the GPU's name)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    on_cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bf16" if on_cuda else "fp32")
    args.bh = args.bh or [64 if on_cuda else 4]
    args.repeats = args.repeats or (20 if on_cuda else 3)
    if args.quick:
        args.n, args.d, args.bh, args.heads = [196, 784], [32], [4], 2
    args.heads = min(args.heads, *args.bh)
    # Every (d, N, B*H, mode) is a shape: room for a compiled path's graphs and their recompiles.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    tag = args.tag or (
        "cpu"
        if not on_cuda
        else re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(args.device)).lower()
    )
    tag = tag.strip("_") + ("_quick" if args.quick else "")
    csv_path, png_path = args.out_dir / f"ttt_kernel_{tag}.csv", args.out_dir / f"ttt_kernel_{tag}.png"
    profile_csv = CsvRows(args.out_dir / f"ttt_kernel_profile_{tag}.csv") if args.profile else None
    rows = run(args, CsvRows(csv_path), profile_csv)
    print_table(rows)
    plot(rows, png_path)
    print(f"wrote {csv_path} and {png_path}" + (f" and {profile_csv.path}" if profile_csv else ""))


if __name__ == "__main__":
    main()
