"""The launch set-up of the Triton kernels: per-GPU tiles, ``fits_device``, the dot precision, every table
configuration run (interpreter or GPU) against the PyTorch path.

The tile table (``triton.tiles.launch_config``) differs by GPU arch and dot precision; whether each entry fits
on chip is checked by the offline compiles (``tests/kernels/test_kernels_compile.py``), whether it computes
the right thing here: each distinct launch structure it produces (column blocks per kernel role) runs through
``triton_ttt`` with ``triton.tiles.TILES_AS`` set to an (arch, precision) that picks it.
"""

from __future__ import annotations

import functools
import types
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers.ops import (
    AMD_GPUS,
    SCALE,
    WEIGHTS,
    make_inputs,
    max_rel_err,
    per_tensor,
    run_both,
    split_heads,
    use_gpu_kernels,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.runtime.jit import JITFunction

import vit3.kernels as kernels
from vit3.kernels import aot
from vit3.kernels.triton import checks as tchecks
from vit3.kernels.triton import device as tdev
from vit3.kernels.triton import op as top
from vit3.kernels.triton import plan as tplan
from vit3.kernels.triton import tiles as ttiles
from vit3.kernels.triton.device import ARCHS, Arch

pytestmark = pytest.mark.triton

HEAD_DIMS = (16, 32, 64, 128)
MODELS = ("swiglu", "linear", "dwconv")


@pytest.fixture(autouse=True)
def _nan_fill(monkeypatch):
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))


def structure(model: str, d: int, dtype: torch.dtype, arch: Arch, prec: str) -> tuple:
    """What decides which launches run and which columns each program owns: column blocks per role."""
    cfg = ttiles.launch_config(model, 3136, d, 8, dtype, arch, prec=prec, interpret=False)
    return tuple(sorted((role, t.block_c) for role, t in cfg.tiles.items()))


# ------------------------------------------------------------------------------------------- tile table


@pytest.mark.parametrize("arch", list(ARCHS), ids=list(ARCHS))
@pytest.mark.parametrize("mode", list(aot.MODES))
def test_every_configuration_is_well_formed(arch, mode):
    dtype, prec = aot.MODES[mode]
    for model in MODELS:
        for d in (*HEAD_DIMS, 24, 72, 96):
            for n in (1, 197, 3136):
                cfg = ttiles.launch_config(model, n, d, 8, dtype, ARCHS[arch], prec=prec, interpret=False)
                assert cfg.block_d >= d and cfg.block_d & (cfg.block_d - 1) == 0
                assert cfg.s * cfg.chunk >= n > (cfg.s - 1) * cfg.chunk
                for role, t in cfg.tiles.items():
                    assert 16 <= t.block_c <= cfg.block_d and t.block_c & (t.block_c - 1) == 0, role
                    assert t.block_n >= 16 and cfg.chunk % t.block_n == 0, role  # a chunk is whole tiles
                    assert t.num_warps in (4, 8) and t.num_stages in (1, 2, 3), role


def test_d64_backward_is_one_launch_only_where_it_fits():
    """The fused d = 64 SwiGLU backward: 16-bit operands on tensor cores everywhere (sm_80+: 48-84 KB); fp32
    TF32 operands (132-184 KB of shared memory) only on >= 200 KB parts; every other case splits the columns.
    The fp32-IEEE case that spilled ~19 KB per thread is split everywhere."""
    for arch in ARCHS.values():
        for mode, (dtype, prec) in aot.MODES.items():
            cfg = ttiles.launch_config("swiglu", 3136, 64, 8, dtype, arch, prec=prec, interpret=False)
            fused = cfg.cols("grad_bwd", 64) == 1
            half = mode in ("bf16", "fp16") and arch.capability >= 80
            expect = half or (arch.smem >= ttiles.FUSED_BACKWARD_SMEM and mode == "fp32-tf32")
            assert fused == expect, (arch.sm, mode)
            assert cfg.cols("readout_bwd", 64) == cfg.cols("grad_bwd", 64)
    assert (
        ttiles.launch_config("swiglu", 3136, 128, 8, torch.bfloat16, ARCHS["sm_90"]).cols("grad_bwd", 128) > 1
    )


