"""The Triton TTT op equals each op's reference (``vit3.kernels.<op>.reference``): output and every gradient.

Runs on ``helpers.ops.DEVICE``: the GPU, or Triton's interpreter on CPU (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` where there is no GPU). Every buffer the op allocates is filled with NaN first
(``triton.plan.DEBUG_FILL``), so an element a kernel fails to write shows up as a mismatch. q, k, v are always
strided views of one qkv projection output.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from helpers.ops import DEVICE, SCALE, make_inputs, max_rel_err, per_tensor, rel_rms, run_both, split_heads

import vit3.kernels as kernels
from vit3.kernels.reference import reference_ttt
from vit3.kernels.triton import node as tnode
from vit3.kernels.triton import op as top
from vit3.kernels.triton import plan as tplan
from vit3.kernels.triton import program as tprogram
from vit3.kernels.triton import tiles as ttiles
from vit3.kernels.triton.jit import operand
from vit3.layers import TTTConfig, TTTMixer, backends

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def _nan_fill(monkeypatch):
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))


CASES = [
    pytest.param("swiglu", "dot", (1, 1, 1, 16), None, id="swiglu-N1-d16"),
    pytest.param("swiglu", "dot", (2, 3, 63, 32), None, id="swiglu-N63-d32-G3"),
    pytest.param("swiglu", "dot", (2, 3, 63, 32), 16, id="swiglu-N63-d32-G3-split4"),
    pytest.param("swiglu", "dot", (1, 2, 197, 64), 64, id="swiglu-N197-d64-split4"),
    pytest.param("swiglu", "dot", (2, 2, 197, 24), None, id="swiglu-N197-d24"),
    pytest.param("linear", "dot", (1, 1, 1, 16), None, id="linear-dot-N1-d16"),
    pytest.param("linear", "dot", (2, 3, 197, 32), 64, id="linear-dot-N197-d32-split4"),
    pytest.param("linear", "mse", (2, 2, 63, 64), None, id="linear-mse-N63-d64"),
    pytest.param("linear", "mse", (1, 3, 197, 16), 32, id="linear-mse-N197-d16-split7"),
    pytest.param("dwconv", "dot", (1, 1, (1, 1), 16), None, id="dwconv-1x1-d16"),
    pytest.param("dwconv", "dot", (2, 2, (7, 9), 32), 32, id="dwconv-7x9-d32-G2-split2"),
    pytest.param("dwconv", "dot", (1, 1, (1, 197), 64), None, id="dwconv-1x197-d64"),
    pytest.param("dwconv", "dot", (2, 1, (13, 15), 24), 64, id="dwconv-13x15-d24-split4"),
    # Heads wider than 64: the matrix kernels split the columns into 16-wide blocks (a column launch and a
    # cross launch for dq/dk per backward stage). d = 96 pads BLOCK_D to 128; d = 72 ends in a partial block.
    pytest.param("swiglu", "dot", (2, 1, 63, 96), None, id="swiglu-N63-d96-6cols"),
    pytest.param("swiglu", "dot", (1, 2, 63, 128), 32, id="swiglu-N63-d128-G2-split2-8cols"),
    pytest.param("linear", "dot", (2, 1, 63, 72), 32, id="linear-dot-N63-d72-split2-5cols"),
    pytest.param("linear", "mse", (1, 2, 63, 96), 32, id="linear-mse-N63-d96-G2-split2-6cols"),
    pytest.param("linear", "mse", (1, 1, 63, 128), None, id="linear-mse-N63-d128-8cols"),
]


@pytest.mark.parametrize(("name", "loss", "shape", "chunk"), CASES)
def test_fp32_output_and_every_gradient_match_reference(name, loss, shape, chunk):
    out, ref, got, exp, weights = run_both(name, shape, torch.float32, loss=loss, chunk=chunk)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert max_rel_err(out, ref) < 2e-5
    for label, a, e in per_tensor(got, exp, weights):
        assert torch.isfinite(a).all(), f"gradient of {label} has unwritten (NaN) entries"
        assert max_rel_err(a, e) < 5e-5, f"gradient of {label}"


@pytest.mark.parametrize(
    ("name", "loss", "grad_norm", "lr", "d"),
    [
        pytest.param("swiglu", "dot", True, 1.0, 32, id="swiglu-norm"),
        pytest.param("swiglu", "dot", False, 0.5, 32, id="swiglu-nonorm-lr0.5"),
        pytest.param("linear", "mse", False, 2.0, 32, id="linear-mse-nonorm-lr2"),
        pytest.param("dwconv", "dot", True, 1.0, 32, id="dwconv-norm"),
        pytest.param("swiglu", "dot", True, 1.0, 128, id="swiglu-norm-d128-8cols"),
        pytest.param("linear", "mse", True, 1.0, 64, id="linear-mse-norm-d64-4cols"),
    ],
)
def test_fp64_matches_reference_to_rounding(name, loss, grad_norm, lr, d):
    out, ref, got, exp, weights = run_both(name, (1, 2, (7, 9), d), torch.float64, loss=loss, lr=lr,
                                           grad_norm=grad_norm, chunk=32)  # fmt: skip
    assert max_rel_err(out, ref) < 1e-12
    for label, a, e in per_tensor(got, exp, weights):
        assert max_rel_err(a, e) < 1e-12, f"gradient of {label}"


@pytest.fixture
def transposed(monkeypatch):
    """Every matrix stage of one column block on transposed token tiles (``Tiles.trans``), in any dtype: the
    tables take them for 16-bit inputs at d = 64 only."""
    real = ttiles._matrix_tiles

    def table(*args):
        t, role, block_d = real(*args), args[2], args[3]
        return t if role.endswith("_cross") else replace(t, block_c=block_d, trans=True)

    monkeypatch.setattr(ttiles, "_matrix_tiles", table)
    top.clear_plans()
    yield
    monkeypatch.undo()
    top.clear_plans()


@pytest.mark.parametrize(
    ("name", "loss", "chunk"),
    [
        pytest.param("swiglu", "dot", None, id="swiglu-whole"),
        pytest.param("swiglu", "dot", 16, id="swiglu-split4"),
        pytest.param("linear", "mse", None, id="linear-mse-whole"),
        pytest.param("linear", "dot", 16, id="linear-dot-split4"),
    ],
)
@pytest.mark.parametrize("n_tok, d", [(63, 32), (300, 24)], ids=["N63-d32", "N300-d24-padded-2tiles"])
def test_transposed_tiles_match_reference_in_fp64(name, loss, chunk, n_tok, d, transposed):
    """The one-launch forward, the split forward's two stages and both backward stages on transposed tiles
    (every product through ``matrix._xw`` / ``_xtp`` / ``_pwt`` the other way round) to fp64 rounding; at
    N = 300 the interpreter's 256-token tiles make two iterations of each token loop, and d = 24 pads the
    channels."""
    out, ref, got, exp, weights = run_both(name, (1, 2, n_tok, d), torch.float64, loss=loss, chunk=chunk)
    assert max_rel_err(out, ref) < 1e-12
    for label, a, e in per_tensor(got, exp, weights):
        assert max_rel_err(a, e) < 1e-12, f"gradient of {label}"


@pytest.fixture(params=[False, True], ids=["rows", "transposed"])
def stacked(request, monkeypatch):
    """SwiGLU's weight-gradient dots stacked (``Tiles.stack``) in every stage that has them, in any dtype and
    both orientations (the tables stack them for 16-bit inputs at d = 32 on ``wgmma`` parts only)."""
    real = ttiles._matrix_tiles

    def table(*args):
        t, role, block_d = real(*args), args[2], args[3]
        if role not in ("forward", "grad", "readout_bwd", "grad_bwd"):
            return t
        return replace(t, stack=True, **({"block_c": block_d, "trans": True} if request.param else {}))

    monkeypatch.setattr(ttiles, "_matrix_tiles", table)
    top.clear_plans()
    yield
    monkeypatch.undo()
    top.clear_plans()


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "split"])
@pytest.mark.parametrize("n_tok, d", [(63, 32), (300, 24)], ids=["N63-d32", "N300-d24-padded-2tiles"])
def test_stacked_weight_gradients_match_reference_in_fp64(chunk, n_tok, d, stacked):
    """SwiGLU's two weight-gradient products as one ``[p1 | p2]ᵀ x`` dot (``matrix._add_wgrad``), split
    back per weight after the token loop (``_wgrad_pair``): the forward's ``G``, the read-out backward's
    ``dW'`` and the gradient backward's ``kᵀ dZ``, to fp64 rounding; whole and split, rows and transposed
    tiles, d = 24 padding the channels and the weights' columns."""
    out, ref, got, exp, weights = run_both("swiglu", (1, 2, n_tok, d), torch.float64, chunk=chunk)
    assert max_rel_err(out, ref) < 1e-12
    for label, a, e in per_tensor(got, exp, weights):
        assert max_rel_err(a, e) < 1e-12, f"gradient of {label}"


