"""The paper's design-space tables, runnable: ``python -m vit3.ablate configs/ablations/<table>/``.

Trains every row (YAML) of a table under one budget and writes ``results.csv``, ``results.md`` and
``results.png`` beside one run folder per row. Budgets: default (embedded MNIST, shrunk backbone, 6 epochs),
``--data PATH`` (an image folder, the rows' own recipe), ``--quick`` (a smoke test), ``--epochs N``.
Occupied row folders are refused unless ``--resume`` or ``--overwrite``. Details: docs/ablations.md.

    python -m vit3.ablate configs/ablations/loss/ --quick
    python -m vit3.ablate configs/ablations/lr/ --data /data/imagenet --epochs 100 device=cuda
    python -m vit3.ablate configs/ablations/loss/ --quick --resume   # finish a killed table
    python -m vit3.ablate --catalog   # the table of configs/ablations/README.md
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine import Config, ConfigError, load_config
from .engine.cli import ArgumentParser, is_user_error, run_cli, user_message
from .engine.config import CONFIG_DIR, WRITTEN_KEY, check_config, parse_override
from .engine.config.path_checks import existing, folder_problem
from .outputs import CHECKPOINT_FILES, atomic_write, hold_folder, write_text

ABLATIONS_DIR = CONFIG_DIR / "ablations"
BUDGET_DIR = ABLATIONS_DIR / "budgets"
# Keys that differ between rows without being a knob of the study.
_BOOKKEEPING = ("output", "_config_file", WRITTEN_KEY, "ablation")
_KNOB_PREFIX = "model.kwargs.ttt_cfg."
# The table folders of configs/ablations in the paper's order.
TABLES = ("loss", "batch", "epochs", "lr", "inner_model", "deep_fixes", "scale")

__all__ = [
    "Row", "RowResult", "catalog_markdown", "check_folders", "check_table", "knob", "load_rows", "main",
    "reference_row", "row_config", "run_rows",
]  # fmt: skip


# ------------------------------------------------------------------------------------------------- rows
@dataclass
class Row:
    """One row of a design-space table: its config file and what the paper reports for it."""

    path: Path
    table: str
    label: str
    paper: float | str | None  # ImageNet-1K top-1, "diverged", or None (not reported)
    order: int
    base: bool
    cfg: Config = field(repr=False)

    @property
    def name(self) -> str:
        return self.path.stem


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _read_row(path: Path) -> Row:
    cfg = load_config(path)
    meta = cfg.get("ablation")
    if not isinstance(meta, Mapping) or "table" not in meta or "row" not in meta:
        raise ConfigError(
            f"{path} is not an ablation row: it needs an 'ablation:' section with table and row"
        )
    paper = meta.get("paper_top1")
    if not (paper is None or paper == "diverged" or isinstance(paper, (int, float))):
        raise ConfigError(f"{path}: ablation.paper_top1 must be a number, 'diverged' or null, got {paper!r}")
    return Row(
        path, str(meta.table), str(meta.row), paper, int(meta.get("order", 0)), bool(meta.get("base")), cfg
    )


def load_rows(paths: Sequence[str | Path]) -> list[Row]:
    """The rows of the given table folders and/or row files, in table order (``ablation.order``).

    Raises:
        ConfigError: a path that does not exist, a folder without YAML files, a file without ``ablation:``.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.glob("*.yaml"))
            if not found:
                raise ConfigError(f"no *.yaml rows in {path}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"ablation table or row not found: {path}")
    rows = [_read_row(f) for f in files]
    return sorted(rows, key=lambda r: (r.table, r.order, r.name))


def knob(row: Row, base: Row) -> str:
    """What ``row`` changes from ``base``: ``"loss=mse"`` (mixer keys without their prefix), ``""`` for the
    base."""
    mine, ref = _flatten(row.cfg.to_dict()), _flatten(base.cfg.to_dict())
    changed = []
    for key in sorted(set(mine) | set(ref)):
        if key.split(".")[0] in _BOOKKEEPING or mine.get(key) == ref.get(key):
            continue
        value = mine.get(key)
        shown = ",".join(map(str, value)) if isinstance(value, list) else value
        changed.append(f"{key.removeprefix(_KNOB_PREFIX)}={shown}")
    return " ".join(changed)


def reference_row(rows: Sequence[Row], root: Path = ABLATIONS_DIR) -> Row:
    """What each row's change is told against: the one base row among ``rows``, else the shipped
    ``base.yaml`` every table's rows build on (as :func:`catalog_markdown` tells it)."""
    bases = [r for r in rows if r.base]
    if len(bases) == 1:
        return bases[0]
    return Row(root / "base.yaml", "", "", None, 0, True, load_config(root / "base.yaml"))


# ----------------------------------------------------------------------------------------------- budget
def _apply(cfg: Config, overlay: Mapping[str, Any]) -> None:
    for key, value in _flatten(overlay).items():
        cfg.set_path(key, value)


def row_config(
    row: Row,
    out: Path,
    *,
    data: str | None = None,
    quick: bool = False,
    epochs: int | None = None,
    overrides: Sequence[str] = (),
    resume: bool = False,
    overwrite: bool = False,
) -> Config:
    """The config one row trains with under the runner's budget (see the module docstring), in
    ``out/<row name>``; ``resume``: continue from that folder's ``last.pt`` if there is one; ``overwrite``:
    move an earlier run's files there aside.

    Raises:
        ConfigError: an override names an unknown key, or a value has the wrong type or range.
    """
    cfg = load_config(row.path)
    overlays = [] if data else [BUDGET_DIR / "mnist.yaml"]
    overlays += [BUDGET_DIR / "quick.yaml"] if quick else []
    for path in overlays:
        overlay = load_config(path).to_dict()
        overlay.pop("_config_file", None)
        _apply(cfg, overlay)
    if data:
        _apply(cfg, {"data": {"dataset": "folder", "path": str(data)}})
    if epochs is not None:
        if epochs < 1:
            raise ConfigError(f"--epochs must be >= 1, got {epochs}")
        warmup = float(cfg.train.warmup_epochs) * epochs / float(cfg.train.epochs)
        _apply(cfg, {"train": {"epochs": epochs, "warmup_epochs": warmup}})
    for text in overrides:
        cfg.set_path(*parse_override(text))
    _apply(cfg, {"output": str(out / row.name), "train": {"progress": "run"}})
    if resume:
        cfg.set_path("train.resume", "auto")
    if overwrite:
        cfg.set_path("train.overwrite", True)
    check_config(cfg)
    return cfg


TABLE_FILES = ("results.csv", "results.md", "results.png")


def check_table(rows: Sequence[Row], out: Path, resume: bool = False, overwrite: bool = False) -> None:
    """Checks, before any row trains, that the table's files (:data:`TABLE_FILES`) would replace no other
    table's: ``out`` holds none, or ``overwrite`` (they are moved aside), or ``resume`` of the table whose
    rows its ``results.csv`` lists (all of them rows of this command).

    Raises:
        ConfigError: naming the folder, the files and the ways on.
    """
    held = [name for name in TABLE_FILES if (out / name).is_file()]
    if not held or overwrite:
        return
    if resume:
        try:
            with open(out / "results.csv", newline="", encoding="utf-8") as f:
                earlier = {Path(line["file"]).resolve() for line in csv.DictReader(f)}
        except (OSError, KeyError, csv.Error):
            earlier = None
        if earlier is not None and earlier <= {row.path.resolve() for row in rows}:
            return
    raise ConfigError(
        f"{out} holds the results of {'another' if resume else 'an earlier'} table ({', '.join(held)}), "
        "which this "
        f"one would overwrite: give it a new --output; --overwrite moves them into {out}/replaced-<time>/ "
        "first"
    )


def check_folders(rows: Sequence[Row], out: Path, again: bool = False) -> None:
    """Checks, before any row trains, that no two rows share a run folder and, unless ``again`` (the runner
    resumes or overwrites), that no row's folder holds an earlier run's checkpoints.

    Raises:
        ConfigError: naming the rows or the folder, and the ways on.
    """

    owners: dict[Path, Row] = {}
    for row in rows:
        folder = out / row.name
        if folder in owners:
            raise ConfigError(
                f"rows {owners[folder].path} and {row.path} would train in the same folder {folder}: run "
                "them "
                f"in separate commands (or give one of the files another name)"
            )
        owners[folder] = row
    taken = [f for f in owners if any((f / name).is_file() for name in CHECKPOINT_FILES)]
    if taken and not again:
        more = f" (and {len(taken) - 1} more rows' folders)" if len(taken) > 1 else ""
        raise ConfigError(
            f"{taken[0]} holds the checkpoints of an earlier run{more}, which this table would overwrite: "
            "continue the table with --resume (finished rows are read back, a killed one continues), or "
            "give "
            "it a new --output; --overwrite moves each row's old files into <row folder>/replaced-<time>/ "
            "first"
        )


def budget_summary(cfg: Config) -> str:
    """One line describing the budget a row config trains with."""
    kw = cfg.model.kwargs
    backbone = ", ".join(f"{k} {kw[k]}" for k in ("embed_dim", "depth", "num_heads", "patch_size") if k in kw)
    data = "MNIST demo digits" if cfg.data.dataset == "mnist5k" else f"image folder {cfg.data.path}"
    return (
        f"{cfg.model.name} ({backbone or 'default size'}) at {cfg.data.img_size}px on {data}, "
        f"{cfg.train.epochs} epoch(s), batch {cfg.data.batch_size}, seed {cfg.seed}"
    )


# -------------------------------------------------------------------------------------------------- run
@dataclass
class RowResult:
    """What one row's run gave: the last epoch's validation (``top1``, ``top5``, ``val_loss``) and the best
    epoch's top-1 (a diverged row keeps the best epoch before it diverged)."""

    row: Row
    knob: str
    status: str  # "ok" | "diverged" | "error"
    top1: float | None = None
    top5: float | None = None
    val_loss: float | None = None
    best_top1: float | None = None
    best_epoch: int | None = None
    epochs: int | None = None  # epochs validated
    params_m: float | None = None
    wall_s: float = 0.0
    message: str = ""
    output: str = ""


def _train_row(cfg: Config) -> dict[str, Any]:
    from .engine import run

    return run(cfg, "train")


def run_rows(rows: Sequence[Row], out: Path, log=print, **budget: Any) -> list[RowResult]:
    """Trains every row under the same budget (keywords of :func:`row_config`); never raises for one row."""
    from .engine.classification import TrainingDiverged

    base = reference_row(rows)
    results = []
    for i, row in enumerate(rows, 1):
        res = RowResult(row, knob(row, base), "error")
        log(f"[{i}/{len(rows)}] {row.table}: {row.label} ({row.path}) {res.knob}")
        tick = time.perf_counter()
        try:
            cfg = row_config(row, out, **budget)
            res.output = str(cfg.output)
            summary = _train_row(cfg)
            final = summary["final"]
            res.status = "ok"
            res.top1, res.top5, res.val_loss = (
                final.get("val_top1"),
                final.get("val_top5"),
                final.get("val_loss"),
            )
            res.params_m = _params_m(cfg)
        except TrainingDiverged as exc:
            res.status, res.message = "diverged", str(exc)
        except Exception as exc:  # one failing row must not lose the others: it is reported as an error
            res.message = f"{type(exc).__name__}: {exc}"
            log(f"error: {user_message(exc)}" if is_user_error(exc) else traceback.format_exc())
        if res.output:
            res.best_top1, res.best_epoch, res.epochs = _best_epoch(Path(res.output))
        res.wall_s = time.perf_counter() - tick
        if res.status == "ok":  # the whole run's (a resumed row's time before the resume included)
            res.wall_s = float(summary.get("wall_time_s", res.wall_s))
        log(
            f"    -> {res.status}"
            + (f": top-1 {res.top1:.2f}%" if res.top1 is not None else f" ({res.message})")
        )
        results.append(res)
    return results


def _best_epoch(run_dir: Path) -> tuple[float | None, int | None, int | None]:
    """The best val top-1 of a run, its epoch and the number of validated epochs (``metrics.json``)."""
    import json

    try:
        history = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None, None
    rows = [r for r in history if _num(r.get("val_top1")) is not None]
    if not rows:
        return None, None, None
    best = max(rows, key=lambda r: r["val_top1"])  # the first of equal bests
    return float(best["val_top1"]), int(best["epoch"]), len(rows)


def _params_m(cfg: Config) -> float | None:
    """Parameters (millions) of the row's trained model, read from its last checkpoint."""
    from .models.record import load_checkpoint

    try:
        state = load_checkpoint(Path(cfg.output) / "last.pt")["model"]
    except (OSError, ValueError, KeyError):
        return None
    return sum(t.numel() for t in state.values()) / 1e6  # the plain ViT³ has no buffers


# ------------------------------------------------------------------------------------------------ report
def _paper(paper: float | str | None) -> str:
    if paper is None:
        return "n/a"
    return paper if isinstance(paper, str) else f"{paper:.1f}"


def _ours(res: RowResult) -> str:
    if res.status == "ok" and res.top1 is not None:
        return f"{res.top1:.2f}"
    return res.status


def _best(res: RowResult) -> str:
    return f"{res.best_top1:.2f} (epoch {res.best_epoch}/{res.epochs})" if res.best_top1 is not None else "—"


def _delta(value: float | None, ref: float | None) -> str:
    if value is None or ref is None:
        return ""
    return f"{value - ref:+.2f}" if isinstance(value, float) and isinstance(ref, float) else ""


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks (1-based, ties averaged)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two equally long sequences (``None`` below 3 points or without
    spread)."""
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var > 0 else None


def results_markdown(results: Sequence[RowResult], budget: str, command: str) -> str:
    """The results as a markdown table beside the paper's numbers (Δ: against the table's base row; "last":
    the last epoch's val top-1, "best": the best epoch's, with its epoch out of the epochs validated)."""
    base = next((r for r in results if r.row.base), None)
    paper_ref = _num(base.row.paper) if base else None
    ours_ref = base.top1 if base and base.status == "ok" else None
    tables = sorted({r.row.table for r in results})
    lines = [
        f"### {' / '.join(tables)}",
        "",
        f"Budget: {budget}. Command: `{command}`. Paper: ImageNet-1K top-1 of the DeiT-S-sized model, 300 "
        "epochs.",
        "",
        "| row | config | change | paper top-1 | Δ paper | last top-1 here | Δ here | best top-1 here "
        "(epoch) "
        "| status | wall (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        label = f"**{r.row.label}** (base)" if r.row.base else r.row.label
        lines.append(
            f"| {label} | `{r.row.path.parent.name}/{r.row.path.name}` | {r.knob or '—'} | "
            f"{_paper(r.row.paper)} "
            f"| {_delta(_num(r.row.paper), paper_ref)} | {_ours(r)} | {_delta(r.top1, ours_ref)} | "
            f"{_best(r)} "
            f"| {r.status} | {r.wall_s:.0f} |"
        )
    pairs = [
        (_num(r.row.paper), r.top1) for r in results if _num(r.row.paper) is not None and r.top1 is not None
    ]
    rho = spearman([p for p, _ in pairs], [o for _, o in pairs])
    total = sum(r.wall_s for r in results)
    lines += ["", f"Total wall time: {total:.0f} s."]
    if rho is not None:
        lines.append(f"Rank correlation with the paper (Spearman, {len(pairs)} rows): {rho:+.2f}.")
    return "\n".join(lines) + "\n"


CSV_FIELDS = (
    "table", "row", "file", "base", "change", "paper_top1", "status", "top1", "top5", "val_loss", "best_top1",
    "best_epoch", "epochs", "params_m", "wall_s", "output", "message",
)  # fmt: skip


def write_csv(results: Sequence[RowResult], path: Path) -> Path:
    """One line per row (``CSV_FIELDS``), written atomically."""
    with atomic_write(path, "table", text=True, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            writer.writerow(
                {
                    "table": r.row.table, "row": r.row.label, "file": str(r.row.path), "base": r.row.base,
                    "change": r.knob, "paper_top1": "" if r.row.paper is None else r.row.paper,
                    "status": r.status, "top1": r.top1, "top5": r.top5, "val_loss": r.val_loss,
                    "best_top1": r.best_top1,
                    "best_epoch": r.best_epoch, "epochs": r.epochs, "params_m": r.params_m,
                    "wall_s": round(r.wall_s, 1), "output": r.output, "message": r.message,
                }
            )  # fmt: skip
    return path


def plot_results(results: Sequence[RowResult], path: Path, budget: str) -> Path | None:
    """Side-by-side horizontal bars: the paper's ImageNet-1K top-1 and this run's top-1, one bar per row."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # headless
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [r.row.label + (" (base)" if r.row.base else "") for r in results]
    panels = [
        (
            "paper: ImageNet-1K top-1 (%)",
            [_num(r.row.paper) for r in results],
            [_paper(r.row.paper) for r in results],
        ),
        ("this run: last-epoch val top-1 (%)", [r.top1 for r in results], [_ours(r) for r in results]),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(results) + 1.6), sharey=True)
    for ax, (title, values, texts) in zip(axes, panels):
        known = [v for v in values if v is not None]
        lo = min(known) if known else 0.0
        hi = max(known) if known else 1.0
        pad = max(0.5, 0.15 * (hi - lo))
        left = max(0.0, lo - pad)
        ys = list(range(len(results)))
        colours = ["tab:orange" if r.row.base else "tab:blue" for r in results]
        ax.barh(ys, [(v if v is not None else left) - left for v in values], left=left, color=colours)
        for y, v, text in zip(ys, values, texts):
            ax.text(v if v is not None else left, y, f" {text}", va="center", fontsize=8,
                    color="black" if v is not None else "tab:red")  # fmt: skip
        ax.set_xlim(left, hi + 1.2 * pad)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(results)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{' / '.join(sorted({r.row.table for r in results}))}\n{budget}", fontsize=9)
    fig.tight_layout()
    try:
        with atomic_write(path, "plot") as f:
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------- catalog
def catalog_markdown(root: Path = ABLATIONS_DIR) -> str:
    """The table of every ablation row under ``root``: file, table, row, change from the base, paper top-1."""
    lines = [
        "| file | table | paper's row | change from `base.yaml` | paper top-1 |",
        "| --- | --- | --- | --- | --- |",
    ]
    folders = [root / t for t in TABLES if (root / t).is_dir()]
    folders += sorted(p for p in root.iterdir() if p.is_dir() and p not in folders and p.name != "budgets")
    rows = [row for d in folders for row in load_rows([d])]  # the paper's table order, then row order
    rows += load_rows(sorted(p for p in root.glob("*.yaml") if p.name != "base.yaml"))
    base = reference_row((), root)
    for row in rows:
        rel = row.path.relative_to(root).as_posix()
        change = knob(row, base) or "— (base row)"
        lines.append(f"| `{rel}` | {row.table} | {row.label} | {change} | {_paper(row.paper)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------- main
# What the runner's own path flags need (checked before any row trains).
_FLAG_NEEDS = {"--data": "an existing image folder", "--output": "a folder this table can write"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m vit3.ablate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "paths", nargs="*", help="table folders and/or row files, then key.sub=value overrides"
    )
    parser.add_argument("--data", default=None, help="an image folder (default: the embedded MNIST digits)")
    parser.add_argument("--quick", action="store_true", help="the quick budget (budgets/quick.yaml)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per row (warmup scaled alike)")
    parser.add_argument("--output", default=None, help="results folder (default: output/ablations/<table>)")
    again = parser.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="continue each row from its folder's last.pt (a killed table)"
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="train again in folders that hold an earlier table's rows, moving their files aside first",
    )
    parser.add_argument("--catalog", action="store_true", help="print the table of all rows and exit")
    resume = "the same command with --resume"  # the table continues, each row from its last.pt
    return run_cli(parser, lambda args: _main(args, argv), argv, resume=resume)  # arguments in any order