def test_half_inputs_meet_the_dots_as_they_are_with_wgmma_sized_tiles():
    """bf16 / fp16 operands from sm_80 on (sm_75 has no bf16 MMA: fp32 operands). At d = 64 SwiGLU's
    one-block stages run on transposed tiles: all three on warp-group parts (sm_90, sm_100; sm_100's forward
    apart), the gradient backward elsewhere. On warp-group parts 64-token tiles but in those stages, one warp
    group on sm_90, the depthwise conv's tiles at d = 64 of 16 tokens, and at d = 32 on sm_90 SwiGLU's
    weight-gradient dots stacked (``Tiles.stack``) in every stage that has them (its gradient backward on
    64-token tiles there, 32 elsewhere); the interpreter takes sm_90's, with bf16
    operands emulated."""
    stages = {"forward", "readout_bwd", "grad_bwd"}
    for arch in ARCHS.values():
        for dtype in (torch.bfloat16, torch.float16):
            for d in HEAD_DIMS:
                cfg = ttiles.launch_config("swiglu", 3136, d, 8, dtype, arch, prec="tf32", interpret=False)
                native = arch.capability >= 80
                assert cfg.dot == (tdev.TL_DTYPES[dtype] if native else tdev.tl.float32)
                assert not cfg.emulate
                trans = {r for r, t in cfg.tiles.items() if t.trans}
                stacked = {r for r, t in cfg.tiles.items() if t.stack}
                wgrad = {"forward", "grad", "readout_bwd", "grad_bwd"}
                assert stacked == (wgrad if d == 32 and arch.sm == "sm_90" else set()), (arch.sm, d)
                if not native or d != 64:
                    assert not trans, (arch.sm, d)
                elif not tdev.warp_group_mma(arch):
                    assert trans == {"grad_bwd"}, arch.sm
                else:  # sm_100's one-launch forward keeps two warp groups on untransposed tiles
                    assert trans == stages - ({"forward"} if arch.sm == "sm_100" else set()), arch.sm
                if tdev.warp_group_mma(arch):
                    long = {r for r, t in cfg.tiles.items() if t.block_n >= 64}
                    short_bwd = {"grad_bwd"} - stacked  # 32 tokens where not stacked
                    short = {16: set(), 32: short_bwd, 64: trans, 128: {"grad_bwd_cross"}}[d]
                    assert long == set(ttiles.MATRIX_ROLES) - short, (arch.sm, d)
                    conv = ttiles.launch_config("dwconv", 3136, d, 8, dtype, arch, interpret=False)
                    assert conv.tiles["conv"].block_n == (16 if d in (64, 128) else 32), (arch.sm, d)
                    if arch.sm == "sm_90" and d <= 64:  # one column block: no cross launch
                        warps = {t.num_warps for r, t in cfg.tiles.items() if not r.endswith("_cross")}
                        assert warps == {4}, d
    here = ttiles.launch_config("swiglu", 197, 64, 2, torch.bfloat16, ARCHS["sm_90"], interpret=True)
    assert here.dot == tdev.tl.bfloat16 and here.emulate
    assert {r for r, t in here.tiles.items() if t.trans} == stages


def test_interpreter_follows_the_tiles_of_a_gpu(monkeypatch):
    arch, prec = ttiles.INTERPRET_TILES
    on_gpu = ttiles.launch_config("swiglu", 197, 64, 2, torch.float32, arch, prec=prec, interpret=False)
    here = ttiles.launch_config("swiglu", 197, 64, 2, torch.float32, arch, prec="ieee", interpret=True)
    assert {r: t.block_c for r, t in here.tiles.items()} == {r: t.block_c for r, t in on_gpu.tiles.items()}
    assert here.s == 1  # one chunk: the interpreter runs programs one after another
    monkeypatch.setattr(ttiles, "TILES_AS", (ARCHS["sm_86"], "tf32"))
    forced = ttiles.launch_config("swiglu", 197, 64, 2, torch.float32, arch, prec="ieee", interpret=True)
    assert forced.cols("grad_bwd", 64) == 2 and forced.prec == "ieee"


# -------------------------------------------------------------------------------- every configuration runs