# 16-bit inputs meet tl.dot as they are (sm_80+, and the interpreter, which takes sm_90's tiles), every
# operand computed on chip (P, dY, dZ, W', dG) rounded to their dtype, fp32 accumulation. fp16 runs natively
# in the interpreter (its fp16 dots are exact); bf16 with its operands rounded to bf16 (to nearest even) and
# multiplied in fp32 (``EMU``), since the interpreter's bf16 dots are wrong. The reference runs on the upcast
# 16-bit inputs, so
# what is left is the kernels' rounding: 2^-11 (fp16) or 2^-8 (bf16) relative per operand and output.
HALF_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
HALF_CASES = [
    pytest.param("swiglu", "dot", (2, 2, 70, 32), None, torch.float16, id="swiglu-N70-d32-whole-fp16"),
    pytest.param("swiglu", "dot", (2, 2, 70, 32), 32, torch.float16, id="swiglu-N70-d32-split3-fp16"),
    pytest.param("swiglu", "dot", (2, 2, 70, 32), None, torch.bfloat16, id="swiglu-N70-d32-whole-bf16"),
    pytest.param("swiglu", "dot", (1, 2, 97, 64), 32, torch.bfloat16, id="swiglu-N97-d64-split4-bf16"),
    pytest.param("swiglu", "dot", (2, 1, 63, 24), None, torch.float16, id="swiglu-N63-d24-padded-fp16"),
    # d = 64 on sm_90's tiles: SwiGLU's one-block stages on transposed tiles; d = 48 pads them to 64
    pytest.param("swiglu", "dot", (2, 1, 70, 48), None, torch.float16, id="swiglu-N70-d48-transposed-fp16"),
    pytest.param("linear", "mse", (2, 2, 63, 64), None, torch.float16, id="linear-mse-N63-d64-fp16"),
    pytest.param("linear", "mse", (1, 2, 63, 64), 16, torch.bfloat16, id="linear-mse-N63-d64-split4-bf16"),
    pytest.param("linear", "dot", (1, 3, 50, 16), 16, torch.float16, id="linear-dot-N50-d16-split4-fp16"),
    pytest.param("dwconv", "dot", (2, 1, (7, 9), 32), None, torch.bfloat16, id="dwconv-7x9-d32-bf16"),
]


