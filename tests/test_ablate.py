"""The design-space ablation configs (configs/ablations/) and their runner (``python -m vit3.ablate``)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import timm
import torch
from helpers.common import REPO

from vit3 import ablate
from vit3.ablate import ABLATIONS_DIR, TABLES, catalog_markdown, knob, load_rows, reference_row, row_config
from vit3.engine import load_config
from vit3.engine.classification import TrainingDiverged
from vit3.engine.config import CONFIG_DIR
from vit3.layers import TTTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TABLE_DIRS = [ABLATIONS_DIR / t for t in TABLES]
ALL_ROWS = load_rows([*TABLE_DIRS, ABLATIONS_DIR / "ttt_linear.yaml", ABLATIONS_DIR / "ttt_mlp.yaml"])
NOT_KNOBS = ("output", "_config_file", "ablation")


def _leaves(cfg) -> dict:
    return {k: v for k, v in ablate._flatten(cfg.to_dict()).items() if k.split(".")[0] not in NOT_KNOBS}


class TestConfigs:
    def test_every_table_folder_is_listed(self):
        folders = {p.name for p in ABLATIONS_DIR.iterdir() if p.is_dir()} - {"budgets"}
        assert folders == set(TABLES)

    @pytest.mark.parametrize("table", TABLES)
    def test_rows_change_only_their_knob(self, table):
        """One base row equal to base.yaml; every other row changes mixer keys (and nothing else) from it."""
        rows = load_rows([ABLATIONS_DIR / table])
        bases = [r for r in rows if r.base]
        assert len(bases) == 1, f"{table}: {len(bases)} base rows"
        base = bases[0]
        assert _leaves(base.cfg) == _leaves(load_config(ABLATIONS_DIR / "base.yaml"))
        assert len({r.label for r in rows}) == len(rows) and len({r.order for r in rows}) == len(rows)
        assert len({r.table for r in rows}) == 1
        for row in rows:
            if row is base:
                continue
            mine, ref = _leaves(row.cfg), _leaves(base.cfg)
            changed = {k for k in mine.keys() | ref.keys() if mine.get(k) != ref.get(k)}
            assert changed, f"{row.path} changes nothing"
            assert all(k.startswith("model.kwargs.ttt_cfg.") for k in changed), f"{row.path}: {changed}"

    @pytest.mark.parametrize("row", ALL_ROWS, ids=lambda r: f"{r.path.parent.name}/{r.name}")
    def test_rows_inherit_the_imagenet_recipe(self, row):
        recipe = load_config(CONFIG_DIR / "imagenet" / "vit3_small.yaml")
        for section in ("data", "aug", "train"):
            assert row.cfg[section].to_dict() == recipe[section].to_dict(), f"{row.path}: {section}"
        assert (
            row.cfg.model.name == "vit3_small" and row.cfg.model.drop_path_rate == recipe.model.drop_path_rate
        )
        assert set(row.cfg.model.kwargs) == {"ttt_cfg"}
        TTTConfig.create(row.cfg.model.kwargs.ttt_cfg)  # a valid mixer config

    @pytest.mark.parametrize("row", ALL_ROWS, ids=lambda r: f"{r.path.parent.name}/{r.name}")
    def test_rows_run_under_the_quick_budget(self, row, tmp_path):
        """Each row builds and trains one step at the runner's quick budget, its mixer config untouched."""
        cfg = row_config(row, tmp_path, quick=True)
        assert cfg.model.kwargs.ttt_cfg == row.cfg.model.kwargs.ttt_cfg
        model = timm.create_model(cfg.model.name, num_classes=10, **cfg.model.kwargs)
        logits = model(torch.randn(2, 1, cfg.data.img_size, cfg.data.img_size))
        logits.sum().backward()
        assert logits.shape == (2, 10) and torch.isfinite(logits).all()

    def test_readme_table_is_the_catalog(self):
        readme = (ABLATIONS_DIR / "README.md").read_text(encoding="utf-8")
        assert catalog_markdown() in readme, (
            "configs/ablations/README.md: rerun `python -m vit3.ablate --catalog`"
        )

    def test_knob_names_the_change(self):
        rows = {r.path.relative_to(ABLATIONS_DIR).as_posix(): r for r in ALL_ROWS}
        base = rows["loss/dot.yaml"]
        assert knob(rows["loss/mse.yaml"], base) == "loss=mse"
        assert knob(rows["inner_model/conv.yaml"], base) == "branches=conv"
        assert knob(base, base) == ""

    def test_rows_chosen_without_their_base_row_are_told_against_base_yaml(self):
        """Two rows of a table, its base row not among them: each still names its change (against the
        shipped ``base.yaml``, as the catalog does), not "unchanged"."""
        chosen = ("loss/mse.yaml", "loss/mae.yaml")
        rows = {r.path.relative_to(ABLATIONS_DIR).as_posix(): r for r in ALL_ROWS}
        picked = [rows[name] for name in chosen]
        assert not any(r.base for r in picked)
        base = reference_row(picked)
        assert base.path == ABLATIONS_DIR / "base.yaml"
        assert [knob(r, base) for r in picked] == ["loss=mse", "loss=mae"]


