"""Where a mixer's forward + backward time goes: the TTT mixer against an SDPA attention layer of the same
width.

Profiles both layers (torch profiler, self CPU time of every op, ``--calls`` calls each, the two layers taken
in turn ``--rounds`` times so drift hits both alike) and attributes each op by what it runs inside: the inner
loop (ops inside the C++ kernel's ops, or inside the SDPA kernel), the projections (``addmm`` / ``mm``: the
qkv and output projections, forward and backward) and the rest (elementwise, copies, autograd, Python-side
ops). Prints the table and writes ``results/mixer_profile_<device>.csv``.

    python benchmarks/mixer_profile.py --threads 1              # dim 384, 6 heads, batch 4, N = 196
    python benchmarks/mixer_profile.py --threads 1 --tokens 3136
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, add_runtime_args, apply_runtime, print_table, write_csv
from benchmarks.mixer import SDPAAttention, add_layer_args, grid_for
from vit3.layers import TTTMixer

PARTS = ("projections", "inner loop", "rest")
_INNER = (
    "vit3_cpu::",
    "aten::_scaled_dot_product_flash",
    "aten::_efficient_attention",
    "aten::_flash",
)


def _part(event) -> str:
    """The part an op's self time counts for: the inner loop when it runs inside an inner-loop kernel."""
    names, parent = [event.name], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    if any(n.startswith(_INNER) for n in names):
        return "inner loop"
    return "projections" if event.name in ("aten::addmm", "aten::mm") else "rest"


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    n, grid = args.tokens, grid_for(args.tokens)
    mixer = TTTMixer(args.dim, args.heads).to(device)
    attn = SDPAAttention(args.dim, args.heads).to(device)
    x = torch.randn(args.batch, n, args.dim, device=device, requires_grad=True)
    upstream = torch.randn(args.batch, n, args.dim, device=device)
    layers = {"ttt_mixer": lambda: mixer(x, grid), "sdpa_attention": attn}
    totals = {name: collections.Counter() for name in layers}
    for fn in layers.values():  # warm-up: builds the kernel, resolves the routes
        for _ in range(2):
            (fn(x) if fn is attn else fn()).backward(upstream)
    for _ in range(args.rounds):
        for name, fn in layers.items():
            with profile() as prof:
                for _ in range(args.calls):
                    (fn(x) if fn is attn else fn()).backward(upstream)
            for event in prof.events():
                totals[name][_part(event)] += event.self_cpu_time_total / 1e3
    rows = []
    for name, parts in totals.items():
        calls = args.rounds * args.calls
        whole = sum(parts.values()) / calls
        for part in PARTS:
            ms = parts[part] / calls
            rows.append({"layer": name, "N": n, "part": part, "ms": ms, "share": ms / whole})
        rows.append({"layer": name, "N": n, "part": "total", "ms": whole, "share": 1.0})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    add_layer_args(p)
    p.add_argument("--tokens", type=int, default=196)
    p.add_argument("--calls", type=int, default=10, help="forward + backward calls per profiled round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="CSV (default: results/mixer_profile_<device>.csv)")
    args = p.parse_args()
    apply_runtime(args)
    rows = run(args)
    print_table(rows)
    out = args.out or RESULTS / f"mixer_profile_{torch.device(args.device).type}.csv"
    write_csv(rows, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