@pytest.mark.parametrize(("name", "loss", "shape", "chunk", "dtype"), HALF_CASES)
def test_half_inputs_match_reference_to_their_rounding(name, loss, shape, chunk, dtype):
    out, ref, got, exp, weights = run_both(name, shape, dtype, loss=loss, chunk=chunk)
    assert out.dtype == dtype
    assert rel_rms(out, ref) < HALF_TOL[dtype]
    for label, a, e in per_tensor(got, exp, weights):
        assert a.dtype == (dtype if label in ("q", "k", "v") else torch.float32), label
        assert torch.isfinite(a).all(), f"gradient of {label} has unwritten (NaN) entries"
        assert rel_rms(a, e) < HALF_TOL[dtype], f"gradient of {label}"


@pytest.mark.parametrize(
    ("name", "loss", "dtype"),
    [
        pytest.param("swiglu", "dot", torch.bfloat16, id="swiglu-bf16"),
        pytest.param("linear", "mse", torch.float16, id="linear-mse-fp16"),
    ],
)
def test_half_inputs_at_head_dim_128_match_reference(name, loss, dtype):
    """Column blocks (a column and a cross launch per backward stage) with 16-bit operands."""
    out, ref, got, exp, weights = run_both(name, (1, 1, 63, 128), dtype, loss=loss, chunk=32)
    assert rel_rms(out, ref) < HALF_TOL[dtype]
    for label, a, e in per_tensor(got, exp, weights):
        assert rel_rms(a, e) < HALF_TOL[dtype], f"gradient of {label}"


