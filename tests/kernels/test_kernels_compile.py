"""The kernels compile for every current NVIDIA GPU, fit its shared memory and stay clear of spills, with no
GPU: ``vit3.kernels.aot`` compiles ahead of time for any ``GPUTarget`` (ptxas ships with Triton) exactly the
launches ``triton_ttt`` makes (planned by ``triton.plan.forward_plan`` / ``backward_plan`` on meta tensors,
specialised by Triton's own JIT binder), in a fresh process without ``TRITON_INTERPRET``, through
``benchmarks/compile_matrix.py``: by default the worst cases of each arch (``aot.matrix("default")``);
``VIT3_COMPILE_MATRIX=full`` adds the whole matrix (arch x inner model x head dim x dtype mode; its run time:
``benchmarks/README.md``). ``$VIT3_OTHER_TRITON`` names a folder holding another Triton release (``.ci/run``
installs 3.6 there, what torch 2.11's GPU machines run): the H200's training cases compile under it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.common import REPO

from vit3.kernels import aot
from vit3.kernels.triton import device, plan

pytestmark = pytest.mark.triton

JOBS = max(1, min(2, os.cpu_count() or 1))


# A folder with another Triton release (``pip install --no-deps --target``), put first on the path of the
# compiles; "" where none is at hand.
OTHER_TRITON = os.environ.get("VIT3_OTHER_TRITON", "")


def compile_matrix(kind: str, tmp, extra: tuple[str, ...] = (), triton_dir: str = "") -> list[dict]:
    """Rows of ``benchmarks/compile_matrix.py --cases kind`` (one per compiled kernel), under the Triton in
    ``triton_dir`` where one is named."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_dir:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [triton_dir, env.get("PYTHONPATH", "")]))
    out = tmp / "matrix.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "compile_matrix.py"),
        "--cases",
        kind,
        "--jobs",
        str(JOBS),
    ]
    cmd += ["--out", str(tmp / "matrix.csv"), "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=4 * 3600)
    if proc.returncode and "GPUTarget" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton cannot compile ahead of time")
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def default_matrix(tmp_path_factory) -> list[dict]:
    return compile_matrix("default", tmp_path_factory.mktemp("compile"))


def rows_of(case: aot.Case, rows: list[dict]) -> list[dict]:
    """The compile rows of ``case``."""
    key = (case.arch.sm, case.model, case.loss, case.d, case.mode)
    return [r for r in rows if (r["arch"], r["model"], r["loss"], r["d"], r["mode"]) == key]


def check(case: aot.Case, rows: list[dict]) -> None:
    """Every launch of ``case`` compiled, within the arch's shared memory, the bound ``fits_device`` compares
    (``triton.tiles.smem_need``) and the spill bound; where ``fits_device`` says no, the compile exceeds the
    limit."""
    mine = rows_of(case, rows)
    assert mine, f"{case.label} was not compiled"
    failed = [r["note"] for r in mine if r["kernel"] == "(compile failed)"]
    assert not failed, f"{case.label}: {failed[0]}"
    assert sorted(r["kernel"] for r in mine) == sorted(launch.label for launch in aot.plan_case(case))
    fits, why = aot.fits(case)
    limit, bound_kb = mine[0]["limit_kb"], mine[0]["bound_kb"]
    if not fits:
        assert why and max(r["smem_kb"] for r in mine) > limit, f"{case.label}: {why}"
        return
    for r in mine:
        label, spill = f"{case.label} {r['kernel']}", aot.spill_bound(case, r["kernel"])
        need = f"{label} needs {r['smem_kb']:.0f} KB (limit {limit:.0f}, bound {bound_kb:.0f})"
        assert r["smem_kb"] <= min(limit, bound_kb), need
        assert r["spill_stores"] <= spill, f"{label} spills {r['spill_stores']} B per thread (bound {spill})"
        if aot.strict_spills(case, r["kernel"]):
            assert r["loop_spills"] == 0, f"{label} spills inside its token loop ({r['loop_spills']} in SASS)"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.label) for c in aot.matrix("default")])
def test_worst_cases_fit_every_arch(case, default_matrix):
    check(case, default_matrix)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("VIT3_COMPILE_MATRIX") != "full", reason="set VIT3_COMPILE_MATRIX=full")
def test_full_matrix_fits_every_arch(tmp_path):
    rows = compile_matrix("full", tmp_path)
    for case in aot.matrix("full"):
        check(case, rows)


