"""The Triton path's hooks in the fused node (``vit3.kernels.triton.node``): a mixer call on Triton is
one autograd node, equal to the op references and to the fused node (output and every gradient), on native
16-bit q, k, v; traced, the registry fuses Triton branches only all together; a failing branch alone is
demoted.

Runs where Triton runs (``triton_device``: the GPU, or the interpreter on CPU). The interpreter's bf16
``tl.dot`` is wrong (``shared/notes/triton.md``): bf16 is emulated there by rounding to bf16, then running
float32.
"""

from __future__ import annotations

import pytest
import torch
from helpers.backends import GRID, assert_same, backends_of, generic_twin, make_mixer, param_names, tokens
from helpers.ops import SCALE, intercept_launches, rel_rms

from vit3.kernels.triton import fuse
from vit3.kernels.triton import plan as tplan
from vit3.layers import backends as reg
from vit3.layers.fused_mix import MixBranch, MixSpec, _FusedMix, fused_mix, reference_mix, takes

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("no_backend_env")]

HEADS, D, SIDE = (2, 32, (7, 9))  # N = 63: awkward token count, H > 1
LR, ROPE_BASE = 0.7, 10000.0


@pytest.fixture(autouse=True)
def _nan_fill(monkeypatch):
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))


def _spec(path: str, rope: bool) -> MixSpec:
    """Both official branches (SwiGLU heads, the depthwise conv on one head) on ``path``."""
    c = HEADS * D
    branches = (MixBranch("swiglu", 0, HEADS, D, rope, path), MixBranch("dwconv", 3 * c, 1, D, False, path))
    return MixSpec(branches, SIDE, SCALE, LR, True, ROPE_BASE)


def _inputs(device: torch.device, dtype: torch.dtype, b: int = 2) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    c, n = HEADS * D, SIDE[0] * SIDE[1]
    qkv = torch.randn(b, n, 3 * (c + D), generator=g, dtype=torch.float64)
    weights = [torch.randn(1, HEADS, D, D, generator=g, dtype=torch.float64) * 0.3 for _ in range(2)]
    weights.append(torch.randn(1, D, 3, 3, generator=g, dtype=torch.float64) * 0.3)
    return qkv.to(device, dtype), [w.to(device, dtype) for w in weights]


def _grads(fn, qkv: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Output and the gradients of qkv and every weight, for a fixed upstream gradient."""
    qkv = qkv.detach().requires_grad_()
    weights = [w.detach().requires_grad_() for w in weights]
    out = fn(qkv, weights)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return [out, *torch.autograd.grad(out, [qkv, *weights], dout.to(out))]


def _reference(rope: bool):
    """The op references branch by branch, as the node's output (``reference_mix``)."""
    return lambda qkv, weights: reference_mix(qkv, _spec("eager", rope), weights)


NAMES = ["out", "d_qkv", "d_w1", "d_w2", "d_conv_weight"]


@pytest.mark.parametrize("rope", [False, True], ids=["rope-off", "rope-on"])
def test_float64_node_matches_the_references_and_the_eager_node(triton_device, rope):
    qkv, weights = _inputs(triton_device, torch.float64)
    got = _grads(lambda x, w: fused_mix(x, _spec("triton", rope), w), qkv, weights)
    assert got[0].grad_fn.name() == _FusedMix.__name__ + "Backward"  # one node for both branches
    assert_same(got, _grads(_reference(rope), qkv, weights), NAMES)
    assert_same(got, _grads(lambda x, w: fused_mix(x, _spec("eager", rope), w), qkv, weights), NAMES)


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.float16, 2e-2, id="fp16")],
)
@pytest.mark.parametrize("rope", [False, True], ids=["rope-off", "rope-on"])
def test_native_operands_match_the_references(triton_device, dtype, tol, rope):
    """fp32 and fp16 q, k, v in place (no upcast copy: the output and the qkv gradient in qkv's dtype), fp32
    accumulation: within ``tol`` (relative RMS) of the references on the same values in float64."""
    qkv, weights = _inputs(triton_device, dtype)
    assert takes(_spec("triton", rope), dtype) and not takes(_spec("eager", rope), torch.float16)
    got = _grads(lambda x, w: fused_mix(x, _spec("triton", rope), w), qkv, weights)
    assert got[0].dtype == got[1].dtype == dtype
    want = _grads(_reference(rope), qkv.double(), [w.double() for w in weights])
    for name, g, w in zip(NAMES, got, want):
        assert rel_rms(g.double(), w) < tol, name


def test_bf16_emulated_matches_the_references(triton_device):
    """bf16 operands, emulated on the interpreter (its bf16 ``tl.dot`` is wrong): rounded to bf16, run in
    float32; native bf16 on a GPU."""
    native = triton_device.type == "cuda"
    qkv, weights = _inputs(triton_device, torch.bfloat16)
    run = qkv if native else qkv.float()
    got = _grads(
        lambda x, w: fused_mix(x, _spec("triton", False), w), run, [w.to(run.dtype) for w in weights]
    )
    want = _grads(_reference(False), qkv.double(), [w.double() for w in weights])
    for name, g, w in zip(NAMES, got, want):
        assert rel_rms(g.double(), w) < (5e-2 if native else 1e-5), name


def test_fused_mix_refuses_half_qkv_on_other_paths():
    qkv, weights = _inputs(torch.device("cpu"), torch.float16)
    with pytest.raises(ValueError, match="only branches on Triton take it"):
        fused_mix(qkv, _spec("eager", False), weights)


