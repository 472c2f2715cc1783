"""vit3 backbones against timm's DeiT/ViT (SDPA attention) of the same size, across resolutions.

For each (model, resolution, mode) it measures images/s and peak memory side by side in one run:
``infer`` is a forward under ``torch.inference_mode``, ``train`` a forward + backward. Peak memory is
``torch.cuda.max_memory_allocated`` on a GPU and the process's peak resident set growth on CPU (Linux
``/proc/self/clear_refs`` resets the high-water mark before each measurement). The roofline column is the
achieved GFLOP/s of the forward (fvcore FLOPs) against the measured matmul roof of the device.

    python benchmarks/models.py                         # CPU: ViT³-T vs DeiT-T, 224..1248, batch 1
    python benchmarks/models.py --pairs vit3_small:deit_small_patch16_224 --res 224 448
"""

from __future__ import annotations

import argparse
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
    peak_memory,
    plot_loglog,
    print_table,
    time_interleaved,
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


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    roof = matmul_peak_flops(device)
    rows = []
    for pair in args.pairs:
        names = pair.split(":")
        for res in args.res:
            x = torch.randn(args.batch, 3, res, res, device=device)
            models = {n: build(n, res, device).eval() for n in names}

            def infer(m):
                with torch.inference_mode():
                    m(x)

            def train(m):
                m(x).float().sum().backward()
                m.zero_grad(set_to_none=True)

            fns = {}
            for n, m in models.items():
                fns[f"{n}/infer"] = lambda m=m: infer(m)
                if not args.no_train:
                    fns[f"{n}/train"] = lambda m=m: train(m)
            times = time_interleaved(fns, device, repeats=args.repeats)
            for n, m in models.items():
                flops = fvcore_flops(m, x[:1]) * args.batch if args.flops else float("nan")
                for mode in ("infer", "train"):
                    key = f"{n}/{mode}"
                    if key not in times:
                        continue
                    mem = peak_memory(lambda key=key: fns[key](), device)
                    rows.append(
                        {
                            "model": n,
                            "res": res,
                            "mode": mode,
                            "img_per_s": args.batch / times[key],
                            "ms": 1e3 * times[key],
                            "peak_mib": mem,
                            "gflops_per_img": flops / args.batch / 1e9,
                            "roofline_pct": 100 * flops / times[key] / roof
                            if mode == "infer"
                            else float("nan"),
                        }
                    )
            print(f"{pair} @ {res} done", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    p.add_argument("--pairs", nargs="+", default=["vit3_tiny:deit_tiny_patch16_224"])
    p.add_argument("--res", type=int, nargs="+", default=[224, 448, 672, 896, 1248])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-train", action="store_true", help="skip the training-step measurement")
    p.add_argument("--no-flops", dest="flops", action="store_false", help="skip fvcore FLOP counting")
    p.add_argument("--out", type=Path, default=RESULTS / "models_cpu.csv")
    args = p.parse_args()
    apply_runtime(args)
    rows = run(args)
    print_table(rows)
    for mode in ("infer", "train"):
        by = {(r["model"], r["res"]): r for r in rows if r["mode"] == mode}
        for pair in args.pairs:
            a, b = pair.split(":")[:2]
            for res in args.res:
                if (a, res) in by and (b, res) in by:
                    ra, rb = by[(a, res)], by[(b, res)]
                    print(
                        f"{mode} {res}px: {a} {ra['img_per_s'] / rb['img_per_s']:.2f}x the img/s of {b}, "
                        f"{ra['peak_mib'] / max(rb['peak_mib'], 1e-9):.2f}x its peak memory"
                    )
    write_csv(rows, args.out)
    for metric, label in (("ms", "ms per batch"), ("peak_mib", "peak MiB")):
        series = {}
        for r in rows:
            xs, ys = series.setdefault(f"{r['model']} {r['mode']}", ([], []))
            xs.append(r["res"])
            ys.append(r[metric])
        png = args.out.with_name(f"{args.out.stem}_{metric}.png")
        plot_loglog(series, "resolution (px)", label, f"{label} vs resolution (batch {args.batch})", png)
        print(f"wrote {png}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