@triton.jit
def _bf16_round_kernel(x_ptr, y_ptr, n: tl.constexpr):
    r = tl.arange(0, n)
    tl.store(y_ptr + r, operand(tl.load(x_ptr + r), tl.bfloat16, True))


def test_bf16_operands_are_rounded_to_nearest_even():
    """The interpreter's bf16 stand-in rounds as a GPU's ``cvt.rn.bf16.f32`` (Triton's interpreter
    truncates)."""
    x = torch.randn(4096, device=DEVICE) * torch.logspace(-20, 20, 4096, device=DEVICE)
    x[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])  # ties and near-ties
    y = torch.empty_like(x)
    _bf16_round_kernel[(1,)](x, y, 4096)
    assert torch.equal(y, x.to(torch.bfloat16).float())


@pytest.mark.parametrize("n", [pytest.param(3136, id="N3136"), pytest.param(16384, id="N16384")])
def test_large_n_matches_reference(n):
    """N = 3136 (56 x 56) and 16384 (128 x 128) tokens, unsplit: many token tiles in one program."""
    out, ref, got, exp, weights = run_both("swiglu", (1, 1, n, 32), torch.float32)
    assert max_rel_err(out, ref) < 2e-5
    for label, a, e in per_tensor(got, exp, weights):
        assert max_rel_err(a, e) < 5e-5, f"gradient of {label}"


def test_split_reduction_is_deterministic():
    b, g, n, d = 1, 2, 100, 32
    qkv, params = make_inputs("swiglu", b, g, n, d, torch.float32)
    runs = []
    for _ in range(2):
        out = kernels.triton_ttt(
            "swiglu", *split_heads(qkv, g), params, scale=SCALE, backend="triton", chunk=32
        )
        runs.append([out, *torch.autograd.grad(out.square().sum(), [qkv, *params.values()])])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize(
    ("name", "loss", "n"),
    [("swiglu", "dot", 20), ("linear", "mse", 20), ("dwconv", "dot", (4, 5))],
    ids=["swiglu", "linear-mse", "dwconv"],
)
def test_double_backward_matches_reference(name, loss, n):
    """``create_graph=True`` (a gradient penalty, second-order methods): the op's gradients are
    differentiable, to the inputs, the weights and the upstream gradient, and their derivatives are the
    reference's."""
    grid = n if isinstance(n, tuple) else (1, n)
    qkv, params = make_inputs(name, 2, 2, grid[0] * grid[1], 16, torch.float64)
    dout = torch.randn(2, 2, grid[0] * grid[1], 16, dtype=torch.float64, device=DEVICE, requires_grad=True)
    inputs = [qkv, *params.values(), dout]
    kw = {"grid": grid, "scale": SCALE, "lr": 1.0, "grad_norm": True, "loss": loss}

    def second_order(op) -> list[torch.Tensor]:
        out = op(name, *split_heads(qkv, 2), params, **kw)
        first = torch.autograd.grad(out, inputs[:-1], dout, create_graph=True)
        return list(torch.autograd.grad(sum(g.square().sum() for g in first), inputs))

    got = second_order(lambda *a, **k: kernels.triton_ttt(*a, backend="triton", **k))
    want = second_order(reference_ttt)
    for label, a, e in zip(["qkv", *params, "dout"], got, want):
        assert max_rel_err(a, e) < 1e-10, f"second-order gradient of {label}"


