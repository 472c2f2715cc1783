"""``benchmarks/ttt_kernel.py`` runs end to end on tiny CPU sizes and writes its CSV and plot (no timing asserted)."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from helpers.common import REPO


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernel_benchmark_writes_a_row_per_path_mode_and_size(dtype, tmp_path):
    """bf16 is what a GPU runs by default: the official baseline (fp32 inner weights) must run under autocast."""
    args = ["--device", "cpu", "--n", "16", "20", "--d", "16", "--bh", "2", "--heads", "2", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ttt_kernel.py"), *args, "--dtype", dtype,
         "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (tmp_path / "ttt_kernel_cpu.csv").open() as f:
        rows = list(csv.DictReader(f))
    cells = {(r["path"], r["mode"], r["N"]) for r in rows}
    paths = {"torch_fast", "torch_loop", "official", "sdpa", "dwconv"}  # fused needs CUDA
    assert cells == {(p, m, n) for p in paths for m in ("fwd", "fwd+bwd") for n in ("16", "20")}
    assert all(float(r["ms"]) > 0 and r["dtype"] == dtype for r in rows)
    assert all(float(r["x_official"]) == 1.0 for r in rows if r["path"] == "official")
    assert all(float(r["peak_mib"]) > 0 for r in rows)  # every path allocates its output at least
    assert (tmp_path / "ttt_kernel_cpu.png").stat().st_size > 0
