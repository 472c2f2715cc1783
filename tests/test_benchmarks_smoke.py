"""The benchmark scripts run end to end on tiny sizes and write their CSV and plots (no timing asserted)."""

from __future__ import annotations

import csv
import os
import re
import shlex
import shutil
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


@pytest.mark.slow
def test_finetune_benchmark_runs_the_readme_recipe_and_both_probes(tmp_path):
    """One 3-class folder, one seed, from a tiny stand-in for the demo (the benchmark trains the real one when
    output/demo/best.pt is missing), a few steps each (--set)."""
    from helpers.train import make_digit_folder, tiny_cfg

    from vit3.engine import run

    work = tmp_path / "work"
    run(
        tiny_cfg(
            make_digit_folder(tmp_path / "digits", n_train=10, n_val=2),
            work / "output" / "demo",
            "train.epochs=1",
        ),
        "train",
    )
    out = tmp_path / "finetune.csv"
    _run(
        "finetune.py", "--work", str(work), "--classes", "3", "--seeds", "0", "--train", "4", "--val", "2",
        "--threads", "1", "--set", "train.min_steps=2", "train.epochs=1", "--out", str(out),
    )  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows] == ["finetune", "probe_recipe", "probe_logreg"]
    assert all(0 <= float(r["val_top1"]) <= 100 for r in rows)
    # fitted: 12 training images, >= 8 batches per epoch -> 1, Mixup's even minimum 2
    assert [r["batch"] for r in rows[:2]] == ["2", "2"]
    summary = list(csv.DictReader(out.with_name("finetune_summary.csv").open()))
    assert [(r["classes"], r["method"], r["seeds"]) for r in summary] == [
        ("3", m, "1") for m in ("finetune", "probe_recipe", "probe_logreg")
    ]
    assert out.with_suffix(".png").stat().st_size > 0


def test_generation_quality_reads_a_resumed_run_back_as_the_same_run():
    """A demo run that was killed and resumed (its saved config names train.resume) is the run the benchmark
    asks for; another seed or mixer is not."""
    from vit3.engine import load_config

    gen = load_benchmark("generation")
    ask = load_config(gen.DEMO, ["seed=0", "output=o"])
    resumed = load_config(gen.DEMO, ["seed=0", "output=o", "train.resume=o/last.pt", "train.overwrite=true"])
    assert gen._settings(resumed) == gen._settings(ask)
    older = load_config(gen.DEMO, ["seed=0", "output=o"])  # saved before train.force_resume existed
    del older.train["force_resume"]
    assert gen._settings(older) == gen._settings(ask)
    for other in ("seed=1", "model.mixer=attention"):
        assert gen._settings(load_config(gen.DEMO, [other, "output=o"])) != gen._settings(ask)


def test_generation_quality_summary_gives_the_spread_over_seeds():
    """benchmarks/generation.py --quality: per mixer the mean and standard deviation over the seeds, and the
    real floor / ceiling at the same sample count beside them."""
    gen = load_benchmark("generation")
    scores = {("ttt", 0): (70.0, 10.0), ("ttt", 1): (80.0, 12.0), ("attention", 0): (60.0, 15.0)}
    rows = [
        {"mixer": m, "seed": s, "samples": 200, "class_accuracy": acc, "real_accuracy": 96.0 + s,
         "real_accuracy_std": 1.0, "frechet_distance": fd, "frechet_real_floor": 2.0 + s,
         "frechet_real_floor_std": 0.5, "train_s": 1.0}
        for (m, s), (acc, fd) in scores.items()
    ]  # fmt: skip
    ttt, attention, real = gen.summarize(rows)
    assert ttt["rows"] == "ttt (seeds 0 1)" and attention["rows"] == "attention (seeds 0)"
    assert ttt["class_accuracy"] == pytest.approx(75.0) and ttt["class_accuracy_std"] == pytest.approx(
        50**0.5
    )
    assert ttt["frechet_distance"] == pytest.approx(11.0) and attention["frechet_distance_std"] == 0.0
    assert real["rows"].startswith("real images at N = 200")
    assert real["class_accuracy"] == pytest.approx(96 + 1 / 3) and real["frechet_distance"] == pytest.approx(
        2 + 1 / 3
    )
    assert real["frechet_distance_std"] == pytest.approx(0.5)


