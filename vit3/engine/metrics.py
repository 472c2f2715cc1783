"""Per-epoch metrics as CSV and JSON, and loss / accuracy curves as PNGs."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_curves", "plot_series", "write_metrics"]


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_metrics(history: Sequence[Mapping[str, Any]], out_dir: str | Path) -> tuple[Path, Path]:
    """Writes ``metrics.csv`` (one row per epoch, union of keys) and ``metrics.json`` (the list)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for row in history:
        keys += [k for k in row if k not in keys]
    csv_path, json_path = out / "metrics.csv", out / "metrics.json"
    tmp = csv_path.with_name(f".{csv_path.name}.tmp{os.getpid()}")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)
    os.replace(tmp, csv_path)
    _atomic_text(json_path, json.dumps(list(history), indent=1))
    return csv_path, json_path


def plot_curves(history: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Two panels: train/val loss and val top-1 (model and EMA) per epoch. ``None`` if nothing to plot."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    epochs = [row["epoch"] for row in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("train_loss", "train"), ("val_loss", "val")):
        pts = [(e, r[key]) for e, r in zip(epochs, history) if r.get(key) is not None]
        if pts:
            ax_loss.plot(*zip(*pts), marker="o", label=label)
    for key, label in (("val_top1", "val top-1"), ("ema_top1", "EMA top-1"), ("val_top5", "val top-5")):
        pts = [(e, r[key]) for e, r in zip(epochs, history) if r.get(key) is not None]
        if pts:
            ax_acc.plot(*zip(*pts), marker="o", label=label)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_series(
    panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
    path: str | Path,
    xlabel: str = "step",
    log_y: bool = False,
) -> Path | None:
    """One panel per entry of ``panels`` (title -> {label: [(x, y), ...]}), saved as a PNG.

    Returns ``None`` (and writes nothing) when no series has a point.
    """
    panels = {title: {k: v for k, v in lines.items() if v} for title, lines in panels.items()}
    panels = {title: lines for title, lines in panels.items() if lines}
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items()):
        for label, pts in lines.items():
            ax.plot(*zip(*pts), label=label)
        if log_y:
            ax.set_yscale("log")
        ax.set(xlabel=xlabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
