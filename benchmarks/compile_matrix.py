"""The offline compile matrix of the fused TTT kernels: shared memory, registers and spills on every GPU arch.

Compiles every launch of ``triton_ttt`` for each case of ``vit3.kernels.aot.matrix`` (``--cases default``:
the CI subset) with no GPU, prints the worst kernel per arch, dtype mode and head dim, flags kernels over
the limits, and writes one row per kernel to ``--out``. Clears ``TRITON_INTERPRET``. Method:
benchmarks/README.md.

    python benchmarks/compile_matrix.py --jobs 2               # the full matrix (long on a cold cache)
    python benchmarks/compile_matrix.py --cases default --jobs 2
    python benchmarks/compile_matrix.py --arch sm_86 --d 64 --mode bf16 fp32-ieee
    python benchmarks/compile_matrix.py --markdown benchmarks/results/compile_matrix.csv  # the README table
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

if os.environ.pop("TRITON_INTERPRET", None) == "1":  # before Triton is imported: compiled, not interpreted
    os.execv(sys.executable, [sys.executable, *sys.argv])

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, print_table, write_csv
from vit3.kernels import aot


def rows_of(results: list) -> list[dict]:
    """One row per compiled kernel (or per failed case), with the verdict against the arch's limits."""
    rows = []
    for case, res in results:
        fits, why = aot.fits(case)
        head = {"arch": case.arch.sm, "model": case.model, "loss": case.loss, "d": case.d, "mode": case.mode,
                "fits": fits, "limit_kb": case.arch.smem / 1024,
                "bound_kb": aot.smem_bound(case) / 1024}  # fmt: skip
        if isinstance(res, str):
            blank = dict.fromkeys(
                ("smem_kb", "regs", "spill_stores", "spill_bound", "spill_loads", "loop_spills", "stack"), 0
            )
            blank |= dict.fromkeys(("wgmma", "tcgen05", "mma"), 0)
            blank |= dict.fromkeys(("block_n", "block_c", "num_warps", "num_stages"), 0)
            rows.append(head | {"kernel": "(compile failed)"} | blank | {"note": res, "ok": False})
            continue
        worst = max(c.smem for c in res)
        for c in res:
            bound = aot.spill_bound(case, c.kernel)
            if fits:  # within the arch's limit, the declared bound, and the spill bounds
                ok = c.smem <= min(case.arch.smem, aot.smem_bound(case)) and c.spill_stores <= bound
                ok = ok and not (aot.strict_spills(case, c.kernel) and c.loop_spills)
                note = ""
            else:  # fits_device says no: the compile must show why (some kernel over the limit)
                ok, note = worst > case.arch.smem, f"fits_device: {why}"
            rows.append(head | {"kernel": c.kernel, "smem_kb": c.smem / 1024, "regs": c.regs,
                                "spill_stores": c.spill_stores, "spill_bound": bound,
                                "spill_loads": c.spill_loads,
                                "loop_spills": c.loop_spills, "stack": c.stack, "wgmma": c.wgmma,
                                "tcgen05": c.tcgen05,
                                "mma": c.mma,
                                "block_n": c.block_n, "block_c": c.block_c,
                                "num_warps": c.num_warps, "num_stages": c.num_stages,
                                "note": note, "ok": ok})  # fmt: skip
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (arch, mode, d): the worst kernel over the inner models by shared memory, registers, spills."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["arch"], r["mode"], r["d"]), []).append(r)
    out = []
    for (arch, mode, d), rs in groups.items():
        done = [r for r in rs if r["kernel"] != "(compile failed)" and r["fits"]]
        top = max(done, key=lambda r: r["smem_kb"]) if done else None
        name = (
            (lambda r: f"{r['model']}{'-mse' if r['loss'] == 'mse' else ''}/{r['kernel']}") if done else None
        )
        out.append({
            "arch": arch, "mode": mode, "d": d,
            "max_smem_kb": top["smem_kb"] if top else float("nan"),
            "limit_kb": top["limit_kb"] if top else float("nan"),
            "smem_kernel": name(top) if top else "-",
            "max_regs": max((r["regs"] for r in done), default=0),
            "max_spill": max((r["spill_stores"] for r in done), default=0),
            "spill_kernel": name(max(done, key=lambda r: r["spill_stores"]))
            if done and max(r["spill_stores"] for r in done)
            else "-",
            "wgmma": f"{sum(r['wgmma'] > 0 for r in done)}/"
            f"{sum(r['wgmma'] + r['tcgen05'] + r['mma'] > 0 for r in done)}",
            "no_fit": len({(r["model"], r["loss"]) for r in rs if not r["fits"]}),
            "failed": sum(not r["ok"] for r in rs),
        })  # fmt: skip
    return out