def test_roofline_prices_every_launch_of_the_plans(tmp_path):
    """One row per launch the launcher plans (forward and backward), a total per shape, a training step per
    model; ``--kernels`` loads another checkout's kernels (here this tree's, as a package of its own)."""
    out = tmp_path / "roofline.csv"
    _run("roofline.py", "--gpus", "H100", "L4", "--shapes", "bench-d64", "--batch", "4", "2",
         "--kernels", str(REPO / "kernels"), "--design", "smoke", "--out", str(out))  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    aot = pytest.importorskip("vit3.kernels.aot")
    h100 = aot.ARCHS["sm_90"]
    fwd, bwd = aot.plan_launches(aot.Case("swiglu", "dot", 64, "bf16", h100, n_tok=3136, batch=16, heads=4))
    priced = [
        r["kernel"]
        for r in rows
        if r["gpu"] == "H100" and r["shape"] == "bench-d64" and r["phase"] != "fwd+bwd"
    ]
    assert priced == [launch.label for launch in fwd + bwd]
    assert all(float(r["us"]) > 0 and float(r["MB"]) >= 0 for r in rows if r["kernel"] != "(training step)")
    steps = {(r["gpu"], r["model"]): r for r in rows if r["kernel"] == "(training step)"}
    assert set(steps) == {(g, m) for g in ("H100", "L4") for m in ("ViT3-S", "H-ViT3-T")}
    for step in steps.values():
        assert 0 < float(step["ttt_share"]) < 1 and float(step["step_ms"]) > float(step["ttt_op_ms"]) > 0
    assert all(r["design"] == "smoke" for r in rows)


def test_triton_overhead_benchmark_reports_every_call(tmp_path):
    out = tmp_path / "overhead.csv"
    _run("triton_overhead.py", "--repeats", "3", "--out", str(out))
    rows = list(csv.DictReader(out.open()))
    calls = [r["call"] for r in rows]
    node = "triton path per mixer call: fused node"
    for row in (
        *(f"{node} {kind} ({how})" for kind in ("infer", "fwd+bwd") for how in ("program", "branch hooks")),
        f"{node} fwd+bwd (program) (back to back)",
        f"{node}: fwd + bwd in the node, summed",
        f"{node}: fwd + bwd in the node, summed (back to back)",
        "floor: an empty autograd node, fwd+bwd (back to back)",
        f"{node} fwd+bwd (program) over the floor (back to back)",
        f"{node} fwd+bwd (branch hooks) over the floor (back to back)",
        f"{node} fwd+bwd (rope, program) over the floor (back to back)",
        f"{node} fwd+bwd (rope, branch hooks) over the floor (back to back)",
    ):
        assert row in calls, calls
    assert all(float(r["median_us"]) > 0 for r in rows)


def test_launcher_overhead_times_both_launchers_on_every_launch(tmp_path):
    out = tmp_path / "launcher.csv"
    _run("launcher_overhead.py", "--models", "vit3_tiny", "--repeats", "3", "--out", str(out))
    (row,) = csv.DictReader(out.open())
    assert row["model"] == "vit3_tiny" and int(row["launches per call"]) > 4
    assert float(row["JIT launcher us"]) > 0 and float(row["pre-bound us"]) > 0


def test_autograd_floor_benchmark_times_both_nodes(tmp_path):
    """The Python node, its bodies alone and (with a C++ compiler, which the C++ kernel needs too) the C++
    node calling the same Python bodies."""
    out = tmp_path / "floor.csv"
    _run("autograd_floor.py", "--repeats", "3", "--out", str(out))
    rows = {r["node"]: float(r["median_us"]) for r in csv.DictReader(out.open())}
    assert set(rows) == {"python node (the floor)", "bodies alone", "c++ node, python bodies"}
    assert all(us > 0 for us in rows.values())


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
    sections = ["env", "warm", "step", "kernel", "tests"]
    assert [line.split()[0] for line in lines] == [*sections, "total"]
    assert all("skipped" in line for line in lines[:-1])


def test_gpu_check_tests_select_tests_on_a_gpu_and_in_the_dry_run(tmp_path):
    """The tests section's selections pick tests: the GPU's (``TESTS`` and ``TESTS_ARGS`` of its CUDA branch,
    collected here) and the dry run's (run: its section ends with rc 0, not pytest's 5 for none)."""
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    tests = re.findall(r"^\s*TESTS=\((.*)\)$", script, re.MULTILINE)
    args = re.findall(r"^\s*TESTS_ARGS=\((.*)\)$", script, re.MULTILINE)
    assert len(tests) == len(args) == 2  # the CUDA branch's, then the dry run's
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run([*collect, *shlex.split(tests[0]), *shlex.split(args[0])], capture_output=True,
                          text=True, timeout=600, cwd=REPO)  # fmt: skip
    found = re.search(r"(\d+)/\d+ tests collected", proc.stdout)
    assert proc.returncode == 0 and found and int(found.group(1)) >= 20, proc.stdout[-2000:]
    gpu = _gpu_check(tmp_path / "out", tmp_path / "work", GPU_CHECK_ONLY="tests")
    assert gpu.returncode == 0, gpu.stderr[-3000:]
    assert "tests rc=0" in (tmp_path / "out" / "summary.txt").read_text()


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_csvs_row_by_row_and_a_summary(tmp_path):
    """The CPU dry run (``GPU_CHECK_DEVICE=cpu``: the interpreter, tiny sizes) of the environment and kernel
    sections: the fused path through the interpreter (also with ``tiles.STACK`` off, and chunked), the
    compiled paths, two batch x heads sizes, the per-kernel profile; what the device tool brings back (8
    plain files at most) lands in the output folder."""
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
        (p, bh) for p in ("fused", "fused_unstacked", "fused_chunked", "compiled") for bh in ("2", "4")
    }
    profile = list(csv.DictReader((out / "ttt_kernel_profile_cpu.csv").open()))
    profiled = {"fused", "fused_unstacked", "fused_chunked", "compiled", "official"}
    assert {r["path"] for r in profile} == profiled
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