def test_the_registry_fuses_traced_triton_branches_only_all_together():
    """Traced, Triton branches fuse as the mixer op (``fused_mix.mix_op``), which runs them all; a call that
    does not fuse runs the generic path for every branch (``registry.joined``)."""
    names, models = ("triton", "triton"), ("swiglu", "dwconv")
    assert not reg.registry.apart(names, models, "dot", "")
    assert not reg.registry.apart(("triton", "eager"), models, "dot", "")
    assert not reg.registry.apart(names, models, "dot", "compile")
    assert "compiled" in reg.registry.apart(("triton", "eager"), models, "dot", "compile")
    assert not reg.registry.apart(("eager", "eager"), models, "dot", "compile")
    assert "branch 1 ('dwconv') has no fast path" in reg.registry.apart(
        ("triton", "generic"), models, "dot", ""
    )
    assert "dot loss only" in reg.registry.apart(("triton",), ("linear",), "mse", "")
    picked = [
        reg.registry.Choice("triton", (("generic", "'triton' is named"),), ""),
        reg.registry.Choice("eager", (("triton", "a reason"),), ""),
    ]
    both, why = reg.registry.joined(picked, models, "dot", "compile")
    assert why == reg.registry.apart(("triton", "eager"), models, "dot", "compile")
    assert [c.backend for c in both] == ["generic", "generic"]
    assert dict(both[0].passed_over) == {"triton": why} and dict(both[1].passed_over)["eager"] == why


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_failing_branch_alone_is_demoted(monkeypatch, triton_device, phase):
    """The conv branch's kernel raises inside the fused node: only that branch steps aside (one warning),
    SwiGLU stays on Triton, and the result is the generic path's."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer = make_mixer().to(triton_device)
    x, dout = tokens(GRID).to(triton_device), tokens(GRID).to(triton_device)
    reference = generic_twin(mixer)
    kernel = "conv_readout_kernel" if phase == "forward" else "conv_readout_bwd_kernel"

    def launch(name, args, kwargs, run):
        if kernel in fuse.kernel_names(name):  # it, or a fused launch of it: split, its part fails alone
            raise RuntimeError(f"{kernel} failed")
        return run()

    intercept_launches(monkeypatch, launch)
    x_ = x.detach().requires_grad_()
    with pytest.warns(reg.BackendWarning, match=rf"'triton' failed in the {phase}.*dwconv") as caught:
        out = mixer(x_, GRID)
        got = [out, *torch.autograd.grad((out * dout).sum(), [x_, *mixer.parameters()])]
    assert len([w for w in caught if issubclass(w.category, reg.BackendWarning)]) == 1
    x_ref = x.detach().requires_grad_()
    ref = reference(x_ref, GRID)
    want = [ref, *torch.autograd.grad((ref * dout).sum(), [x_ref, *reference.parameters()])]
    assert_same(got, want, param_names(mixer))
    assert backends_of(mixer.explain(x.requires_grad_(), GRID))[0] == "triton"
    assert backends_of(mixer.explain(x, GRID))[1] != "triton"


def test_a_half_precision_mixer_hands_the_triton_node_its_qkv_as_it_is(monkeypatch, triton_device):
    """A float16 mixer on Triton: the fused node gets the float16 qkv itself (no float32 copy) and float32
    initial weights; output and gradients within fp16 accuracy of the float64 mixer."""
    import vit3.layers.ttt as ttt

    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    seen = []
    real = ttt.fused_mix

    def spy(qkv, spec, weights):
        seen.append((qkv.dtype, {w.dtype for w in weights}))
        return real(qkv, spec, weights)

    monkeypatch.setattr(ttt, "fused_mix", spy)
    mixer = make_mixer().to(triton_device)
    x = tokens(GRID).to(triton_device)
    half = make_mixer(dtype=torch.float16).to(triton_device)
    x_half = x.half().requires_grad_()
    out = half(x_half, GRID)
    (dx,) = torch.autograd.grad(out.float().sum(), [x_half])
    assert seen and all(s == (torch.float16, {torch.float32}) for s in seen)
    assert out.dtype == dx.dtype == torch.float16
    x64 = x.detach().requires_grad_()
    ref = mixer(x64, GRID)
    (dx64,) = torch.autograd.grad(ref.sum(), [x64])
    assert rel_rms(out.double(), ref) < 2e-2 and rel_rms(dx.double(), dx64) < 2e-2


@pytest.mark.triton
def test_weights_the_kernels_cannot_read_in_place_are_refused_by_the_node_and_copied_alone(triton_device):
    """One rule (``checks.not_in_place``) for both: the node names it (the guard then demotes the branch),
    ``triton_ttt`` copies the weights into the layout the kernels read and matches the op reference."""
    from vit3.kernels import reference
    from vit3.kernels.triton import op as top

    qkv, weights = _inputs(triton_device, torch.float64)
    column_major = [w.transpose(-1, -2).contiguous().transpose(-1, -2) for w in weights[:2]]
    taps_apart = weights[2].permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)  # 3 x 3 taps transposed
    for bad, rule in (([column_major[0], weights[1], weights[2]], "one layout and dtype"),
                      ([*weights[:2], taps_apart], "3 x 3 taps one stride apart")):  # fmt: skip
        with pytest.raises(ValueError, match=f"the Triton node reads .*{rule}"):
            fused_mix(qkv, _spec("triton", False), bad)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 1, SIDE[0] * SIDE[1], D, generator=g, dtype=torch.float64).to(triton_device)
               for _ in range(3))  # fmt: skip
    cases = {
        "swiglu": {"w1": column_major[0][:, :1], "w2": weights[1][:, :1]},
        "dwconv": {"weight": taps_apart},
    }
    for name, params in cases.items():
        got = top.triton_ttt(name, q, k, v, params, grid=SIDE, scale=SCALE, lr=LR, backend="triton")
        want = reference.reference_ttt(name, q, k, v, params, grid=SIDE, scale=SCALE, lr=LR, grad_norm=True)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
