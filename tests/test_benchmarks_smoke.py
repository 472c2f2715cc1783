"""The benchmark scripts run end to end on tiny sizes and write their CSV and plots (no timing asserted)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from helpers.common import REPO, load_benchmark


def _run(script: str, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_mixer_benchmark_writes_rows_for_every_length(tmp_path):
    out = tmp_path / "mixer.csv"
    _run(
        "mixer.py",
        "--dim",
        "32",
        "--heads",
        "2",
        "--batch",
        "1",
        "--tokens",
        "16",
        "35",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    rows = list(csv.DictReader(out.open()))
    assert [int(r["N"]) for r in rows] == [16, 35]
    assert all(float(r["inner_ours_fwd+bwd_ms"]) > 0 and float(r["sdpa_fwd_ms"]) > 0 for r in rows)
    assert out.with_suffix(".png").stat().st_size > 0


def test_mixer_profile_attributes_every_op_of_both_layers(tmp_path):
    out = tmp_path / "profile.csv"
    _run(
        "mixer_profile.py",
        *("--dim", "32", "--heads", "2", "--batch", "1", "--tokens", "35", "--calls", "1", "--rounds", "1"),
        *("--threads", "1", "--out", str(out)),
    )
    rows = list(csv.DictReader(out.open()))
    for layer in ("ttt_mixer", "sdpa_attention"):
        parts = {r["part"]: float(r["ms"]) for r in rows if r["layer"] == layer}
        assert set(parts) == {"projections", "inner loop", "rest", "total"}
        assert parts["projections"] > 0 and parts["inner loop"] > 0
        assert parts["total"] == pytest.approx(parts["projections"] + parts["inner loop"] + parts["rest"])


@pytest.mark.slow
def test_models_benchmark_compares_vit3_with_deit(tmp_path):
    out = tmp_path / "models.csv"
    _run(
        "models.py",
        "--pairs",
        "test_vit3_ttt:deit_tiny_patch16_224",
        "--res",
        "32",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    rows = list(csv.DictReader(out.open()))
    assert {(r["model"], r["mode"]) for r in rows} == {
        (m, mode) for m in ("test_vit3_ttt", "deit_tiny_patch16_224") for mode in ("infer", "train")
    }
    assert all(float(r["img_per_s"]) > 0 and float(r["gflops_per_img"]) > 0 for r in rows)
    # the targets' columns: ratios against the group's last model, which is 1 against itself
    assert all(float(r["peak_tensor_mib"]) > 0 and float(r["speed_vs_base"]) > 0 for r in rows)
    assert all(float(r["tensor_peak_vs_base"]) == 1.0 for r in rows if r["model"] == "deit_tiny_patch16_224")


def test_paired_ratio_is_the_median_of_per_round_ratios():
    paired_ratio = load_benchmark("common").paired_ratio
    # per round 2, 0.5, 3 -> median 2, where the ratio of the medians would say 4 / 3
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 8.0, 3.0]) == 2.0


def test_generation_benchmark_compares_dit3_with_dit(tmp_path):
    out = tmp_path / "generation.csv"
    _run("generation.py", "--model", "dit3_s_8", "--sizes", "16", "--repeats", "1", "--out", str(out))
    rows = list(csv.DictReader(out.open()))
    assert [r["model"] for r in rows] == ["dit3_s_8/ttt", "dit3_s_8/attention"]
    assert all(float(r["fwd+bwd_ms"]) > 0 and float(r["attention_over_ttt"]) > 0 for r in rows)
    assert out.with_suffix(".png").stat().st_size > 0


def _gpu_check(out, work, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={
            **os.environ,
            "GPU_CHECK_DEVICE": "cpu",
            "GPU_CHECK_WORK": str(work),
            "PYTHON": sys.executable,
            **env,
        },
    )


def test_gpu_check_skips_what_its_time_budget_cannot_hold(tmp_path):
    proc = _gpu_check(tmp_path / "out", tmp_path / "work", GPU_CHECK_BUDGET="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    sections = ["env", "warm", "kernel", "models", "compiled", "explain", "tests", "backends", "compile"]
    assert [line.split()[0] for line in lines] == [*sections, "total"]
    assert all("skipped" in line for line in lines[:-1])


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_csvs_row_by_row_and_a_summary(tmp_path):
    """The CPU dry run (``GPU_CHECK_DEVICE=cpu``: the interpreter, tiny sizes) of the environment and kernel
    sections: the fused path through the interpreter, the compiled paths, two batch x heads sizes, the
    per-kernel profile; what the device tool brings back (8 plain files at most) lands in the output folder."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _gpu_check(out, work, GPU_CHECK_ONLY="env kernel")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert "env rc=0" in summary and "kernel rc=0" in summary, summary
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.log", "summary.txt", "ttt_kernel_cpu.csv", "ttt_kernel_profile_cpu.csv"
    ]  # fmt: skip
    rows = list(csv.DictReader((out / "ttt_kernel_cpu.csv").open()))
    assert {(r["path"], r["BH"]) for r in rows} >= {
        (p, bh) for p in ("fused", "compiled") for bh in ("2", "4")
    }
    profile = list(csv.DictReader((out / "ttt_kernel_profile_cpu.csv").open()))
    assert {r["path"] for r in profile} == {"fused", "compiled", "official"}
    assert (work / "kernel.log").stat().st_size > 0


