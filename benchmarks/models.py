"""vit3 backbones against timm's DeiT/ViT (SDPA attention) of the same size, across resolutions.

For each (model, resolution, mode) it measures images/s and peak memory side by side in one run:
``infer`` is a forward under ``torch.inference_mode``, ``train`` a training step's forward + backward
(gradients of every parameter; no optimizer step). ``--amp bf16`` runs both under ``torch.autocast`` (the
default on CUDA). Peak memory is ``torch.cuda.max_memory_allocated`` on a GPU and the process's peak
resident set growth on CPU (Linux ``/proc/self/clear_refs`` resets the high-water mark before each
measurement; it includes what the allocator keeps), and beside it on CPU ``peak_tensor_mib``, the peak of the
tensor storage alive during the call as the PyTorch profiler records it (allocator-independent,
deterministic: ``common.peak_tensor_memory``). Each row's ``*_vs_base`` columns compare it with the last
model of its group at the same resolution and mode: ``speed_vs_base`` is the paired median over rounds of
base time / model time, the memory ones are plain ratios. ``recompute`` records ``$VIT3_TTT_RECOMPUTE``
(what vit3's mixers save for the backward, ``TTTConfig.recompute``). The roofline column is the achieved GFLOP/s of the forward (fvcore FLOPs) against the
measured matmul roof of the device. A group ``a:b:c`` times its models side by side; the ratios printed
compare each to the last (the baseline).

    python benchmarks/models.py                         # CPU: ViT³-T vs DeiT-T, 224..1248, batch 1
    python benchmarks/models.py --pairs vit3_small:deit_small_patch16_224 --res 224 448
    python benchmarks/models.py --device cuda --pairs vit3_tiny:h_vit3_tiny:deit_tiny_patch16_224 \
        --res 224 512 1024 1248 --batch 64 16 4 2 --no-flops       # GPU, bf16 autocast
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vit3  # noqa: F401  - registers the vit3 models in timm
from benchmarks.common import (
    RESULTS,
    add_runtime_args,
    apply_runtime,
    matmul_peak_flops,
    paired_ratio,
    peak_memory,
    peak_tensor_memory,
    plot_loglog,
    print_table,
    time_samples,
    write_csv,
)


def build(name: str, res: int, device: torch.device) -> torch.nn.Module:
    """A model at resolution ``res`` (DeiT/ViT get their position embedding resized by timm)."""
    kwargs = {"img_size": res}
    if name.startswith(("deit", "vit_")):
        kwargs["dynamic_img_size"] = True
    return timm.create_model(name, num_classes=1000, **kwargs).to(device)


def fvcore_flops(model: torch.nn.Module, x: torch.Tensor) -> float:
    from fvcore.nn import FlopCountAnalysis

    analysis = FlopCountAnalysis(model, x)
    analysis.unsupported_ops_warnings(False)
    analysis.uncalled_modules_warnings(False)
    return float(analysis.total())


AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def batches(args: argparse.Namespace) -> dict[int, int]:
    """Batch size per resolution: one ``--batch`` for all, or one per ``--res``."""
    if len(args.batch) == 1:
        return dict.fromkeys(args.res, args.batch[0])
    if len(args.batch) != len(args.res):
        raise SystemExit(f"--batch takes one size or one per --res ({len(args.res)}), got {len(args.batch)}")
    return dict(zip(args.res, args.batch))


def fits_memory(key: str, fn, res: int, device: torch.device) -> bool:
    """Runs ``fn`` once; False (and a note) where it runs out of memory, so the other models still get timed."""
    try:
        fn()
        return True
    except torch.OutOfMemoryError:
        print(f"{key} @ {res}px: out of memory, skipped", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return False


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    amp = AMP[args.amp]
    roof = matmul_peak_flops(device, amp or torch.float32)
    rows = []
    for pair in args.pairs:
        names = pair.split(":")
        for res, batch in batches(args).items():
            x = torch.randn(batch, 3, res, res, device=device)
            models = {n: build(n, res, device).eval() for n in names}

            def autocast():
                return torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()

            def infer(m):
                with torch.inference_mode(), autocast():
                    m(x)

            def train(m):
                with autocast():
                    out = m(x)
                out.float().sum().backward()
                m.zero_grad(set_to_none=True)

            fns = {}
            for n, m in models.items():
                fns[f"{n}/infer"] = lambda m=m: infer(m)
                if not args.no_train:
                    fns[f"{n}/train"] = lambda m=m: train(m)
            fns = {key: fn for key, fn in fns.items() if fits_memory(key, fn, res, device)}
            samples = time_samples(fns, device, repeats=args.repeats)
            times = {key: statistics.median(ts) for key, ts in samples.items()}
            group = []
            for n, m in models.items():
                flops = fvcore_flops(m, x[:1]) * batch if args.flops else float("nan")
                for mode in ("infer", "train"):
                    key = f"{n}/{mode}"
                    if key not in times:
                        continue
                    mem = peak_memory(lambda key=key: fns[key](), device)
                    tensor_mem = (
                        peak_tensor_memory(lambda key=key: fns[key](), device)
                        if device.type == "cpu"
                        else float("nan")
                    )
                    group.append(
                        {
                            "model": n,
                            "res": res,
                            "batch": batch,
                            "amp": args.amp,
                            "mode": mode,
                            "recompute": os.environ.get("VIT3_TTT_RECOMPUTE", "auto"),
                            "img_per_s": batch / times[key],
                            "ms": 1e3 * times[key],
                            "peak_mib": mem,
                            "peak_tensor_mib": tensor_mem,
                            "gflops_per_img": flops / batch / 1e9,
                            "roofline_pct": 100 * flops / times[key] / roof
                            if mode == "infer"
                            else float("nan"),
                        }
                    )
            base = names[-1]
            for row in group:
                ref = next((r for r in group if r["model"] == base and r["mode"] == row["mode"]), None)
                if ref is None:
                    continue
                row["speed_vs_base"] = paired_ratio(
                    samples[f"{base}/{row['mode']}"], samples[f"{row['model']}/{row['mode']}"]
                )
                row["peak_vs_base"] = row["peak_mib"] / max(ref["peak_mib"], 1e-9)
                row["tensor_peak_vs_base"] = row["peak_tensor_mib"] / max(ref["peak_tensor_mib"], 1e-9)
            rows += group
            print(f"{pair} @ {res} done", flush=True)
            write_csv(rows, args.out)  # so far: a run cut short keeps what it measured
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    p.add_argument("--pairs", nargs="+", default=["vit3_tiny:deit_tiny_patch16_224"])
    p.add_argument("--res", type=int, nargs="+", default=[224, 448, 672, 896, 1248])
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="one size, or one per --res")
    p.add_argument("--amp", choices=sorted(AMP), default=None, help="autocast dtype (default: bf16 on CUDA)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-train", action="store_true", help="skip the training-step measurement")
    p.add_argument("--no-flops", dest="flops", action="store_false", help="skip fvcore FLOP counting")
    p.add_argument("--out", type=Path, default=None, help="CSV (default: results/models_<device>.csv)")
    args = p.parse_args()
    on_cuda = args.device.startswith("cuda")
    args.amp = args.amp or ("bf16" if on_cuda else "none")
    if args.out is None:
        tag = (
            re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(args.device)).lower()
            if on_cuda
            else "cpu"
        )
        args.out = RESULTS / f"models_{tag.strip('_')}.csv"
    apply_runtime(args)
    rows = run(args)
    print_table(rows)
    for mode in ("infer", "train"):
        by = {(r["model"], r["res"]): r for r in rows if r["mode"] == mode}
        for pair in args.pairs:
            *models, base = pair.split(":")
            for a in models:
                for res in args.res:
                    if (a, res) in by and (base, res) in by:
                        ra = by[(a, res)]
                        print(
                            f"{mode} {res}px: {a} {ra.get('speed_vs_base', float('nan')):.2f}x the speed of "
                            f"{base} (paired), {ra.get('peak_vs_base', float('nan')):.2f}x its peak RSS, "
                            f"{ra.get('tensor_peak_vs_base', float('nan')):.2f}x its peak tensor memory"
                        )
    write_csv(rows, args.out)
    for metric, label in (("ms", "ms per batch"), ("peak_mib", "peak MiB")):
        series = {}
        for r in rows:
            xs, ys = series.setdefault(f"{r['model']} {r['mode']}", ([], []))
            xs.append(r["res"])
            ys.append(r[metric])
        png = args.out.with_name(f"{args.out.stem}_{metric}.png")
        plot_loglog(
            series,
            "resolution (px)",
            label,
            f"{label} vs resolution ({args.amp}, batch {'/'.join(map(str, args.batch))})",
            png,
        )
        print(f"wrote {png}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
