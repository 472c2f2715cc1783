"""One training step of a model, profiled: where its device time goes, how many kernels, its peak memory.

Per (model, resolution, batch) and variant (``eager``; ``graphs``: CUDA graphs through ``torch.compile``), a
bf16-autocast training step timed beside its group, profiled once: kernel count, device time by category and
peak memory. Method: benchmarks/README.md.

    python benchmarks/step_profile.py --device cuda --models vit3_tiny:deit_tiny_patch16_224 \
        --res 224 --batch 128
    python benchmarks/step_profile.py --device cpu --res 32 --batch 2 --variants eager     # dry run
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import timm
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vit3  # noqa: F401  (registers the models)
from benchmarks.common import (
    RESULTS,
    CsvRows,
    add_runtime_args,
    apply_runtime,
    paired_ratio,
    sync,
    time_samples,
)

# Kernel categories, first match wins (names as the CUDA profiler records them; CPU ops in the dry run).
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("flash", r"flash|fmha|attention"),
    ("vit3_triton", r"fused__|forward_kernel|grad_partial|grad_bwd|readout|wgrad_reduce|conv_"),
    ("inductor", r"^triton_"),
    ("cublas", r"gemm|cutlass|cublas|xmma|sm\d+_|addmm|\bmm\b|bmm|matmul|linear"),
    ("cudnn", r"cudnn|conv|implicit_"),
    ("copies_casts", r"copy|cast|to_copy|Memcpy|Memset|convert|clone|contiguous"),
)
VARIANTS = ("eager", "graphs")


def category(name: str) -> str:
    """The category of a kernel (or CPU op) ``name``."""
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def make_step(name: str, res: int, batch: int, device: torch.device, variant: str) -> Callable[[], None]:
    """A training step of ``name`` (forward + backward, bf16 autocast on CUDA) on a fixed batch."""
    model = timm.create_model(name, img_size=res, num_classes=1000).to(device).train()
    net: Callable[[torch.Tensor], torch.Tensor] = model
    if variant == "graphs":
        net = torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else "default")
    x = torch.randn(batch, 3, res, res, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with amp:
            loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def profile_step(step: Callable[[], None], device: torch.device) -> dict[str, float]:
    """Kernel count and device milliseconds by category of one settled ``step``."""
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
        sync(device)
    row: dict[str, float] = {"kernels": 0}
    for event in prof.events():
        if device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device.type == "cpu" and event.cpu_parent is not None:
            continue  # top-level CPU ops only: their children's time is inside theirs
        ms = (event.device_time if device.type == "cuda" else event.cpu_time) / 1e3
        key = f"{category(event.name)}_ms"
        row[key] = round(row.get(key, 0.0) + ms, 3)
        row["kernels"] += 1
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_runtime_args(p)
    p.add_argument(
        "--models", nargs="+", default=["vit3_tiny:deit_tiny_patch16_224"], help="groups a:b (b: base)"
    )
    p.add_argument("--res", type=int, nargs="+", default=[224])
    p.add_argument("--batch", type=int, nargs="+", default=[128], help="one per resolution, or one for all")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="CSV (default: results/step_profile_<device>.csv)")
    args = p.parse_args()
    apply_runtime(args)
    device = torch.device(args.device)
    batches = args.batch * len(args.res) if len(args.batch) == 1 else args.batch
    rows = CsvRows(args.out or RESULTS / f"step_profile_{device.type}.csv")
    for group in args.models:
        names = group.split(":")
        for res, batch in zip(args.res, batches):
            for variant in args.variants:
                steps, peaks = {}, {}
                for name in names:
                    try:
                        steps[name] = make_step(name, res, batch, device, variant)
                        if device.type == "cuda":
                            torch.cuda.reset_peak_memory_stats(device)
                        for _ in range(3):  # compile, record the graphs, settle
                            steps[name]()
                        sync(device)
                        peaks[name] = (
                            torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
                        )
                    except Exception as exc:
                        print(f"{name} {res}px {variant}: {type(exc).__name__}: {exc}", file=sys.stderr)
                        steps.pop(name, None)
                samples = time_samples(steps, device, repeats=args.repeats, alternate=True)
                base = names[-1]
                for name, step in steps.items():
                    row = {"model": name, "res": res, "batch": batch, "variant": variant}
                    row["step_ms"] = round(statistics.median(samples[name]) * 1e3, 3)
                    if base in samples and name != base:
                        row["speed_vs_base"] = round(paired_ratio(samples[base], samples[name]), 3)
                    row["peak_mib"] = round(peaks[name], 1)
                    if peaks.get(base):
                        row["memory_vs_base"] = round(peaks[name] / peaks[base], 3)
                    row.update(profile_step(step, device))
                    rows.add(row)
                    print(row, flush=True)


if __name__ == "__main__":
    main()