def _budget_entry(doc: str, name: str) -> str:
    """The bullet (or comment block) of a document that describes ``budgets/<name>``."""
    entries = [e for e in re.split(r"\n\s*[-*] |\n\n", doc) if f"budgets/{name}" in e]
    assert entries, f"budgets/{name} is not described"
    return " ".join(entries)


BUDGET_DOCS = {
    "docs/ablations.md": lambda: (REPO / "docs" / "ablations.md").read_text(encoding="utf-8"),
    "configs/ablations/README.md": lambda: (ABLATIONS_DIR / "README.md").read_text(encoding="utf-8"),
}


class TestBudget:
    @pytest.mark.parametrize("doc", sorted(BUDGET_DOCS))
    @pytest.mark.parametrize("budget", sorted(p.name for p in ablate.BUDGET_DIR.glob("*.yaml")))
    def test_each_budget_is_documented_as_it_trains(self, doc, budget):
        """The docs state each budget's epochs as its YAML sets them (the YAML's own header too)."""
        path = ablate.BUDGET_DIR / budget
        epochs = load_config(path).train.epochs
        header = "\n".join(
            line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")
        )
        for text in (_budget_entry(BUDGET_DOCS[doc](), budget), header):
            stated = {int(n) for n in re.findall(r"\b(\d+) epochs?\b", text)}
            assert stated == {epochs}, (
                f"{doc if text is not header else budget} states {stated}, {budget} trains {epochs}"
            )

    def test_mnist_budget_keeps_the_knob_and_shrinks_the_backbone(self, tmp_path):
        row = next(r for r in ALL_ROWS if r.path.name == "n4.yaml")
        cfg = row_config(row, tmp_path, epochs=3)
        assert cfg.data.dataset == "mnist5k" and cfg.model.kwargs.in_chans == 1
        assert cfg.model.kwargs.ttt_cfg.mini_batches == 4 and cfg.model.kwargs.num_heads == 6
        assert cfg.train.epochs == 3 and cfg.train.warmup_epochs == pytest.approx(3 / 6)
        assert cfg.output == str(tmp_path / "n4") and cfg.train.progress == "run"

    def test_folder_data_keeps_the_recipe(self, tmp_path):
        row = ALL_ROWS[0]
        cfg = row_config(row, tmp_path, data="/data/imagenet", overrides=["device=cuda"])
        assert cfg.data.dataset == "folder" and cfg.data.path == "/data/imagenet" and cfg.device == "cuda"
        assert cfg.model.kwargs.to_dict() == row.cfg.model.kwargs.to_dict() and cfg.train.epochs == 300

    def test_bad_override_is_a_clear_error(self, tmp_path, capsys):
        assert ablate.main([str(ABLATIONS_DIR / "loss"), "train.epochz=3", "--output", str(tmp_path)]) == 2
        assert "unknown config key 'train.epochz'" in capsys.readouterr().err

    def test_missing_table_is_a_clear_error(self, tmp_path, capsys):
        assert ablate.main([str(tmp_path / "nope")]) == 2
        assert "not found" in capsys.readouterr().err


