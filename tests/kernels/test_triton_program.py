"""The fused node of Triton branches as one launch program (``vit3.kernels.triton.program``): when it serves,
that it launches what the per-branch hooks launch (bit for bit the same results; 16-bit RoPE outputs within
a unit in the last place), that on a GPU host its addresses are the interpreter's tensors' (shape, strides
and pointer, call after call and thread against thread), how it lays out its workspaces, and that it is made
once per layout and names a branch that fails.

Numerics run where Triton runs (``triton_device``: the GPU, or the interpreter on CPU); a GPU host's addresses
are simulated on CPU tensors on any host (``TRITON_INTERPRET=0`` for the program, launches recorded, not run).
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers.backends import mix_short
from helpers.common import REPO, count_calls
from helpers.ops import SCALE, intercept_launches, use_gpu_kernels

from vit3.kernels.ops import BRANCH_ATTR
from vit3.kernels.triton import checks as tchecks
from vit3.kernels.triton import fuse
from vit3.kernels.triton import node as tnode
from vit3.kernels.triton import op as top
from vit3.kernels.triton import plan as tplan
from vit3.kernels.triton import program as tprogram
from vit3.layers import TTTMixer
from vit3.layers import fused_mix as em

LR = 0.7
CPU = torch.device("cpu")

# (branches as (op, heads, head dim), batch, grid): the official mixer, awkward sizes, several SwiGLU branches
CASES = {
    "official": ((("swiglu", 2, 32), ("dwconv", 1, 32)), 2, (7, 9)),
    "batch-1": ((("swiglu", 2, 32), ("dwconv", 1, 32)), 1, (5, 5)),
    "two-swiglu-dwconv": ((("swiglu", 1, 32), ("swiglu", 2, 16), ("dwconv", 1, 16)), 3, (4, 5)),
    "swiglu-only": ((("swiglu", 3, 16),), 2, (6, 6)),
    "dwconv-only": ((("dwconv", 2, 16),), 2, (6, 7)),
    "linear": ((("linear", 2, 32),), 2, (5, 8)),
    "swiglu-d64": ((("swiglu", 1, 64), ("dwconv", 1, 16)), 2, (5, 6)),  # 16-bit: transposed tiles
}


def _spec(branches, grid, path: str = "triton", rope: bool = False, recompute: bool = True) -> em.MixSpec:
    found, offset = [], 0
    for name, heads, d in branches:
        found.append(em.MixBranch(name, offset, heads, d, rope and name != "dwconv", path))
        offset += 3 * heads * d
    return em.MixSpec(tuple(found), grid, SCALE, LR, True, 10000.0, recompute)


def _inputs(
    spec: em.MixSpec, b: int, dtype: torch.dtype, device: torch.device = CPU
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    n = spec.grid[0] * spec.grid[1]
    width = sum(br.heads * br.head_dim for br in spec.branches)
    qkv = torch.randn(b, n, 3 * width, generator=g, dtype=torch.float64)
    weights = []
    for br in spec.branches:
        shape = (
            (1, br.heads * br.head_dim, 3, 3)
            if br.op == "dwconv"
            else (1, br.heads, br.head_dim, br.head_dim)
        )
        count = 2 if br.op == "swiglu" else 1
        weights += [torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 for _ in range(count)]
    return qkv.to(device, dtype), [w.to(device, dtype) for w in weights]


def _run(spec: em.MixSpec, qkv: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The node's output and the gradients of qkv and every weight, for a fixed upstream gradient."""
    qkv = qkv.detach().requires_grad_()
    weights = [w.detach().requires_grad_() for w in weights]
    out = em.fused_mix(qkv, spec, weights)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return [out, *torch.autograd.grad(out, [qkv, *weights], dout.to(out))]


@pytest.fixture
def per_branch(monkeypatch):
    """Runs the fused node branch by branch (every branch's ``Node`` hooks), as it did before the program."""

    def run(spec, qkv, weights, how=_run):
        real = em.mix_layout
        with monkeypatch.context() as patch:
            patch.setattr(em, "mix_layout", lambda p: real(p)._replace(whole=None))
            return how(spec, qkv, weights)

    return run


@pytest.fixture(autouse=True)
def _fresh_programs():
    top.clear_plans()
    yield
    top.clear_plans()


# ------------------------------------------------------------------------------------------------ when it
# serves