def test_output_is_token_major_so_the_head_merge_is_free():
    qkv, params = make_inputs("linear", 1, 3, 5, 16, torch.float32)
    out = kernels.triton_ttt("linear", *split_heads(qkv, 3), params, scale=SCALE, backend="triton")
    assert out.transpose(1, 2).is_contiguous()


# ------------------------------------------------------------------------------------ reference switch


@pytest.mark.parametrize("name", ["swiglu", "linear", "dwconv"])
def test_reference_switch_by_argument_only(name, monkeypatch):
    b, g, n, d = 1, 2, 40, 16
    qkv, params = make_inputs(name, b, g, n, d, torch.float32)
    calls = []
    original = top.reference.reference_ttt
    monkeypatch.setattr(top.reference, "reference_ttt", lambda *a, **k: calls.append(1) or original(*a, **k))

    def run(**kw):
        out = kernels.triton_ttt(name, *split_heads(qkv, g), params, grid=(5, 8), scale=SCALE, **kw)
        return [out, *torch.autograd.grad(out.square().sum(), [qkv, *params.values()])]

    fused = run(backend="triton")
    assert not calls
    reference = run(backend="reference")
    assert len(calls) == 1
    monkeypatch.setenv("VIT3_TTT_BACKEND", "generic")  # the mixer's switch: the op reads no variable
    assert torch.equal(run()[0], fused[0]) and len(calls) == 1
    for a, e in zip(fused, reference):
        assert max_rel_err(a, e) < 5e-5


def test_bad_backend_value_is_rejected():
    with pytest.raises(ValueError, match="backend must be 'auto', 'triton' or 'reference'"):
        kernels.resolve_backend("fast")


@pytest.mark.parametrize(
    ("name", "shape", "weights", "loss", "match"),
    [
        pytest.param("mlp", (1, 1, 4, 16), ("w",), "dot", "inner models", id="unknown-model"),
        pytest.param("dwconv", (1, 1, 4, 16), ("weight",), "dot", "grid", id="dwconv-without-grid"),
        pytest.param("swiglu", (1, 1, 4, 16), ("w1", "w2"), "mse", "losses", id="swiglu-mse"),
        pytest.param("swiglu", (1, 1, 4, 16), ("w1",), "dot", "weights", id="missing-weight"),
        pytest.param("linear", (1, 1, 0, 16), ("w",), "dot", "N >= 1", id="no-tokens"),
        pytest.param("linear", (1, 1, 4, 8), ("w",), "dot", "head dims", id="head-dim-8"),
    ],
)
def test_bad_inputs_raise_value_error(name, shape, weights, loss, match):
    b, g, n, d = shape
    q = torch.randn(b, g, n, d, device=DEVICE)
    params = {
        w: torch.randn((1, g * d, 3, 3) if name == "dwconv" else (1, g, d, d), device=DEVICE) for w in weights
    }
    with pytest.raises(ValueError, match=match):
        kernels.triton_ttt(name, q, q, q, params, scale=SCALE, loss=loss, backend="triton")


def test_weight_shape_mismatch_is_named():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"\[1, 2, 16, 16\]"):
        kernels.triton_ttt("linear", q, q, q, {"w": torch.randn(2, 2, 16, 16)}, scale=SCALE)
    with pytest.raises(ValueError, match=r"\[1, 32, 3, 3\]"):
        kernels.triton_ttt("dwconv", q, q, q, {"weight": torch.randn(1, 16, 3, 3)}, grid=(2, 2), scale=SCALE)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.triton_ttt("linear", q, q, q, {"w": torch.randn(1, 2, 16, 16)}, grid=(3, 2), scale=SCALE)


# ---------------------------------------------------------------------------------- torch.library, compile