def _main(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """The runner's work once its arguments are parsed: every row checked, then the table trained.

    Raises:
        UserError: a mistake in the arguments, the rows or the folders, found before any row trains.
    """
    if args.catalog:
        print(catalog_markdown(), end="")
        return 0
    paths = [p for p in args.paths if "=" not in p]
    overrides = [p for p in args.paths if "=" in p]
    if not paths:
        raise ConfigError("give a table folder (e.g. configs/ablations/loss/) or row files")
    rows = load_rows(paths)
    if args.output:
        out = Path(args.output)
    else:
        name = Path(paths[0]).stem if len(paths) == 1 else "custom"
        out = Path("output/ablations") / (name + ("-quick" if args.quick else ""))
    budget = dict(
        data=args.data, quick=args.quick, epochs=args.epochs, overrides=overrides, resume=args.resume,
        overwrite=args.overwrite,
    )  # fmt: skip
    problems = {
        "--data": args.data and existing("folder")(args.data, None),
        "--output": folder_problem(out),
    }
    for flag, why in problems.items():
        if why:
            value = args.data if flag == "--data" else out
            raise ConfigError(f"{flag} must be {_FLAG_NEEDS[flag]}, got '{value}': {why}")
    configs = [row_config(row, out, **budget) for row in rows]
    for cfg in configs:  # what a run needs on this machine (its data, a folder it can write): before any row
        check_config(cfg, "train")
    summary = budget_summary(configs[0])
    with hold_folder(out, "give this table another --output"):  # for the whole table
        check_folders(rows, out, again=args.resume or args.overwrite)
        check_table(rows, out, resume=args.resume, overwrite=args.overwrite)
        return _run_table(rows, out, budget, summary, args.overwrite, argv)


def _run_table(
    rows: Sequence[Row],
    out: Path,
    budget: dict[str, Any],
    summary: str,
    overwrite: bool,
    argv: Sequence[str] | None,
) -> int:
    """Trains the rows (:func:`run_rows`) and writes the table: ``results.md``, ``.csv`` and ``.png``."""
    if overwrite:
        from .engine.run_folder import move_aside

        target, moved = move_aside(out, TABLE_FILES, ())
        if moved:
            print(f"warning: --overwrite: moved the earlier table's {', '.join(moved)} to {target}")
    print(f"{len(rows)} row(s); budget: {summary}; results in {out}")
    results = run_rows(rows, out, **budget)
    command = "python -m vit3.ablate " + " ".join(argv if argv is not None else sys.argv[1:])
    md = results_markdown(results, summary, command)
    write_text(out / "results.md", md, "table")
    write_csv(results, out / "results.csv")
    png = plot_results(results, out / "results.png", summary)
    print("\n" + md)
    print(f"wrote {out / 'results.csv'}, {out / 'results.md'}" + (f", {png}" if png else ""))
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