def _structures() -> list:
    """One (model, loss, d, arch, prec) per distinct structure the table gives fp32-class inputs, but for the
    interpreter's default one (``INTERPRET_TILES``), which ``tests/kernels/test_kernels_ttt.py`` runs
    throughout."""
    seen, out = set(), []
    for model, loss in (("swiglu", "dot"), ("linear", "dot"), ("linear", "mse"), ("dwconv", "dot")):
        for d in HEAD_DIMS:
            seen.add((model, loss, d, structure(model, d, torch.float32, *ttiles.INTERPRET_TILES)))
            for arch in ARCHS.values():
                for prec in ("tf32", "ieee"):
                    key = (model, loss, d, structure(model, d, torch.float32, arch, prec))
                    if key not in seen:
                        seen.add(key)
                        label = f"{model}-{loss}-d{d}-as-{arch.sm}-{prec}"
                        out.append(pytest.param(model, loss, d, arch, prec, id=label))
    return out


@pytest.mark.parametrize(("model", "loss", "d", "arch", "prec"), _structures())
def test_each_table_configuration_matches_reference(model, loss, d, arch, prec, monkeypatch):
    """Forward and every gradient, with the column blocks the table gives ``arch`` (N = 197 in 4 chunks)."""
    monkeypatch.setattr(ttiles, "TILES_AS", (arch, prec))
    shape = (2, 2, (1, 197) if model == "dwconv" else 197, d)
    out, ref, got, exp, weights = run_both(model, shape, torch.float32, loss=loss, chunk=64)
    assert max_rel_err(out, ref) < 2e-5
    for label, a, e in per_tensor(got, exp, weights):
        assert torch.isfinite(a).all(), f"gradient of {label} has unwritten (NaN) entries"
        assert max_rel_err(a, e) < 5e-5, f"gradient of {label}"


# ------------------------------------------------------------------------------------------ fits_device


@pytest.fixture
def gpu(monkeypatch):
    """Pretends the CUDA device is the given ``Arch`` (``fits_device`` asks ``Arch.of``)."""

    def use(arch: Arch) -> torch.device:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(tdev.Arch, "of", staticmethod(lambda device: arch))
        ttiles.fits_arch.cache_clear()
        return torch.device("cuda")

    yield use
    ttiles.fits_arch.cache_clear()


@pytest.mark.parametrize("arch", list(ARCHS), ids=list(ARCHS))
def test_every_current_gpu_fits_every_model_dtype_and_head_dim(arch, gpu):
    """All but SwiGLU in the fp64 checking mode at d = 128 on the T4 (its fp64 tiles need ~88 KB, the T4
    64)."""
    device = gpu(ARCHS[arch])
    for model in MODELS:
        for d in HEAD_DIMS:
            for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
                ok, why = ttiles.fits_device(model, d, dtype, device)
                if (arch, model, dtype, d) == ("sm_75", "swiglu", torch.float64, 128):
                    assert not ok and "96 KB" in why and "allows 64 KB" in why and "Tesla T4" in why
                else:
                    assert (ok, why) == (True, ""), (model, d, dtype)


def test_fits_device_names_what_is_missing(gpu):
    ok, why = ttiles.fits_device("swiglu", 64, torch.bfloat16, gpu(Arch(70, 96 * 1024, 80, "Tesla V100")))
    assert not ok and "sm_70 (Tesla V100)" in why and "sm_75+" in why
    ok, why = ttiles.fits_device("swiglu", 64, torch.bfloat16, gpu(Arch(87, 48 * 1024, 16, "Orin-lite")))
    assert not ok and "allows 48 KB" in why and "need 96 KB" in why  # 16-bit SwiGLU at d = 64: wgmma tiles
    assert ttiles.fits_device("swiglu", 64, torch.bfloat16, gpu(ARCHS["sm_75"])) == (True, "")
    ok, why = ttiles.fits_device("swiglu", 256, torch.bfloat16, gpu(ARCHS["sm_90"]))
    assert not ok and "16..128" in why
    ok, why = ttiles.fits_device("mlp", 64, torch.bfloat16, gpu(ARCHS["sm_90"]))
    assert not ok and "mlp" in why
    ok, why = ttiles.fits_device("swiglu", 64, torch.int32, gpu(ARCHS["sm_90"]))
    assert not ok and "int32" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks about a CUDA device where there is none")
