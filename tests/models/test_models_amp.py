"""Mixed precision: every model trains under autocast (bf16, fp16), backward() inside the autocast region or
after it (the usual pattern), in every recompute mode, with gradients near an fp32 run; the hand-written
autograd nodes' backward runs under their forward's autocast state, so the gradients do not depend on where
backward() is called (``vit3.kernels.common.autocast_forward`` / ``autocast_backward``)."""

from __future__ import annotations

import contextlib

import pytest
import timm
import torch
from helpers.models import FULL_MODELS

from vit3.layers import TTTMixer
from vit3.layers.blocks import LeanMlp, TTTBlock
from vit3.models.dit3 import create_dit3

pytestmark = pytest.mark.usefixtures("one_thread")

AMP = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
RECOMPUTE = ["always", "never", "qkv"]  # "auto" is "always"
# fp16 without loss scaling underflows small gradients: scale as a GradScaler would (and undo it)
LOSS_SCALE = {torch.bfloat16: 1.0, torch.float16: 1024.0, torch.float32: 1.0}
# relative error of all gradients together, and of each tensor, against the fp32 run (measured: bf16
# 5e-3..8e-3 / per tensor up to 0.14, fp16 8e-4..2e-3 / up to 0.05)
TOLERANCE = {torch.bfloat16: (3e-2, 0.3), torch.float16: (1e-2, 0.15)}


def _model(name: str, recompute: str) -> torch.nn.Module:
    """The architecture of ``name`` at one block per stage (its widths and heads), eval mode (BatchNorm on
    its running statistics: batch statistics of two images would dominate the comparison)."""
    torch.manual_seed(0)
    cfg = dict(recompute=recompute)
    if name == "dit3":
        model = create_dit3("dit3_s_2", input_size=8, in_channels=4, hidden_size=64, depth=1, num_heads=2,
                            num_classes=10, ttt_cfg=cfg)  # fmt: skip
        with torch.no_grad():  # the official init zeroes the adaLN and output layers: no gradient to compare
            for p in model.parameters():
                p.normal_(0.0, 0.1)
        return model.eval()
    depth = dict(depths=(1, 1, 1, 1)) if name.startswith("h_") else dict(depth=1)
    return timm.create_model(name, num_classes=5, ttt_cfg=cfg, **depth).eval()


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    """Images or DiT³ latents with timesteps and labels. The plain models see 4x8 = 32 tokens (the C++
    kernel's side of the token rule), the H-ViT³ stages 128 down to 2 (both sides), DiT³ 16 (the tiled
    path)."""
    g = torch.Generator().manual_seed(1)
    if name == "dit3":
        return torch.randn(2, 4, 8, 8, generator=g), torch.tensor([3, 500]), torch.tensor([1, 2])
    size = (32, 64) if name.startswith("h_") else (64, 128)
    return (torch.randn(2, 3, *size, generator=g),)


