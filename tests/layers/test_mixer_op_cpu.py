"""The mixer op ``vit3::mix`` on the C++ CPU kernel: its kernels are the whole-mixer C++ op's two halves
(``vit3_cpu::mix_forward`` / ``mix_backward``, glued by ``kernels/mix/cpp.py``), as the fused node's
whole-node hooks where every branch takes ``cpu``.

That the node's one C++ call computes bit for bit what each branch's own hooks compute (forward and every
gradient; RoPE, dense copies, a strided qkv, Z and Y saved or recomputed), that the op through the
dispatcher does too, that ``torch.library.opcheck`` passes (schema, fakes, autograd), that a compiled mixer is
one forward and one backward op with eager's bits, that a compiled model keeps them per block, and that
``torch.compile`` routes to the C++ kernel only where it built, never ``torch.export`` or tracing.
"""

from __future__ import annotations

import pytest
import timm
import torch
from helpers.common import OpNames, compiled_model_ops, compiled_with_ops

import vit3  # noqa: F401  (registers the models)
from vit3.kernels import cpp as cpu_ext
from vit3.kernels.mix import cpp as mix_cpp
from vit3.kernels.ops import Branch, Inputs, Settings
from vit3.kernels.paths import cpu_supports
from vit3.kernels.swiglu import eager as swiglu_eager
from vit3.layers import TTTMixer
from vit3.layers import backends as reg
from vit3.layers import fused_mix as fm

HEADS, D, GRID = 2, 16, (5, 6)


@pytest.fixture(autouse=True)
def _kernel():
    ops, why = cpu_ext.load()
    if ops is None:
        pytest.skip(f"the C++ CPU kernel is not built here ({why})")


def _spec(rope: bool, recompute: bool, scale: float = 0.3) -> fm.MixSpec:
    c = HEADS * D
    branches = (
        fm.MixBranch("swiglu", 0, HEADS, D, rope, "cpu"),
        fm.MixBranch("dwconv", 3 * c, 1, D, False, "cpu"),
    )
    return fm.MixSpec(branches, GRID, scale, 1 / 3, True, 10000.0, recompute)


def _inputs(dtype: torch.dtype = torch.float64, strided: bool = False) -> tuple[torch.Tensor, list]:
    g = torch.Generator().manual_seed(0)
    c, n = HEADS * D, GRID[0] * GRID[1]
    qkv = torch.randn(2, n, 3 * (c + D), generator=g, dtype=torch.float64)
    if strided:  # channels not of unit stride: the op reads a dense copy
        qkv = torch.randn(2, 3 * (c + D), n, generator=g, dtype=torch.float64).transpose(1, 2)
    weights = [0.3 * torch.randn(1, HEADS, D, D, generator=g, dtype=torch.float64) for _ in range(2)]
    weights.append(0.3 * torch.randn(1, D, 3, 3, generator=g, dtype=torch.float64))
    return qkv.to(dtype).requires_grad_(), [w.to(dtype).requires_grad_() for w in weights]