def _h200_cases() -> list[aot.Case]:
    """The training configurations of the models on an H100 / H200: sm_90, bf16, head dims 32 and 64."""
    return [c for c in aot.matrix("full") if c.arch.sm == "sm_90" and c.mode == "bf16" and c.d in (32, 64)]


H200_ARGS = ("--arch", "sm_90", "--mode", "bf16", "--d", "32", "64")


def check_h200(case: aot.Case, rows: list[dict]) -> None:
    """Every launch of ``case`` spills nothing and leaves room for a second block on its SM: at most 1024
    registers x warps (half of 64K registers) and half the SM's shared memory."""
    mine = rows_of(case, rows)
    assert mine, f"{case.label} was not compiled"
    for r in mine:
        label = f"{case.label} {r['kernel']}"
        assert r["spill_stores"] == 0, f"{label} spills {r['spill_stores']} B per thread"
        assert r["regs"] * r["num_warps"] <= 1024, f"{label}: {r['regs']} registers x {r['num_warps']} warps"
        assert r["smem_kb"] * 1024 <= case.arch.smem / 2, f"{label} needs {r['smem_kb']:.0f} KB"


def test_h200_cases_spill_nothing_and_leave_room_for_two_blocks_per_sm(tmp_path):
    """The H200's training kernels fit their bounds, spill nothing and leave room for two blocks per SM (a
    latency-bound kernel hides its waits behind the other block's work)."""
    rows = compile_matrix("full", tmp_path, H200_ARGS)
    for case in _h200_cases():
        check(case, rows)
        check_h200(case, rows)


@pytest.mark.skipif(not OTHER_TRITON, reason="set VIT3_OTHER_TRITON to a folder holding another Triton")
def test_h200_cases_fit_under_the_other_triton(tmp_path):
    """Under the other release the same bounds hold, on the same tiles: shared memory, no spill, two blocks
    per SM."""
    probe = [sys.executable, "-c", "import triton; print(triton.__version__)"]
    env = {**os.environ, "PYTHONPATH": OTHER_TRITON}
    other = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip()
    import triton

    assert other != triton.__version__, f"{OTHER_TRITON} holds the pinned Triton {other}"
    rows = compile_matrix("full", tmp_path, H200_ARGS, OTHER_TRITON)
    for case in _h200_cases():
        check(case, rows)
        check_h200(case, rows)


def test_sm90_half_kernels_issue_wgmma(default_matrix):
    """16-bit operands on sm_90: at d = 64 (ViT³-S/B) every dot of every kernel is a ``wgmma`` (no warp-level
    ``mma.sync`` left: SwiGLU's one-block stages run on transposed tiles); at d = 32 (ViT³-T, H-ViT³) every
    kernel with 64-token tiles issues ``wgmma``, and SwiGLU's only ``wgmma`` (its weight-gradient dots, 32
    rows each, stacked into one of 64: ``Tiles.stack``); the linear model's have 32 rows there."""
    for case in aot.matrix("default"):
        if case.arch.sm != "sm_90" or case.mode not in ("bf16", "fp16") or case.d not in (32, 64):
            continue
        rows = [r for r in rows_of(case, default_matrix) if r["wgmma"] + r["mma"] > 0]
        assert rows, case.label
        for r in rows:
            if case.d == 64:
                assert r["wgmma"] > 0 and r["mma"] == 0, f"{case.label} {r['kernel']}: {r['mma']} mma.sync"
            elif r["block_n"] >= 64:
                assert r["wgmma"] > 0, f"{case.label} {r['kernel']}"
                if case.model != "linear":
                    assert r["mma"] == 0, f"{case.label} {r['kernel']}: {r['mma']} mma.sync"


def test_default_cases_cover_every_arch_and_inner_model():
    cases = aot.matrix("default")
    assert {c.arch.sm for c in cases} == set(aot.ARCHS)
    assert {(c.model, c.loss) for c in cases} == set(aot.MODELS)
    assert {c.d for c in cases} == set(aot.HEAD_DIMS) and {c.mode for c in cases} == set(aot.MODES)
    assert set(cases) <= set(aot.matrix("full"))


SPECIALISATION = """
import json, sys, torch
from vit3.kernels import aot
from vit3.kernels.triton.device import ARCHS
case = aot.Case("swiglu", "dot", 64, "bf16", ARCHS["sm_90"], n_tok=int(sys.argv[1]))
launch = next(l for l in aot.plan_case(case) if l.label == "grad_partial_kernel")
_, signature, constexprs, attrs = aot.specialise(launch, case.arch)
names = list(signature)
div16 = sorted(names[k[0]] for k, v in attrs.items() if ["tt.divisibility", 16] in v)
constexprs = {names[k[0]]: str(v) for k, v in constexprs.items()}
print(json.dumps({"signature": signature, "div16": div16, "constexprs": constexprs}))
"""


