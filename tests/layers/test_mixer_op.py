"""The mixer op ``vit3::mix`` (``fused_mix.mix_op``): a mixer call on Triton as one op of a compiled graph.

That its spec survives its plain arguments, that it computes bit for bit what the fused node computes (forward
and every gradient, with and without RoPE), that its autograd kernel is that node, that
``torch.library.opcheck`` passes (schema, fakes, symbolic sizes, autograd registration), that a compiled
mixer (and a whole compiled ViT³ or H-ViT³) is one forward and one backward op per call, and that the
backward finds its program again after the plans were cleared.
Kernels run where Triton runs (``triton_device``: the GPU, or the interpreter on CPU).
"""

from __future__ import annotations

import pytest
import timm
import torch
from helpers.common import OpNames, compiled_model_ops, compiled_with_ops

import vit3  # noqa: F401  (registers the models)
from vit3.kernels.triton import op as top
from vit3.layers import TTTMixer
from vit3.layers import fused_mix as em

pytestmark = pytest.mark.triton

# (branches as (op, heads, head dim), RoPE on the token-wise branches, batch, grid)
CASES = {
    "official-rope": ((("swiglu", 2, 16), ("dwconv", 1, 16)), True, 2, (4, 5)),
    "linear": ((("linear", 2, 16),), False, 1, (3, 6)),
}


def _spec(branches, rope: bool, grid) -> em.MixSpec:
    found, offset = [], 0
    for name, heads, d in branches:
        found.append(em.MixBranch(name, offset, heads, d, rope and name != "dwconv", "triton"))
        offset += 3 * heads * d
    return em.MixSpec(tuple(found), grid, 0.3, 1 / 3, True, 10000.0)


def _inputs(case: str, device: torch.device) -> tuple[em.MixSpec, torch.Tensor, list[torch.Tensor]]:
    branches, rope, b, grid = CASES[case]
    spec = _spec(branches, rope, grid)
    g = torch.Generator().manual_seed(0)
    width = sum(heads * d for _, heads, d in branches)
    qkv = torch.randn(b, grid[0] * grid[1], 3 * width, generator=g, dtype=torch.float64)
    weights = []
    for name, heads, d in branches:
        matrix = (1, heads, d, d)
        shapes = {"swiglu": [matrix] * 2, "linear": [matrix], "dwconv": [(1, heads * d, 3, 3)]}
        weights += [0.2 * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes[name]]
    return spec, qkv.to(device).requires_grad_(), [w.to(device).requires_grad_() for w in weights]


def _train(out: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [out, *torch.autograd.grad(out.square().sum(), leaves)]


def test_the_route_survives_the_ops_arguments():
    for case in CASES.values():
        spec = _spec(case[0], case[1], case[3])
        assert em.spec_of(*em.op_args(spec)) == spec


@pytest.mark.parametrize("case", list(CASES))
def test_the_op_computes_what_the_node_computes(case, triton_device):
    spec, qkv, weights = _inputs(case, triton_device)
    leaves = [qkv, *weights]
    exp = _train(em.fused_mix(qkv, spec, weights), leaves)
    got = _train(em.mix_op(qkv, weights, *em.op_args(spec), True)[0], leaves)
    for a, e in zip(got, exp):
        assert a.shape == e.shape and torch.equal(a, e)


def test_the_ops_autograd_kernel_is_the_node(triton_device):
    """One autograd node for the mixer call, eager or through the op: the op's autograd kernel is the fused
    node, which hands the op's saved tensors back as non-differentiable outputs; called under a dispatch mode
    (as tracing is), the node dispatches the op below autograd and records the op's two halves."""
    spec, qkv, weights = _inputs("official-rope", triton_device)
    args = em.op_args(spec)
    node = em.fused_mix(qkv, spec, weights).grad_fn.name()
    out, saved = em.mix_op(qkv, weights, *args, True)
    assert out.grad_fn.name() == node and saved and not any(t.requires_grad for t in saved)
    with OpNames() as seen:
        out = em.mix_op(qkv, weights, *args, True)[0]
        out.backward(torch.ones_like(out))
    assert out.grad_fn.name() == node
    assert seen.names.count("vit3.mix.default") == 1 and seen.names.count("vit3.mix_backward.default") == 1


def test_a_second_order_backward_is_the_nodes(triton_device):
    """``create_graph=True``: the op's gradients are differentiable (through the op references, as the
    node's), and their own gradients are the node's."""
    spec, qkv, weights = _inputs("official-rope", triton_device)
    leaves = [qkv, *weights]
    found = []
    for out in (em.fused_mix(qkv, spec, weights), em.mix_op(qkv, weights, *em.op_args(spec), True)[0]):
        first = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
        found.append(torch.autograd.grad(sum(g.square().sum() for g in first), leaves))
    for a, e in zip(*found):
        assert torch.equal(a, e)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "save"])
