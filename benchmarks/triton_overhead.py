"""The Python (CPU) time of the Triton path per call, with the kernel launches stubbed out.

What a GPU host's CPU spends around the kernels: argument checks, the cached launch plan (key, buffers,
binding), the autograd node. Runs without ``TRITON_INTERPRET`` (so the custom ops are
``torch.library.triton_op``'s, as on a GPU host) on CPU tensors, with Triton's launcher
(``triton.plan.wrap_triton``) a no-op and ``triton_runs_on`` / ``fits_device`` told the CPU is a GPU (the plans
are sized for an H100, ``triton.tiles.INTERPRET_TILES``). Reported per call, median of interleaved
repeats (``benchmarks.common.time_samples``), in microseconds:

- ``triton_ttt`` of each branch of the official mixer (SwiGLU heads and the depthwise conv): inference (no
  autograd node), the forward with a graph, the backward inside the op's autograd node (``bwd node``), and
  forward + backward end to end (with the autograd engine and the gradients of the q, k, v views);
- the Triton path of one mixer call: the two branches' forward + backward node (the target: <= 50 us), and
  measured end to end;
- for scale, a whole ``TTTMixer`` forward + backward on ``backend="triton"`` (the registry, the projections on
  tiny tensors and the branches; the registry and the projections are not the Triton path), and one
  ``torch.empty`` (what one PyTorch call costs on this machine: a loaded CPU stretches every row alike).

Triton's own launch cost (its binder and the driver call, ~10-20 us per launch in Python) is not in these
figures: it is what the stub removes, and what CUDA graphs remove on a GPU.

    python benchmarks/triton_overhead.py --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

if os.environ.pop("TRITON_INTERPRET", None) == "1":  # before Triton is imported: the GPU host's custom ops
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, print_table, time_samples, write_csv
from vit3.kernels.triton import op, plan, tiles
from vit3.layers import TTTMixer
from vit3.layers import backends as reg


class _Stub:
    """Triton's launcher stubbed: ``kernel[grid](*args, **kwargs)`` records the kernel's name, runs nothing."""

    def __init__(self, kernel, launched: list[str]) -> None:
        self.name, self.launched = kernel.fn.__name__, launched

    def __getitem__(self, grid: tuple):
        return lambda *args, **kwargs: self.launched.append(self.name)


def stub_launches() -> list[str]:
    """Makes the CPU look like a GPU to the Triton path and every launch a no-op that records its kernel (the
    plan's launches still bind their arguments: only Triton's launcher is stubbed); the registry does not
    verify new specialisations (stubbed launches compute nothing: it would demote them)."""
    launched: list[str] = []
    plan.wrap_triton = lambda kernel: _Stub(kernel, launched)
    op.triton_runs_on = lambda device: True
    tiles.fits_device = lambda *args: (True, "")
    reg.BACKENDS["triton"] = dataclasses.replace(reg.BACKENDS["triton"], specialises=False)
    return launched


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--side", type=int, default=4, help="tokens: side x side")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "triton_overhead.csv")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    launched = stub_launches()
    b, c, h, n = args.batch, args.dim, args.heads, args.side**2
    d = c // h
    grid = (args.side, args.side)
    qkv = torch.randn(b, n, 3 * (c + d), requires_grad=True)
    q1, k1, v1, q2, k2, v2 = qkv.split([c, c, c, d, d, d], dim=-1)
    heads = {"swiglu": h, "dwconv": 1}
    views = {
        "swiglu": [t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q1, k1, v1)],
        "dwconv": [t.unflatten(-1, (1, -1)).transpose(1, 2) for t in (q2, k2, v2)],
    }
    params = {
        "swiglu": {w: torch.randn(1, h, d, d, requires_grad=True) for w in ("w1", "w2")},
        "dwconv": {"weight": torch.randn(1, d, 3, 3, requires_grad=True)},
    }

    def call(name: str) -> torch.Tensor:
        return op.triton_ttt(name, *views[name], params[name], grid=grid, scale=9**-0.5, backend="triton")

    def infer(name: str):
        def run() -> None:
            with torch.no_grad():
                call(name)

        return run

    def forward(name: str):
        return lambda: call(name)

    def both(name: str):
        def run() -> None:
            out = call(name)
            torch.autograd.backward(out, torch.ones_like(out))

        return run

    def path() -> None:
        outs = [call(name) for name in heads]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    mixer = TTTMixer(c, h, backend="triton")
    x = torch.randn(b, n, c, requires_grad=True)

    def mixer_both() -> None:
        mixer(x, grid).sum().backward()

    node: dict[str, list[float]] = {name: [] for name in heads}
    real_backward = op._TritonTTT.backward

    def timed_backward(ctx, dout):
        start = time.perf_counter()
        grads = real_backward(ctx, dout)
        node[ctx.call.cfg[0]].append(time.perf_counter() - start)
        return grads

    op._TritonTTT.backward = staticmethod(timed_backward)
    fns = {f"{name} {kind}": make(name) for name in heads for kind, make in
           (("infer", infer), ("fwd", forward), ("fwd+bwd", both))}  # fmt: skip
    fns["triton path per mixer call (fwd+bwd)"] = path
    fns["TTTMixer fwd+bwd (backend=triton)"] = mixer_both
    fns["torch.empty (for scale)"] = lambda: torch.empty(16)
    samples = time_samples(fns, torch.device("cpu"), repeats=args.repeats, warmup=20)
    for name in heads:
        samples[f"{name} bwd node"] = node[name]
    launched.clear()
    path()

    def stats(ts: list[float]) -> dict[str, float]:
        ts = sorted(ts)
        return {"median_us": ts[len(ts) // 2] * 1e6, "p10_us": ts[len(ts) // 10] * 1e6}

    rows = [{"call": label} | stats(ts) for label, ts in samples.items()]
    by = {r["call"]: r for r in rows}
    own = {k: sum(by[f"{n} {part}"][k] for n in heads for part in ("fwd", "bwd node")) for k in stats([0.0])}
    rows.append({"call": "triton path per mixer call: fwd + bwd node, summed"} | own)
    print_table(rows, floatfmt="{:.1f}")
    print(f"launches stubbed per mixer call (fwd+bwd): {len(launched)}; shape B={b} N={n} C={c} heads={h}")
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
