"""The TTT mixer against the official eager formulation and softmax attention, across sequence lengths.

Side by side in one run, per N: (1) the inner loop alone (q, k, v -> read-out; what the official code spends
its ~37 eager ops on) for our path (on a CPU: the C++ kernel, and beside it the tiled pure-PyTorch path it
replaces) and the official formulation, forward and forward+backward;
(2) the whole mixer (with the qkv/output projections) against an SDPA attention layer of the same width.
Prints a table with ratios, peak memory of the inner loop's forward+backward, time per token (linear scaling
check) and achieved GFLOP/s against the measured matmul roof, and writes CSV + PNG to ``benchmarks/results/``.

    python benchmarks/mixer.py                  # CPU defaults: dim 384, 6 heads, batch 4
    python benchmarks/mixer.py --tokens 196 784 3136 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    RESULTS,
    add_runtime_args,
    apply_runtime,
    matmul_peak_flops,
    paired_ratio,
    peak_memory,
    plot_loglog,
    print_table,
    time_samples,
    write_csv,
)
from benchmarks.official_baseline import official_inner
from vit3.layers import TTTMixer


class SDPAAttention(nn.Module):
    """timm-style multi-head softmax attention (qkv + SDPA + proj) of the same width."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


def grid_for(n: int) -> tuple[int, int]:
    """The most square grid with exactly ``n`` tokens."""
    h = int(n**0.5)
    while n % h:
        h -= 1
    return h, n // h


def inner_flops(n: int, dim: int, heads: int, backward: bool = False) -> float:
    """Matmul FLOPs of one inner-loop forward, or forward + backward (``backward``): the SwiGLU branch
    12 N d² per head forward and 32 N d² backward (the default memory-lean backward recomputes Z and Y),
    the dwconv branch (one d-channel head) 36 N d forward and 72 N d backward."""
    d = dim // heads
    swiglu, dwconv = (44, 108) if backward else (12, 36)
    return swiglu * n * d * d * heads + dwconv * n * d


