"""Conversion by distillation on the embedded digits, and the converted model's inference cost at high res.

Accuracy per seed, every run through ``train.py`` (resumable): ``teacher`` (an attention ViT), ``converted``
(that teacher converted to TTT) and ``scratch`` (the same TTT student from random weights). Latency
(``measure=latency``): ``--latency-model`` and its conversion per ``--sizes``, one image, inference.
Method and columns: benchmarks/README.md.

    python benchmarks/convert.py --threads 1                # 3 seeds; writes results/convert_cpu.csv and .png
    python benchmarks/convert.py --threads 1 --seeds 0 1 --keep-latency   # seed 1 added, latency kept
    python benchmarks/convert.py --quick --work /tmp/cv     # a tiny smoke run (1 seed, few steps, small)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, print_table, save_figure, time_samples, write_csv  # noqa: E402

TEACHER_CONFIG = "configs/convert/teacher_mnist.yaml"
CONVERT_CONFIG = "configs/convert/demo_mnist.yaml"
QUICK = ["model.kwargs={img_size: 32, patch_size: 8, in_chans: 1, embed_dim: 32, depth: 2, num_heads: 2}"]
QUICK_LATENCY = dict(embed_dim=32, depth=2, num_heads=2)  # --quick: a smoke-test teacher (16 tokens, depth 2)


def _summary(out: Path) -> dict | None:
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def train(name: str, config: str, out: Path, overrides: list[str], log: Path) -> dict:
    """Runs ``train.py`` (resuming a killed run) unless ``out`` holds a finished run; returns its summary."""
    done = _summary(out)
    if done is not None:
        print(f"{name}: done before ({out})", flush=True)
        return done
    cmd = [sys.executable, "train.py", "--config", config, f"output={out}", "train.resume=auto", *overrides]
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    tick = time.perf_counter()
    with log.open("a") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ})
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); see {log}")
    summary = _summary(out)
    summary["bench_wall_s"] = round(time.perf_counter() - tick, 1)
    return summary


def _history(out: Path) -> list[dict]:
    return json.loads((out / "metrics.json").read_text())


def accuracy_rows(args: argparse.Namespace) -> tuple[list[dict], dict[str, dict[int, list[dict]]]]:
    """The accuracy rows and each run's per-epoch history (method -> seed -> rows)."""
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    log = work / "runs.log"
    common = [
        f"threads={args.threads}",
        "train.progress=false",
        *(QUICK if args.quick else []),
        *args.override,
    ]
    rows, curves = [], {"teacher": {}, "converted": {}, "scratch": {}}
    teachers = {}  # every teacher first: the conversions' settings do not change them
    for seed in args.seeds:
        t_out = work / f"teacher_s{seed}"
        overrides = [*common, f"seed={seed}", f"train.epochs={args.teacher_epochs}"]
        teachers[seed] = (t_out, train(f"teacher seed {seed}", TEACHER_CONFIG, t_out, overrides, log))
    for seed in args.seeds:
        base = [*common, f"seed={seed}"]
        t_out, teacher = teachers[seed]
        record = torch.load(t_out / "last.pt", map_location="cpu", weights_only=True)["record"]
        t_steps = int(teacher["final"]["step"])
        t_top1 = float(teacher["final"]["val_top1"])
        curves["teacher"][seed] = _history(t_out)
        runs = [("teacher", teacher, args.teacher_epochs)]
        c_out = work / f"converted_s{seed}"
        converted = train(
            f"converted seed {seed}", CONVERT_CONFIG, c_out,
            [*base, f"train.epochs={args.budget_epochs}", f"convert.transfer_epochs={args.transfer_epochs}",
             f"convert.teacher={t_out / 'last.pt'}", "convert.teacher_config="],
            log,
        )  # fmt: skip
        curves["converted"][seed] = _history(c_out)
        runs.append(("converted", converted, args.budget_epochs))
        student = {"base": record["name"], **record["kwargs"], "ttt": {}, "scope": "stage"}
        for epochs in sorted({args.budget_epochs, *args.scratch_epochs}):
            s_out = work / f"scratch_e{epochs}_s{seed}"
            scratch = train(
                f"scratch {epochs} epochs seed {seed}", TEACHER_CONFIG, s_out,
                [*base, f"train.epochs={epochs}", "model.name=ttt_swap",
                 f"model.kwargs={json.dumps(student)}"],
                log,
            )  # fmt: skip
            if epochs == args.budget_epochs:
                curves["scratch"][seed] = _history(s_out)
            runs.append(("scratch", scratch, epochs))
        for method, summary, epochs in runs:
            final = summary["final"]
            rows.append(
                {
                    "measure": "accuracy",
                    "method": method,
                    "seed": seed,
                    "steps": int(final["step"]),
                    "epochs": epochs,
                    "val_top1": float(final["val_top1"]),
                    "best_top1": float(summary["best_top1"]),
                    "of_teacher": round(float(final["val_top1"]) / t_top1, 4),
                    "budget": round(int(final["step"]) / t_steps, 4),
                    "wall_s": summary.get("wall_time_s"),
                }
            )
    return rows, curves


