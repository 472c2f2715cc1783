"""Mixed-precision training of a plain ViT³ against fp32: the digits demo through train.py's config system.

Trains the classification demo once per AMP mode (``train.amp``) from one seed, and once more in fp32 from
``--spread-seed`` as the yardstick; per epoch each run's losses, top-1 and gap to the first fp32 run.
Writes ``results/amp_<device>.csv`` and ``.png``. Method: benchmarks/README.md.

    python benchmarks/amp.py                          # fp32, bf16 and fp32 from seed 1
    python benchmarks/amp.py --amp bf16 fp16          # fp16 (GradScaler) too
    python benchmarks/amp.py train.epochs=1           # any config override of the runs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, print_table, write_csv
from vit3.engine import load_config, run
from vit3.engine.config import CONFIG_DIR
from vit3.engine.metrics import plot_series

DEMO = CONFIG_DIR / "demo_mnist.yaml"
# A plain ViT³ for the demo's 32x32 one-channel digits (the demo's own model is an H-ViT³).
PLAIN = [
    "model.name=vit3_tiny",
    "model.kwargs={img_size: 32, in_chans: 1, patch_size: 4, embed_dim: 64, depth: 4, num_heads: 2}",
]


def train_once(amp: str, seed: int, device: str, overrides: list[str], root: Path) -> list[dict]:
    """One demo run in AMP mode ``amp`` from ``seed``; returns its per-epoch history (``metrics.json``)."""
    out = root / f"{amp}_{seed}"
    run_overrides = [f"device={device}", f"seed={seed}", f"train.amp={amp}", "train.progress=false"]
    cfg = load_config(DEMO, [*PLAIN, *run_overrides, f"output={out}", *overrides])
    start = time.perf_counter()
    run(cfg, "train")
    history = json.loads((out / "metrics.json").read_text())
    for row in history:
        row["run_wall_s"] = round(time.perf_counter() - start, 1)
    return history


def compare(histories: dict[str, list[dict]]) -> list[dict]:
    """Rows per (run, epoch): losses, top-1 and the relative gap of each loss to the first (fp32) run's."""
    base = next(iter(histories.values()))
    rows = []
    for label, history in histories.items():
        for row, ref in zip(history, base):
            rows.append(
                {
                    "run": label,
                    "epoch": row["epoch"],
                    "step": row["step"],
                    "train_loss": row["train_loss"],
                    "val_loss": row["val_loss"],
                    "val_top1": row["val_top1"],
                    "train_loss_gap": row["train_loss"] / ref["train_loss"] - 1.0,
                    "val_loss_gap": row["val_loss"] / ref["val_loss"] - 1.0,
                    "finite": all(math.isfinite(row[k]) for k in ("train_loss", "val_loss")),
                    "run_wall_s": row["run_wall_s"],
                }
            )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    modes = list(dict.fromkeys(r["run"] for r in rows))

    def series(key: str, run: str) -> list[tuple[float, float]]:
        return [(r["step"], r[key]) for r in rows if r["run"] == run]

    panels = {
        "loss": {f"{m} {k.split('_')[0]}": series(k, m) for m in modes for k in ("train_loss", "val_loss")},
        "val top-1": {m: series("val_top1", m) for m in modes},
    }
    plot_series(
        panels, path, "optimizer step", ylabels={"loss": "loss", "val top-1": "top-1 (%)"}, marker="o"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--amp", nargs="+", default=["bf16"], choices=["bf16", "fp16"], help="modes beside fp32")
    p.add_argument("--spread-seed", type=int, default=1, help="seed of the second fp32 run (-1: none)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None, help="CSV path (default: results/amp_<device>.csv)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides of every run")
    args = p.parse_args(argv)
    runs = {"fp32": ("none", 0), **{amp: (amp, 0) for amp in args.amp}}
    if args.spread_seed >= 0:
        runs[f"fp32 seed {args.spread_seed}"] = ("none", args.spread_seed)
    with tempfile.TemporaryDirectory() as tmp:
        histories = {
            label: train_once(amp, seed, args.device, args.overrides, Path(tmp))
            for label, (amp, seed) in runs.items()
        }
    rows = compare(histories)
    print_table(rows, floatfmt="{:.4g}")
    out = args.out or RESULTS / f"amp_{args.device.split(':')[0]}.csv"
    write_csv(rows, out)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(r["finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
