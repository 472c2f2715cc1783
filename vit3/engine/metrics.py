"""Per-epoch metrics as CSV and JSON, and loss / accuracy curves as PNGs (each file written atomically)."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..outputs import atomic_write, write_text

__all__ = ["plot_curves", "plot_series", "write_metrics"]


def write_metrics(history: Sequence[Mapping[str, Any]], out_dir: str | Path) -> tuple[Path, Path]:
    """Writes ``metrics.csv`` (one row per epoch, union of keys) and ``metrics.json`` (the list), each
    atomically (:func:`~vit3.outputs.atomic_write`)."""
    out = Path(out_dir)
    keys: list[str] = []
    for row in history:
        keys += [k for k in row if k not in keys]
    csv_path, json_path = out / "metrics.csv", out / "metrics.json"
    with atomic_write(csv_path, "metrics", text=True, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)
    write_text(json_path, json.dumps(list(history), indent=1), "metrics")
    return csv_path, json_path


def plot_curves(history: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Train/val loss and val top-1 (model and EMA) per epoch; a third panel for the per-layer transfer loss
    of a conversion (``val_transfer_loss_<i>``, log scale) when the rows have it. ``None`` if nothing to
    plot."""

    def points(key: str) -> list[tuple[float, float]]:
        return [(r["epoch"], r[key]) for r in history if r.get(key) is not None]

    panels = {
        "loss": {"train": points("train_loss"), "val": points("val_loss")},
        "accuracy": {
            "val top-1": points("val_top1"),
            "EMA top-1": points("ema_top1"),
            "val top-5": points("val_top5"),
        },
    }
    layers = sorted(
        {int(k.rpartition("_")[2]) for r in history for k in r if re.fullmatch(r"val_transfer_loss_\d+", k)}
    )
    panels["transfer loss (val)"] = {f"layer {i}": points(f"val_transfer_loss_{i}") for i in layers}
    ylabels = {
        "loss": "loss",
        "accuracy": "accuracy (%)",
        "transfer loss (val)": "MSE to the attention output",
    }
    return plot_series(
        panels, path, "epoch", ylabels=ylabels, marker="o", log_panels=("transfer loss (val)",)
    )


def plot_series(
    panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
    path: str | Path,
    xlabel: str = "step",
    log_y: bool = False,
    ylabels: Mapping[str, str] | None = None,
    marker: str | None = None,
    log_panels: Sequence[str] = (),
) -> Path | None:
    """One panel per entry of ``panels`` (title -> {label: [(x, y), ...]}), saved as a PNG; ``log_y`` (every
    panel) or ``log_panels`` (those titles) put the y axis on a log scale.

    Empty series and panels are left out; returns ``None`` (and writes nothing) when no series has a point.
    """
    panels = {title: {k: v for k, v in lines.items() if v} for title, lines in panels.items()}
    panels = {title: lines for title, lines in panels.items() if lines}
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items()):
        for label, pts in lines.items():
            ax.plot(*zip(*pts), marker=marker, label=label)
        if log_y or title in log_panels:
            ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel=(ylabels or {}).get(title, ""), title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_write(path, "plot") as f:
            fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=100)
    finally:
        plt.close(fig)
    return path
