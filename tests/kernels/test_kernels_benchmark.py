"""``benchmarks/ttt_kernel.py`` runs end to end on tiny CPU sizes and writes its CSV, kernel profile and plot
(no timing asserted)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from helpers.common import REPO, load_benchmark


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernel_benchmark_writes_a_row_per_path_mode_and_size(dtype, tmp_path):
    """bf16 is what a GPU runs by default: the official baseline (fp32 inner weights) must run under autocast.
    Two batch x heads sizes (inference- and training-sized on a GPU); the compiled paths through the cheap
    ``eager`` backend of ``torch.compile``; no interpreter, so no fused path on CPU."""
    args = ["--device", "cpu", "--n", "16", "20", "--d", "16", "--bh", "2", "4", "--heads", "2",
            "--repeats", "1", "--compile-backend", "eager", "--profile", "--profile-paths", "compiled",
            "official"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ttt_kernel.py"), *args, "--dtype", dtype,
         "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (tmp_path / "ttt_kernel_cpu.csv").open() as f:
        rows = list(csv.DictReader(f))
    cells = {(r["path"], r["mode"], r["N"], r["BH"]) for r in rows}
    paths = {"compiled", "compiled_official", "torch_fast", "torch_loop", "official", "sdpa", "dwconv"}
    modes, sizes = ("fwd", "fwd+bwd"), [(n, bh) for n in ("16", "20") for bh in ("2", "4")]
    assert cells == {(p, m, n, bh) for p in paths for m in modes for n, bh in sizes}
    assert all(float(r["ms"]) > 0 and r["dtype"] == dtype for r in rows)
    assert all(float(r["x_official"]) == 1.0 for r in rows if r["path"] == "official")
    assert all(float(r["peak_mib"]) > 0 for r in rows)  # every path allocates its output at least
    assert (tmp_path / "ttt_kernel_cpu.png").stat().st_size > 0
    with (tmp_path / "ttt_kernel_profile_cpu.csv").open() as f:
        profile = list(csv.DictReader(f))
    assert {(r["path"], r["N"], r["BH"]) for r in profile} == {
        (p, n, bh) for p in ("compiled", "official") for n, bh in sizes
    }
    assert all(float(r["us"]) > 0 and 0 < float(r["share"]) for r in profile)


def test_rows_are_on_disk_as_they_come(tmp_path):
    """A benchmark cut short by its time limit keeps every row it measured, a later row may add a column."""
    rows = load_benchmark("common").CsvRows(tmp_path / "out.csv")
    rows.add({"a": 1})
    assert (tmp_path / "out.csv").read_text().split() == ["a", "1"]
    rows.add({"a": 2, "b": 3})
    assert list(csv.DictReader((tmp_path / "out.csv").open())) == [{"a": "1", "b": ""}, {"a": "2", "b": "3"}]