@pytest.mark.slow
def test_amp_benchmark_compares_each_mode_with_fp32(tmp_path):
    out = tmp_path / "amp.csv"
    small = "model.kwargs={img_size: 32, in_chans: 1, patch_size: 8, embed_dim: 16, depth: 1, num_heads: 1}"
    _run("amp.py", "--out", str(out), "train.epochs=1", "data.batch_size=500", "train.lr_batch=500", small)
    rows = list(csv.DictReader(out.open()))
    assert [(r["run"], r["epoch"]) for r in rows] == [("fp32", "1"), ("bf16", "1"), ("fp32 seed 1", "1")]
    assert float(rows[0]["train_loss_gap"]) == 0.0 and all(r["finite"] == "True" for r in rows)
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_convert_benchmark_rows_for_every_method_and_size(tmp_path):
    from helpers.train import make_digit_folder

    digits = make_digit_folder(tmp_path / "digits", digits=(0, 1), n_train=20, n_val=10)
    out = tmp_path / "convert.csv"
    bench = [
        *("convert.py", "--quick", "--teacher-epochs", "2", "--budget-epochs", "1", "--sizes", "32", "48"),
        *("--repeats", "1", "--work", str(tmp_path / "runs"), "--out", str(out)),
    ]
    data = ["data.dataset=folder", f"data.path={digits}", "data.batch_size=10", "train.warmup_epochs=0"]
    _run(*bench, "--seeds", "0", "--override", *data)
    rows = list(csv.DictReader(out.open()))
    acc = {r["method"]: r for r in rows if r["measure"] == "accuracy"}
    assert set(acc) == {"teacher", "converted", "scratch"}
    assert (
        int(acc["teacher"]["steps"]) == 8
        and int(acc["converted"]["steps"]) == int(acc["scratch"]["steps"]) == 4
    )
    assert float(acc["converted"]["budget"]) == 0.5
    lat = [r for r in rows if r["measure"] == "latency"]
    assert [(r["method"], int(r["tokens"])) for r in lat] == [
        ("teacher", 4), ("converted", 4), ("teacher", 9), ("converted", 9)
    ]  # fmt: skip
    assert all(float(r["ms_per_image"]) > 0 for r in lat) and lat[-1]["exponent"]
    assert out.with_suffix(".png").stat().st_size > 0
    # rerun: the finished runs are reused, the latency rows kept as they were timed (not timed again)
    _run(*bench, "--seeds", "0", "--keep-latency", "--override", *data)
    assert list(csv.DictReader(out.open())) == rows
