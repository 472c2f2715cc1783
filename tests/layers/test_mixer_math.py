"""The mixer's closed-form inner gradients and whole forward/backward against float64 autograd references."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import (
    REFERENCE_ACTIVATIONS,
    WRITTEN_HERE,
    assert_mixer_matches_reference,
    reference_forward,
    reference_inner_loop,
    reference_params,
    stand_in,
)
from torch import nn

from vit3.layers import (
    INNER_LOSSES,
    INNER_MODELS,
    InnerModel,
    MLPInner,
    ResidualNormInner,
    TTTConfig,
    TTTMixer,
    create_inner_model,
    inner_loop,
    loss_grad,
    loss_value,
    register_inner_model,
)
from vit3.layers.config import BIAS_MODELS, GRID_MODELS
from vit3.layers.inner_math import (
    ACTIVATIONS,
    activation,
    activation_grad,
    layer_norm_backward,
    layer_norm_forward,
    tracing,
    tracing_kind,
)


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# Rows with options. Every registered inner model also gets a row with its defaults (``MODELS``): a new one is
# held to autograd of its own forward (``helpers.reference.stand_in``) without a line here.
VARIANTS = {
    "linear": {},
    "linear-bias": {"inner_bias": True},
    "silu": {},
    "silu-bias": {"inner_bias": True},
    "swiglu": {},
    "swiglu_out": {},
    "swiglu_out-r2": {"mlp_ratio": 2.0},
    "swiglu_out-identity-init": {"mlp_identity_init": True},
    "mlp-gelu-r2": {"mlp_ratio": 2.0, "mlp_act": "gelu"},
    "mlp-gelu_tanh-r4-bias": {"mlp_ratio": 4.0, "mlp_act": "gelu_tanh", "inner_bias": True},
    "mlp-silu-add": {"mlp_act": "silu", "mlp_residual": "add"},
    "mlp-silu-identity": {"mlp_act": "silu", "mlp_residual": "identity"},
    "mlp-identity-init": {"mlp_act": "silu", "mlp_identity_init": True},
    "mlp3-silu": {"mlp_act": "silu"},
    "mlp3-gelu-r2-bias": {"mlp_ratio": 2.0, "inner_bias": True},
    "mlp3-silu-identity": {"mlp_act": "silu", "mlp_residual": "identity"},
    "mlp3-add-identity-init": {"mlp_residual": "add", "mlp_identity_init": True},
    "conv": {},
    "dwconv": {},
    # x + LN(g(x)): TTT-Linear, TTT-MLP and the wrapper around other token-wise models
    "linear-ln-bias": {"inner_norm": "ln", "inner_bias": True},
    "mlp-ln-bias-r4-gelu_tanh": {
        "inner_norm": "ln",
        "inner_bias": True,
        "mlp_ratio": 4.0,
        "mlp_act": "gelu_tanh",
    },
    "mlp3-ln-silu": {"inner_norm": "ln", "mlp_act": "silu"},
    "swiglu-ln": {"inner_norm": "ln"},
    "swiglu_out-ln": {"inner_norm": "ln"},
}
MODELS = {name: {} for name in INNER_MODELS} | VARIANTS
GRID = (5, 7)


def _model(model_id: str):
    name = model_id.split("-")[0]
    cfg = TTTConfig.create(branches=(name,), **MODELS[model_id])
    torch.manual_seed(1)
    model = create_inner_model(name, heads=3, head_dim=8, cfg=cfg).double()
    with torch.no_grad():  # biases and LayerNorm affine start at 0 / 1: move them so every term is exercised
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.5 * torch.randn_like(p))
    return name, cfg, model


def _perturbed(model) -> dict[str, torch.Tensor]:
    # Initial weights are tiny (std 0.02); scale them up so every nonlinearity is exercised.
    return {k: (p * 25).detach() for k, p in model.initial_params().items()}


@pytest.mark.parametrize("loss", INNER_LOSSES)
@pytest.mark.parametrize("model_id", list(MODELS))
def test_closed_form_inner_gradient_equals_autograd(model_id: str, loss: str):
    name, cfg, model = _model(model_id)
    b, n = 2, GRID[0] * GRID[1]
    k = torch.randn(b, 3, n, 8)
    v = torch.randn(b, 3, n, 8)
    p = {
        key: val.expand(b, *val.shape[1:]).clone().requires_grad_(True)
        for key, val in _perturbed(model).items()
    }
    _, norm = reference_params(name, model)

    pred = reference_forward(name, p, k, GRID, cfg, norm, stand_in(name, model))
    total = loss_value(loss, pred, v).sum() * (0.37 / n)
    expected = torch.autograd.grad(total, list(p.values()))

    v_hat, cache = model.forward_train(p, k, GRID, need_output=True)
    torch.testing.assert_close(v_hat, pred, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.apply_to(p, k, GRID), pred, rtol=1e-12, atol=1e-12)
    e = loss_grad(loss, v_hat, v) * (0.37 / n)
    got = model.grads(p, k, e, cache, GRID)
    assert list(got) == list(p)
    for (key, g_ref), key2 in zip(zip(p, expected), got):
        assert key == key2
        torch.testing.assert_close(got[key], g_ref, rtol=1e-10, atol=1e-12, msg=f"{model_id}/{loss}/{key}")
    if loss == "dot":  # the dot loss needs no prediction: the cache of need_output=False must serve too
        _, lean = model.forward_train(p, k, GRID, need_output=False)
        for key, g in model.grads(p, k, e, lean, GRID).items():
            torch.testing.assert_close(g, got[key], rtol=1e-12, atol=1e-14)


class _GateInner(InnerModel):
    """``v_hat = k ⊙ w``, one weight per channel: an inner model written here, as a user would add one."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        self.w = nn.Parameter(torch.ones(1, heads, 1, head_dim))

    def initial_params(self):
        return {"w": self.w}

    def forward_train(self, p, k, grid, need_output):
        return (k * p["w"] if need_output else None), {}

    def grads(self, p, k, e, cache, grid):
        return {"w": (k * e).sum(-2, keepdim=True)}

    def apply_to(self, p, q, grid):
        return q * p["w"]

    def norm_dims(self, name):
        return [-1]  # a per-channel vector: its gradient normalised over the channels


