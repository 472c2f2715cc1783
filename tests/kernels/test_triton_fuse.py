"""Independent launches as one (``vit3.kernels.triton.fuse``): the fused kernel runs each part's programs on
its share of one grid, with each part's arguments, constexprs and dead tail; what cannot be fused says so."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from vit3.kernels.triton import fuse
from vit3.kernels.triton import plan as tplan

pytestmark = pytest.mark.triton


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor: tl.float64, BLOCK: tl.constexpr, PID0=0):
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0) - PID0
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    if pid * BLOCK >= n:
        return
    x = tl.load(x_ptr + rows, mask=rows < n)
    tl.store(out_ptr + rows, x * factor, mask=rows < n)


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr, NEG: tl.constexpr, PID0=0):
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0) - PID0
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    if pid * BLOCK >= n:
        return
    y = tl.load(y_ptr + rows, mask=rows < n)
    if NEG:
        y = -y
    tl.store(out_ptr + rows, tl.load(x_ptr + rows, mask=rows < n) + y, mask=rows < n)


@triton.jit
def _no_pid0_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), 0.0)


def _launches(n: int, m: int) -> tuple[list[tplan.Launch], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(size, generator=g, dtype=torch.float64) for size in (n, m, m))
    outs = [
        torch.full((n,), float("nan"), dtype=torch.float64),
        torch.full((m,), float("nan"), dtype=torch.float64),
    ]
    first = tplan.Launch(
        "scale", _scale_kernel, (3, 1), (x, outs[0], n, 0.3), {"BLOCK": 16, "num_warps": 4}, 3
    )
    programs = -(-m // 8)
    second = tplan.Launch("add", _add_kernel, (programs, 1), (a, b, outs[1], m),
                          {"BLOCK": 8, "NEG": True, "num_warps": 8, "num_stages": 2}, programs)  # fmt: skip
    return [first, second], outs


def test_a_fused_launch_computes_what_its_parts_compute():
    """Each part's programs on its share of the grid, its constexprs its own (both name ``BLOCK``), its
    float64 scalar typed as declared, the dead programs of its tail (n = 40 over 3 programs of 16) idle."""
    parts, want = _launches(40, 21)
    for launch in parts:
        launch()
    fused_parts, got = _launches(40, 21)
    fused = fuse.fuse(fused_parts)
    fused()
    assert fused.programs == 3 + 3 and fused.label == "scale+add"
    assert fused.kwargs["num_warps"] == 8 and fused.kwargs["num_stages"] == 2  # the most of any part
    assert fused.kwargs["k0_BLOCK"] == 16 and fused.kwargs["k1_BLOCK"] == 8
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and torch.equal(g, w)


def test_the_fused_kernel_is_made_once_per_tuple_of_kernels():
    parts, _ = _launches(40, 21)
    assert fuse.fuse(parts).kernel is fuse.fuse(_launches(8, 8)[0]).kernel
    assert fuse.fused_kernel([_add_kernel, _scale_kernel]) is not fuse.fuse(parts).kernel


def test_slots_follow_their_arguments_into_the_fused_launch():
    """A plan's launches leave their tensors out as slots; in the fused launch each slot points at the
    argument's new position (the run-time arguments of each part, in order; constexprs by keyword)."""
    parts, _ = _launches(40, 21)
    slotted = [tplan.slotted(launch, [*launch.args[:2], *launch.args[2:3]]) for launch in parts]
    fused = fuse.fuse(slotted)
    positions = [pos for pos, _ in fused.slots]
    assert all(fused.args[pos] is None for pos in positions)
    assert positions == [0, 1, 4, 5, 6]  # x, out of the first; a, b, out of the second after n, factor


def test_what_cannot_be_fused_says_so():
    parts, _ = _launches(8, 8)
    other = parts[1]._replace(kwargs=parts[1].kwargs | {"enable_fp_fusion": False})
    assert fuse.fusable(parts) and not fuse.fusable([parts[0], other])
    lone = tplan.Launch("lone", _no_pid0_kernel, (1, 1), (torch.zeros(16),), {"BLOCK": 16}, 1)
    assert not fuse.fusable([parts[0], lone])
    with pytest.raises(ValueError, match="PID0"):
        fuse.fuse([parts[0], lone])
