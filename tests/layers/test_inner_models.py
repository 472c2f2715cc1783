"""Every registered inner model through each check a model gets, a model added later included: its
closed-form gradients against autograd of its forward, a mixer with it as a branch against the float64
reference (``helpers.reference``: written out there, or standing in for itself), scripting; registering one;
the reference's own guards. Its row in docs/mixer.md and the guide's example: ``tests/test_docs.py``."""

from __future__ import annotations

import pytest
import timm
import torch
from helpers.common import default_dtype
from helpers.reference import (
    REFERENCE_ACTIVATIONS,
    WRITTEN_HERE,
    check_mixer,
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
    TTTConfig,
    TTTMixer,
    create_inner_model,
    inner_loop,
    loss_grad,
    loss_value,
    register_inner_model,
)
from vit3.layers.config import BIAS_MODELS, GRID_MODELS
from vit3.layers.inner_math import ACTIVATIONS

pytestmark = pytest.mark.usefixtures("float64")


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


@pytest.mark.parametrize("name", list(INNER_MODELS))
def test_every_registered_inner_model_in_a_mixer_equals_autograd_reference(name: str):
    """Each registered inner model as a branch of a whole mixer (beside a depthwise-conv branch, token lr
    gates, two steps of two mini-batches, the MSE loss, RoPE where it applies): the mixer's output equals the
    reference's (each model's forward written out in ``helpers.reference``, a model added to the registry
    standing in for itself), with no row of its own here."""
    branches = ("dwconv",) if name == "dwconv" else (f"{name}:2", "dwconv:1")
    cfg = dict(branches=branches, loss="mse", steps=2, mini_batches=2, lr_mode="token", rope=True)
    check_mixer(TTTMixer(32, 4, **cfg), GRID)


@pytest.mark.usefixtures("one_thread")
def test_a_mixer_built_scriptable_scripts_every_inner_model_and_setting():
    """Every registered inner model (FC chains with biases and the LayerNorm wrapper, grid models), RoPE,
    token lr gates, several steps and mini-batches and a residual loss: scripted, as eager and as the generic
    backend of a mixer built as usual. Under the float32 default, as users build it: a tensor ``.double()``
    misses or one made without a dtype would show."""
    with default_dtype(torch.float32):
        torch.manual_seed(0)
        branches = ("swiglu", "dwconv:1", *(f"{m}:1" for m in INNER_MODELS if m not in ("swiglu", "dwconv")))
        cfg = dict(
            branches=branches, inner_norm="ln", inner_bias=True, lr_mode="token", steps=2, mini_batches=3
        )
        cfg.update(loss="mse", rope=True, backend="generic")
        with timm.layers.set_scriptable(True):
            mixer = TTTMixer(32, 2, cfg).double()
        usual = TTTMixer(32, 2, cfg).double()
        usual.load_state_dict(mixer.state_dict())
        x = torch.randn(2, 20, 32, dtype=torch.float64)
        with torch.jit.optimized_execution(False):
            got = torch.jit.script(mixer)(x, (4, 5))
        torch.testing.assert_close(got, mixer(x, (4, 5)), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, usual(x, (4, 5)), rtol=1e-12, atol=1e-12)


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
        check_mixer(mixer, GRID)
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
