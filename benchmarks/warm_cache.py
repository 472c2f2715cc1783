"""Fills the Triton kernel cache in parallel before a timed run: one process per item, all cores at once.

Items: ``kernel:D:N:BH`` (the fused op as ``ttt_kernel.py`` runs it, whole and chunked) and
``model:NAME:RES:BATCH`` (a training step and an inference forward as ``models.py`` runs them). Prints one
line per item (exit status, seconds); exits 1 if any item failed or timed out. Why and how:
benchmarks/README.md.

    python benchmarks/warm_cache.py --jobs 16 --timeout 120 kernel:64:3136:64 model:vit3_tiny:224:64
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def warm(item: str, device: torch.device) -> None:
    """Runs ``item`` once (in this process)."""
    kind, *fields = item.split(":")
    if kind == "kernel":
        from benchmarks.ttt_kernel import build_paths, step

        d, n, bh = map(int, fields)
        heads = min(4, bh)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        paths = build_paths(heads, d, device)
        qkv = torch.randn(bh // heads, n, 3 * heads * d, device=device, dtype=dtype, requires_grad=True)
        w1, w2 = ((0.02 * torch.randn(1, heads, d, d, device=device)).requires_grad_() for _ in range(2))
        dout = torch.randn(bh // heads, n, heads * d, device=device, dtype=dtype)
        for path in ("fused", "fused_chunked"):  # their launches differ where the second splits N
            for mode in ("fwd", "fwd+bwd"):
                step(paths[path], mode, qkv, w1, w2, dout)
    elif kind == "model":
        from benchmarks.models import build

        name, res, batch = fields[0], int(fields[1]), int(fields[2])
        model = build(name, res, device)
        x = torch.randn(batch, 3, res, res, device=device)
        amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        with amp:
            model.train()(x).float().sum().backward()
            with torch.inference_mode():
                model.eval()(x)
    else:
        raise SystemExit(f"error: unknown item {item!r} (kernel:D:N:BH or model:NAME:RES:BATCH)")
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", help="kernel:D:N:BH or model:NAME:RES:BATCH")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes at once")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for all items")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode: run this item here
    args = p.parse_args()
    if args.one is not None:
        return warm(args.one, torch.device(args.device))
    deadline = time.monotonic() + args.timeout

    def child(item: str) -> tuple[str, str, float]:
        start = time.monotonic()
        cmd = [sys.executable, __file__, "--device", args.device, "--one", item]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, deadline - start))
        except subprocess.TimeoutExpired:
            return item, "timed out", time.monotonic() - start
        status = "ok" if proc.returncode == 0 else f"rc {proc.returncode}: {proc.stderr.strip()[-300:]}"
        return item, status, time.monotonic() - start

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(child, args.items))
    for item, status, seconds in results:
        print(f"{item:<40} {seconds:6.1f}s  {status}", flush=True)
    if any(status != "ok" for _, status, _ in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