def test_a_new_inner_model_is_one_registered_class(registry):
    register_inner_model("gate")(_GateInner)
    assert "gate" in INNER_MODELS and "gate" not in GRID_MODELS and "gate" not in BIAS_MODELS
    mixer = TTTMixer(32, 4, branches=("gate", "dwconv:1"), loss="mse").double()
    assert isinstance(mixer.inner[0], _GateInner)
    x = torch.randn(2, GRID[0] * GRID[1], 32, requires_grad=True)
    mixer(x, GRID).square().sum().backward()
    assert mixer.inner[0].w.grad.abs().sum() > 0 and x.grad.isfinite().all()
    for norm in ("none", "ln"):  # the reference asks the model for its forward and norm_dims, bare or wrapped
        mixer = TTTMixer(32, 4, branches=("gate", "dwconv:1"), loss="mse", inner_norm=norm).double()
        _check_mixer(mixer)
    p = {"w": torch.randn(2, 3, 1, 8, requires_grad=True)}
    k, v = torch.randn(2, 3, 35, 8), torch.randn(2, 3, 35, 8)
    got = inner_loop(_GateInner(3, 8), {"w": p["w"].detach()}, k, v, GRID, loss="mse", grad_norm=False)
    (grad,) = torch.autograd.grad(loss_value("mse", k * p["w"], v).sum() * (9**-0.5 / 35), [p["w"]])
    torch.testing.assert_close(got["w"], p["w"] - grad, rtol=1e-12, atol=1e-12)


def test_an_inner_model_name_is_registered_once(registry):
    with pytest.raises(ValueError, match="'swiglu' is registered already"):
        register_inner_model("swiglu")(_GateInner)
    for name in ("gated-linear", "gate:2", ""):
        with pytest.raises(ValueError, match="letters, digits and '_'"):
            register_inner_model(name)
    with pytest.raises(ValueError, match="unknown inner model 'gate'"):
        TTTConfig(branches=("gate",))


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
    _check_mixer(TTTMixer(32, 4, **MIXER_CASES[case]))


@pytest.mark.parametrize("name", list(INNER_MODELS))
def test_every_registered_inner_model_in_a_mixer_equals_autograd_reference(name: str):
    """Each registered inner model as a branch of a whole mixer (beside a depthwise-conv branch, token lr
    gates, two steps of two mini-batches, the MSE loss, RoPE where it applies): the mixer's output equals the
    reference's (each model's forward written out in ``helpers.reference``, a model added to the registry
    standing in for itself), with no row of its own here."""
    branches = ("dwconv",) if name == "dwconv" else (f"{name}:2", "dwconv:1")
    cfg = dict(branches=branches, loss="mse", steps=2, mini_batches=2, lr_mode="token", rope=True)
    _check_mixer(TTTMixer(32, 4, **cfg))


def test_forced_kernel_steps_aside_for_the_ttt_wrapper():
    """The Triton kernel fuses the bare linear model (head dim 16 here, which it takes): with the LayerNorm
    wrapper and biases it must leave the branch to the generic path, and say why."""
    mixer = TTTMixer(32, 2, **{**TTT_LINEAR, "lr_mode": "fixed", "backend": "triton"})
    x = torch.randn(1, GRID[0] * GRID[1], 32, dtype=torch.float64)
    (branch,) = mixer.double().explain(x, GRID).branches
    assert branch.backend == "generic"
    assert "inner_norm" in dict(branch.passed_over)["triton"]
    with pytest.warns(UserWarning, match="inner_norm / inner_bias"):
        _check_mixer(mixer)


def _check_mixer(mixer: TTTMixer) -> None:
    torch.manual_seed(2)
    mixer = mixer.double()
    with torch.no_grad():  # larger initial inner weights so the step is not negligible
        for model in mixer.inner:
            for p in model.parameters():
                p.mul_(20)
                if p.ndim == 1:  # biases and LayerNorm affine start at 0 / 1
                    p.add_(0.5 * torch.randn_like(p))
    x = torch.randn(2, GRID[0] * GRID[1], 32, requires_grad=True)
    assert_mixer_matches_reference(mixer, x, GRID)


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


class _Refuses:
    """A model under test that answers nothing."""

    def __getattr__(self, attr: str):
        raise AssertionError(f"the reference asked the model under test for {attr!r}")


@pytest.mark.parametrize("name", list(WRITTEN_HERE))
def test_the_reference_writes_out_each_model_it_names_without_the_models_code(name: str):
    """The models ``helpers.reference`` writes out never consult the model under test: its forward, layouts
    and inner loop stay the reference's own even when a stand-in is handed in."""
    _, cfg, model = _model(name)
    assert stand_in(name, model) is None
    p0, norm = reference_params(name, model)
    k, v = torch.randn(2, 3, GRID[0] * GRID[1], 8), torch.randn(2, 3, GRID[0] * GRID[1], 8)
    params = reference_inner_loop(name, p0, k, v, GRID, cfg, 0.3, None, norm, _Refuses())
    assert reference_forward(name, params, k, GRID, cfg, norm, _Refuses()).isfinite().all()


def test_the_reference_writes_out_every_activation():
    assert set(REFERENCE_ACTIVATIONS) == set(ACTIVATIONS)