@pytest.mark.parametrize("backward", ["inside", "after"])
@pytest.mark.parametrize(
    "path", ["eager", pytest.param("triton", marks=pytest.mark.triton)], ids=["tiled-passes", "program-rope"]
)
def test_the_node_computes_in_its_inputs_dtype_under_autocast(path, backward, request):
    """``fused_mix`` under a bfloat16 autocast region, its backward inside the region or after it: the same
    output and gradients, bit for bit, as without autocast (the branches' tiled PyTorch passes run with it
    off; so does whatever PyTorch op the launch program's path runs, RoPE on)."""
    device = request.getfixturevalue("triton_device") if path == "triton" else CPU
    branches, b, grid = CASES["batch-1"]
    spec = _spec(branches, grid, path=path, rope=path == "triton")
    qkv, weights = _inputs(spec, b, torch.float32, device)
    plain = _run(spec, qkv, weights)

    def under() -> list[torch.Tensor]:
        leaves = [t.detach().requires_grad_() for t in (qkv, *weights)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = em.fused_mix(leaves[0], spec, leaves[1:])
            if backward == "inside":
                return [out, *torch.autograd.grad(out, leaves, dout.to(out))]
        return [out, *torch.autograd.grad(out, leaves, dout.to(out))]

    dout = torch.randn(plain[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for got, exp in zip(under(), plain, strict=True):
        assert got.dtype == exp.dtype and torch.equal(got, exp)


def test_launches_switch_the_current_gpu_only_for_another_gpus_tensors(monkeypatch):
    """``on_device``: nothing to enter for CPU tensors and for the current GPU's (the usual call, where
    ``torch.cuda.device`` would cost more than the launches' own Python), the GPU's context for another's;
    before CUDA is initialised (fake tensors of a GPU on a host without one) the GPU's context, unasked."""
    initialised = [False]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    nothing = tplan.on_device(CPU)
    with nothing:
        pass
    assert isinstance(tplan.on_device(torch.device("cuda", 1)), torch.cuda.device)
    initialised[0] = True
    assert tplan.on_device(torch.device("cuda", 1)) is nothing
    other = tplan.on_device(torch.device("cuda", 0))
    assert isinstance(other, torch.cuda.device) and other.idx == 0


@pytest.mark.triton
def test_a_node_of_triton_branches_is_one_program(monkeypatch, triton_device):
    branches, b, grid = CASES["official"]
    assert em.mix_layout(_spec(branches, grid)).whole is not None
    assert em.mix_layout(_spec(branches, grid, rope=True)).whole is not None  # RoPE: rotated by the program
    assert em.mix_layout(_spec(branches, grid, path="eager")).whole is None
    mixed = _spec(branches, grid)._replace(branches=(_spec(branches, grid).branches[0], em.MixBranch(
        "dwconv", 192, 1, 32, False, "eager")))  # fmt: skip
    assert em.mix_layout(mixed).whole is None
    hooks = count_calls(monkeypatch, tnode, "forward")
    made = count_calls(monkeypatch, tprogram, "MixProgram")
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float64, triton_device)
    for _ in range(2):
        _run(spec, qkv, weights)
    with torch.no_grad():
        em.fused_mix(qkv, spec, weights)
    assert hooks["n"] == 0 and made["n"] == 1  # one program for training and inference calls of one layout
    _run(spec, qkv[:1], weights)  # another batch: another program
    assert made["n"] == 2


# ----------------------------------------------------------------------- the per-branch hooks' results
# exactly


# RoPE on every branch but the depthwise conv's (H-ViT³'s mixer): a few layouts, both dtypes, one chunk or
# chunks of 8 tokens; the hooks' rotated pairs rotated again by the backward (recompute) or saved
ROPE_CASES = [
    pytest.param(case, dtype, chunk, True, recompute, id=f"{case}-rope-{name}-{how}-{chunks}")
    for case in ("official", "two-swiglu-dwconv", "linear", "swiglu-d64")
    for dtype, name in ((torch.float64, "fp64"), (torch.float16, "fp16"))
    for recompute, how in ((True, "rotated-again"), (False, "saved"))
    for chunk, chunks in ((None, "one-chunk"), (8, "chunks-of-8"))
    if chunk is None or (case == "official" and recompute)
]


def _rotated_columns(spec: em.MixSpec) -> torch.Tensor:
    """Which channels of qkv hold a RoPE branch's q or k."""
    width = sum(3 * br.heads * br.head_dim for br in spec.branches)
    mask = torch.zeros(width, dtype=torch.bool)
    for br in spec.branches:
        if br.rope:
            mask[br.offset : br.offset + 2 * br.heads * br.head_dim] = True
    return mask


def _within_a_rounding_of_the_pair(got: torch.Tensor, want: torch.Tensor, bits: int) -> bool:
    """Every element of ``got`` within one unit in the last place (of ``bits`` mantissa bits) of the larger
    of ``want``'s channel pair ``(2j, 2j + 1)``: a rotation rounded once against one rounded before and
    after."""
    pair = want.abs().unflatten(-1, (-1, 2)).amax(-1, keepdim=True).expand(*want.shape[:-1], -1, 2)
    return bool(((got - want).abs() <= pair.flatten(-2) * 2.0**-bits).all())


PLAIN_CASES = [
    pytest.param(case, dtype, chunk, False, True, id=f"{case}-{name}-{how}")
    for case in CASES
    for dtype, name in ((torch.float64, "fp64"), (torch.float16, "fp16"))
    for chunk, how in ((None, "one-chunk"), (8, "chunks-of-8"))
]


@pytest.mark.triton
@pytest.mark.parametrize(("case", "dtype", "chunk", "rope", "recompute"), PLAIN_CASES + ROPE_CASES)
def test_the_program_computes_what_the_branch_hooks_compute(
    case, dtype, chunk, rope, recompute, per_branch, monkeypatch, triton_device
):
    """Output and every gradient bit for bit the per-branch hooks' (the same launches on the same memory,
    every buffer NaN-filled so an unwritten element shows); with N cut in chunks of 8 tokens too (the split
    stages and the two-stage weight-gradient reduction).

    With RoPE the program's kernels rotate q, k on load and dq, dk back on store, where the hooks rotate into
    a pair and back by launches of their own. Under the interpreter that gives the same bits in fp64; in 16
    bits dq, dk are rounded once where the hooks round twice, and the dots on the rotated q, k, in another
    form than the hooks', may round otherwise in the CPU's BLAS (OpenBLAS's FMA kernels do, its AVX ones
    not): every output within a unit in the last place. On a GPU, whose kernels contract the rotation into
    fused multiply-adds, close."""
    if chunk is not None:
        real = tnode.plan_key
        monkeypatch.setattr(tnode, "plan_key", lambda *a, **k: real(*a, **k)._replace(chunk=chunk))
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))
    branches, b, grid = CASES[case]
    spec = _spec(branches, grid, rope=rope, recompute=recompute)
    qkv, weights = _inputs(spec, b, dtype, triton_device)
    got = _run(spec, qkv, weights)
    want = per_branch(spec, qkv, weights)
    if rope and triton_device.type == "cuda":
        tol = 1e-12 if dtype is torch.float64 else 2e-2
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    else:
        if rope and dtype is torch.float16:
            rotated = _rotated_columns(spec)
            assert _within_a_rounding_of_the_pair(got[1][..., rotated], want[1][..., rotated], 10)
            assert not torch.equal(got[1][..., rotated], want[1][..., rotated])  # rounded once, not twice
            got[1][..., rotated] = want[1][..., rotated]
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.isfinite(g).all() and ((g - w).abs() <= w.abs() * 2.0**-10 + 2.0**-24).all(), i
        else:
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.isfinite(g).all() and torch.equal(g, w), i
    if dtype is torch.float64:
        ref = em.reference_mix(qkv.requires_grad_(), spec, [w.requires_grad_() for w in weights])
        assert torch.allclose(got[0], ref, rtol=1e-10, atol=1e-12)