def _train(out: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return [out, *torch.autograd.grad(out, leaves, dout)]


def _by_branch(spec: fm.MixSpec, qkv: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """The fused node on each branch's own hooks (``Node``), not the whole-node C++ call."""
    layout = fm.mix_layout(spec)._replace(whole=None)
    return fm._FusedMix.apply(qkv, layout, None, *weights)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("rope", "recompute"), [(True, True), (True, False), (False, True)])
def test_the_whole_call_computes_what_the_branch_hooks_compute(rope, recompute, dtype):
    spec = _spec(rope, recompute)
    assert fm.mix_layout(spec).whole is not None and fm.whole_path(spec)
    qkv, weights = _inputs(dtype)
    leaves = [qkv, *weights]
    exp = _train(_by_branch(spec, qkv, weights), leaves)
    for out in (fm.fused_mix(qkv, spec, weights), fm.mix_op(qkv, weights, *fm.op_args(spec), True)[0]):
        for a, e in zip(_train(out, leaves), exp):
            assert a.shape == e.shape and torch.equal(a, e)


def test_dense_copies_give_the_same_bits(monkeypatch):
    """Dense copies of q, k, v (the rule of large problems, here forced for every size): the C++ call copies
    as each branch's hooks do, forward and backward."""
    monkeypatch.setattr(swiglu_eager, "TILE_BYTES", 1)
    spec = _spec(True, True, scale=0.25)  # a spec of its own: its cached arguments hold the dense rule
    qkv, weights = _inputs()
    assert mix_cpp.cpp_args(spec, qkv)[-1]  # dense
    leaves = [qkv, *weights]
    exp = _train(_by_branch(spec, qkv, weights), leaves)
    for a, e in zip(_train(fm.fused_mix(qkv, spec, weights), leaves), exp):
        assert torch.equal(a, e)


def test_a_strided_qkv_gives_the_bits_of_a_dense_one():
    """A qkv whose channels are not of unit stride (the op reads a dense copy)."""
    spec = _spec(True, False)
    strided, weights = _inputs(strided=True)
    dense = strided.detach().contiguous().requires_grad_()
    got = _train(fm.fused_mix(strided, spec, weights), [strided, *weights])
    exp = _train(fm.fused_mix(dense, spec, weights), [dense, *weights])
    for a, e in zip(got, exp):
        assert torch.equal(a, e)


def test_the_whole_call_is_one_cpp_call_each_way():
    spec = _spec(True, True)
    qkv, weights = _inputs()
    with OpNames() as seen:
        out = fm.fused_mix(qkv, spec, weights)
        out.backward(torch.ones_like(out))
    cpp = [n for n in seen.names if n.startswith("vit3_cpu.")]
    assert cpp == ["vit3_cpu.mix_forward.default", "vit3_cpu.mix_backward.default"]


@pytest.mark.parametrize(("rope", "recompute"), [(True, True), (True, False), (False, False)])
def test_opcheck_passes(rope, recompute):
    """Schema, fakes (what the forward saves: never a view of qkv, its layout by the spec alone), the
    registered autograd and AOT dispatch, of both ops on the ``cpu`` path."""
    spec = _spec(rope, recompute)
    qkv, weights = _inputs()
    args = fm.op_args(spec)
    torch.library.opcheck(fm.mix_op, (qkv, weights, *args, True))
    torch.library.opcheck(fm.mix_op, (qkv.detach(), [w.detach() for w in weights], *args, False))
    out, saved = fm.mix_op(qkv, weights, *args, True)
    assert not any(t.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() for t in saved)
    inputs = (torch.randn_like(out), qkv.detach(), [w.detach() for w in weights], [t.detach() for t in saved])
    torch.library.opcheck(fm.mix_backward_op, (*inputs, *args))


@pytest.mark.parametrize("rope", [False, True])
def test_a_compiled_mixer_on_cpu_is_one_op_per_call(rope):
    """Under ``torch.compile`` a CPU mixer keeps the C++ kernel: one ``vit3::mix`` in the forward graph and
    one ``vit3::mix_backward`` in the backward graph, with eager's numbers (the projections around it may
    round otherwise in the graph); the generic inner loop it compiled before ran 2x slower than eager."""
    torch.manual_seed(0)
    mixer = TTTMixer(64, 4, branches=("swiglu", "dwconv"), rope=rope).double()
    x = torch.randn(2, 30, 64, dtype=torch.float64, requires_grad=True)
    exp = _train(mixer(x, GRID), [x, *mixer.parameters()])
    compiled, graphs = compiled_with_ops(mixer)
    got = _train(compiled(x, GRID), [x, *mixer.parameters()])
    forward, backward = graphs
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)
    assert forward.count("vit3.mix.default") == 1 and backward.count("vit3.mix_backward.default") == 1
    assert not [t for t in forward + backward if "vit3_cpu" in t]


@pytest.mark.parametrize(
    ("name", "size"), [("vit3_tiny", {"depth": 2}), ("h_vit3_tiny", {"depths": (1, 1, 1, 1)})]
)
def test_a_compiled_model_on_cpu_is_one_mixer_op_per_block(name, size):
    """In float64: H-ViT³'s batch-normed stem makes float32 gradients of two images differ by 1e-3 between
    any two orders of summation, with or without the mixer op."""
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, num_classes=10, drop_path_rate=0.0, **size).double()
    x, y = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 7])
    forward, backward = compiled_model_ops(model, x, y, rtol=1e-9, atol=1e-12)
    blocks = sum(isinstance(m, TTTMixer) for m in model.modules())
    assert forward.count("vit3.mix.default") == blocks == backward.count("vit3.mix_backward.default")


def _route(tracing: str) -> reg.Route:
    mixer = TTTMixer(64, 4)
    args = ((mixer.cfg.loss, 1, 1, "fixed"), "auto", mixer.route_branches, torch.device("cpu"), torch.float64)
    return reg.route(*args, "any N" if tracing else "N>=32", True, tracing)


def test_only_torch_compile_routes_to_the_cpp_kernel(monkeypatch):
    """``torch.compile`` takes the C++ kernel where it built; ``torch.export``, ``torch.jit.trace`` and ONNX
    take the portable generic path. A kernel that failed to build is not routed to under compile (compiled
    code runs unguarded) and says why."""
    assert _route("compile").backends == ("cpu", "cpu")
    assert _route("export").backends == ("generic", "generic") == _route("trace").backends
    branch, settings = Branch(0, "swiglu", 4, 16, True), Settings("dot", 1, 1, "fixed")
    x = Inputs(torch.device("cpu"), torch.float32, "any N", True, "compile")
    assert cpu_supports(branch, settings, x) == (True, "")
    assert not cpu_supports(branch, settings, x._replace(tracing="export"))[0]
    monkeypatch.setattr(cpu_ext, "load", lambda: (None, "no C++ compiler"))
    served, why = cpu_supports(branch, settings, x)
    assert not served and "no C++ compiler" in why and "cannot step aside" in why
    assert cpu_supports(branch, settings, x._replace(tracing=""))[0]  # eager: the guard demotes a bad build
    reg.reset()
    assert _route("compile").backends == ("generic", "generic")