@pytest.mark.parametrize("model", ["swiglu", "dwconv"])
def test_custom_op_registration_passes_opcheck(model):
    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, device=DEVICE, requires_grad=True)

    q, k, v = (leaf(1, 2, 20, 16) for _ in range(3))
    w1, w2 = (leaf(1, 32, 3, 3), None) if model == "dwconv" else (leaf(1, 2, 16, 16), leaf(1, 2, 16, 16))
    args = (
        q,
        k,
        v,
        w1,
        w2,
        model,
        "dot",
        4,
        5,
        SCALE,
        1.0,
        True,
        0,
    )  # ..., grid 4 x 5, scale, lr, grad_norm, chunk
    # test_aot_dispatch_dynamic would re-run the interpreter for many symbolic shapes: too slow on CPU.
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(torch.ops.vit3.triton_ttt_fwd.default, args, test_utils=tests)


def test_compiles_with_fullgraph_and_keeps_gradients():
    b, g, n, d = 2, 2, 30, 16
    qkv, params = make_inputs("swiglu", b, g, n, d, torch.float32)

    def branch(qkv, w1, w2):
        return kernels.triton_ttt(
            "swiglu", *split_heads(qkv, g), {"w1": w1, "w2": w2}, scale=SCALE, backend="triton"
        )

    torch._dynamo.reset()
    # aot_eager runs dynamo + AOT autograd (graph capture, fake tensors, the registered backward) without
    # Inductor's C++ build; fullgraph=True fails on any graph break.
    compiled = torch.compile(branch, fullgraph=True, backend="aot_eager")
    inputs = [qkv, *params.values()]
    got = [compiled(*inputs)]
    got += torch.autograd.grad(got[0].square().sum(), inputs)
    exp = [branch(*inputs)]
    exp += torch.autograd.grad(exp[0].square().sum(), inputs)
    for a, e in zip(got, exp):
        assert torch.equal(a, e)


@pytest.mark.parametrize("model", ["swiglu", "dwconv"])
def test_compiles_with_symbolic_sizes_and_keeps_gradients(model):
    """``dynamic=True`` (what torch.compile turns to by itself on a second input size): the ops' fake
    implementations get symbolic sizes, which the plans' caches cannot key, and allocate the outputs alone;
    at run time the graph calls the op on real tensors, so every size equals the eager op."""
    g, d = 2, 16

    def branch(qkv, grid, *weights):
        params = dict(zip(["weight"] if model == "dwconv" else ["w1", "w2"], weights))
        return kernels.triton_ttt(
            model, *split_heads(qkv, g), params, grid=grid, scale=SCALE, backend="triton"
        )

    torch._dynamo.reset()
    compiled = torch.compile(branch, fullgraph=True, backend="aot_eager", dynamic=True)
    for b, grid in ((2, (5, 6)), (1, (4, 5))):
        qkv, params = make_inputs(model, b, g, grid[0] * grid[1], d, torch.float32)
        inputs = [qkv, *params.values()]
        got = [compiled(qkv, grid, *inputs[1:])]
        got += torch.autograd.grad(got[0].square().sum(), inputs)
        exp = [branch(qkv, grid, *inputs[1:])]
        exp += torch.autograd.grad(exp[0].square().sum(), inputs)
        for a, e in zip(got, exp):
            assert a.shape == e.shape and torch.equal(a, e)


@pytest.mark.parametrize("model", ["swiglu", "linear", "dwconv"])
def test_backward_op_fake_matches_the_kernels(model):
    """The backward op's fake implementation gives the kernels' shapes, strides and dtypes
    (``torch.library.opcheck``'s fake-tensor test, on a real call's saved statistics)."""
    leaf = functools.partial(torch.randn, device=DEVICE)
    q, k, v, dout = (leaf(1, 2, 20, 16) for _ in range(4))
    w1, w2 = (leaf(1, 32, 3, 3), None) if model == "dwconv" else (leaf(1, 2, 16, 16), leaf(1, 2, 16, 16))
    w2 = w2 if model == "swiglu" else None
    cfg = (model, "dot", 4, 5, SCALE, 1.0, True, 0)
    _, gbuf, nbuf = torch.ops.vit3.triton_ttt_fwd(q, k, v, w1, w2, *cfg)
    args = (dout, q, k, v, w1, w2, gbuf, nbuf, *cfg)
    torch.library.opcheck(
        torch.ops.vit3.triton_ttt_bwd.default, args, test_utils=("test_schema", "test_faketensor")
    )