# --------------------------------------------------------------------------------------------- latency
def latency_rows(args: argparse.Namespace) -> list[dict]:
    """Inference time per image of the teacher architecture and its conversion at each size."""
    import timm

    import vit3  # noqa: F401  (registers ttt_swap)

    torch.manual_seed(0)
    rows: list[dict] = []
    previous: dict[str, tuple[int, float]] = {}
    for size in args.sizes:
        kwargs = dict(img_size=size, **(QUICK_LATENCY if args.quick else {}))
        models = {
            "teacher": timm.create_model(args.latency_model, **kwargs).eval(),
            "converted": timm.create_model("ttt_swap", base=args.latency_model, **kwargs).eval(),
        }
        x = torch.randn(1, 3, size, size)

        def forward(model: torch.nn.Module) -> None:
            with torch.no_grad():
                model(x)

        samples = time_samples(
            {k: (lambda m=m: forward(m)) for k, m in models.items()}, x.device, args.repeats
        )
        tokens = models["teacher"].patch_embed.num_patches
        for method, times in samples.items():
            ms = 1e3 * statistics.median(times)
            row = {
                "measure": "latency", "method": method, "model": args.latency_model, "img_size": size,
                "tokens": tokens, "ms_per_image": round(ms, 2), "ms_per_ktoken": round(ms / tokens * 1e3, 3),
                "threads": torch.get_num_threads(),
            }  # fmt: skip
            if method in previous:
                n0, t0 = previous[method]
                row["exponent"] = round(math.log(ms / t0) / math.log(tokens / n0), 3)
            previous[method] = (tokens, ms)
            rows.append(row)
        print(f"latency {size} px done", flush=True)
    return rows


def kept_latency_rows(args: argparse.Namespace) -> list[dict]:
    """With ``--keep-latency``: the latency rows of ``--out`` when they are of the same model, sizes and
    threads (the accuracy of more seeds added without timing again); else none."""
    if not (args.keep_latency and args.out.is_file()):
        return []
    with args.out.open(newline="") as f:
        kept = [
            {k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f) if r["measure"] == "latency"
        ]
    same = [
        r for r in kept if r["model"] == args.latency_model and int(r["threads"]) == torch.get_num_threads()
    ]
    if sorted({int(r["img_size"]) for r in same}) != sorted(set(args.sizes)):
        return []
    numbers = {
        "img_size": int, "tokens": int, "threads": int, "ms_per_image": float, "ms_per_ktoken": float,
        "exponent": float,
    }  # fmt: skip
    print(f"latency: kept from {args.out}", flush=True)
    return [{k: numbers.get(k, str)(v) for k, v in r.items()} for r in same]