@pytest.mark.triton
@pytest.mark.parametrize("whole", [True, False], ids=["program", "per-branch"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
def test_the_nan_fill_reaches_every_element_the_kernels_write(
    whole, rope, per_branch, monkeypatch, triton_device
):
    """With ``DEBUG_FILL`` set and no kernel launched, the output and every gradient are NaN throughout: the
    node's own output and qkv gradient are filled too, so the tests that lean on the fill see an element a
    kernel fails to write (a fresh allocation may hold the right numbers of a call before)."""
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid, rope=rope)
    qkv, weights = _inputs(spec, b, torch.float64, triton_device)
    want = _run(spec, qkv, weights)
    intercept_launches(monkeypatch, lambda name, args, kwargs, launch: None)
    got = _run(spec, qkv, weights) if whole else per_branch(spec, qkv, weights)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and torch.isnan(g).all(), i


@pytest.mark.triton
def test_unusual_layouts_compute_what_the_branch_hooks_compute(per_branch, monkeypatch, triton_device):
    """qkv a strided view past its storage's start, 16-bit qkv beside float32 weights (what the mixer hands a
    16-bit node) and an upstream gradient that is not contiguous: bit for bit the per-branch hooks."""
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))
    branches, b, grid = CASES["two-swiglu-dwconv"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float16, triton_device)
    wide = torch.zeros(*qkv.shape[:-1], qkv.shape[-1] + 24, dtype=qkv.dtype, device=triton_device)
    wide[..., 8 : 8 + qkv.shape[-1]] = qkv
    qkv = wide[..., 8 : 8 + qkv.shape[-1]]
    weights = [w.float() for w in weights]

    def run(spec, qkv, weights):
        qkv = qkv.detach().requires_grad_()
        weights = [w.detach().requires_grad_() for w in weights]
        out = em.fused_mix(qkv, spec, weights)
        dout = (
            torch.randn(out.shape[::-1], generator=torch.Generator().manual_seed(1)).to(out).permute(2, 1, 0)
        )
        return [out, *torch.autograd.grad(out, [qkv, *weights], dout)]

    got = run(spec, qkv, weights)
    want = per_branch(spec, qkv, weights, run)
    assert qkv.storage_offset() == 8 and not qkv.is_contiguous()
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all() and torch.equal(g, w), i


@pytest.mark.triton
def test_inference_writes_the_training_output_and_saves_nothing(triton_device):
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float64, triton_device)
    with torch.no_grad():
        out = em.fused_mix(qkv, spec, weights)
    assert torch.equal(out, _run(spec, qkv, weights)[0])
    layout, again = em.mix_layout(spec), torch.empty_like(out)
    views = em._whole_calls(qkv, again, layout, tuple(weights), False)
    saved, _ = tprogram.forward({}, layout.spec, qkv, again, weights, False, lambda: views)
    assert saved == [] and torch.equal(again, out)


@pytest.mark.triton
@pytest.mark.parametrize("how", ["program", "branch-hooks"])
def test_swiglu_weight_gradients_are_kept_as_the_kernels_write_them(how, per_branch, triton_device):
    """W1's and W2's gradients come out contiguous, side by side in one buffer (``[2, 1, G, c, c]``), so
    autograd keeps them as ``.grad`` (``zero_grad``'s ``None``) instead of copying each: both ``.grad`` s on
    the kernel's one buffer. (Interleaved ``[1, G, 2, c, c]`` halves were copied, one storage each.)"""
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float32, triton_device)
    weights = [w.requires_grad_() for w in weights]

    def train(spec, qkv, weights):
        em.fused_mix(qkv.requires_grad_(), spec, weights).sum().backward()

    if how == "program":
        train(spec, qkv, weights)
    else:
        per_branch(spec, qkv, weights, how=train)
    w1, w2 = weights[:2]
    assert w1.grad.is_contiguous() and w2.grad.is_contiguous()
    assert w1.grad.untyped_storage().data_ptr() == w2.grad.untyped_storage().data_ptr()


