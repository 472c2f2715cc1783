"""Shared benchmark plumbing: interleaved timing, peak memory, machine peaks, CSV and PNG output."""

from __future__ import annotations

import argparse
import csv
import ctypes
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK_TOKENS = 256  # tokens a program of the chunked split: ttt_kernel's fused_chunked, roofline's prices


def sync(device: torch.device) -> None:
    """Waits for queued device work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_samples(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int = 5,
    warmup: int = 1,
    alternate: bool = False,
) -> dict[str, list[float]]:
    """Seconds of every call of each function, timed in turn (A B C A B C ...) so drift hits all alike; with
    ``alternate`` every other round runs in reverse (A B C C B A ...), so no function always runs first, in
    the caches and pages the others left (for calls of a few hundred µs that position alone is tens of µs)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(repeats):
        for name, fn in reversed(items) if alternate and r % 2 else items:
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    return samples


def time_interleaved(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call of each function, timed in turn (``time_samples``)."""
    return {name: statistics.median(ts) for name, ts in time_samples(fns, device, repeats, warmup).items()}


def paired_ratio(base: list[float], other: list[float]) -> float:
    """Median over rounds of ``base[i] / other[i]``: a speed-up measured side by side within each round.

    On a shared VM a whole stretch of rounds can run 1.3-1.5x slower, for one path more than another; the
    ratio of two medians can then pair a slow stretch of one path with a fast one of the other.
    """
    return statistics.median(b / o for b, o in zip(base, other))


def paired_diff(first: list[float], second: list[float]) -> float:
    """Median over rounds of ``first[i] - second[i]``: a difference measured side by side within each
    round."""
    return statistics.median(f - s for f, s in zip(first, second))


def _rss_hwm_bytes() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024


def _rss_bytes() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


def peak_tensor_memory(fn, device: torch.device) -> float:
    """Peak extra tensor memory (MiB) of one call of ``fn``: what its tensors hold at most beyond the live
    ones.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the running sum of the allocations and frees the PyTorch
    profiler records (``profile_memory``), sampled at the boundaries of top-level ops: tensor storage only,
    deterministic, unlike the resident set of a small call (see ``peak_memory``), which allocator caching
    swamps.
    """
    if device.type == "cuda":
        return peak_memory(fn, device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    top = sorted((e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in top:
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak / 2**20


def peak_memory(fn, device: torch.device) -> float:
    """Peak extra memory (MiB) of one call of ``fn``: CUDA ``max_memory_allocated``, CPU peak RSS growth."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed blocks back so the baseline is what is live
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS high-water mark
    base = _rss_bytes()
    fn()
    return (_rss_hwm_bytes() - base) / 2**20


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 2048) -> float:
    """Measured dense matmul throughput (FLOP/s) of this device: the roofline's compute roof."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    t = time_interleaved({"mm": lambda: a @ b}, device, repeats=5)["mm"]
    return 2 * size**3 / t


def memory_bandwidth(device: torch.device, numel: int = 1 << 25) -> float:
    """Measured copy bandwidth (bytes/s, read + write) of this device: the roofline's memory roof."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    t = time_interleaved({"copy": lambda: dst.copy_(src)}, device, repeats=5)["copy"]
    return 2 * numel * src.element_size() / t


def write_csv(rows: Sequence[dict], path: Path) -> None:
    """Writes dict rows (every key as a column, in first-seen order; blank where a row lacks one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)


def run_script(
    p: argparse.ArgumentParser, argv: list[str] | None, run: Callable, name: str, floatfmt: str = "{:.3g}"
) -> int:
    """A table script's ``main``: ``--out`` added to ``p`` (its runtime flags from ``add_runtime_args``), the
    arguments parsed and applied, ``run(args)``'s rows printed and written (``report``)."""
    p.add_argument("--out", type=Path, default=None, help=f"CSV (default: results/{name}_<device>.csv)")
    args = p.parse_args(argv)
    apply_runtime(args)
    report(run(args), args.out, name, args.device, floatfmt=floatfmt)
    return 0


def report(rows: Sequence[dict], out: Path | None, name: str, device: str, floatfmt: str = "{:.3g}") -> Path:
    """Prints ``rows`` as a table and writes them to ``out`` (default ``results/<name>_<device>.csv``)."""
    print_table(rows, floatfmt=floatfmt)
    out = out or RESULTS / f"{name}_{torch.device(device).type}.csv"
    write_csv(rows, out)
    print(f"wrote {out}")
    return out


class CsvRows:
    """Rows written to ``path`` as they come (the file rewritten each time, so a later row may add columns): a
    run cut short, e.g. by a time limit, keeps every row it measured."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows = path, []

    def add(self, *rows: dict) -> None:
        self.rows += rows
        write_csv(self.rows, self.path)


def print_table(rows: Sequence[dict], floatfmt: str = "{:.3g}") -> None:
    """Prints dict rows as an aligned text table (every key as a column; blank where a row lacks one)."""
    if not rows:
        return
    keys = list(dict.fromkeys(k for row in rows for k in row))
    cells = [
        [floatfmt.format(v) if isinstance(v := r.get(k, ""), float) else str(v) for k in keys] for r in rows
    ]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def plot_loglog(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
) -> None:
    """One log-log line per series ``name -> (xs, ys)``, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, (xs, ys) in series.items():
        ax.loglog(xs, ys, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """Lays out ``fig``, writes it to ``path`` (its folder made) and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """The options every benchmark shares: the device and the CPU allocator setting."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="intra-op CPU threads (default: torch's)")
    p.add_argument(
        "--no-tune-malloc",
        dest="tune_malloc",
        action="store_false",
        help="keep glibc's default allocator thresholds (see vit3/engine/cpu.py)",
    )


def apply_runtime(args: argparse.Namespace) -> None:
    """Applies the shared options: on CPU, one process-wide allocator setting for every path compared."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.tune_malloc and args.device == "cpu":
        from vit3.engine.cpu import tune_malloc

        tune_malloc()


class GpuDriver:
    """The driver calls Triton's launchers and the launch programs make, answered without a GPU (an sm_90
    device 0, stream 0): ``triton.runtime.driver.set_active(GpuDriver())`` where a CPU plays a GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class FloorNode(torch.autograd.Function):
    """The least a Python autograd node with the fused node's inputs and output costs: it saves qkv and the
    weights and returns fresh gradients of their shapes, and does nothing else."""

    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, width: int, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(qkv, *weights)
        return qkv.new_empty(*qkv.shape[:-1], width)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qkv, *weights = ctx.saved_tensors
        return (d_out.new_empty(qkv.shape), None, *(w.new_empty(w.shape) for w in weights))