def test_opcheck_passes(recompute, triton_device):
    """Schema, fakes (shapes, strides, dtypes of every output, symbolic sizes included), the registered
    autograd, and AOT dispatch, of both ops, a RoPE branch among them, under either ``recompute``."""
    spec, qkv, weights = _inputs("official-rope", triton_device)
    spec = spec._replace(recompute=recompute)
    args = em.op_args(spec)
    torch.library.opcheck(em.mix_op, (qkv, weights, *args, True))
    torch.library.opcheck(em.mix_op, (qkv.detach(), [w.detach() for w in weights], *args, False))
    out, saved = em.mix_op(qkv, weights, *args, True)
    d_out = torch.randn_like(out)
    inputs = (d_out, qkv.detach(), [w.detach() for w in weights], [t.detach() for t in saved], *args)
    torch.library.opcheck(em.mix_backward_op, inputs)


def test_the_backward_finds_its_program_after_the_plans_are_cleared(triton_device):
    spec, qkv, weights = _inputs("official-rope", triton_device)
    leaves = [qkv, *weights]
    exp = _train(em.mix_op(qkv, weights, *em.op_args(spec), True)[0], leaves)
    out = em.mix_op(qkv, weights, *em.op_args(spec), True)[0]
    top.clear_plans()
    got = [out, *torch.autograd.grad(out.square().sum(), leaves)]
    for a, e in zip(got, exp):
        assert torch.equal(a, e)


def test_a_compiled_mixer_is_one_op_per_call(triton_device):
    """Compiled whole (``fullgraph``), a mixer of two Triton branches with RoPE is one ``vit3::mix`` in the
    forward graph and one ``vit3::mix_backward`` in the backward graph: no per-branch ops, no concatenation;
    its outputs and gradients are the eager mixer's."""
    torch.manual_seed(0)
    mixer = TTTMixer(64, 4, branches=("swiglu", "dwconv"), rope=True, backend="triton").to(triton_device)
    x = torch.randn(2, 16, 64, device=triton_device, requires_grad=True)
    exp = _train(mixer(x, (4, 4)), [x, *mixer.parameters()])
    compiled, graphs = compiled_with_ops(mixer)
    got = _train(compiled(x, (4, 4)), [x, *mixer.parameters()])
    forward, backward = graphs
    for a, e in zip(got, exp):
        assert torch.equal(a, e)
    assert forward.count("vit3.mix.default") == 1 and backward.count("vit3.mix_backward.default") == 1
    assert not [t for t in forward + backward if "triton_ttt" in t or t == "aten.cat.default"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "size"), [("vit3_tiny", {"depth": 2}), ("h_vit3_tiny", {"depths": (1, 1, 1, 1)})]
)
def test_a_compiled_model_is_one_mixer_op_per_block(name, size, triton_device, monkeypatch):
    """ViT³ and H-ViT³ (RoPE) on the Triton path, compiled whole: one ``vit3::mix`` and one
    ``vit3::mix_backward`` per block, no per-branch op; the loss and every gradient are eager's."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", "triton")
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, num_classes=10, drop_path_rate=0.0, **size).to(triton_device)
    x, y = torch.randn(2, 3, 32, 32, device=triton_device), torch.tensor([1, 7], device=triton_device)
    forward, backward = compiled_model_ops(model, x, y, rtol=1e-5, atol=1e-6)
    blocks = sum(isinstance(m, TTTMixer) for m in model.modules())
    assert forward.count("vit3.mix.default") == blocks == backward.count("vit3.mix_backward.default")
    assert not [t for t in forward + backward if "triton_ttt" in t]