@pytest.mark.triton
def test_a_second_order_backward_goes_through_the_references(triton_device):
    """``create_graph=True``: the saved qkv and weights (the program's saved list ends with them) feed the
    reference's differentiable backward."""
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float64, triton_device)
    got, want = [], []
    for fn, into in ((em.fused_mix, got), (em.reference_mix, want)):
        x = qkv.detach().requires_grad_()
        w = [t.detach().requires_grad_() for t in weights]
        (gx,) = torch.autograd.grad(fn(x, spec, w).square().sum(), [x], create_graph=True)
        into += torch.autograd.grad(gx.square().sum(), [x, *w])
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------------------------- a GPU host's
# addresses


def _record(store: list):
    """A launch hook that records each argument (pointer, dtype, shape, strides of a pointer argument) and
    launches nothing."""

    def hook(name, args, kwargs, run):
        row = [name]
        for a in args:
            if hasattr(a, "data_ptr"):
                stride = a.stride() if callable(a.stride) else a.stride
                a = (a.data_ptr(), a.dtype, tuple(a.shape), tuple(stride))
            row.append(a)
        store.append(tuple(row))

    return hook


def _gpu_host(monkeypatch) -> None:
    """The program's view of a GPU host on CPU tensors: Triton not interpreted, the checks told it runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(tchecks, "triton_runs_on", lambda device: True)


def _fixed_buffers(monkeypatch) -> None:
    """Every buffer a program allocates the same tensor per size, so that two runs' buffers lie at the same
    addresses."""
    made: dict = {}
    monkeypatch.setattr(
        tprogram, "_alloc", lambda n, device: made.setdefault(n, torch.empty(n, dtype=torch.uint8))
    )
    real = tplan.Buffer.alloc
    monkeypatch.setattr(tplan.Buffer, "alloc", lambda buf, device: made.setdefault(buf, real(buf, device)))


def _no_starts(row: tuple) -> tuple:
    """A recorded launch without the starts of a fused launch (``fuse``: one per kernel after the first)."""
    starts = len(fuse.kernel_names(row[0])) - 1
    return row[: len(row) - starts] if starts > 0 else row


def _program_call(cache: dict, layout: em.MixLayout, qkv, weights, out, d_out, dqkv) -> None:
    """A training call of the program of ``layout`` in ``cache``, forward and backward, on these tensors."""
    views = em._whole_calls(qkv, out, layout, tuple(weights), True)
    saved, state = tprogram.forward(cache, layout.spec, qkv, out, weights, True, lambda: views)
    grads = em._whole_grads(d_out, dqkv, layout)  # saved: the program's, qkv, weights
    tprogram.backward(d_out, dqkv, [*saved, qkv, *weights], state, lambda: grads)


def _call_tensors(spec: em.MixSpec, qkv: torch.Tensor, weights: list) -> tuple:
    """``_program_call``'s tensors for ``qkv`` and ``weights``: theirs, an output, its gradient, qkv's."""
    out = qkv.new_empty(*qkv.shape[:2], em.mix_layout(spec).width)
    return qkv, weights, out, torch.randn_like(out), torch.empty_like(qkv)


@pytest.mark.parametrize("case", ["official", "two-swiglu-dwconv", "official-rope"])
def test_on_a_gpu_host_the_addresses_are_the_interpreters_tensors(case, monkeypatch):
    """Forward and backward, two calls of one program on other tensors: every launch gets at each pointer
    argument the address, dtype, shape and strides of the tensor the interpreter gets there (whose results are
    tested above), and every other argument the same. N in chunks of 16 tokens in both (left to itself, the
    interpreter takes one chunk: other launches)."""
    _fixed_buffers(monkeypatch)
    real = tnode.plan_key
    monkeypatch.setattr(tnode, "plan_key", lambda *a, **k: real(*a, **k)._replace(chunk=16))
    branches, b, grid = CASES[case.removesuffix("-rope")]
    spec = _spec(branches, grid, rope=case.endswith("-rope"))
    layout = em.mix_layout(spec)
    calls = []
    for seed in (0, 1):  # the same tensors for both runs, other tensors for each call
        qkv, weights = _inputs(spec, b, torch.float32)
        calls.append(_call_tensors(spec, qkv + seed, weights))
    seen: dict[str, list] = {}
    for mode in ("interpreter", "gpu"):
        with monkeypatch.context() as patch:
            if mode == "gpu":
                _gpu_host(patch)
            else:  # the interpreter's binding, on any host (nothing is launched)
                patch.setenv("TRITON_INTERPRET", "1")
            seen[mode] = rows = []
            intercept_launches(patch, _record(rows))
            cache: dict = {}
            for call in calls:
                _program_call(cache, layout, *call)
            assert len(cache) == 1
    assert len(seen["gpu"]) % 2 == 0 and len(seen["gpu"]) >= 10
    # a fused launch's starts (its last arguments) count programs, which the interpreter sizes otherwise
    assert [_no_starts(r) for r in seen["gpu"]] == [_no_starts(r) for r in seen["interpreter"]]
    first = len(seen["gpu"]) // 2
    assert seen["gpu"][:first] != seen["gpu"][first:]  # the second call's pointers, not the first's


@pytest.mark.parametrize("chunk", [63, 16], ids=["N-whole", "N-in-chunks"])
def test_a_vit3_mixer_call_is_one_launch_per_stage_for_both_branches(chunk, monkeypatch):
    """A GPU host's training call of ViT³'s mixer (SwiGLU and the depthwise conv): 2 forward launches and 3
    backward, each running both branches (``fuse``); with N in chunks too (each sum of partials and the
    step taken by the last program to arrive, not a launch of its own). Branch after branch: more."""
    if chunk is not None:
        real = tnode.plan_key
        monkeypatch.setattr(tnode, "plan_key", lambda *a, **k: real(*a, **k)._replace(chunk=chunk))
    _gpu_host(monkeypatch)
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float32)
    names: list[str] = []
    intercept_launches(monkeypatch, lambda name, args, kwargs, run: names.append(name))
    counts = {}
    for fused in (True, False):
        monkeypatch.setattr(tprogram, "FUSE_BRANCHES", fused)
        top.clear_plans()
        names.clear()
        _run(spec, qkv, weights)
        counts[fused] = list(names)
    lone = [n for n in counts[True] if len(fuse.kernel_names(n)) == 1]
    assert len(counts[True]) == 5 and lone == ([] if chunk < 63 else ["conv_readout_kernel"]), counts[True]
    first = "grad_partial_kernel" if chunk < 63 else "forward_kernel"  # N whole: SwiGLU's forward is one
    assert fuse.kernel_names(counts[True][0]) == [first, "conv_grad_partial_kernel"]
    assert len(counts[False]) >= 7


@pytest.mark.triton
def test_a_mixer_on_the_program_takes_the_short_path_on_a_verified_specialisation(triton_device):
    """Triton specialises (a call never settles): once a call's input specialisation is verified, the next
    call of that specialisation takes the mixer's short path to the program, with the general path's output
    and gradients (a differentiable one too); a new batch size is a new specialisation: the general path,
    guarded, then the short path again."""
    torch.manual_seed(0)
    mixer = TTTMixer(32, 2, backend="triton").to(triton_device, torch.float64)
    grid = (4, 4)

    def qkv_of(b: int) -> torch.Tensor:
        x = torch.randn(b, 16, 32, dtype=torch.float64, device=triton_device)
        return mixer.qkv(x).detach().requires_grad_()

    def call(qkv: torch.Tensor) -> bool:
        out, short = mix_short(mixer, qkv, grid)
        out.sum().backward()
        return short

    qkv = qkv_of(2)
    # guarded and verified in its backward; unguarded, and kept; the short path
    shorts = [call(qkv) for _ in range(3)]
    assert shorts == [False, False, True] and not any(c.settled for c in mixer._calls.routes.values())
    got, short = mix_short(mixer, qkv, grid)
    assert short
    params = [qkv, *mixer.inner.parameters()]
    grads = torch.autograd.grad(got.square().sum(), params, create_graph=True)
    want = mixer._mix_tokens(qkv, grid, None, "")
    ref = torch.autograd.grad(want.square().sum(), params, create_graph=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(sum(g.sum() for g in grads), params[1:]))
    assert not call(qkv_of(3))  # another batch: another specialisation


@pytest.mark.triton
def test_a_fused_launch_that_fails_alone_runs_as_its_parts_from_then_on(monkeypatch, triton_device):
    """A fused launch whose kernel fails while its parts run (say it did not compile): the call completes on
    the parts, with the results of branch after branch, no branch is blamed, and later calls launch the
    parts without trying the fused kernel again."""
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float64, triton_device)
    want = _run(spec, qkv, weights)
    names: list[str] = []

    def launch(name, args, kwargs, run):
        names.append(name)
        if len(fuse.kernel_names(name)) > 1:
            raise RuntimeError("the fused kernel failed")
        return run()

    intercept_launches(monkeypatch, launch)
    for call in range(2):
        names.clear()
        got = _run(spec, qkv, weights)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), (call, i)
        fused = [n for n in names if len(fuse.kernel_names(n)) > 1]
        assert (len(fused) > 0) == (call == 0) and len(names) > len(fused) + 5, names


@pytest.mark.triton
def test_every_launch_leaves_the_counters_zero_and_they_matter(monkeypatch, triton_device):
    """The last-to-arrive counters (``plan.counters``) are zero after each training call; counters left
    otherwise (a launch killed midway) would let no program be the last: no ``G``, no step (NaN, the fill).
    A launch that fails has the device's counters zeroed (``plan.reset_counters``)."""
    real = tnode.plan_key
    monkeypatch.setattr(tnode, "plan_key", lambda *a, **k: real(*a, **k)._replace(chunk=8))
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float64, triton_device)
    counters = tplan.counters(triton_device, 64)
    good = _run(spec, qkv, weights)
    assert all(torch.isfinite(g).all() for g in good) and not counters.any()
    counters.fill_(3)
    spoiled = _run(spec, qkv, weights)
    assert torch.isnan(spoiled[0]).any()
    counters.fill_(3)

    def fail(name, args, kwargs, run):
        raise RuntimeError("a launch that fails")

    intercept_launches(monkeypatch, fail)
    with pytest.raises(RuntimeError, match="a launch that fails"):
        _run(spec, qkv, weights)
    assert not tplan.counters(triton_device, 64).any()


