"""The README's fine-tuning recipe on small folders of real photographs, against linear probes.

Runs the README's "From the demo to your own photographs" word for word in a work folder, per folder (3 and 6
classes) and seed, against ``probe_recipe`` (the classifier alone trains) and ``probe_logreg`` (a tuned
logistic regression on the frozen features). Accuracy is the final epoch's val top-1. Not a timing benchmark.
Method: benchmarks/README.md.

    python benchmarks/finetune.py              # 3 and 6 classes x seeds 0 1 2 -> results/finetune_cpu.csv
    python benchmarks/finetune.py --seeds 0 1 2 3 4 --jobs 2 --threads 1
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, print_table, save_figure, write_csv
from vit3.data import build_datasets, build_transform
from vit3.data.samples import make_photo_folder
from vit3.engine import load_config
from vit3.engine.checkpoint import apply_model_record
from vit3.engine.classification import build_model, data_stats, input_channels, resolve_data_cfg
from vit3.engine.config import CONFIG_DIR
from vit3.models.record import model_record, peek_vit3_checkpoint

REPO = Path(__file__).resolve().parents[1]
METHODS = ("finetune", "probe_recipe", "probe_logreg")
ORDER = ("finetune", "probe_logreg", "probe_recipe")  # the order runs start in


def readme_commands(readme: Path = REPO / "README.md") -> list[list[str]]:
    """The commands of the README's "From the demo to your own photographs" block, each as argv."""
    text = readme.read_text(encoding="utf-8")
    block = text[text.index("From the demo to your own photographs") :]
    start = block.index("```bash")
    block = block[start + len("```bash") : block.index("```", start + 7)]
    return [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.strip()]


def readme_finetune_command(readme: Path = REPO / "README.md") -> list[str]:
    """The README's fine-tune command (``python train.py --config configs/finetune.yaml ...``) as argv."""
    argv = next(a for a in readme_commands(readme) if "configs/finetune.yaml" in a)
    if argv[:2] != ["python", "train.py"]:
        raise ValueError(f"the README's fine-tune line is not a train.py command: {shlex.join(argv)}")
    return argv


def _train(work: Path, argv: list[str], log: Path) -> None:
    """Runs ``python train.py ...`` (the repository's) in ``work``."""
    cmd = [sys.executable, str(REPO / "train.py"), *argv[2:]]
    with log.open("w") as f:
        done = subprocess.run(cmd, cwd=work, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {done.returncode}), see {log}")


def _run_row(work: Path, argv: list[str], name: str, reuse: bool) -> dict:
    """One fine-tune run of the README command in ``work``: its figures from summary.json / config.yaml.
    ``reuse``: a finished run already there (its summary.json) is read, not run again."""
    import yaml

    out = work / "output" / name
    if not (reuse and (out / "summary.json").is_file()):
        shutil.rmtree(out, ignore_errors=True)  # a fresh run, not the continuation of an earlier one
        _train(work, [*argv, f"output=output/{name}"], work / f"{name}.log")
    summary = json.loads((out / "summary.json").read_text())
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    last = summary["final"]
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    return {
        "val_top1": float(last["val_top1"]),
        "best_top1": float(summary["best_top1"]),
        "steps": int(rows[-1]["step"]),
        "batch": int(cfg["data"]["batch_size"]),
        "epochs": int(cfg["train"]["epochs"]),
        "wall_s": summary["wall_time_s"],
    }