def test_compiled_rope_mixer_hands_the_op_one_dtype():
    """Traced, a mixer runs as the mixer op; RoPE rotates 16-bit q, k in float32, and they go back to the io
    dtype (as in the fused node) before the op, which takes q, k, v of one dtype."""
    torch.manual_seed(0)
    mixer = TTTMixer(32, 2, branches=("swiglu",), rope=True, backend="triton").to(DEVICE)
    x = torch.randn(2, 16, 32, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        exp = mixer(x, (4, 4))
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = torch.compile(mixer, backend="aot_eager", fullgraph=True)(x, (4, 4))
    # the traced path reaches the op without tracing through a cached call (dynamo warns of those)
    assert not [w for w in seen if "lru_cache" in str(w.message)]
    assert got.dtype == exp.dtype == torch.float16
    assert max_rel_err(got.float(), exp.float()) < 1e-3


# -------------------------------------------------------------------------------------------- the mixer


def mixer_pair(branches: tuple[str, ...], dim: int = 64, heads: int = 2) -> tuple[TTTMixer, TTTMixer]:
    fused = TTTMixer(dim, heads, branches=branches, backend="triton").to(DEVICE)
    plain = TTTMixer(dim, heads, branches=branches, backend="generic").to(DEVICE)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def mixer_run(
    mixer: TTTMixer, x: torch.Tensor, grid: tuple[int, int]
) -> tuple[torch.Tensor, dict, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = mixer(x, grid)
    out.backward(torch.ones_like(out) + out.detach())
    return out, {k: p.grad for k, p in mixer.named_parameters()}, x.grad


def _triton_calls(monkeypatch) -> list[str]:
    """The inner models the Triton path runs, in order: a branch alone (``triton_ttt``), in the fused node
    (``triton.node.forward``) or in its launch program (``MixProgram.forward``: every branch)."""
    calls: list[str] = []
    alone, in_node, whole = top.triton_ttt, tnode.forward, tprogram.MixProgram.forward
    monkeypatch.setattr(top, "triton_ttt", lambda *a, **k: calls.append(a[0]) or alone(*a, **k))
    monkeypatch.setattr(tnode, "forward", lambda name, call: calls.append(name) or in_node(name, call))
    monkeypatch.setattr(tprogram.MixProgram, "forward", lambda p, *a: calls.extend(p.names) or whole(p, *a))
    return calls


@pytest.mark.parametrize("branches", [("swiglu", "dwconv:1"), ("linear",)], ids=["official", "linear"])
def test_mixer_triton_equals_torch_end_to_end(branches, monkeypatch):
    calls = _triton_calls(monkeypatch)
    fused, plain = mixer_pair(branches)
    x = torch.randn(2, 35, 64, device=DEVICE)
    out_f, grads_f, dx_f = mixer_run(fused, x, (5, 7))
    out_p, grads_p, dx_p = mixer_run(plain, x, (5, 7))
    assert calls == [name.partition(":")[0] for name in branches]
    assert max_rel_err(out_f, out_p) < 2e-5
    assert max_rel_err(dx_f, dx_p) < 5e-5
    assert set(grads_f) == set(grads_p)
    for key, g in grads_f.items():
        assert max_rel_err(g, grads_p[key]) < 5e-5, f"gradient of {key}"


def test_mixer_environment_variable_flips_the_implementation(monkeypatch):
    calls = _triton_calls(monkeypatch)
    mixer = TTTMixer(32, 2, branches=("swiglu",)).to(DEVICE)  # backend="auto": the kernel on CUDA only
    x = torch.randn(1, 12, 32, device=DEVICE)
    with torch.no_grad():
        monkeypatch.setenv("VIT3_TTT_BACKEND", "generic")
        plain = mixer(x, (3, 4))
        assert calls == []
        monkeypatch.setenv("VIT3_TTT_BACKEND", "triton")
        fused = mixer(x, (3, 4))
        assert calls == ["swiglu"]
        monkeypatch.setenv("VIT3_TTT_BACKEND", "eager")
        eager = mixer(x, (3, 4))
        monkeypatch.delenv("VIT3_TTT_BACKEND")
        auto = mixer(x, (3, 4))
        assert len(calls) == (2 if DEVICE.type == "cuda" else 1)
    assert torch.equal(auto, fused if DEVICE.type == "cuda" else eager)
    assert max_rel_err(fused, plain) < 2e-5 and max_rel_err(eager, plain) < 2e-5


def _triton_serves(name: str, cfg: TTTConfig, x: torch.Tensor, head_dim: int = 32) -> tuple[bool, str]:
    """The mixer registry's verdict on the Triton backend for one branch."""
    inputs = backends.Inputs(x.device, x.dtype, backends.token_class(x.shape[1]), False, "")
    settings = backends.Settings(cfg.loss, cfg.steps, cfg.mini_batches, cfg.lr_mode)
    branch = backends.Branch(0, name, 1, head_dim, plain=True)  # a bare inner model, as the kernels take
    return backends.BACKENDS["triton"].supports(branch, settings, inputs)


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [
        pytest.param("swiglu", {}, "", id="official"),
        pytest.param("linear", {}, "", id="linear-dot"),
        pytest.param("linear", {"loss": "mse"}, "loss 'mse' is not fused in the mixer op", id="linear-mse"),
        pytest.param("dwconv", {}, "", id="dwconv"),
        pytest.param("swiglu", {"loss": "mse"}, "loss 'mse' is not fused", id="swiglu-mse"),
        pytest.param("swiglu", {"steps": 2}, "steps=2", id="two-steps"),
        pytest.param("swiglu", {"mini_batches": 2}, "mini_batches=2", id="mini-batches"),
        pytest.param("swiglu", {"lr_mode": "token"}, "lr_mode='token'", id="token-lr"),
    ],
)
def test_triton_backend_supports(name, overrides, expected):
    ok, why = _triton_serves(name, TTTConfig(**overrides), torch.randn(1, 4, 32, device=DEVICE))
    assert ok is (not expected) and expected in why


def test_triton_backend_checks_head_dim_and_device(monkeypatch):
    cfg = TTTConfig()
    x = torch.randn(1, 4, 32, device=DEVICE)
    assert _triton_serves("swiglu", cfg, x, head_dim=64)[0]
    assert _triton_serves("swiglu", cfg, x, head_dim=128)[0]  # in column blocks
    assert _triton_serves("linear", cfg, x.double(), head_dim=128)[0]
    assert _triton_serves("dwconv", cfg, x, head_dim=128)[0]
    assert _triton_serves("swiglu", cfg, x, head_dim=256) == (
        False,
        "head dim 256 > 128: wider tiles exceed on-chip shared memory",
    )
    assert not _triton_serves("dwconv", cfg, x, head_dim=256)[0]
    assert _triton_serves("swiglu", cfg, x, head_dim=8) == (
        False,
        "head dim 8 < 16: below the smallest dot tile",
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor without the interpreter: no Triton
    ok, why = _triton_serves("swiglu", cfg, x.cpu())
    assert not ok and "TRITON_INTERPRET=1" in why


def test_unsupported_head_dim_falls_back_to_reference_or_raises(monkeypatch):
    g, n, d = 1, 6, 136
    qkv, params = make_inputs("linear", 1, g, n, d, torch.float32)
    calls = []
    original = top.reference.reference_ttt
    monkeypatch.setattr(top.reference, "reference_ttt", lambda *a, **k: calls.append(1) or original(*a, **k))
    out = kernels.triton_ttt("linear", *split_heads(qkv, g), params, scale=SCALE)
    assert calls == [1] and out.shape == (1, g, n, d)
    with pytest.raises(ValueError, match="shared memory"):
        kernels.triton_ttt("linear", *split_heads(qkv, g), params, scale=SCALE, backend="triton")