def test_the_counters_stream_is_the_one_tritons_driver_launches_on(monkeypatch):
    """``plan.current_stream``: the handle Triton's launcher would take for the device's current stream (its
    driver's, per device index); 0 off a GPU, where one set of counters serves."""

    class Active:
        @staticmethod
        def get_current_stream(index: int) -> int:
            return 1000 + index

    class Driver:
        active = Active()

    monkeypatch.setattr(tplan, "driver", Driver)
    assert tplan.current_stream(torch.device("cuda", 1)) == 1001
    assert tplan.current_stream(torch.device("cpu")) == 0


def test_two_threads_never_see_each_others_addresses(monkeypatch):
    """A GPU host's program writes each call's pointers into the addresses it made once: two threads calling
    one program (a lock around each call's launches) each launch on their own tensors."""
    _gpu_host(monkeypatch)
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    layout = em.mix_layout(spec)
    wrong, checked = [], []
    reads_qkv_first = {"forward_kernel", "grad_partial_kernel", "readout_kernel", "conv_grad_partial_kernel"}

    def hook(name, args, kwargs, run):
        time.sleep(1e-4)  # hand the other thread the interpreter between launches
        first = fuse.kernel_names(name)[0]  # a fused launch's: its first part's
        if first in reads_qkv_first:  # its first argument is q or k: a view of the calling thread's qkv
            mine = threading.current_thread().qkv
            checked.append(name)
            if not mine.data_ptr() <= args[0].data_ptr() < mine.data_ptr() + mine.nbytes:
                wrong.append(name)

    intercept_launches(monkeypatch, hook)
    qkv, weights = _inputs(spec, b, torch.float32)
    cache: dict = {}

    def calls(x: torch.Tensor) -> None:
        threading.current_thread().qkv = x
        for _ in range(20):
            out = x.new_empty(b, x.shape[1], layout.width)
            views = em._whole_calls(x, out, layout, tuple(weights), False)
            tprogram.forward(cache, layout.spec, x, out, weights, False, lambda v=views: v)

    threads = [threading.Thread(target=calls, args=(qkv.clone(),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 1 and len(checked) >= 40 and not wrong


def _workspaces(rope: bool, device: torch.device) -> dict[tuple[str, int], tuple[int, set]]:
    """Each workspace of a program's training forward, inference and backward: its size and the spans of the
    buffers placed in it."""
    branches, b, grid = CASES["two-swiglu-dwconv"]
    spec = _spec(branches, grid, rope=rope)
    qkv, weights = _inputs(spec, b, torch.float32, device)
    _run(spec, qkv, weights)
    (program,) = em.mix_layout(spec).programs.values()
    launches, n_saved, n_scratch, _, n_count = program._forward(True)
    infer, no_saved, n_infer, _, _ = program._forward(False)
    (back, n_back, _, n_back_count) = next(iter(program._backwards.values()))
    # inference keeps nothing: its G, ||G|| lie in its scratch (a saved workspace of 0 bytes held them before)
    assert no_saved == 0 and all(w.base != tprogram.SAVED for w in infer.places)
    sizes = {("forward", tprogram.SAVED): (launches, n_saved),
             ("forward", tprogram.SCRATCH): (launches, n_scratch),
             ("inference", tprogram.SCRATCH): (infer, n_infer),
             ("backward", tprogram.B_SCRATCH): (back, n_back),
             ("forward", tprogram.COUNT): (launches, n_count),
             ("backward", tprogram.B_COUNT): (back, n_back_count)}  # fmt: skip
    found = {}
    for key, (run, size) in sizes.items():
        if size:  # no counters where no launch counts (N whole)
            found[key] = (
                size,
                {
                    (w.offset, w.offset + tprogram._nbytes(tplan.Buffer(w.shape, w.stride, w.dtype)))
                    for w in run.places
                    if w.base == key[1]
                },
            )
    return found


@pytest.mark.triton
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
def test_workspace_buffers_are_aligned_and_apart(rope, triton_device):
    """Each buffer of a workspace starts on an ``ALIGN`` boundary and overlaps no other; the workspace holds
    them all. RoPE adds none: its kernels rotate q, k as they load them."""
    found = _workspaces(rope, triton_device)
    for size, every in found.values():
        spans = sorted(every)
        assert spans and size == spans[-1][1]
        assert all(start % tprogram.ALIGN == 0 for start, _ in spans)
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    if rope:
        top.clear_plans()
        assert found == _workspaces(False, triton_device)


# --------------------------------------------------------------------------------------- made once, names a
# branch


@pytest.mark.triton
def test_a_branch_the_program_cannot_take_is_named(triton_device):
    """SwiGLU weights in two layouts: the second branch's check raises, tagged with its index (the guard
    demotes that branch alone)."""
    branches, b, grid = CASES["two-swiglu-dwconv"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float64, triton_device)
    weights[2] = weights[2].transpose(-1, -2).contiguous().transpose(-1, -2)  # branch 1's w1, column-major
    with pytest.raises(ValueError, match="one layout and dtype") as caught:
        em.fused_mix(qkv, spec, weights)
    assert getattr(caught.value, BRANCH_ATTR) == 1


@pytest.mark.triton
def test_a_rope_branch_of_an_odd_head_dim_is_refused_by_name(triton_device):
    """Rotated per head on load, a RoPE branch needs an even head dim (a channel pair of the rotation must not
    straddle two heads): refused, tagged with the branch."""
    spec = _spec((("dwconv", 1, 16), ("swiglu", 4, 3)), (4, 5), rope=True)
    qkv, weights = _inputs(spec, 2, torch.float64, triton_device)
    with pytest.raises(ValueError, match="even head dim, got 3") as caught:
        em.fused_mix(qkv, spec, weights)
    assert getattr(caught.value, BRANCH_ATTR) == 1


@pytest.mark.triton
def test_cleared_plans_and_another_launcher_make_a_new_program(monkeypatch, triton_device):
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float64, triton_device)
    made = count_calls(monkeypatch, tprogram, "MixProgram")
    for step in range(3):
        with torch.no_grad():
            em.fused_mix(qkv, spec, weights)
        if step == 0:
            top.clear_plans()
        if step == 1:
            intercept_launches(monkeypatch, lambda name, args, kwargs, run: run())
    with torch.no_grad():
        em.fused_mix(qkv, spec, weights)
    assert made["n"] == 3


def test_an_address_past_its_storage_is_refused():
    """The interpreter's addresses are as strict as a GPU's: past the end of its base, an error (``set_``
    would grow the storage and the call would pass where a GPU writes out of bounds)."""
    storage = torch.empty(64, dtype=torch.uint8).untyped_storage()
    inside = tprogram._Where(0, 32, torch.float32, (8,), (1,))
    assert tprogram.at_address((storage, 0), inside).data_ptr() == storage.data_ptr() + 32
    with pytest.raises(ValueError, match="reaches byte 68 of a storage of 64 bytes"):
        tprogram.at_address((storage, 4), inside)
    assert storage.nbytes() == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_triton_specialises_an_address_as_the_tensor_there(dtype):
    """What Triton's launcher reads of a pointer argument (its type and 16-byte alignment, the key of the
    compiled kernel) is the same for an ``Address`` as for the tensor at that address, aligned or not."""
    jit = pytest.importorskip("triton.runtime.jit")
    specialise = getattr(jit, "native_specialize_impl", None)
    if specialise is None:
        pytest.skip("this Triton specialises in Python (no native_specialize_impl)")
    from triton.backends.compiler import BaseBackend

    base = torch.empty(64, dtype=dtype)
    for offset in (0, 1, 8):
        t = base[offset:]
        address = tprogram.Address(t.data_ptr(), dtype, tuple(t.shape), t.stride())
        assert specialise(BaseBackend, address, False, True, True) == specialise(
            BaseBackend, t, False, True, True
        )


@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
def test_a_gpu_host_calls_each_compiled_kernel_with_the_arguments_tritons_launcher_would(rope, monkeypatch):
    """On a GPU host a program compiles its kernels once per device and 16-byte alignment of its bases
    (``JITFunction.warmup``: compiled, not launched) and calls each compiled kernel itself, Triton's JIT
    launcher (its binder, its cache lookup) skipped, with the arguments that launcher would hand it: those of
    Triton's own binder for an sm_90 target, each pointer as the integer address Triton's launcher would read
    from it (``data_ptr``), checked at every launch against the JIT launcher's on the same tensors, the first
    call's included; with RoPE the rotations among them. Each launch goes on the stream the driver names
    current, asked once per launch list (Triton's launcher asks at every launch)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import CompiledKernel, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    # The binder's first call imports Gluon, whose helpers check the kernels' kind against the interpreter
    # setting: imported here, as this process's kernels are, before the GPU host's setting.
    importlib.import_module("triton.experimental.gluon")
    _gpu_host(monkeypatch)
    use_gpu_kernels(monkeypatch)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    compiled, launched, streams, asked = [], [], [], []

    class Driver:
        def get_current_stream(self, device):
            asked.append(device)
            return 1234

    monkeypatch.setattr(tprogram.driver, "_active", Driver())

    def resolved(args) -> list:
        return [a.data_ptr() if isinstance(a, tprogram.Address) else a for a in args]

    class Compiled:
        """A compiled kernel launching nothing, launched through Triton's own ``[grid]`` runner."""

        function = packed_metadata = src = None
        __getitem__ = CompiledKernel.__getitem__
        launch_metadata = CompiledKernel.launch_metadata

        def __init__(self, kernel: JITFunction, args: tuple, kwargs: dict) -> None:
            self.name = kernel.fn.__name__
            self.rope = any(v is True for k, v in kwargs.items() if k.endswith("ROPE"))  # a fused part's too
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            self.expected = resolved(binder(*args, **kwargs)[0].values())  # the addresses bound now

        def _init_handles(self) -> None:
            pass

        def run(self, *grid_stream_meta_args):  # the driver's launch: grid, stream, 5 handles, arguments
            *grid, stream = grid_stream_meta_args[:4]
            args = grid_stream_meta_args[9:]
            assert all(isinstance(n, int) and n >= 1 for n in grid)
            assert not any(isinstance(a, tprogram.Address) for a in args), self.name
            assert len(args) == len(self.expected), self.name
            launched.append((self.name, list(args)))
            streams.append(stream)

    def warmup(kernel: JITFunction, *args, grid, **kwargs):
        made = Compiled(kernel, args, kwargs)
        compiled.append(made)
        return made

    through_jit = []

    def run(kernel: JITFunction, *args, grid, warmup, **kwargs):  # Triton's JIT launcher, reading pointers
        through_jit.append((kernel.fn.__name__, resolved(tprogram.bound_arguments(kernel, args, kwargs))))

    monkeypatch.setattr(JITFunction, "warmup", warmup)
    monkeypatch.setattr(JITFunction, "run", run)
    _fixed_buffers(monkeypatch)  # the program's buffers at the same addresses in both runs below
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid, rope=rope)
    layout = em.mix_layout(spec)
    qkv, weights = _inputs(spec, b, torch.float32)
    shifted = torch.empty(qkv.numel() + 2).narrow(0, 2, qkv.numel()).view_as(qkv).copy_(qkv)  # 8 bytes off
    # other tensors aligned as before, then another alignment
    calls = [_call_tensors(spec, x, weights) for x in (qkv, qkv.clone(), shifted)]
    cache: dict = {}
    for call in calls:
        _program_call(cache, layout, *call)
    kernels = len(compiled) // 2  # compiled for the first call's alignment, then for the shifted one's
    assert kernels >= 5 and len(launched) == 3 * kernels and not through_jit
    # three calls' forward and backward, each asking for its device's (CPU tensors here: no index)
    assert streams == [1234] * len(launched) and asked == [None] * 3 * 2
    # RoPE in the SwiGLU branch's kernels (the conv's launches and the reduction without)
    assert {k.rope for k in compiled[:kernels]} == ({True, False} if rope else {False})
    firsts = [*launched[:kernels], *launched[2 * kernels :]]  # the calls the kernels were compiled for
    assert [args for _, args in firsts] == [k.expected for k in compiled]
    # every call's integers are the addresses Triton's JIT launcher reads on the same tensors
    with monkeypatch.context() as patch:
        patch.setattr(tprogram, "BIND_COMPILED", False)
        for call in calls:
            _program_call(cache, layout, *call)
    assert launched == through_jit
    assert launched[:kernels] != launched[kernels : 2 * kernels]  # the second call: its own pointers


def test_where_binding_the_compiled_kernels_fails_tritons_launcher_launches(monkeypatch):
    """A GPU host whose Triton cannot be pre-bound (here ``JITFunction.warmup`` raises, as another release's
    API might): every launch goes through Triton's JIT launcher, which compiles and reports a real failure."""
    from triton.runtime.jit import JITFunction

    _gpu_host(monkeypatch)
    use_gpu_kernels(monkeypatch)
    launched = []

    def warmup(kernel, *args, grid, **kwargs):
        raise TypeError("warmup() got an unexpected keyword argument")

    monkeypatch.setattr(JITFunction, "warmup", warmup)
    monkeypatch.setattr(JITFunction, "run", lambda kernel, *a, grid, warmup, **k: launched.append(kernel))
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid)
    qkv, weights = _inputs(spec, b, torch.float32)
    for _ in range(2):
        _run(spec, qkv, weights)
    assert len(launched) >= 10 and len(launched) % 2 == 0