def test_model_overhead_times_each_model_and_its_bare_ops(tmp_path):
    out = tmp_path / "model_overhead.csv"
    _run(
        "model_overhead.py",
        *("--pair", "test_vit3_ttt:test_vit", "--res", "160", "--repeats", "1", "--threads", "1"),
        *("--out", str(out)),
    )
    rows = list(csv.DictReader(out.open()))
    assert [(r["model"], r["mode"]) for r in rows] == [
        (m, mode) for m in ("test_vit3_ttt", "test_vit") for mode in ("infer", "train")
    ]
    assert all(int(r["ops"]) > 0 and float(r["bare_ms"]) > 0 for r in rows)
    base = [r for r in rows if r["model"] == "test_vit"]
    assert all(float(r["speed_vs_base"]) == 1.0 == float(r["bare_vs_base"]) for r in base)


def test_cpu_attribution_sorts_samples_into_parts():
    """Each sample goes to the code that spent it: MKL's GEMM apart from ATen's other code in the same
    library, vit3's extension, the interpreter, the bindings, the C library; header and padding lines are
    skipped."""
    attribution = load_benchmark("cpu_attribution")
    report = "\n".join(
        [
            "# Samples: 9K of event 'cpu-clock:pppH'",
            " 40.10% \t 12031      \tlibtorch_cpu.so          \t[.] mkl_blas_avx512_sgemm_kernel_0",
            " 3.36%  \t 1007       \tlibtorch_cpu.so          \t[.] "
            "at::native::AVX2::RowwiseMomentsImpl<float, 4l>",
            " 0.91%  \t 273        \tvit3_cpu_avx512_0123.so  \t[.] (anonymous "
            "namespace)::inner_grad_impl<float>",
            " 2.77%  \t 831        \tlibpython3.11.so.1.0     \t[.] _PyEval_EvalFrameDefault",
            " 0.35%  \t 105        \tlibtorch_python.so       \t[.] torch::FunctionSignature::parse",
            " 0.78%  \t 234        \tlibc.so.6                \t[.] _int_malloc",
            " 0.42%  \t 126        \t[JIT] tid 9280           \t[.] 0x00007f368a28010f",
            " 0.10%  \t 30         \t[kernel.kallsyms]        \t[k] clear_page_erms",
            " 0.05%  \t 15         \tlibstdc++.so.6.0.30      \t[.] operator new",
            "",
        ]
    )
    samples = attribution.parse_report(report)
    assert set(samples) == set(attribution.PARTS)
    expected = {"gemm": 12031, "aten": 1007, "vit3 kernels": 273, "python": 831, "bindings": 105}
    expected |= {"libc": 234, "jit code": 126, "os": 30, "other": 15, "c10": 0}
    assert samples == expected


def _perf_usable(tmp_path) -> bool:
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(
        ["perf", "record", "-q", "-o", str(tmp_path / "probe.data"), "--", "true"], capture_output=True
    )
    return probe.returncode == 0


def test_cpu_attribution_prices_every_part_of_both_models(tmp_path):
    if not _perf_usable(tmp_path):
        pytest.skip("Linux perf is not installed or may not sample processes here")
    out = tmp_path / "attribution.csv"
    _run(
        "cpu_attribution.py",
        *("--pair", "test_vit3_ttt:test_vit", "--res", "160", "--modes", "infer", "--threads", "1"),
        *("--seconds", "1.5", "--warmup", "2", "--out", str(out)),
    )
    rows = list(csv.DictReader(out.open()))
    parts = {(r["model"], r["part"]): r for r in rows}
    attribution = load_benchmark("cpu_attribution")
    for model in ("test_vit3_ttt", "test_vit"):
        step = float(parts[model, "step"]["ms"])
        assert step > 0
        assert sum(float(parts[model, p]["ms"]) for p in attribution.PARTS) == pytest.approx(step, rel=1e-6)
    assert all(float(r["vs_base_ms"]) == 0 for r in rows if r["model"] == "test_vit")
    assert float(parts["test_vit", "vit3 kernels"]["ms"]) == 0  # timm's ViT runs none of vit3's code