@torch.no_grad()
def _features(demo: Path, folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The demo backbone's pooled features ``[N, C]`` and labels of the folder's train and val images, through
    the val transform that fine-tuning evaluates with."""
    cfg = load_config(CONFIG_DIR / "finetune.yaml", [f"data.path={folder}", f"model.pretrained={demo}"])
    apply_model_record(cfg, model_record(peek_vit3_checkpoint(demo)), str(demo))
    chans = input_channels(cfg)
    data = build_datasets(cfg, chans)
    model, _ = build_model(cfg, len(data["classes"]), str(demo))
    resolve_data_cfg(cfg, model, chans)
    model.eval()
    transform = build_transform(cfg, False, *data_stats(cfg))
    out = {}
    for split in ("train", "val"):
        images, labels = zip(*(data[split][i] for i in range(len(data[split]))))
        x = torch.stack([transform(img) for img in images])  # [N, C_in, H, W]
        feats = model.forward_head(model.forward_features(x), pre_logits=True)  # [N, C]
        out[split] = (feats.numpy(), np.asarray(labels))
    return out


def _logreg_row(demo: Path, folder: Path, seed: int) -> dict:
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    start = time.perf_counter()
    feats = _features(demo, folder)
    (xt, yt), (xv, yv) = feats["train"], feats["val"]
    probe = make_pipeline(
        StandardScaler(),
        LogisticRegressionCV(
            Cs=np.logspace(-4, 4, 17), cv=4, scoring="accuracy", max_iter=10_000, random_state=seed
        ),
    )
    with warnings.catch_warnings():  # scikit-learn's notes on defaults that change in later versions
        warnings.simplefilter("ignore", FutureWarning)
        probe.fit(xt, yt)
    top1 = float((probe.predict(xv) == yv).mean() * 100)
    return {"val_top1": top1, "best_top1": top1, "wall_s": round(time.perf_counter() - start, 1)}


def _summary(rows: list[dict]) -> list[dict]:
    out = []
    for classes in sorted({r["classes"] for r in rows}):
        for method in METHODS:
            acc = [r["val_top1"] for r in rows if r["classes"] == classes and r["method"] == method]
            if not acc:
                continue
            out.append(
                {
                    "classes": classes,
                    "method": method,
                    "seeds": len(acc),
                    "mean": round(statistics.mean(acc), 2),
                    "std": round(statistics.stdev(acc), 2) if len(acc) > 1 else 0.0,
                    "min": round(min(acc), 2),
                    "max": round(max(acc), 2),
                    "chance": round(100 / classes, 2),
                }
            )
    return out


def _plot(rows: list[dict], summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len({s["classes"] for s in summary}), figsize=(9, 3.8), squeeze=False)
    for ax, classes in zip(axes[0], sorted({s["classes"] for s in summary})):
        ss = [s for s in summary if s["classes"] == classes]
        ax.bar(range(len(ss)), [s["mean"] for s in ss], yerr=[s["std"] for s in ss], capsize=4, alpha=0.6)
        for i, s in enumerate(ss):
            acc = [r["val_top1"] for r in rows if r["classes"] == classes and r["method"] == s["method"]]
            ax.plot([i] * len(acc), acc, "k.", alpha=0.7)
        ax.axhline(100 / classes, color="r", ls="--", lw=1, label="chance")
        ax.set_xticks(range(len(ss)), [s["method"] for s in ss])
        ax.set_ylim(0, 100)
        ax.set_title(f"{classes} classes (16 train / 16 val images each)")
        ax.set_ylabel("val top-1 (%), final epoch")
        ax.legend(loc="lower right")
    fig.suptitle("README fine-tune recipe from the MNIST demo vs linear probes (mean ± std over seeds)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--work", type=Path, default=Path("output/bench_finetune"), help="work folder (runs, logs)"
    )
    p.add_argument("--classes", type=int, nargs="+", default=[3, 6])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train", type=int, default=16, help="training images per class")
    p.add_argument("--val", type=int, default=16, help="val images per class")
    p.add_argument("--jobs", type=int, default=1, help="training runs at once")
    p.add_argument("--threads", type=int, default=None, help="adds threads=N to every command")
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides (quick checks only)"
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="read the runs already finished in --work (a stopped benchmark goes on)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "finetune_cpu.csv")
    args = p.parse_args(argv)

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    threads = [f"threads={args.threads}"] if args.threads else []
    extra = [*threads, *args.set]
    demo = work / "output" / "demo" / "best.pt"
    if not demo.is_file():  # the README's first command, once
        print(f"training the demo (python train.py) in {work} ...", flush=True)
        _train(work, ["python", "train.py", *threads], work / "demo.log")
    command = readme_finetune_command()
    print("README command:", shlex.join(command), flush=True)

    tasks = []
    for classes in args.classes:
        for seed in args.seeds:
            run_dir = work / f"c{classes}_s{seed}"
            (run_dir / "output").mkdir(parents=True, exist_ok=True)
            if not (run_dir / "output" / "demo").exists():
                (run_dir / "output" / "demo").symlink_to(demo.parent)
            photos = run_dir / "photos"
            if not photos.is_dir():
                make_photo_folder(photos, args.train, args.val, size=64, seed=seed, classes=classes)
            base = {"classes": classes, "seed": seed}
            runs = {
                "finetune": [*command, f"seed={seed}", *extra],
                "probe_recipe": [*command, f"seed={seed}", "train.freeze=backbone", *extra],
            }
            for method, cmd in runs.items():
                tasks.append(({**base, "method": method}, run_dir, cmd))
            tasks.append(({**base, "method": "probe_logreg"}, run_dir, None))

    rows: list[dict] = []
    lock = threading.Lock()

    def do(task) -> None:
        base, run_dir, cmd = task
        if cmd is None:
            row = _logreg_row(demo, run_dir / "photos", base["seed"])
        else:
            row = _run_row(run_dir, cmd, base["method"], args.reuse)
        row = {**base, **row}
        print(json.dumps(row), flush=True)
        with lock:  # the CSV so far after each run: a stopped benchmark keeps what finished
            rows.append(row)
            rows.sort(key=lambda r: (r["classes"], METHODS.index(r["method"]), r["seed"]))
            write_csv(rows, args.out)

    tasks.sort(key=lambda t: ORDER.index(t[0]["method"]))  # the recipe and the cheap probe first
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(do, tasks))
    summary = _summary(rows)
    print_table(rows)
    print()
    print_table(summary)
    write_csv(summary, args.out.with_name(args.out.stem + "_summary.csv"))
    _plot(rows, summary, args.out.with_suffix(".png"))
    print(
        f"wrote {args.out}, {args.out.with_name(args.out.stem + '_summary.csv')}, "
        f"{args.out.with_suffix('.png')}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