def test_fits_device_without_a_gpu_defers_the_check():
    assert ttiles.fits_device("swiglu", 64, torch.bfloat16, torch.device("cuda")) == (True, "")


def test_fits_device_on_cpu_depends_on_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ttiles.fits_device("swiglu", 64, torch.float32, torch.device("cpu")) == (True, "")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = ttiles.fits_device("swiglu", 64, torch.float32, torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET" in why


def test_fits_device_is_cached_per_arch(gpu, monkeypatch):
    device = gpu(ARCHS["sm_86"])
    calls = []
    real = ttiles.launch_config
    monkeypatch.setattr(ttiles, "launch_config", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(3):  # fp32: the tiles decide (16-bit SwiGLU at d = 64 has one declared bound)
        ttiles.fits_device("swiglu", 64, torch.float32, device)
    ttiles.fits_device("swiglu", 48, torch.float32, device)  # the same 64-wide tiles
    assert len(calls) == 1


def test_arch_of_reads_the_device_properties(monkeypatch):
    props = types.SimpleNamespace(
        major=8, minor=6, shared_memory_per_block_optin=101376, multi_processor_count=72, name="NVIDIA A10"
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    tdev._cuda_arch.cache_clear()
    try:
        assert Arch.of(torch.device("cuda", 0)) == Arch(86, 101376, 72, "NVIDIA A10")
        del props.shared_memory_per_block_optin  # older PyTorch: the table's value for the capability
        tdev._cuda_arch.cache_clear()
        assert Arch.of(torch.device("cuda", 0)).smem == ARCHS["sm_86"].smem
    finally:
        tdev._cuda_arch.cache_clear()


def test_rocm_takes_triton_only_where_its_dot_precision_is_allowed(fake_gpu):
    """Triton's AMD backend rejects TF32 dots on most parts (its own option parser says which take them)."""
    assert "tf32" in tdev.hip_dot_precisions("gfx942")
    assert "tf32" not in tdev.hip_dot_precisions("gfx90a")
    mi250 = fake_gpu(AMD_GPUS["gfx90a"], hip="6.3")
    ok, why = ttiles.fits_device("swiglu", 32, torch.bfloat16, mi250)
    assert not ok and "ROCm gfx90a" in why and "not the tf32 dots" in why and "ieee" in why, why
    assert ttiles.fits_device("swiglu", 32, torch.float64, mi250) == (True, "")  # IEEE dots
    mi300 = fake_gpu(AMD_GPUS["gfx942"], hip="6.3")
    assert "ROCm" not in ttiles.fits_device("swiglu", 32, torch.bfloat16, mi300)[1]


# ----------------------------------------------------------------------------------- where launches run


class _CurrentDevice:
    """``torch.cuda.device`` on a machine without GPUs: keeps which CUDA device is current (0 at first)."""

    current = torch.device("cuda", 0)

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def __enter__(self) -> None:
        self.before, _CurrentDevice.current = _CurrentDevice.current, self.device

    def __exit__(self, *exc: object) -> None:
        _CurrentDevice.current = self.before


@pytest.fixture
def fresh_plans():
    """No cached plan before or after the test (a plan holds its kernels, and the tiles of its arch)."""
    top.clear_plans()
    yield
    top.clear_plans()


def test_launches_run_on_the_inputs_device_with_tiles_for_it(monkeypatch, fresh_plans):
    """Inputs on GPU 1 while GPU 0 is current (stubbed launches on fake tensors): every launch runs with
    GPU 1 current (Triton takes the current device and its current stream), on tiles sized for GPU 1."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a GPU host's launch set-up
    use_gpu_kernels(monkeypatch)
    archs = {0: ARCHS["sm_90"], 1: ARCHS["sm_86"]}
    monkeypatch.setattr(tdev, "_cuda_arch", lambda index: archs[index])
    monkeypatch.setattr(torch.cuda, "device", _CurrentDevice)
    seen = []

    class Launcher:
        def __init__(self, kernel: JITFunction) -> None:
            self.name = kernel.fn.__name__

        def __getitem__(self, grid: tuple):
            return lambda *args, **kwargs: seen.append((self.name, _CurrentDevice.current, kwargs))

    monkeypatch.setattr(tplan, "launcher", Launcher)
    cfg = ("swiglu", "dot", 1, 196, SCALE, 1.0, True, 0)
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 2, 196, 64, device="cuda:1", dtype=torch.bfloat16) for _ in range(3))
        w1, w2 = (torch.empty(1, 2, 64, 64, device="cuda:1") for _ in range(2))
        # the ops' real bodies (the ops themselves take their shape-only fakes on fake tensors)
        out, *stats = top._forward(q, k, v, w1, w2, *cfg)
        top._backward_grads(out, q, k, v, w1, w2, *stats, *cfg)
    assert len(seen) > 4 and {device for _, device, _ in seen} == {torch.device("cuda", 1)}
    assert _CurrentDevice.current == torch.device("cuda", 0)  # restored

    # The tiles are GPU 1's (sm_86, 99 KB per block: 32-token gradient tiles), not GPU 0's (sm_90: 64).
    def tiles(arch: Arch) -> list:
        fwd, bwd = aot.plan_launches(aot.Case("swiglu", "dot", 64, "bf16", arch, n_tok=196, batch=2, heads=2))
        return [(launch.kernel.fn.__name__, _tiles(launch.kwargs)) for launch in fwd + bwd]

    assert [(name, _tiles(kwargs)) for name, _, kwargs in seen] == tiles(archs[1]) != tiles(archs[0])


def _tiles(kwargs: dict) -> dict:
    keys = ("BLOCK_N", "BLOCK_C", "TRANS", "num_warps", "num_stages")
    return {key: kwargs[key] for key in keys if key in kwargs}


# ------------------------------------------------------------------------------------------ dot precision


@pytest.fixture
def restore_fp32_precision():
    matmul = torch.backends.cuda.matmul
    before = (matmul.fp32_precision, torch.backends.fp32_precision)
    yield matmul
    matmul.fp32_precision, torch.backends.fp32_precision = before


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="PyTorch < 2.9")
def test_precision_follows_the_new_fp32_precision_api_without_raising(restore_fp32_precision, monkeypatch):
    matmul = restore_fp32_precision
    monkeypatch.setattr(tdev, "interpreting", lambda: False)  # the interpreter always takes IEEE dots
    matmul.fp32_precision = "tf32"
    with pytest.raises(RuntimeError):
        _ = matmul.allow_tf32  # what the old ``dot_precision`` read: PyTorch refuses once the new API is set
    assert tdev.fp32_uses_tf32() and tdev.dot_precision(torch.float32) == "tf32"
    matmul.fp32_precision = "ieee"
    assert not tdev.fp32_uses_tf32() and tdev.dot_precision(torch.float32) == "ieee"
    assert tdev.dot_precision(torch.bfloat16) == "tf32" and tdev.dot_precision(torch.float64) == "ieee"


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="PyTorch < 2.9")
def test_precision_follows_the_legacy_flag(restore_fp32_precision, monkeypatch):
    matmul = restore_fp32_precision
    monkeypatch.setattr(tdev, "interpreting", lambda: False)
    matmul.fp32_precision = "none"
    # Set directly, not by monkeypatch: ``allow_tf32`` is a computed attribute of the cuBLAS module, which
    # pytest 9.2's undo would try to delete; the fixture restores the precision state.
    matmul.allow_tf32 = True
    assert tdev.dot_precision(torch.float32) == "tf32"
    matmul.allow_tf32 = False
    assert tdev.dot_precision(torch.float32) == "ieee"


# ------------------------------------------------------------------------------------------------- plans


def plan(model: str, loss: str, batch: int, heads: int, n: int, d: int, arch: Arch = ARCHS["sm_90"],
         mode: str = "bf16") -> tuple[list, list]:  # fmt: skip
    """The forward's and backward's launches ``triton_ttt`` makes on ``arch`` (meta tensors: no kernel
    runs)."""
    return aot.plan_launches(aot.Case(model, loss, d, mode, arch, n_tok=n, batch=batch, heads=heads))


@pytest.mark.parametrize(
    ("model", "loss", "d"),
    [("swiglu", "dot", 32), ("swiglu", "dot", 64), ("linear", "mse", 32), ("linear", "mse", 64),
     ("linear", "dot", 64), ("dwconv", "dot", 64)],
    ids=["swiglu-32", "swiglu-64", "linear-mse-32", "linear-mse-64", "linear-dot-64", "dwconv-64"],
)  # fmt: skip
def test_weight_gradient_reduction_fills_a_132_sm_gpu(model, loss, d):
    """At B*H = 64, N = 3136 (the benchmark shape), however the 64 split into samples and heads, the
    reduction's (first) launch runs on >= 132 programs; the old one ran on H x column blocks (4-12)
    programs."""
    for batch, heads in ((64, 1), (16, 4), (8, 8), (4, 16), (1, 64)):
        _, bwd = plan(model, loss, batch, heads, 3136, d)
        first = next(launch for launch in bwd if launch.label.startswith("wgrad_reduce_kernel"))
        assert first.programs >= 132, (batch, heads, first.label, first.programs)
        assert first.grid[0] * first.grid[1] >= first.programs


def test_batch_times_heads_beyond_the_grid_limits_folds():
    """4096 samples x 16 heads: 65,536 (sample, head) programs, one more than CUDA's grid axes 1 and 2
    take."""
    for model, loss, d in (("swiglu", "dot", 32), ("dwconv", "dot", 32), ("linear", "mse", 128)):
        fwd, bwd = plan(model, loss, 4096, 16, 49, d)
        for launch in fwd + bwd:
            x, y = launch.grid
            assert x <= 2**31 - 1 and y <= 65535 and x * y >= launch.programs, (model, launch.label)
        assert max(launch.programs for launch in fwd) >= 4096 * 16


def test_folded_grids_compute_what_unfolded_ones_do():
    """The folding itself, with a cap of 5 programs on axis 0: the same programs, the same sums, bit for
    bit."""
    cases = (
        ("swiglu", (2, 3, 40, 32), None),
        ("swiglu", (2, 2, 40, 16), 16),
        ("dwconv", (2, 1, (5, 8), 16), 16),
    )
    for name, (b, g, n, d), chunk in cases:
        grid = n if isinstance(n, tuple) else (1, n)
        qkv, params = make_inputs(name, b, g, grid[0] * grid[1], d, torch.float32)
        run = functools.partial(_fwd_bwd, name, qkv, g, params, grid, chunk)
        flat = run()
        launched = []
        real = tplan.Launch.__call__
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tplan, "GRID_X_MAX", 5)
            patch.setattr(tplan.Launch, "__call__", functools.partialmethod(_recorded, launched, real))
            folded = run()
        assert any(y > 1 for _, y in launched) and all(x <= 5 for x, _ in launched)
        for a, e in zip(folded, flat):
            assert torch.equal(a, e), name


def _recorded(self, launched: list, real, tensors=()) -> None:
    """A launch that records its grid, then runs (``real``)."""
    launched.append(self.grid)
    real(self, tensors)


def _fwd_bwd(name: str, qkv: torch.Tensor, g: int, params: dict, grid: tuple, chunk: int | None) -> list:
    out = kernels.triton_ttt(name, *split_heads(qkv, g), params, grid=grid, scale=SCALE, backend="triton",
                             chunk=chunk)  # fmt: skip
    return [out, *torch.autograd.grad(out.square().sum(), [qkv, *params.values()])]


def test_plans_are_built_once_per_key(fresh_plans):
    qkv, params = make_inputs("swiglu", 1, 2, 20, 16, torch.float32)

    def run(n: int) -> None:
        out = kernels.triton_ttt("swiglu", *split_heads(qkv[:, :n], 2), params, scale=SCALE, backend="triton")
        out.sum().backward()

    for _ in range(3):
        run(20)
    fwd, bwd = top.forward_template.cache_info(), top.backward_template.cache_info()
    assert (fwd.misses, bwd.misses) == (1, 1)
    assert ttiles._launch_config.cache_info().misses == 1
    run(19)  # a new N: a new plan
    assert top.forward_template.cache_info().misses == 2


def test_a_second_eager_call_of_one_signature_only_binds_and_launches(fresh_plans, monkeypatch):
    """The eager hot path: a call whose signature was seen runs its cached plans, with no checks, no plan key,
    no plan built or looked up, no custom op (the dispatcher's machinery is for ``torch.compile``), forward,
    backward and inference alike; a new layout of the upstream gradient builds its backward plan once."""
    for name, loss in (("swiglu", "dot"), ("linear", "mse"), ("dwconv", "dot")):
        qkv, params = make_inputs(name, 1, 2, 16, 16, torch.float32)

        def fwd(name=name, loss=loss, qkv=qkv, params=params) -> torch.Tensor:
            q, k, v = split_heads(qkv, 2)
            return kernels.triton_ttt(
                name, q, k, v, params, grid=(4, 4), scale=SCALE, loss=loss, backend="triton"
            )

        out = fwd()  # the first calls: checked and planned
        out.backward(torch.ones_like(out))
        with torch.no_grad():
            fwd()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tchecks, "_validate", lambda *a, **k: pytest.fail("_validate on the hot path"))
            for slow in (
                "check_call",
                "plan_key",
                "_fwd_op",
                "_bwd_op",
                "_forward",
                "_backward_grads",
            ):
                patch.setattr(top, slow, lambda *a, slow=slow, **k: pytest.fail(f"{slow} on the hot path"))
            for where, cache in (
                (top, "forward_template"),
                (top, "backward_template"),
                (ttiles, "_launch_config"),
            ):
                patch.setattr(where, cache, lambda *a, cache=cache: pytest.fail(f"{cache} looked up"))
            out = fwd()
            out.backward(torch.ones_like(out))
            with torch.no_grad():
                fwd()
        out = fwd()
        dout = torch.ones(out.shape[::-1]).permute(3, 2, 1, 0)  # another layout: a new backward plan
        before = top.backward_template.cache_info().misses
        out.backward(dout)
        out = fwd()
        out.backward(dout)
        assert top.backward_template.cache_info().misses == before + 1, name


def test_eager_path_and_custom_ops_agree_bit_for_bit(fresh_plans):
    """The eager node (``_TritonTTT``) and the custom ops ``torch.compile`` traces (their registered autograd)
    run the same plans: identical outputs and gradients."""
    for name, loss in (("swiglu", "dot"), ("linear", "mse"), ("dwconv", "dot")):
        qkv, params = make_inputs(name, 2, 2, 20, 16, torch.float32)
        w = list(params.values())
        w1, w2 = w[0], (w[1] if len(w) == 2 else None)
        cfg = (name, loss, 4, 5, SCALE, 1.0, True, 0)
        eager = kernels.triton_ttt(name, *split_heads(qkv, 2), params, grid=(4, 5), scale=SCALE, loss=loss,
                                   backend="triton")  # fmt: skip
        op = torch.ops.vit3.triton_ttt_fwd(*split_heads(qkv, 2), w1, w2, *cfg)[0]
        for a, e in zip([op, *torch.autograd.grad(op.square().sum(), [qkv, *w])],
                        [eager, *torch.autograd.grad(eager.square().sum(), [qkv, *w])]):  # fmt: skip
            assert torch.equal(a, e), name


def test_forward_and_backward_read_no_tensor_data_on_the_host(monkeypatch):
    """No host synchronisation, so CUDA graphs can capture the op: the whole Python path (checks, plans,
    allocations, launches, autograd) runs on meta tensors, where reading a value (``.item()``, ``bool``, a
    copy to the host) raises."""
    launched = []
    monkeypatch.setattr(tchecks, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(tplan.Launch, "__call__", lambda self, tensors=(): launched.append(self.label))
    for name, loss in (("swiglu", "dot"), ("linear", "mse"), ("dwconv", "dot")):
        qkv = torch.empty(2, 64, 3 * 2 * 32, device="meta", requires_grad=True)
        shape = (1, 64, 3, 3) if name == "dwconv" else (1, 2, 32, 32)
        params = {w: torch.empty(shape, device="meta", requires_grad=True) for w in WEIGHTS[name]}
        for chunk in (None, 16):
            launched.clear()
            out = kernels.triton_ttt(name, *split_heads(qkv, 2), params, grid=(8, 8), scale=SCALE, loss=loss,
                                     backend="triton", chunk=chunk)  # fmt: skip
            grads = torch.autograd.grad(out.sum(), [qkv, *params.values()])
            assert out.device.type == "meta" and all(g.device.type == "meta" for g in grads)
            assert any("wgrad_reduce" in label for label in launched), (name, chunk, launched)


def test_backward_saves_g_and_its_norm_not_the_stepped_weights():
    """What the autograd graph keeps besides the inputs: ``G`` ``[B*G, NW, d, d]`` and ``||G||`` ``[B*G, NW,
    d]`` (fp32); ``W'`` is recomputed from ``W``, ``G`` and the norm (the old op kept it too, twice the
    bytes)."""
    b, g, n, d = 2, 3, 24, 16
    qkv, params = make_inputs("swiglu", b, g, n, d, torch.float16)
    inputs = {t.data_ptr() for t in (qkv, *params.values())}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = kernels.triton_ttt("swiglu", *split_heads(qkv, g), params, scale=SCALE, backend="triton")
    extra = [t for t in saved if t.untyped_storage().data_ptr() not in inputs]
    assert sorted(tuple(t.shape) for t in extra) == [(b * g, 2, d), (b * g, 2, d, d)]
    assert all(t.dtype == torch.float32 for t in extra)
    out.float().sum().backward()
    assert all(p.grad is not None for p in params.values())


def test_stacked_weight_gradient_dots_are_refused_for_a_one_weight_model(monkeypatch):
    """``Tiles.stack`` joins two weights' products: a linear model's tiles with it are refused by name."""
    real = ttiles._matrix_tiles
    monkeypatch.setattr(ttiles, "_matrix_tiles", lambda *args: replace(real(*args), stack=True))
    with pytest.raises(ValueError, match="stacked weight-gradient dots are SwiGLU's"):
        ttiles.launch_config("linear", 3136, 32, 8, torch.bfloat16, ARCHS["sm_90"], interpret=False)


@pytest.mark.parametrize("flag", ["trans", "stack"])
def test_a_cross_launch_refuses_tiles_its_kernels_would_ignore(monkeypatch, flag):
    """The cross launch of a split backward stage (``dq`` / ``dk`` over every column block) runs its token
    tiles untransposed and its dots unstacked whatever its tiles say: a table giving a cross role ``trans``
    or ``stack`` is refused by name, not ignored."""
    real = ttiles._matrix_tiles

    def patched(model, loss, role, *rest):
        t = real(model, loss, role, *rest)
        return replace(t, **{flag: True}) if role.endswith("_cross") else t

    monkeypatch.setattr(ttiles, "_matrix_tiles", patched)
    ttiles.clear()
    with pytest.raises(ValueError, match="a cross launch runs untransposed and unstacked tiles"):
        ttiles.launch_config("swiglu", 3136, 128, 8, torch.bfloat16, ARCHS["sm_90"], interpret=False)
    ttiles.clear()


def test_the_stack_hook_gives_the_design_before_under_a_key_of_its_own(monkeypatch):
    """``tiles.STACK = False`` (the benchmarks' side-by-side timing of the design before): SwiGLU at d = 32 on
    sm_90 without stacked dots and its gradient backward on 32-token tiles, in launch configurations and plan
    keys of their own (both designs' plans live side by side)."""
    sm90 = ARCHS["sm_90"]
    q = torch.empty(2, 4, 196, 32, dtype=torch.bfloat16)

    def table() -> tuple[dict, Any]:
        cfg = ttiles.launch_config("swiglu", 3136, 32, 8, torch.bfloat16, sm90, interpret=False)
        key = tplan.plan_key(q, "swiglu", "dot", 4, 32, 1.0, 1.0, True, 196, arch=sm90, prec="tf32")
        return cfg.tiles, key

    on, on_key = table()
    monkeypatch.setattr(ttiles, "STACK", False)
    off, off_key = table()
    assert {r for r, t in on.items() if t.stack} == {"forward", "grad", "readout_bwd", "grad_bwd"}
    assert (on["grad_bwd"].block_n, off["grad_bwd"].block_n) == (64, 32)
    assert not any(t.stack for t in off.values()) and on_key != off_key