def markdown(rows: list[dict]) -> str:
    """The README's table of ``rows`` (this script's CSV rows): per (arch, mode) a line, per head dim the
    worst kernel of the inner models that fit: shared memory KB · registers · spilled bytes per thread of the
    token kernels, in parentheses those of the weight-gradient reduction where not 0; ‡ where an inner model
    does not fit.
    """
    cells: dict[tuple[str, str], dict[int, list[dict]]] = {}
    for r in sorted(rows, key=lambda r: int(str(r["arch"]).removeprefix("sm_"))):
        cells.setdefault((r["arch"], r["mode"]), {}).setdefault(int(r["d"]), []).append(r)
    lines = [
        "| arch (limit) | mode | " + " | ".join(f"d={d}" for d in sorted(next(iter(cells.values())))) + " |"
    ]
    lines.append("|---" * (2 + len(next(iter(cells.values())))) + "|")
    for (arch, mode), by_d in cells.items():
        out = []
        for d in sorted(by_d):
            rs = by_d[d]
            ok = [r for r in rs if str(r["fits"]) == "True"]
            small = [aot.kernel_name(r["kernel"]) in aot.SMALL_KERNELS for r in ok]
            step = [int(r["spill_stores"]) for r, s in zip(ok, small) if s]
            token = [int(r["spill_stores"]) for r, s in zip(ok, small) if not s]
            smem, regs = max(float(r["smem_kb"]) for r in ok), max(int(r["regs"]) for r in ok)
            cell = f"{smem:.0f} · {regs} · {max(token)}"
            cell += f" ({max(step)})" if max(step) else ""
            out.append(cell + (" ‡" if len(ok) < len(rs) else ""))
        limit = float(next(iter(by_d.values()))[0]["limit_kb"])
        lines.append(f"| {arch} ({limit:.0f} KB) | {mode} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", choices=["full", "default"], default="full")
    p.add_argument("--arch", nargs="+", default=None, help="only these archs (e.g. sm_86)")
    p.add_argument("--d", type=int, nargs="+", default=None, help="only these head dims")
    p.add_argument("--mode", nargs="+", default=None, choices=list(aot.MODES), help="only these dtype modes")
    models = sorted({m for m, _ in aot.MODELS})
    p.add_argument("--model", nargs="+", default=None, choices=models, help="only these models / mixers")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--out", type=Path, default=RESULTS / "compile_matrix.csv")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON (the tests read it)")
    p.add_argument(
        "--markdown", type=Path, default=None, help="print the README table of this CSV; no compile"
    )
    args = p.parse_args(argv)
    if args.markdown:
        with args.markdown.open(newline="") as f:
            print(markdown(list(csv.DictReader(f))))
        return 0
    cases = [
        c
        for c in aot.matrix(args.cases)
        if (args.arch is None or c.arch.sm in args.arch)
        and (args.d is None or c.d in args.d)
        and (args.mode is None or c.mode in args.mode)
        and (args.model is None or c.model in args.model)
    ]
    start = time.perf_counter()
    rows = rows_of(aot.compile_cases(cases, args.jobs))
    print_table(summary(rows), floatfmt="{:.0f}")
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"OVER: {r['arch']} {r['model']}-{r['loss']} d{r['d']} {r['mode']} {r['kernel']}: "
              f"{r['smem_kb']:.0f} KB (limit {r['limit_kb']:.0f}, bound {r['bound_kb']:.0f}), "
              f"{r['spill_stores']} B spilled (bound {r['spill_bound']}), {r['loop_spills']} spills in loops "
              f"{r['note']}")  # fmt: skip
    for r in {
        (r["arch"], r["model"], r["loss"], r["d"], r["mode"], r["note"]) for r in rows if not r["fits"]
    }:
        print("DOES NOT FIT (as fits_device says):", *r)
    print(
        f"{len(cases)} cases, {len(rows)} kernels in {time.perf_counter() - start:.0f}s; {len(bad)} over a "
        "limit"
    )
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