@pytest.mark.skipif(
    not os.environ.get("VIT3_OTHER_TRITON"), reason="no other Triton named (VIT3_OTHER_TRITON)"
)
def test_the_compiled_kernels_take_the_same_arguments_under_the_other_triton():
    """The test above, both cases, under the Triton in ``$VIT3_OTHER_TRITON`` (3.6 in CI, what the H200
    runs)."""
    import triton

    other = os.environ["VIT3_OTHER_TRITON"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [other, os.environ.get("PYTHONPATH")]))}
    test = f"{__file__}::test_a_gpu_host_calls_each_compiled_kernel_with_the_arguments_tritons_launcher_would"
    code = "import sys, pytest, triton; print(triton.__version__); sys.exit(pytest.main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", test]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] != triton.__version__ and "2 passed" in proc.stdout


@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
def test_a_training_call_reads_no_tensor_data_on_the_host(rope, monkeypatch):
    """No host synchronisation, so CUDA graphs can capture it: a GPU host's training call of the program
    (forward and backward, program made, then reused; with RoPE, its tables made too) runs on meta tensors,
    where reading a value raises."""
    _gpu_host(monkeypatch)
    launched = []
    intercept_launches(monkeypatch, lambda name, args, kwargs, run: launched.append(name))
    branches, b, grid = CASES["official"]
    spec = _spec(branches, grid, rope=rope)
    qkv, weights = _inputs(spec, b, torch.float32, torch.device("meta"))
    for _ in range(2):
        got = _run(spec, qkv, weights)
    assert all(t.device.type == "meta" for t in got)
    half = len(launched) // 2
    assert half >= 5 and launched[:half] == launched[half:]  # the same launches, made once


