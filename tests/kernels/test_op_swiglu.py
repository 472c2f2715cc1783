"""The SwiGLU op (``vit3.kernels.swiglu``): its reference against float64 finite differences, the official
code's formulation and (through the mixer, ``test_mixer_official``) the official fixtures; every fast path —
the tiled eager path, the C++ kernel, the Triton kernels (``TRITON_INTERPRET=1`` on CPU), the generic inner
loop — forward and every gradient (q, k, v, w1, w2) against the reference; then the C++ kernel's own
contract: threads and blocks, strided views, loud failures (the registry then falls back:
``test_backends_*``), loading without Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.common import count_cpp_swiglu, load_benchmark
from helpers.ops import assert_matches_reference, branch_node

import vit3.kernels.cpp as cpu_ext
import vit3.kernels.swiglu.cpp as swiglu_cpp
import vit3.kernels.swiglu.eager as fast
from vit3.kernels.swiglu.reference import swiglu_ttt_ref
from vit3.layers import TTTConfig, create_inner_model, inner_loop

H, D = 2, 8


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts forwards that ran in the kernel."""
    return count_cpp_swiglu(monkeypatch)


@pytest.fixture
def threads():
    """Sets the intra-op thread count for one test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _inputs(b: int, h: int, n: int, d: int, dtype=torch.float64, shared: bool = True, gain: float = 1.0):
    torch.manual_seed(5)
    qkv = (gain * torch.randn(b, n, 3 * h * d, dtype=dtype)).requires_grad_()
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in qkv.split(h * d, dim=-1))  # strided views
    w1, w2 = (torch.randn(1 if shared else b, h, d, d, dtype=dtype, requires_grad=True) for _ in range(2))
    return qkv, q, k, v, w1, w2


def _grads(out: torch.Tensor, dout: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * dout).sum(), leaves))


_reference = swiglu_ttt_ref


def _generic(q, k, v, w1, w2, *, scale: float, lr: float, grad_norm: bool) -> torch.Tensor:
    """The generic closed-form inner loop and read-out (``vit3.layers``), differentiated by autograd."""
    model = create_inner_model("swiglu", heads=q.shape[1], head_dim=q.shape[-1], cfg=TTTConfig())
    params = inner_loop(
        model, {"w1": w1, "w2": w2}, k, v, (1, q.shape[2]), scale=scale, lr=lr, grad_norm=grad_norm
    )
    return model.apply_to(params, q, (1, q.shape[2]))


def _triton(q, k, v, w1, w2, *, scale: float, lr: float, grad_norm: bool) -> torch.Tensor:
    from vit3.kernels import triton_ttt  # imports Triton

    params = {"w1": w1, "w2": w2}
    return triton_ttt("swiglu", q, k, v, params, scale=scale, lr=lr, grad_norm=grad_norm, backend="triton")


# Every fast path of the op, called like the reference. Triton takes shared initial weights and d >= 16.
PATHS = {
    "eager-tiles": lambda *a, **kw: fast.swiglu_ttt(*a, **kw),
    "cpp": lambda *a, **kw: fast.swiglu_ttt(*a, passes=swiglu_cpp.PASSES, **kw),
    "triton": _triton,
    "generic": _generic,
}
SETTINGS = {
    "norm-lr1": {"scale": 1 / 3, "lr": 1.0, "grad_norm": True},
    "no-norm-lr0.7": {"scale": 0.4, "lr": 0.7, "grad_norm": False},
}


# --------------------------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("grad_norm", [True, False], ids=["norm", "no-norm"])
def test_reference_gradients_equal_finite_differences(grad_norm):
    """The reference's gradients (autograd through its autograd inner step) against float64 finite
    differences, every input."""
    _, q, k, v, w1, w2 = _inputs(2, 1, 5, 3)
    inputs = tuple(t.detach().clone().requires_grad_() for t in (q, k, v, w1, w2))

    def fn(*xs):
        return swiglu_ttt_ref(*xs, scale=0.4, lr=0.8, grad_norm=grad_norm)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_official_formulation_equals_the_reference_every_gradient():
    """The benchmarks' transcription of the official eager code (``benchmarks/official_baseline.py``) computes
    the reference's numbers: forward and every gradient, float64."""
    qkv, q, k, v, w1, w2 = _inputs(2, H, 35, D)
    out = load_benchmark("official_baseline").official_swiglu_branch(q, k, v, w1, w2)
    ref = swiglu_ttt_ref(q, k, v, w1, w2, scale=9**-0.5, lr=1.0, grad_norm=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    for name, g, g_ref in zip(
        ["qkv", "w1", "w2"], _grads(out, dout, [qkv, w1, w2]), _grads(ref, dout, [qkv, w1, w2])
    ):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12, msg=f"gradient of {name}")