def test_runner_reports_diverged_and_failed_rows(monkeypatch, tmp_path):
    """Diverged rows are reported as diverged, failures as errors (exit status 1), and the table still comes
    out."""

    def fake_train(cfg):
        name = Path(cfg.output).name
        if name == "rmse":
            raise RuntimeError("out of memory")
        Path(cfg.output).mkdir(parents=True)
        last = 50.0 + len(name)
        history = [{"epoch": e, "val_top1": v} for e, v in ((1, 40.0), (2, last + 5.0), (3, last))]
        (Path(cfg.output) / "metrics.json").write_text(json.dumps(history[: 1 if name == "mae" else 3]))
        if name == "mae":
            raise TrainingDiverged("non-finite training loss nan at epoch 2, batch 3")
        return {"final": {"val_top1": last, "val_top5": 90.0, "val_loss": 1.0}}

    monkeypatch.setattr(ablate, "_train_row", fake_train)
    assert ablate.main([str(ABLATIONS_DIR / "loss"), "--quick", "--output", str(tmp_path)]) == 1
    with open(tmp_path / "results.csv", encoding="utf-8") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert rows["MAE"]["status"] == "diverged" and "non-finite" in rows["MAE"]["message"]
    assert rows["RMSE"]["status"] == "error" and "out of memory" in rows["RMSE"]["message"]
    assert rows["MSE"]["status"] == "ok" and float(rows["MSE"]["top1"]) == 53.0
    assert rows["MSE"]["paper_top1"] == "79.2" and rows["MSE"]["change"] == "loss=mse"
    md = (tmp_path / "results.md").read_text(encoding="utf-8")
    # the last and the best epoch, for a diverged row the best before it diverged
    assert (
        "| MAE | `loss/mae.yaml` | loss=mae | 76.5 | -2.40 | diverged |  | 40.00 (epoch 1/1) | diverged |"
        in md
    )
    assert (
        "| MSE | `loss/mse.yaml` | loss=mse | 79.2 | +0.30 | 53.00 | +0.00 | 58.00 (epoch 2/3) | ok |" in md
    )
    assert (
        rows["MSE"]["best_top1"] == "58.0"
        and rows["MSE"]["best_epoch"] == "2"
        and rows["MSE"]["epochs"] == "3"
    )
    assert (tmp_path / "results.png").stat().st_size > 0


# ------------------------------------------------------------------------------------- output folders
def _fake_rows(monkeypatch) -> list[str]:
    """Replaces the training of a row by writing its checkpoint; returns the rows trained, in order."""
    trained = []

    def fake_train(cfg):
        out = Path(cfg.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "last.pt").write_bytes(b"row " + out.name.encode())
        trained.append(out.name)
        return {"final": {"val_top1": 50.0, "val_top5": 90.0, "val_loss": 1.0}}

    monkeypatch.setattr(ablate, "_train_row", fake_train)
    return trained