@pytest.mark.triton
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "save"])
def test_a_rope_branch_rotates_in_its_kernels_and_saves_no_pair(recompute, monkeypatch, triton_device):
    """A training call of the program with a RoPE branch (H-ViT³'s mixer): the launches of the same mixer
    without RoPE (q, k rotated as the kernels load them, dq, dk back as they store them), no PyTorch
    rotation, nothing saved but the statistics whatever ``recompute`` says; output and every gradient those
    of the reference."""
    launched, saved = [], []
    intercept_launches(monkeypatch, lambda name, args, kwargs, run: (launched.append(name), run()))
    monkeypatch.setattr(em, "apply_rope_2d", lambda *a, **k: pytest.fail("a PyTorch rotation"))
    grid = (5, 7)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 35, 144, generator=g, dtype=torch.float64).to(triton_device).requires_grad_()
    weights = [
        (torch.randn(shape, generator=g, dtype=torch.float64) * 0.3).to(triton_device).requires_grad_()
        for shape in ((1, 2, 16, 16), (1, 2, 16, 16), (1, 16, 3, 3))
    ]

    def spec(rope: bool) -> em.MixSpec:
        branches = (
            em.MixBranch("swiglu", 0, 2, 16, rope, "triton"),
            em.MixBranch("dwconv", 96, 1, 16, False, "triton"),
        )
        return em.MixSpec(branches, grid, SCALE, LR, True, 10000.0, recompute)

    em.fused_mix(qkv, spec(False), weights).sum().backward()
    plain, launched[:] = list(launched), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        out = em.fused_mix(qkv, spec(True), weights)
    grads = torch.autograd.grad(out.square().sum(), [qkv, *weights])
    assert launched == plain
    stats = sum(
        math.prod(shape) * 8
        for name, bg in (("swiglu", 4), ("dwconv", 2))
        for shape in tplan.stat_shapes(name, bg, 16)
    )
    workspace = saved[0]  # then qkv and the weights
    assert stats <= workspace < stats + 5 * tprogram.ALIGN
    monkeypatch.undo()
    top.clear_plans()
    ref = em.reference_mix(qkv, spec(True), weights)
    want = torch.autograd.grad(ref.square().sum(), [qkv, *weights])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-11)