def _grads(model: torch.nn.Module, inputs, amp: torch.dtype | None, inside: bool = False) -> dict:
    """Parameter and input gradients of a squared-output loss, its forward under autocast in ``amp``."""
    model.zero_grad(set_to_none=True)
    x = inputs[0].clone().requires_grad_()
    region = torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext()
    scale = LOSS_SCALE[amp or torch.float32]
    with region:
        out = model(x, *inputs[1:])
        loss = out.float().square().mean() * scale
        if inside:
            loss.backward()
    if not inside:
        loss.backward()
    grads = {n: p.grad / scale for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        assert p.grad is None or p.grad.dtype == p.dtype, f"{name}: gradient in {p.grad.dtype}"
    assert x.grad.dtype == x.dtype
    return {**grads, "input": x.grad / scale}


_FP32: dict[str, dict] = {}


def _fp32_grads(name: str) -> dict:
    """The fp32 reference of ``name`` (the same in every recompute mode), computed once."""
    if name not in _FP32:
        _FP32[name] = _grads(_model(name, "never"), _inputs(name), None)
    return _FP32[name]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("recompute", RECOMPUTE, ids=lambda r: f"recompute-{r}")
@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("name", [*FULL_MODELS, "dit3"])
def test_autocast_training_gradients_track_fp32_wherever_backward_runs(name, amp, recompute):
    model, inputs = _model(name, recompute), _inputs(name)
    ref = _fp32_grads(name)
    after = _grads(model, inputs, amp)
    inside = _grads(model, inputs, amp, inside=True)
    assert set(after) == set(ref)
    total, per_tensor = TOLERANCE[amp]
    err = (sum(float((after[k].float() - ref[k]).square().sum()) for k in ref) /
           sum(float(ref[k].square().sum()) for k in ref)) ** 0.5  # fmt: skip
    assert err < total, f"all gradients: relative error {err:.2e} against fp32"
    scale = max(float(g.abs().max()) for g in ref.values())
    for key, g in ref.items():
        if float(g.abs().max()) > 1e-3 * scale:  # tensors whose gradient is not ~0 (a conv bias before BN)
            assert _rel(after[key], g) < per_tensor, f"{key}: relative error {_rel(after[key], g):.2e}"
        # every node's backward ran under its forward's autocast state: the same numbers either way
        assert _rel(inside[key], after[key]) < 1e-6 or torch.equal(inside[key], after[key]), key


# ------------------------------------------------------------------------------------- the nodes, one by one


def _node_grads(fn, inputs: list[torch.Tensor], params: list, amp: torch.dtype | None, where: str) -> list:
    """Gradients of ``fn(*inputs)`` (inputs, then ``params``) with the forward under autocast in ``amp``
    (``None``: off) and backward() ``where``: ``"after"`` the region, ``"inside"`` it, or inside a ``"bf16"``
    region of its own."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    for p in params:
        p.grad = None
    scale = LOSS_SCALE[amp or torch.float32]
    with torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext():
        loss = fn(*leaves).float().square().mean() * scale
        if where == "inside":
            loss.backward()
    if where == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss.backward()
    elif where == "after":
        loss.backward()
    return [t.grad / scale for t in [*leaves, *params]]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and _rel(x, y) < 1e-6, f"gradient {i}: {_rel(x, y):.2e} apart"


def _assert_near(a: list[torch.Tensor], fp32: list[torch.Tensor], bound: float = 5e-2) -> None:
    for i, (x, y) in enumerate(zip(a, fp32)):
        assert _rel(x, y) < bound, f"gradient {i}: {_rel(x, y):.2e} from fp32"


def _block_case(kind: str) -> tuple:
    """A module, its inputs and parameters exercising one node: the lean MLP (the C++ node
    ``vit3_cpu::lean_mlp`` in fp32, the Python node ``_LeanMlpFn`` under autocast), the CPE (the C++ node
    ``vit3_cpu::cpe``), the lean block's CPE + first norm (the C++ node ``vit3_cpu::cpe_norm``) and a whole
    block; the CPE nodes run the C++ kernel, fp32 outside autocast only (under autocast the convolution
    serves)."""
    torch.manual_seed(0)
    if kind == "lean-mlp":
        mlp, norm = LeanMlp(32, 64), torch.nn.LayerNorm(32)
        return (lambda x: mlp(x, norm=norm)), [torch.randn(2, 5, 32)], [*mlp.parameters(), *norm.parameters()]
    block, x = TTTBlock(32, 2), torch.randn(2, 6, 6, 32)
    if kind == "cpe":
        return block.cpe, [x], list(block.cpe.parameters())
    if kind == "cpe-norm":
        params = [*block.cpe.parameters(), *block.norm1.parameters()]
        return (lambda t: torch.stack(block._cpe_norm(t))), [x], params
    return block, [x], list(block.parameters())


# A whole block in fp32 is left out: plain PyTorch layers (the projections) run their backward under the
# caller's autocast state, by PyTorch's rule.
BLOCK_CASES = [
    *(pytest.param(kind, amp, id=f"{kind}-{tag}") for kind in ("lean-mlp", "block") for amp, tag in
      ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))),
    *(pytest.param(kind, None, id=f"{kind}-fp32") for kind in ("lean-mlp", "cpe", "cpe-norm")),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "amp"), BLOCK_CASES)
def test_block_nodes_backward_under_their_forward_autocast_state(kind, amp):
    """backward() inside the autocast region or after it (an fp32 forward: inside a bf16 region) gives the
    same gradients, in each tensor's dtype, near the fp32 ones."""
    module, inputs, params = _block_case(kind)
    after = _node_grads(module, inputs, params, amp, "after")
    _assert_same(_node_grads(module, inputs, params, amp, "inside" if amp else "bf16"), after)
    if amp is not None:
        _assert_near(after, _node_grads(module, inputs, params, None, "after"))


MIXER_CASES = [
    *(pytest.param(b, r, id=f"{b}-recompute-{r}") for b in ("cpu", "eager") for r in RECOMPUTE),
    # the interpreter takes ~20 s: one case, its backward reruns the Triton forward and differentiates it
    pytest.param("triton", "qkv", id="triton-recompute-qkv", marks=[pytest.mark.triton, pytest.mark.slow]),
]


@pytest.mark.parametrize(("backend", "recompute"), MIXER_CASES)
def test_mixer_nodes_backward_under_their_forward_autocast_state(backend, recompute):
    """The mixer's nodes (``_FusedMix``, ``_SwiGLUTTT``, the Triton op, ``_RecomputedMix``): the same
    gradients with backward() inside or after a bf16 region, near the fp32 ones; the inner loops alone
    (``mix``, fp32) the same with backward() after or inside a bf16 region."""
    torch.manual_seed(0)
    mixer = TTTMixer(32, 2, dict(backend=backend, recompute=recompute))  # head dim 16: Triton's smallest
    x, qkv = torch.randn(2, 35, 32), torch.randn(2, 35, mixer.qkv.out_features)

    def whole(amp: torch.dtype | None, where: str) -> list[torch.Tensor]:
        return _node_grads(lambda t: mixer(t, (5, 7)), [x], list(mixer.parameters()), amp, where)

    bf16 = whole(torch.bfloat16, "after")
    _assert_same(whole(torch.bfloat16, "inside"), bf16)
    _assert_near(bf16, whole(None, "after"))
    inner = list(mixer.inner.parameters())
    mix = _node_grads(lambda t: mixer.mix(t, (5, 7)), [qkv], inner, None, "after")
    _assert_same(_node_grads(lambda t: mixer.mix(t, (5, 7)), [qkv], inner, None, "bf16"), mix)


def test_a_nodes_gradients_come_back_in_its_inputs_dtypes():
    """``autocast_backward`` leaves the gradients' dtypes to the autograd engine, which casts each to its
    input's: a node returning float32 gradients for a bfloat16 input and a float64 weight gives them in those
    dtypes (backward() inside an autocast region and outside it)."""
    from vit3.kernels.common import autocast_backward, autocast_forward

    class Node(torch.autograd.Function):
        @staticmethod
        @autocast_forward
        def forward(ctx, x, w):
            return x.float() * w.float()

        @staticmethod
        @autocast_backward
        def backward(ctx, grad):
            return grad.float(), grad.float().sum(0)

    for inside in (False, True):
        x = torch.randn(4, 3, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(3, dtype=torch.float64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = Node.apply(x, w)
            with contextlib.nullcontext() if inside else torch.autocast("cpu", enabled=False):
                out.sum().backward()
        assert (x.grad.dtype, w.grad.dtype) == (torch.bfloat16, torch.float64)
