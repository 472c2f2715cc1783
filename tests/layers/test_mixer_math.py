"""The whole mixer's forward and backward against the float64 autograd reference across its settings (losses,
steps, mini-batches, lr modes, scales, the TTT wrapper), and the inner math the models share (activations,
LayerNorm backward, the tracing probe). Each inner model's own checks: ``test_inner_models.py``."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import check_mixer

from vit3.layers import (
    INNER_LOSSES,
    MLPInner,
    ResidualNormInner,
    TTTConfig,
    TTTMixer,
    create_inner_model,
    inner_loop,
)
from vit3.layers.inner_math import (
    ACTIVATIONS,
    activation,
    activation_grad,
    layer_norm_backward,
    layer_norm_forward,
    tracing,
    tracing_kind,
)

pytestmark = pytest.mark.usefixtures("float64")


GRID = (5, 7)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_activation_is_its_table_entry_and_its_derivative_autograds(name: str):
    """``activation`` and ``activation_grad`` (one branch per name, for TorchScript) compute what
    ``ACTIVATIONS`` holds; the derivative is autograd's of the activation."""
    z = torch.linspace(-8, 8, 401, requires_grad=True)
    fn, grad = ACTIVATIONS[name]
    torch.testing.assert_close(activation(name, z), fn(z), rtol=0, atol=0)
    torch.testing.assert_close(activation_grad(name, z.detach()), grad(z.detach()), rtol=0, atol=0)
    (expected,) = torch.autograd.grad(activation(name, z).sum(), z)
    torch.testing.assert_close(activation_grad(name, z.detach()), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fn", [activation, activation_grad])
def test_an_unknown_activation_is_refused_naming_every_known_one(fn):
    z = torch.zeros(3)
    with pytest.raises(ValueError, match=r"unknown activation no_such_act; choose from (.*)") as err:
        fn("no_such_act", z)
    assert err.value.args[0].split("choose from ")[1].split(", ") == list(ACTIVATIONS)


def test_the_tracing_probe_names_each_tracer():
    x = torch.zeros(2)
    assert (tracing_kind(), tracing()) == ("", False)
    seen = []

    def record(t: torch.Tensor) -> torch.Tensor:
        seen.append((tracing_kind(), tracing()))
        return t + 1

    torch.jit.trace(record, x, check_trace=False)
    assert seen == [("trace", True)]

    def marked(t: torch.Tensor) -> torch.Tensor:  # dynamo folds the probe: the graph keeps the branch taken
        return t + (1.0 if tracing_kind() == "compile" and tracing() else 0.0)

    torch.testing.assert_close(torch.compile(marked, backend="eager", fullgraph=True)(x), x + 1)


def test_layer_norm_backward_equals_autograd():
    z = torch.randn(3, 4, 9, 16, requires_grad=True)
    weight, bias, dy = torch.randn(16), torch.randn(16), torch.randn(3, 4, 9, 16)
    y, z_hat, rstd = layer_norm_forward(z, weight, bias)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(z, (16,), weight, bias, eps=1e-6))
    (expected,) = torch.autograd.grad((y * dy).sum(), z)
    torch.testing.assert_close(layer_norm_backward(dy, z_hat, rstd, weight), expected, rtol=1e-10, atol=1e-12)


# TTT-Linear / TTT-MLP (Sun et al. 2024) as configs/ablations/ttt_{linear,mlp}.yaml define them
TTT_LINEAR = {
    "branches": ("linear",),
    "inner_norm": "ln",
    "inner_bias": True,
    "loss": "mse",
    "inner_lr": 1.0,
    "lr_mode": "token",
    "grad_norm": False,
    "scale": "1/head_dim",
}
TTT_MLP = {**TTT_LINEAR, "branches": ("mlp",), "mlp_ratio": 4.0, "mlp_act": "gelu_tanh", "inner_lr": 0.1}