def test_a_second_table_run_refuses_the_first_ones_folders(monkeypatch, tmp_path, capsys):
    trained = _fake_rows(monkeypatch)
    args = [str(ABLATIONS_DIR / "loss"), "--quick", "--output", str(tmp_path)]
    assert ablate.main(args) == 0 and len(trained) == 5
    first = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert ablate.main(args) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'dot'} holds the checkpoints of an earlier run (and 4 more rows' folders), "
        "which "
        "this table would overwrite: continue the table with --resume (finished rows are read back, a "
        "killed one "
        f"continues), or give it a new --output; --overwrite moves each row's old files into "
        f"<row folder>/replaced-<time>/ first\n"
    )
    assert len(trained) == 5 and {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == first


def test_rows_that_would_share_a_folder_are_refused(monkeypatch, tmp_path, capsys):
    trained = _fake_rows(monkeypatch)
    other = tmp_path / "mine" / "dot.yaml"  # another row file of the same name
    other.parent.mkdir()
    other.write_text(f"base: {ABLATIONS_DIR / 'loss' / 'dot.yaml'}\nablation: {{table: mine, row: mine}}\n")
    assert (
        ablate.main([str(ABLATIONS_DIR / "loss" / "dot.yaml"), str(other), "--output", str(tmp_path / "o")])
        == 2
    )
    err = capsys.readouterr().err
    assert "would train in the same folder" in err and str(tmp_path / "o" / "dot") in err and not trained


@pytest.fixture(scope="module")
def few_digits(tmp_path_factory):
    from helpers.train import make_digit_folder

    return make_digit_folder(tmp_path_factory.mktemp("few"), digits=(0, 1), n_train=20, n_val=5)


def test_resume_reads_finished_rows_back_and_overwrite_keeps_them_aside(few_digits, tmp_path, capsys):
    """A real (tiny) row: a second plain run is refused; --resume reads the finished row back from its
    checkpoint (the same top-1, and the parameter count of its nested-ttt_cfg checkpoint); --overwrite trains
    it again after moving the old row's and table's files aside."""
    row = ABLATIONS_DIR / "ttt_mlp.yaml"
    tiny = [
        "data.dataset=folder",
        f"data.path={few_digits}",
        "data.batch_size=20",
        "train.epochs=1",
        "--quick",
    ]
    args = [str(row), *tiny, "--output", str(tmp_path)]

    def table() -> dict:
        with open(tmp_path / "results.csv", encoding="utf-8") as f:
            (line,) = csv.DictReader(f)
        return line

    assert ablate.main(args) == 0
    first, checkpoint = table(), (tmp_path / "ttt_mlp" / "last.pt").read_bytes()
    assert first["status"] == "ok" and float(first["params_m"]) > 0
    assert ablate.main(args) == 2 and "holds the checkpoints of an earlier run" in capsys.readouterr().err
    assert ablate.main([*args, "--resume"]) == 0
    again = table()
    assert (again["top1"], again["params_m"]) == (first["top1"], first["params_m"])
    # the row's whole run time (its summary's, the time before the resume included), not the resumed call's
    summary = json.loads((tmp_path / "ttt_mlp" / "summary.json").read_text())
    assert float(again["wall_s"]) == summary["wall_time_s"] and summary["wall_time_covers"].startswith(
        "the whole"
    )
    assert (tmp_path / "ttt_mlp" / "last.pt").read_bytes() == checkpoint  # read back, not trained again
    assert ablate.main([*args, "--overwrite"]) == 0
    (aside,) = (tmp_path / "ttt_mlp").glob("replaced-*")
    assert (aside / "last.pt").read_bytes() == checkpoint
    assert len(list(tmp_path.glob("replaced-*/results.csv"))) == 1


def test_training_divergence_raises_training_diverged(tmp_path):
    """The engine's hook: an absurd outer lr blows the model up; the run ends with TrainingDiverged."""
    from vit3.engine import run

    row = next(r for r in ALL_ROWS if r.path.name == "dot.yaml")
    cfg = row_config(row, tmp_path, quick=True, overrides=["train.base_lr=1e6", "train.warmup_epochs=0"])
    cfg.set_path("train.progress", False)
    with pytest.raises(TrainingDiverged, match="non-finite"):
        run(cfg, "train")


def test_spearman():
    assert ablate.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert ablate.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert ablate.spearman([1, 2], [1, 2]) is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_loss_table_end_to_end(tmp_path):
    """The CI smoke test: ``python -m vit3.ablate configs/ablations/loss/ --quick`` trains all five rows."""
    assert ablate.main([str(ABLATIONS_DIR / "loss"), "--quick", "--output", str(tmp_path)]) == 0
    with open(tmp_path / "results.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["row"] for r in rows] == ["dot product", "MSE", "RMSE", "MAE", "smooth L1"]
    for r in rows:
        assert r["status"] in ("ok", "diverged"), r
        if r["status"] == "ok":
            assert 10.0 < float(r["top1"]) <= 100.0  # above chance on the digits
            assert (Path(r["output"]) / "last.pt").is_file()
    assert (tmp_path / "results.md").is_file() and (tmp_path / "results.png").stat().st_size > 0


def test_nonfinite_tokens_in_a_training_step_are_divergence():
    """A TTT mixer meeting NaN tokens inside a training step (the images are checked first) means
    divergence."""
    from vit3.engine.classification import _diverged_on_nonfinite_tokens
    from vit3.layers import TTTMixer

    x = torch.randn(1, 12, 16)
    x[0, 3, 2] = float("nan")
    with pytest.raises(TrainingDiverged, match="non-finite activations at epoch 1"):
        with _diverged_on_nonfinite_tokens("at epoch 1, batch 0"):
            TTTMixer(16, 2)(x, (3, 4))
    with pytest.raises(ValueError, match="C=16 channels got C=8"):  # other errors pass through unchanged
        with _diverged_on_nonfinite_tokens("at epoch 1, batch 0"):
            TTTMixer(16, 2)(torch.randn(1, 12, 8), (3, 4))
