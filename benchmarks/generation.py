"""DiT³ against DiT (timm Attention, SDPA) of the same size: a training step's forward + backward per latent size.

Both models are ``vit3.create_dit3`` builds that differ only in the mixer (``mixer="ttt"`` / ``"attention"``),
with every weight random (the official init zeroes the adaLN and output layers, which would make the backward
trivial). For each latent size the two are timed in turn (A B A B ...) and the speed-up is the median of the
per-round ratios (``common.paired_ratio``); peak memory is ``max_memory_allocated`` on a GPU and the growth of
the peak resident set on CPU.

    python benchmarks/generation.py                                 # DiT³-S/2 vs DiT-S/2, latents 32², 64², 128²
    python benchmarks/generation.py --model dit3_b_2 --sizes 32 64 --batch 8 --dtype bf16   # GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    RESULTS,
    add_runtime_args,
    apply_runtime,
    paired_ratio,
    peak_memory,
    plot_loglog,
    print_table,
    time_samples,
    write_csv,
)
from vit3.models.dit3 import create_dit3, num_params

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(name: str, mixer: str, size: int, device: torch.device) -> torch.nn.Module:
    model = create_dit3(name, input_size=size, mixer=mixer)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.to(device).train()


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    rows = []
    for size in args.sizes:
        models = {mixer: build(args.model, mixer, size, device) for mixer in ("ttt", "attention")}
        x = torch.randn(args.batch, 4, size, size, device=device)
        t = torch.randint(0, 1000, (args.batch,), device=device)
        y = torch.randint(0, 1000, (args.batch,), device=device)

        def step(m: torch.nn.Module) -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                out = m(x, t, y)
            out.float().square().mean().backward()
            for p in m.parameters():
                p.grad = None

        fns = {mixer: (lambda m=m: step(m)) for mixer, m in models.items()}
        samples = time_samples(fns, device, repeats=args.repeats, warmup=1)
        ratio = paired_ratio(samples["attention"], samples["ttt"])
        for mixer, m in models.items():
            ms = 1e3 * sorted(samples[mixer])[len(samples[mixer]) // 2]
            rows.append(
                {
                    "model": f"{args.model}/{mixer}",
                    "latent": size,
                    "tokens": (size // m.patch_size) ** 2,
                    "batch": args.batch,
                    "dtype": args.dtype,
                    "threads": torch.get_num_threads(),
                    "params_m": num_params(m) / 1e6,
                    "fwd+bwd_ms": ms,
                    "peak_mib": peak_memory(fns[mixer], device),
                    "attention_over_ttt": ratio,
                }
            )
        print(f"latent {size}² done: DiT³ step {ratio:.2f}x the speed of DiT (paired)", flush=True)
        del models
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    p.add_argument("--model", default="dit3_s_2", help="a create_dit3 name (default: %(default)s)")
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128], help="latent sizes (4 channels)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="autocast dtype of the forward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--out", type=Path, default=None, help="CSV path (default: results/generation_<device>.csv)"
    )
    args = p.parse_args()
    apply_runtime(args)
    out = args.out or RESULTS / f"generation_{torch.device(args.device).type}.csv"
    rows = run(args)
    print_table(rows)
    write_csv(rows, out)
    series = {}
    for r in rows:
        xs, ys = series.setdefault(r["model"], ([], []))
        xs.append(r["tokens"])
        ys.append(r["fwd+bwd_ms"])
    png = out.with_suffix(".png")
    plot_loglog(
        series,
        "tokens (latent² / patch²)",
        "ms per training step",
        f"{args.model}: DiT³ vs DiT (batch {args.batch})",
        png,
    )
    print(f"wrote {out}\nwrote {png}")


if __name__ == "__main__":
    main()
