"""vit3 backbones against timm's DeiT/ViT (SDPA attention) of the same size, across resolutions.

For each (model, resolution, mode: ``infer`` / ``train``) it measures images/s and peak memory side by side,
with ``*_vs_base`` ratios to the last model of each group ``a:b:c``. ``--amp bf16`` runs under autocast (the
default on CUDA); ``--variants eager compiled`` adds ``torch.compile`` (``--compile-scope blocks|model``).
The CSV is rewritten after every resolution. Method and columns: benchmarks/README.md.

    python benchmarks/models.py                         # CPU: ViT³-T vs DeiT-T, 224..1248, batch 1
    python benchmarks/models.py --pairs vit3_small:deit_small_patch16_224 --res 224 448
    python benchmarks/models.py --device cuda --pairs vit3_tiny:h_vit3_tiny:deit_tiny_patch16_224 \
        --res 224 512 1024 1248 --batch 64 16 4 2 --no-flops       # GPU, bf16 autocast
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vit3  # noqa: F401  - registers the vit3 models in timm
from benchmarks.common import (
    RESULTS,
    CsvRows,
    add_runtime_args,
    apply_runtime,
    matmul_peak_flops,
    paired_ratio,
    peak_memory,
    peak_tensor_memory,
    plot_loglog,
    print_table,
    sync,
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


def compiled(model: torch.nn.Module, scope: str, backend: str) -> torch.nn.Module:
    """A compiled copy of ``model``: every ``*Block`` module compiled in place (``scope="blocks"``), or the
    whole forward (``"model"``)."""
    model = copy.deepcopy(model)
    if scope == "model":
        return torch.compile(model, backend=backend)
    for m in model.modules():
        if type(m).__name__.endswith("Block"):
            m.compile(backend=backend)
    return model


def first_call(key: str, fn, res: int, device: torch.device) -> float | None:
    """Seconds of the first call of ``fn`` (a compiled model compiles here), or ``None`` (and a note) where it
    fails, e.g. out of memory or a compile error, so the other models still get timed."""
    start = time.perf_counter()
    try:
        fn()
        sync(device)
    except Exception as exc:
        print(f"{key} @ {res}px: {type(exc).__name__}: {str(exc).strip()[:300]} (left out)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    amp = AMP[args.amp]
    roof = matmul_peak_flops(device, amp or torch.float32)
    csv = CsvRows(args.out)
    for pair in args.pairs:
        names = pair.split(":")
        for res, batch in batches(args).items():
            x = torch.randn(batch, 3, res, res, device=device)
            models = {}
            for n in names:
                models[n, "eager"] = build(n, res, device)
                if "compiled" in args.variants:
                    models[n, "compiled"] = compiled(
                        models[n, "eager"], args.compile_scope, args.compile_backend
                    )

            def autocast():
                return torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()

            def infer(m):
                m.eval()
                with torch.inference_mode(), autocast():
                    m(x)

            def train(m):
                m.train()
                with autocast():
                    out = m(x)
                out.float().sum().backward()
                m.zero_grad(set_to_none=True)

            fns = {}
            for (n, variant), m in models.items():
                if variant not in args.variants:
                    continue
                for mode, step in (("infer", infer), ("train", train)):
                    if mode in args.modes:
                        fns[n, variant, mode] = lambda m=m, step=step: step(m)
            first = {key: first_call("/".join(key), fn, res, device) for key, fn in fns.items()}
            fns = {key: fn for key, fn in fns.items() if first[key] is not None}
            samples = time_samples(fns, device, repeats=args.repeats)
            times = {key: statistics.median(ts) for key, ts in samples.items()}
            group = []
            for (n, variant, mode), fn in fns.items():
                flops = fvcore_flops(models[n, "eager"].eval(), x[:1]) * batch if args.flops else float("nan")
                mem = peak_memory(fn, device)
                tensor_mem = peak_tensor_memory(fn, device) if device.type == "cpu" else float("nan")
                group.append(
                    {
                        "model": n,
                        "res": res,
                        "batch": batch,
                        "amp": args.amp,
                        "mode": mode,
                        "variant": variant,
                        "recompute": os.environ.get("VIT3_TTT_RECOMPUTE", "auto"),
                        "img_per_s": batch / times[n, variant, mode],
                        "ms": 1e3 * times[n, variant, mode],
                        "first_call_s": first[n, variant, mode],
                        "peak_mib": mem,
                        "peak_tensor_mib": tensor_mem,
                        "gflops_per_img": flops / batch / 1e9,
                        "roofline_pct": 100 * flops / times[n, variant, mode] / roof
                        if mode == "infer"
                        else float("nan"),
                    }
                )
            base = names[-1]
            for row in group:
                ref = next(
                    (
                        r
                        for r in group
                        if (r["model"], r["mode"], r["variant"]) == (base, row["mode"], row["variant"])
                    ),
                    None,
                )
                if ref is None:
                    continue
                row["speed_vs_base"] = paired_ratio(
                    samples[base, row["variant"], row["mode"]],
                    samples[row["model"], row["variant"], row["mode"]],
                )
                row["peak_vs_base"] = row["peak_mib"] / max(ref["peak_mib"], 1e-9)
                row["tensor_peak_vs_base"] = row["peak_tensor_mib"] / max(ref["peak_tensor_mib"], 1e-9)
            csv.add(*group)  # so far: a run cut short keeps what it measured
            print(f"{pair} @ {res} done", flush=True)
            del models, fns
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return csv.rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    p.add_argument("--pairs", nargs="+", default=["vit3_tiny:deit_tiny_patch16_224"])
    p.add_argument("--res", type=int, nargs="+", default=[224, 448, 672, 896, 1248])
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="one size, or one per --res")
    p.add_argument("--amp", choices=sorted(AMP), default=None, help="autocast dtype (default: bf16 on CUDA)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=["infer", "train"], default=["infer", "train"])
    p.add_argument("--variants", nargs="+", choices=["eager", "compiled"], default=["eager"])
    p.add_argument("--compile-scope", choices=["blocks", "model"], default="blocks", help="what is compiled")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
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
    # Every block shape, resolution and mode is a compiled graph: room for all of them and their recompiles.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    rows = run(args)
    print_table(rows)
    for variant in args.variants:
        for mode in args.modes:
            by = {(r["model"], r["res"]): r for r in rows if (r["mode"], r["variant"]) == (mode, variant)}
            for pair in args.pairs:
                *models, base = pair.split(":")
                for a in models:
                    for res in args.res:
                        if (a, res) in by and (base, res) in by:
                            ra = by[(a, res)]
                            print(
                                f"{mode} {variant} {res}px: {a} {ra.get('speed_vs_base', float('nan')):.2f}x "
                                "the "
                                f"speed of {base} (paired), {ra.get('peak_vs_base', float('nan')):.2f}x its "
                                "peak "
                                f"memory, {ra.get('tensor_peak_vs_base', float('nan')):.2f}x its peak tensor "
                                "memory"
                            )
    write_csv(rows, args.out)
    for metric, label in (("ms", "ms per batch"), ("peak_mib", "peak MiB")):
        series = {}
        for r in rows:
            xs, ys = series.setdefault(f"{r['model']} {r['mode']} {r['variant']}", ([], []))
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