# ------------------------------------------------------------------------------- every fast path vs reference

CASES = [
    pytest.param(path, setting, shared, id=f"{path}-{setting}-{'shared' if shared else 'per-sample'}-w")
    for path in PATHS
    for setting in SETTINGS
    for shared in (True, False)
    if shared or path != "triton"
]


@pytest.mark.parametrize(("path", "setting", "shared"), CASES)
def test_fast_path_output_and_every_gradient_match_reference(path, setting, shared):
    """float64, q, k, v strided views of one qkv tensor; gradients of q, k, v (as one qkv gradient), w1,
    w2."""
    qkv, q, k, v, w1, w2 = _inputs(2, H, 35, 16, shared=shared)
    hyper = SETTINGS[setting]
    out = PATHS[path](q, k, v, w1, w2, **hyper)
    assert_matches_reference(out, swiglu_ttt_ref(q, k, v, w1, w2, **hyper), qkv, {"w1": w1, "w2": w2})


@pytest.mark.parametrize(
    "tile_bytes", [10**9, 10**4, 1000], ids=["folded-one-tile", "folded-tiles", "strided-tiles"]
)
@pytest.mark.parametrize("grad_norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("shared_weights", [True, False], ids=["shared-w", "per-sample-w"])
@pytest.mark.parametrize("cpp", [False, True], ids=["tiles", "cpu-kernel"])
def test_eager_tilings_equal_the_reference(monkeypatch, tile_bytes, grad_norm, shared_weights, cpp):
    """The tiled eager path (custom backward; tiled PyTorch or the C++ CPU kernel, whose blocks follow the
    same tile size) over every tiling: one folded tile, folded tiles, strided per-sample tiles."""
    monkeypatch.setattr(fast, "TILE_BYTES", tile_bytes)
    monkeypatch.setattr(fast, "MIN_TILE_TOKENS", 4)
    b, h, n, d = 3, 2, 35, 8
    qkv = torch.randn(b, n, 3 * h * d, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in qkv.split(h * d, dim=-1))  # strided views
    w1, w2 = (
        torch.randn(1 if shared_weights else b, h, d, d, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    hyper = {"scale": 0.4, "lr": 0.8, "grad_norm": grad_norm}
    out = fast.swiglu_ttt(q, k, v, w1, w2, passes=swiglu_cpp.PASSES if cpp else fast.PASSES, **hyper)
    assert_matches_reference(out, swiglu_ttt_ref(q, k, v, w1, w2, **hyper), qkv, {"w1": w1, "w2": w2})


# --------------------------------------------------------------------------------------------- the C++ kernel


PROBLEMS = {
    # (B, H, N, d, tile bytes, threads): one block per head or several with a short last one; problems spread
    # over the threads (B*H >= threads) or run one after another with parallel ops (B*H < threads); a head
    # width that fills whole vectors of doubles (8) or leaves a scalar tail (12).
    "spread-one-block": (3, H, 35, D, 10**9, 2),
    "spread-blocks": (3, H, 35, D, 6 * D * 8, 2),
    "serial-blocks": (1, 1, 35, D, 6 * D * 8, 2),
    "one-thread-blocks": (2, H, 35, D, 6 * D * 8, 1),
    "vector-tail": (2, H, 21, 12, 10**9, 2),
    # heads of a sample grouped into batched matmuls, two per group, the last group short (H = 3)
    "grouped-heads": (2, 3, 35, D, 80 * 2 * D * 8, 1),
    "grouped-heads-spread": (3, 3, 35, D, 80 * 2 * D * 8, 2),
}


@pytest.mark.parametrize(
    ("b", "h", "n", "d", "tile_bytes", "n_threads"), list(PROBLEMS.values()), ids=list(PROBLEMS)
)
@pytest.mark.parametrize("shared", [True, False], ids=["shared-w", "per-sample-w"])
@pytest.mark.parametrize("recompute", [False, True], ids=["save-zy", "recompute-zy"])
def test_kernel_matches_float64_reference_every_gradient(
    monkeypatch, kernel_calls, threads, b, h, n, d, tile_bytes, n_threads, shared, recompute
):
    monkeypatch.setattr(fast, "TILE_BYTES", tile_bytes)
    monkeypatch.setattr(fast, "MIN_TILE_TOKENS", 4)
    threads(n_threads)
    qkv, q, k, v, w1, w2 = _inputs(b, h, n, d, shared=shared)
    hyper = {"scale": 0.4, "lr": 0.8, "grad_norm": True}
    out = fast.swiglu_ttt(q, k, v, w1, w2, passes=swiglu_cpp.PASSES, recompute=recompute, **hyper)
    ref = _reference(q, k, v, w1, w2, **hyper)
    assert kernel_calls["n"] == 1
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    got, want = _grads(out, dout, [qkv, w1, w2]), _grads(ref, dout, [qkv, w1, w2])
    for name, g, g_ref in zip(["qkv", "w1", "w2"], got, want):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


def test_saturated_gates_stay_finite_and_match_float64(kernel_calls):
    """Pre-activations of ±50 and beyond: the vectorised sigmoid must saturate cleanly, as exp
    over/underflows."""
    qkv, q, k, v, w1, w2 = _inputs(2, H, 20, D, gain=30.0)
    hyper = {"scale": 0.4, "lr": 0.5, "grad_norm": True}
    ref = _reference(q, k, v, w1, w2, **hyper)
    dout = torch.randn_like(ref)
    want = _grads(ref, dout, [qkv, w1, w2])
    qkv32, w1_32, w2_32 = (t.detach().float().requires_grad_() for t in (qkv, w1, w2))
    q32, k32, v32 = (t.unflatten(-1, (H, D)).transpose(1, 2) for t in qkv32.split(H * D, dim=-1))
    out = fast.swiglu_ttt(q32, k32, v32, w1_32, w2_32, passes=swiglu_cpp.PASSES, **hyper)
    got = _grads(out, dout.float(), [qkv32, w1_32, w2_32])
    assert kernel_calls["n"] == 1
    assert (k32.detach() @ w2_32.detach()).abs().max() > 50  # the gates really saturate
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for name, g, g_ref in zip(["qkv", "w1", "w2"], got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-3, atol=1e-3 * g_ref.abs().max().item())


@pytest.mark.parametrize("how", ["argument", "mixer-backend"])
def test_switch_picks_the_path_it_names_and_both_agree(monkeypatch, kernel_calls, how):
    qkv, q, k, v, w1, w2 = _inputs(2, H, 30, D, dtype=torch.float32)
    dout = torch.randn(2, H, 30, D)
    results = {}
    for on in (False, True):
        before = kernel_calls["n"]
        if how == "argument":
            out = fast.swiglu_ttt(
                q, k, v, w1, w2, scale=1 / 3, passes=swiglu_cpp.PASSES if on else fast.PASSES
            )
        else:  # a one-branch mixer op on the path (on cpu: the whole-mixer C++ call)
            path = "cpu" if on else "eager"
            out = branch_node("swiglu", path, q, k, v, {"w1": w1, "w2": w2}, (1, 30), scale=1 / 3)
        assert kernel_calls["n"] - before == int(on)
        results[on] = [out, *_grads(out, dout, [qkv, w1, w2])]
    for a, b in zip(results[False], results[True]):  # float32, sums in different orders
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("block", [16, 200], ids=["token-blocks", "grouped-heads"])
def test_ops_read_and_write_strided_token_views_like_dense_ones(block):
    """The ops take q, k, v, the read-out and dq, dk, dv as views with unit stride along d (matmuls read and
    write them with their row strides), in token blocks or with a sample's heads grouped (N = 40 <= block)."""
    ops, _ = cpu_ext.load()
    b, n = 2, 40
    qkv = torch.randn(b, n, 3 * H * D)
    w1, w2 = (0.3 * torch.randn(b, H, D, D) for _ in range(2))
    d_out = torch.randn(b, n, H * D)
    results = []
    for strided in (True, False):
        heads = lambda t: t.unflatten(-1, (H, D)).transpose(1, 2)  # noqa: E731 - [B, N, H*D] -> [B, H, N, D]
        tokens = [heads(t) for t in qkv.split(H * D, dim=-1)]
        grads = [heads(t) for t in torch.empty_like(qkv).split(H * D, dim=-1)]
        out, dout = heads(torch.empty(b, n, H * D)), heads(d_out)
        if not strided:
            tokens, grads, dout = (
                [t.contiguous() for t in tokens],
                [torch.empty_like(t) for t in tokens],
                dout.contiguous(),
            )
            out = torch.empty_like(tokens[0])
        z, y = (torch.empty(b, H, n, 2 * D) for _ in range(2))
        saved = ops.ttt_forward(*tokens, w1, w2, out, z, y, 0.1, 0.9, True, block)
        dw = ops.ttt_backward(dout, *tokens, z, y, *saved, *grads, 0.1, 0.9, True, block)
        results.append((out, z, y, *saved, *grads, dw))
    assert not results[0][0].is_contiguous()
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_ops_reject_mismatched_inputs_by_name():
    ops, _ = cpu_ext.load()
    q, v = torch.randn(1, H, 10, D), torch.randn(1, H, 11, D)
    w = torch.randn(1, H, D, D)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match=r"\[B, H, N, d\] of one shape"):
        ops.ttt_forward(q, q, v, w, w, out, None, None, 0.1, 1.0, True, 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.ttt_forward(q, q, q.double(), w, w, out, None, None, 0.1, 1.0, True, 8)
    with pytest.raises(RuntimeError, match="positive number of tokens"):
        ops.ttt_forward(q, q, q, w, w, out, None, None, 0.1, 1.0, True, 0)
    pair = torch.randn(1, H, D, 2 * D)  # the kernel's [W1 | W2] is built inside: w1, w2 come [1|B, H, d, d]
    with pytest.raises(RuntimeError, match=r"w1, w2 must be \[1\|B, H, d, d\] = \[1\|1, 2, 8, 8\]"):
        ops.ttt_forward(q, q, q, pair, pair, out, None, None, 0.1, 1.0, True, 8)
    with pytest.raises(RuntimeError, match=r"z and y must be \[B, H, 10, 16\]"):
        ops.ttt_forward(q, q, q, w, w, out, torch.empty(1, H, 10, D), None, 0.1, 1.0, True, 8)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        h = q.half()
        ops.ttt_forward(h, h, h, w.half(), w.half(), h.clone(), None, None, 0.1, 1.0, True, 8)


def test_forcing_the_kernel_onto_unsupported_tensors_names_the_problem():
    _, q, k, v, w1, w2 = _inputs(1, H, 6, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"float32/float64 CPU tensors, got torch\.bfloat16"):
        fast.swiglu_ttt(q, k, v, w1, w2, scale=1 / 3, passes=swiglu_cpp.PASSES)


def test_a_failed_build_raises_naming_the_error(monkeypatch):
    monkeypatch.setattr(cpu_ext, "load", lambda: (None, "CalledProcessError: no C++ compiler"))
    _, q, k, v, w1, w2 = _inputs(2, H, 12, D)
    with pytest.raises(RuntimeError, match=r"could not be built.*no C\+\+ compiler"):
        fast.swiglu_ttt(q, k, v, w1, w2, scale=1 / 3, passes=swiglu_cpp.PASSES)


def test_build_targets_the_cpus_vector_unit():
    suffix, flags = cpu_ext._build_flags()
    capability = torch.backends.cpu.get_cpu_capability()
    assert "-O3" in flags and "-fopenmp" in flags
    if capability in ("AVX512", "AVX2"):
        assert suffix == capability.lower() and f"-DCPU_CAPABILITY_{capability}" in flags
    else:
        assert suffix == "portable" and not any(f.startswith("-DCPU_CAPABILITY") for f in flags)


def test_the_build_is_keyed_by_its_source_so_checkouts_never_rebuild_each_other(tmp_path, monkeypatch):
    """Checkouts (source roots) with different kernels get different extension names and build folders; with
    the same kernel, one build whose inputs name no checkout (copies of the sources in its folder: its ninja
    file, so the build, is the same whichever loads it). The flags key it too; the folder sits under
    ``$TORCH_EXTENSIONS_DIR``, else PyTorch's build root."""
    import torch.utils.cpp_extension as cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **kw: calls.append((name, sources, kw)))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    for root, edit in (("clone", b""), ("wheel", b""), ("edited", b"// a change\n")):
        files = [tmp_path / root / f.name for f in cpu_ext.FILES]
        files[0].parent.mkdir(parents=True)
        for copy, f in zip(files, cpu_ext.FILES):
            copy.write_bytes(f.read_bytes() + (edit if copy.suffix == ".cpp" else b""))
        monkeypatch.setattr(cpu_ext, "FILES", tuple(files))
        cpu_ext.load.__wrapped__()  # uncached: the process's kernel stays loaded
    clone, wheel, edited = calls
    assert clone == wheel, "the same source builds once, whichever checkout loads it"
    name, sources, kw = clone
    folder = tmp_path / "ext" / name
    cpp_files = [f for f in cpu_ext.FILES if f.suffix == ".cpp"]
    assert kw["build_directory"] == str(folder) and [Path(s).parent for s in sources] == [folder] * len(
        cpp_files
    )
    assert edited[0] != name and edited[2]["build_directory"] != str(folder)
    suffix, flags = cpu_ext._build_flags()
    assert cpu_ext.build_target(files, suffix, flags) != cpu_ext.build_target(files, suffix, [*flags, "-g"])
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cpu_ext.build_target(files, suffix, flags)[1].parent == Path(
        cpp_extension.get_default_build_root()
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning concerns machines without a CUDA runtime")
def test_a_cpu_run_logs_no_cuda_home_warning(tmp_path):
    """Loading the kernel imports torch.utils.cpp_extension, whose import logs "No CUDA runtime is found,
    using CUDA_HOME=..." on a machine without a GPU whenever CUDA_HOME is set; the kernel is CPU code."""
    code = "import timm, torch, vit3; timm.create_model('vit3_tiny').eval()(torch.rand(1, 3, 224, 224))"
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "No CUDA runtime" not in proc.stdout + proc.stderr and "CUDA_HOME" not in proc.stderr


def test_the_cpp_kernel_loads_and_runs_without_triton():
    """With ``triton`` unimportable (``sys.modules["triton"] = None``), the C++ path and the mixer's CPU
    backends load and run; the registry names why Triton cannot serve."""
    code = """
import sys
sys.modules["triton"] = None
import torch
from vit3.kernels.cpp import cpu_kernel_ops
from vit3.kernels.swiglu.cpp import PASSES
from vit3.kernels.swiglu.eager import swiglu_ttt
from vit3.kernels import triton_path
from vit3.layers import TTTMixer

q = torch.randn(2, 2, 128, 16)
w = 0.1 * torch.randn(1, 2, 16, 16)
assert swiglu_ttt(q, q, q, w, w, scale=1 / 3, passes=PASSES).shape == q.shape
cpu_kernel_ops(q)
expl = TTTMixer(64, 4).explain(torch.randn(1, 144, 64), (12, 12))
assert [b.backend for b in expl.branches] == ["cpu", "cpu"], expl
assert "triton" not in sys.modules or sys.modules["triton"] is None
print("why not triton:", triton_path._kernels()[1])
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the Triton kernels cannot be imported" in proc.stdout