def tiled_mixer(mixer: TTTMixer) -> TTTMixer:
    """``mixer`` on the tiled pure-PyTorch path (backend ``eager``, not the C++ CPU kernel), same weights."""
    tiled = TTTMixer(mixer.dim, mixer.num_heads, dataclasses.replace(mixer.cfg, backend="eager"))
    tiled.load_state_dict(mixer.state_dict())
    return tiled.to(mixer.qkv.weight.device)


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    dim, heads, b = args.dim, args.heads, args.batch
    mixer = TTTMixer(dim, heads).to(device)
    attn = SDPAAttention(dim, heads).to(device)
    tiled = tiled_mixer(mixer)
    w1, w2, w3 = mixer.inner[0].w1, mixer.inner[0].w2, mixer.inner[1].weight
    peak = matmul_peak_flops(device)
    rows = []
    for n in args.tokens:
        grid = grid_for(n)
        qkv = torch.randn(b, n, mixer.qkv.out_features, device=device, requires_grad=True)
        x = torch.randn(b, n, dim, device=device, requires_grad=True)

        upstream = {}  # dense output gradients, one per output shape, made once (not timed)
        leaves = [qkv, x, *mixer.parameters(), *tiled.parameters(), *attn.parameters()]

        def step(fn, backward):
            # As a training step: gradients set to None first (optimizer.zero_grad), so nothing accumulates
            # into .grad, and a dense upstream gradient, as the next layer would send.
            for t in leaves:
                t.grad = None
            out = fn()
            if backward:
                if out.shape not in upstream:
                    upstream[out.shape] = torch.randn(out.shape, device=device)
                out.backward(upstream[out.shape].to(out.dtype))

        fns = {}
        for bw in (False, True):
            tag = "fwd+bwd" if bw else "fwd"
            fns[f"ours/{tag}"] = lambda bw=bw: step(lambda: mixer.mix(qkv, grid), bw)
            if device.type == "cpu":  # ours is the C++ kernel there; its pure-PyTorch reference beside it
                fns[f"tiled/{tag}"] = lambda bw=bw: step(lambda: tiled.mix(qkv, grid), bw)
            fns[f"official/{tag}"] = lambda bw=bw: step(
                lambda: official_inner(qkv, heads, grid, w1, w2, w3), bw
            )
            fns[f"mixer/{tag}"] = lambda bw=bw: step(lambda: mixer(x, grid), bw)
            if n <= args.sdpa_max_tokens:  # quadratic: minutes per call on a CPU at 16k tokens
                fns[f"sdpa/{tag}"] = lambda bw=bw: step(lambda: attn(x), bw)
        samples = time_samples(fns, device, repeats=args.repeats)
        t = {name: statistics.median(ts) for name, ts in samples.items()}
        row = {"N": n, "grid": f"{grid[0]}x{grid[1]}", "threads": torch.get_num_threads()}
        for tag in ("fwd", "fwd+bwd"):
            row[f"inner_ours_{tag}_ms"] = 1e3 * t[f"ours/{tag}"]
            row[f"inner_official_{tag}_ms"] = 1e3 * t[f"official/{tag}"]
            # official / ours within each round (see paired_ratio), then the median over rounds
            row[f"inner_speedup_{tag}"] = paired_ratio(samples[f"official/{tag}"], samples[f"ours/{tag}"])
            if f"tiled/{tag}" in samples:
                row[f"inner_tiled_{tag}_ms"] = 1e3 * t[f"tiled/{tag}"]
                row[f"kernel_over_tiled_{tag}"] = paired_ratio(
                    samples[f"tiled/{tag}"], samples[f"ours/{tag}"]
                )
            row[f"mixer_{tag}_ms"] = 1e3 * t[f"mixer/{tag}"]
            sdpa = t.get(f"sdpa/{tag}", float("nan"))
            row[f"sdpa_{tag}_ms"] = 1e3 * sdpa
            row[f"sdpa_over_mixer_{tag}"] = (  # the mixer's speed-up over SDPA attention, paired per round
                paired_ratio(samples[f"sdpa/{tag}"], samples[f"mixer/{tag}"])
                if f"sdpa/{tag}" in samples
                else sdpa
            )
        for name in ("ours", "official"):
            row[f"inner_{name}_fwd+bwd_peak_mib"] = peak_memory(fns[f"{name}/fwd+bwd"], device)
        row["inner_us_per_token_fwd+bwd"] = 1e6 * t["ours/fwd+bwd"] / (b * n)
        for tag, backward in (("fwd", False), ("fwd+bwd", True)):
            row[f"inner_gflops_{tag}"] = b * inner_flops(n, dim, heads, backward) / t[f"ours/{tag}"] / 1e9
            # the inner loop's fraction of the measured matmul roof (one thread: a single core's)
            row[f"inner_roof_frac_{tag}"] = row[f"inner_gflops_{tag}"] * 1e9 / peak
        row["matmul_roof_gflops"] = peak / 1e9
        rows.append(row)
        print(f"N={n} done", flush=True)
    return rows


def add_layer_args(p: argparse.ArgumentParser) -> None:
    """The mixer and attention layers' shape: width, heads, batch (shared with ``mixer_profile.py``)."""
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    add_layer_args(p)
    p.add_argument("--tokens", type=int, nargs="+", default=[196, 1024, 3136, 9216, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--sdpa-max-tokens", type=int, default=9216, help="skip SDPA above this N (NaN in the table)"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "mixer_cpu.csv")
    args = p.parse_args()
    apply_runtime(args)
    rows = run(args)
    print_table(rows)
    # Linear scaling check, from 1k tokens on (below that fixed per-call overheads dominate).
    base = next((r for r in rows if r["N"] >= 1024), rows[0])
    last = rows[-1]
    ratio = last["inner_us_per_token_fwd+bwd"] / base["inner_us_per_token_fwd+bwd"]
    print(f"inner-loop time per token at N={last['N']} over N={base['N']}: {ratio:.2f}x")
    write_csv(rows, args.out)
    ns = [r["N"] for r in rows]
    series = {
        "ours inner fwd+bwd": (ns, [r["inner_ours_fwd+bwd_ms"] for r in rows]),
        "official inner fwd+bwd": (ns, [r["inner_official_fwd+bwd_ms"] for r in rows]),
        "TTT mixer fwd+bwd": (ns, [r["mixer_fwd+bwd_ms"] for r in rows]),
        "SDPA attention fwd+bwd": (ns, [r["sdpa_fwd+bwd_ms"] for r in rows]),
    }
    png = args.out.with_suffix(".png")
    plot_loglog(series, "tokens N", "ms", f"TTT mixer vs attention (dim {args.dim}, batch {args.batch})", png)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