@pytest.mark.parametrize("n_tok", [3136, 197])
def test_launches_are_specialised_as_triton_would_launch_them(n_tok):
    """Unit strides fold into constants, ints and 16-aligned pointers carry divisibility hints, N only when
    it is a multiple of 16: the binary a real launch on contiguous qkv views gets."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SPECIALISATION, str(n_tok)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if proc.returncode and "GPUTarget" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton cannot compile ahead of time")
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = json.loads(proc.stdout.strip().splitlines()[-1])
    sig = spec["signature"]
    assert sig["k_ptr"] == "*bf16" and sig["part_ptr"] == "*fp32" and sig["N"] == "i32"
    assert sig["skc"] == sig["svc"] == "constexpr" and spec["constexprs"]["skc"] == "1"  # channel stride 1
    assert {"k_ptr", "v_ptr", "w1_ptr", "w2_ptr", "part_ptr", "D", "skn", "svn"} <= set(spec["div16"])
    assert ("N" in spec["div16"]) == (n_tok % 16 == 0)


def test_readme_table_is_the_committed_matrix():
    """benchmarks/README's per-cell table is what ``--markdown`` derives from
    ``results/compile_matrix.csv``."""
    bench = REPO / "benchmarks"
    cmd = [
        sys.executable,
        str(bench / "compile_matrix.py"),
        "--markdown",
        str(bench / "results" / "compile_matrix.csv"),
    ]
    table = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(table) > 2 and table[0].startswith("| arch (limit) | mode |")
    readme = (bench / "README.md").read_text().splitlines()
    start = readme.index(table[0])
    assert readme[start : start + len(table)] == table


FLOAT_ARGS = """
import json
from vit3.kernels import aot
from vit3.kernels.triton.device import ARCHS
rows = []
for model, loss in aot.MODELS:
    for d in (32, 64):
        case = aot.Case(model, loss, d, "fp64", ARCHS["sm_90"])
        for launch in aot.plan_case(case):
            _, signature, _, _ = aot.specialise(launch, case.arch)
            floats = {k: v for k, v in signature.items() if v[:2] in ("fp", "bf")}
            rows.append([case.label, launch.label, floats])
print(json.dumps(rows))
"""


def test_float64_kernels_take_float64_scalars():
    """Every float a float64 launch takes (``coef = s / N``, ``lr``) reaches the kernel as fp64: Triton types
    a Python float fp32, which a GPU's float64 kernel then widens (``cvt.f64.f32``), 4e-9 off; the interpreter
    keeps Python floats, so only the binder's specialisation can show it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", FLOAT_ARGS], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    if proc.returncode and "GPUTarget" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton cannot compile ahead of time")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {name for _, _, floats in rows for name in floats}
    bare = {n.split("_", 1)[1] if n[0] == "k" and n[1].isdigit() else n for n in names}  # fused: k<i>_lr
    assert bare == {"coef", "lr"}
    narrow = [
        f"{case} {kernel}: {floats}" for case, kernel, floats in rows if set(floats.values()) - {"fp64"}
    ]
    assert not narrow, narrow


@pytest.mark.parametrize("mode", list(aot.MODES))
def test_run_time_precision_is_the_compile_matrix_precision(mode, monkeypatch):
    """A launch planned as the GPU path plans it (no precision given) gets the ``tl.dot`` precision that the
    compile matrix compiles for its dtype mode: the matrix checks the specialisation that runs."""
    dtype, prec = aot.MODES[mode]
    monkeypatch.setattr(device, "fp32_uses_tf32", lambda: prec == "tf32")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (torch.empty(2, 3, 196, 32, dtype=dtype, device="meta") for _ in range(3))
    w1, w2 = (torch.empty(1, 3, 32, 32, dtype=acc, device="meta") for _ in range(2))
    _, launches = plan.forward_plan(q, k, v, w1, w2, "swiglu", "dot", 14, 14, 9**-0.5, 1.0, True, 0,
                                    arch=device.ARCHS["sm_90"], interpret=False)  # fmt: skip
    assert {launch.kwargs["PREC"] for launch in launches if "PREC" in launch.kwargs} == {prec}