# ------------------------------------------------------------------------------------------------ report
def _stats(values: list[float]) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {sd:.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def report(rows: list[dict], budget_epochs: int) -> None:
    acc = [r for r in rows if r["measure"] == "accuracy"]
    by = lambda method, epochs=None: [  # noqa: E731
        r for r in acc if r["method"] == method and (epochs is None or r["epochs"] == epochs)
    ]
    teacher, converted, scratch = by("teacher"), by("converted"), by("scratch", budget_epochs)
    if not (teacher and converted and scratch):
        return
    print(f"\nteacher val top-1      {_stats([r['val_top1'] for r in teacher])}")
    print(f"converted val top-1    {_stats([r['val_top1'] for r in converted])}")
    print(f"scratch val top-1      {_stats([r['val_top1'] for r in scratch])}  (same steps as converted)")
    print(f"converted / teacher    {_stats([100 * r['of_teacher'] for r in converted])} %")
    margin = [c["val_top1"] - s["val_top1"] for c, s in zip(converted, scratch)]
    print(f"converted - scratch    {_stats(margin)} points (paired by seed)")
    print(
        f"budget                 {converted[0]['steps']} steps = {100 * converted[0]['budget']:.1f}% of the "
        "teacher's"
    )


def plot(rows: list[dict], curves: dict[str, dict[int, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = [r for r in rows if r["measure"] == "latency"]
    fig, axes = plt.subplots(1, 2 if lat else 1, figsize=(12 if lat else 6.4, 4.4), squeeze=False)
    ax = axes[0][0]
    for method, runs in curves.items():
        if not runs:
            continue
        points: dict[int, list[float]] = {}
        for history in runs.values():
            for r in history:
                if r.get("val_top1") is not None:
                    points.setdefault(int(r["step"]), []).append(float(r["val_top1"]))
        steps = sorted(points)
        mean = [statistics.fmean(points[s]) for s in steps]
        ax.plot(steps, mean, marker="o", label=f"{method} (mean of {len(runs)} seeds)")
        ax.fill_between(steps, [min(points[s]) for s in steps], [max(points[s]) for s in steps], alpha=0.2)
    ax.set(
        xlabel="optimizer steps of the run", ylabel="val top-1 (%)", title="digits: accuracy against steps"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    if lat:
        ax = axes[0][1]
        for method in ("teacher", "converted"):
            pts = [(r["tokens"], r["ms_per_image"]) for r in lat if r["method"] == method]
            ax.loglog(*zip(*pts), marker="o", label=method)
        n = [r["tokens"] for r in lat if r["method"] == "converted"]
        t = [r["ms_per_image"] for r in lat if r["method"] == "converted"]
        ax.loglog(n, [t[0] * k / n[0] for k in n], ls="--", color="gray", label="linear in tokens")
        ax.set(
            xlabel="tokens",
            ylabel="ms / image",
            title=f"inference, {lat[0]['model']}, {lat[0]['threads']} thread(s)",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    save_figure(fig, path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--teacher-epochs", type=int, default=12)
    p.add_argument("--budget-epochs", type=int, default=3, help="epochs of the conversion and of scratch")
    p.add_argument(
        "--transfer-epochs", type=int, default=1, help="attention-transfer epochs of the conversion"
    )
    p.add_argument("--scratch-epochs", type=int, nargs="*", default=[], help="more scratch budgets (epochs)")
    p.add_argument(
        "--sizes", type=int, nargs="*", default=[224, 384, 512, 768, 1024], help="latency sizes (px)"
    )
    p.add_argument("--latency-model", default="vit_tiny_patch16_224")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per latency size")
    p.add_argument(
        "--keep-latency",
        action="store_true",
        help="reuse the latency rows of --out (same model, sizes, threads)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", type=Path, default=REPO / "output" / "bench_convert", help="the runs' folders")
    p.add_argument("--out", type=Path, default=RESULTS / "convert_cpu.csv")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run")
    p.add_argument("--override", nargs="*", default=[], help="key=value config overrides for every run")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows, curves = accuracy_rows(args)
    if args.sizes:
        rows += kept_latency_rows(args) or latency_rows(args)
    write_csv(rows, args.out)
    plot(rows, curves, args.out.with_suffix(".png"))
    print_table([{k: v for k, v in r.items() if k != "measure"} for r in rows if r["measure"] == "accuracy"])
    print()
    print_table([{k: v for k, v in r.items() if k != "measure"} for r in rows if r["measure"] == "latency"])
    report(rows, args.budget_epochs)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