MIXER_CASES = {
    "official": {},
    "official-rope": {"rope": True},
    "linear-mse-2steps": {"branches": ("linear",), "loss": "mse", "steps": 2},
    "mlp-rmse-minibatch3": {"branches": ("mlp:2", "dwconv:1"), "loss": "rmse", "mini_batches": 3},
    "swiglu-smoothl1-token-lr": {"loss": "smooth_l1", "lr_mode": "token", "inner_lr": 0.5},
    "silu-mae-nonorm": {"branches": ("silu",), "loss": "mae", "grad_norm": False},
    "dwconv-only-minibatch2": {"branches": ("dwconv",), "mini_batches": 2, "steps": 2, "loss": "mse"},
    "three-branches-headdim-scale": {"branches": ("swiglu:2", "linear:2", "dwconv:1"), "scale": "head_dim"},
    "mlp3-mse-minibatch2-token-lr": {
        "branches": ("mlp3",),
        "loss": "mse",
        "mini_batches": 2,
        "lr_mode": "token",
    },
    "conv-dot": {"branches": ("conv",)},
    "conv-smoothl1-minibatch3-token-lr-2steps": {
        "branches": ("conv", "dwconv:1"),
        "loss": "smooth_l1",
        "mini_batches": 3,
        "lr_mode": "token",
        "steps": 2,
    },
    "swiglu_out-rmse-2steps-r2": {"branches": ("swiglu_out",), "loss": "rmse", "steps": 2, "mlp_ratio": 2.0},
    "linear-bias-mae-dwconv": {"branches": ("linear:2", "dwconv:1"), "inner_bias": True, "loss": "mae"},
    "ttt-linear": {**TTT_LINEAR},
    "ttt-linear-minibatch3-2steps": {**TTT_LINEAR, "mini_batches": 3, "steps": 2},
    "ttt-mlp-minibatch2": {**TTT_MLP, "mini_batches": 2},
    # the wrapper on the official SwiGLU branch (the dwconv branch stays plain): the fused paths step aside
    "official-ln": {"inner_norm": "ln"},
    "official-ln-rope": {"inner_norm": "ln", "rope": True},
}


@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_mixer_equals_autograd_reference(case: str):
    check_mixer(TTTMixer(32, 4, **MIXER_CASES[case]), GRID)


def test_forced_kernel_steps_aside_for_the_ttt_wrapper():
    """The Triton kernel fuses the bare linear model (head dim 16 here, which it takes): with the LayerNorm
    wrapper and biases it must leave the branch to the generic path, and say why."""
    mixer = TTTMixer(32, 2, **{**TTT_LINEAR, "lr_mode": "fixed", "backend": "triton"})
    x = torch.randn(1, GRID[0] * GRID[1], 32, dtype=torch.float64)
    (branch,) = mixer.double().explain(x, GRID).branches
    assert branch.backend == "generic"
    assert "inner_norm" in dict(branch.passed_over)["triton"]
    with pytest.warns(UserWarning, match="inner_norm / inner_bias"):
        check_mixer(mixer, GRID)


class _IdentityNorm(ResidualNormInner):
    """``x + g(x)``: the TTT wrapper with its LayerNorm replaced by the identity map."""

    def norm(self, z):
        return z, {}

    def norm_backward(self, dy, cache):
        return dy


@pytest.mark.parametrize("loss", INNER_LOSSES)
@pytest.mark.parametrize("name", ["linear", "mlp"])
def test_ttt_wrapper_with_identity_norm_reduces_to_the_plain_model(name: str, loss: str):
    """f(x) = x + LN(g(x)) with LN := identity is g with the residual made explicit, f(x) = x + g(x):

    - its inner loop on (k, v) equals the plain g trained on (k, v - k) for the residual losses (l depends on
      v_hat - v only: l(x + g(x), v) = l(g(x), v - x)) and on (k, v) for the dot loss (the residual adds the
      weight-free term -<k, v>); its read-out is q + g'(q);
    - for the MLP it is exactly the plain ``mlp`` with ``mlp_residual="add"`` (SiLU(xW1)W2 + x) on (k, v).
    """
    grid, n = (5, 7), 35
    cfg = TTTConfig(branches=(name,), inner_bias=True, mlp_act="silu")
    torch.manual_seed(3)
    plain = create_inner_model(name, heads=2, head_dim=8, cfg=cfg).double()
    wrapped = _IdentityNorm(plain)
    q, k, v = (torch.randn(2, 2, n, 8) for _ in range(3))
    p0 = {key: val * 25 + 0.3 * torch.randn_like(val) for key, val in plain.initial_params().items()}
    kw = dict(loss=loss, scale=0.4, lr=0.6, steps=2, mini_batches=2, grad_norm=True)
    got = inner_loop(wrapped, p0, k, v, grid, **kw)
    target = v if loss == "dot" else v - k
    want = inner_loop(plain, p0, k, target, grid, **kw)
    for key in p0:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-10, msg=key)
    out = wrapped.apply_to(got, q, grid)
    torch.testing.assert_close(out, q + plain.apply_to(want, q, grid), rtol=1e-10, atol=1e-10)
    if name == "mlp":
        residual = MLPInner(2, 8, act="silu", residual="add", bias=True).double()
        explicit = inner_loop(residual, p0, k, v, grid, **kw)
        for key in p0:
            torch.testing.assert_close(got[key], explicit[key], rtol=1e-10, atol=1e-10, msg=key)
        torch.testing.assert_close(out, residual.apply_to(explicit, q, grid), rtol=1e-10, atol=1e-10)
