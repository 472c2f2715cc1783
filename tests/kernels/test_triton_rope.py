"""RoPE's rotation of a RoPE branch's q, k pair in one Triton launch (``vit3.kernels.triton.rope``): the bits
of ``apply_rope_2d`` forward and back, and the fused node of Triton branches rotating with it instead of
PyTorch's ops."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.ops import SCALE, intercept_launches

from vit3.kernels.triton import op as top
from vit3.kernels.triton import plan as tplan
from vit3.kernels.triton import program as tprogram
from vit3.kernels.triton import rope as trope
from vit3.layers import fused_mix as em
from vit3.layers.rope import apply_rope_2d, rope_tables

pytestmark = pytest.mark.triton

GRID = (5, 7)


def _stat_bytes(name: str, bg: int, d: int) -> list[int]:
    """The bytes of a branch's float64 statistics (``G``, ``||G||``) for ``bg`` samples x heads."""
    return [math.prod(shape) * 8 for shape in tplan.stat_shapes(name, bg, d)]


def _pair(dtype: torch.dtype, device: torch.device, c: int = 48) -> torch.Tensor:
    """q and k of a qkv projection ``[B, N, 3C]`` as the node hands them: a strided ``[B, 2, N, C]`` view."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, GRID[0] * GRID[1], 3 * c, generator=g, dtype=torch.float64).to(device, dtype)
    return qkv[..., : 2 * c].unflatten(-1, (2, c)).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "back"])
def test_the_rotation_gives_the_bits_of_apply_rope_2d(dtype, inverse, triton_device):
    """Into a strided view (the qkv gradient's q, k) as into a fresh pair; float64 tables for float64, float32
    ones otherwise. Triton's interpreter casts to bfloat16 by truncation (a GPU rounds to nearest): there a
    bfloat16 result may be one unit in the last place off."""
    pair = _pair(dtype, triton_device)
    want = apply_rope_2d(pair, GRID, 10000.0, inverse=inverse).to(dtype)
    tables = rope_tables(GRID, 48, 10000.0, triton_device, torch.promote_types(dtype, torch.float32))
    for out in (pair.new_full(pair.shape, float("nan")), _pair(dtype, triton_device).fill_(float("nan"))):
        trope.rotate(pair, tables, inverse, out)
        if dtype is torch.bfloat16 and triton_device.type == "cpu":
            ulp = want.float().abs() * 2.0**-7
            assert ((out.float() - want.float()).abs() <= ulp).all()
        else:
            assert torch.equal(out, want)


def test_a_pair_or_tables_it_cannot_take_are_refused():
    pair = _pair(torch.float32, torch.device("cpu"))
    tables = rope_tables(GRID, 48, 10000.0, pair.device, torch.float32)
    with pytest.raises(ValueError, match=r"\[B, 2, N, C\] pair"):
        trope.rotate(pair[:, :1], tables, False, pair[:, :1])
    with pytest.raises(ValueError, match=r"torch\.float32 RoPE tables of 35 tokens x 24 pairs"):
        trope.rotate(pair, tuple(t.double() for t in tables), False, pair.clone())


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "save"])
def test_the_triton_node_rotates_with_one_launch_each_way(recompute, monkeypatch, triton_device):
    """A training call of a Triton node with a RoPE branch: q, k rotated by one launch and their gradients
    back by another, no PyTorch rotation; the rotated pair saved only where Z, Y are (``recompute`` off),
    else rotated again by the backward (one launch more, the pair's bytes fewer saved); the results those of
    the references."""
    launched, saved = [], []
    intercept_launches(monkeypatch, lambda name, args, kwargs, run: (launched.append(name), run()))
    monkeypatch.setattr(em, "apply_rope_2d", lambda *a, **k: pytest.fail("a PyTorch rotation"))
    branches = (
        em.MixBranch("swiglu", 0, 2, 16, True, "triton"),
        em.MixBranch("dwconv", 96, 1, 16, False, "triton"),
    )
    spec = em.MixSpec(branches, GRID, SCALE, 0.7, True, 10000.0, recompute)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 35, 144, generator=g, dtype=torch.float64).to(triton_device).requires_grad_()
    weights = [
        (torch.randn(shape, generator=g, dtype=torch.float64) * 0.3).to(triton_device).requires_grad_()
        for shape in ((1, 2, 16, 16), (1, 2, 16, 16), (1, 16, 3, 3))
    ]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        out = em.fused_mix(qkv, spec, weights)
    grads = torch.autograd.grad(out.square().sum(), [qkv, *weights])
    assert launched.count("rope_kernel") == (3 if recompute else 2)
    pair = 2 * 2 * 35 * 32 * 8  # [B, 2, N, C] float64
    stats = sum(n for name, b, d in (("swiglu", 4, 16), ("dwconv", 2, 16)) for n in _stat_bytes(name, b, d))
    workspace = saved[0]  # then qkv and the weights
    assert stats <= workspace - (0 if recompute else pair) < stats + 5 * tprogram.ALIGN
    monkeypatch.undo()
    top.clear_plans()
    ref = em.reference_mix(qkv, spec, weights)
    want = torch.autograd.grad(ref.square().sum(), [qkv, *weights])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-11)