def test_step_profile_rows_with_time_by_category(tmp_path):
    """A training step of two models side by side, each with its kernel (op) count and time by category."""
    category = load_benchmark("step_profile").category
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "cublas"
    assert category("flash_fwd_kernel") == "flash"
    assert category("grad_bwd_kernel") == "vit3_triton"
    assert category("triton_poi_fused_add_0") == "inductor"
    assert category("aten::_to_copy") == "copies_casts"
    out = tmp_path / "step.csv"
    env = {
        k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"
    }  # the CPU kernels, not the interpreter
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "step_profile.py"), "--device", "cpu", "--models",
         "test_vit3_ttt:test_h_vit3", "--res", "32", "--batch", "2", "--repeats", "1", "--variants", "eager",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["model"] for r in rows] == ["test_vit3_ttt", "test_h_vit3"]
    assert float(rows[0]["speed_vs_base"]) > 0 and all(int(r["kernels"]) > 0 for r in rows)
    assert all(float(r["step_ms"]) > 0 and any(k.endswith("_ms") and k != "step_ms" for k in r) for r in rows)


def test_step_counts_counts_ops_launches_syncs_and_memory(tmp_path):
    """The Triton path emulated: every TTT block launches kernels, a settled step reads nothing back."""
    out = tmp_path / "counts.csv"
    _run("step_counts.py", "--models", "test_vit3_ttt", "test_h_vit3", "--res", "64", "--batch", "1",
         "--out", str(out))  # fmt: skip
    rows = {r["model"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"test_vit3_ttt", "test_h_vit3"}
    for row in rows.values():
        assert float(row["launches_per_block"]) > 0 and int(row["aten_ops"]) > 0, row
        assert int(row["host_syncs"]) == 0 and float(row["saved_mib_per_image"]) > 0, row


def test_roofline_calibrated_on_the_h200_profile_predicts_the_unfitted_shapes(tmp_path):
    """The latency model fitted on the profile's B*H = 64 rows predicts its B*H = 1024 totals within 20%,
    and prices both branches of ViT³-T's and ViT³-S's own shapes as the launch program runs them: 5 launches
    a training call, most of them both branches' stage in one; and the GPU check's kernel shapes whole and
    chunked."""
    out = tmp_path / "calibration.csv"
    _run("roofline.py", "--calibrate", "--out", str(out))
    rows = list(csv.DictReader(out.open()))
    totals = [r for r in rows if r["table"] == "check" and r["kernel"] == "(total)"]
    assert {(r["N"], r["BH"], r["sample"]) for r in totals} == {
        (n, bh, s) for n in ("196", "3136") for bh, s in (("64", "fitted"), ("1024", "predicted"))
    }
    for r in totals:
        assert abs(float(r["error"])) <= 0.2, r
    # the check prices the design the H200 ran (its step kernels, which today's plans no longer launch)
    checked = {r["kernel"] for r in rows if r["table"] == "check"}
    assert {"step_kernel", "step_bwd_kernel"} <= checked
    models = [r for r in rows if r["table"] == "models"]
    for shape in ("ViT3-T-224-b128", "ViT3-T-1248-b32", "ViT3-S-224-b128"):
        launches = [r for r in models if r["shape"] == shape]
        assert len(launches) == 5, launches
        assert sum(r["branch"] == "swiglu+dwconv" for r in launches) >= 4
        assert {b for r in launches for b in r["branch"].split("+")} == {"swiglu", "dwconv"}
    assert all(float(r["us"]) > 0 for r in models)
    # the GPU check's kernel shapes, whole and chunked at 256 tokens a program: one chunk at N 196 (the same
    # launches), more and shorter waves wherever N splits
    chunked = {(r["shape"], r["path"]): r for r in rows if r["table"] == "chunked"}
    assert {path for _, path in chunked} == {"fused", "fused_chunked"} and len(chunked) == 6
    for shape in {shape for shape, _ in chunked}:
        whole, split = chunked[(shape, "fused")], chunked[(shape, "fused_chunked")]
        if "n196-" in shape:
            assert (whole["waves"], whole["us"]) == (split["waves"], split["us"])
        else:
            assert int(split["waves"]) > int(whole["waves"]) and float(split["us"]) > 0
