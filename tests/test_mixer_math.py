"""The mixer's closed-form inner gradients and whole forward/backward against float64 autograd references."""

from __future__ import annotations

import pytest
import torch

from tests.ttt_reference import assert_mixer_matches_reference, reference_forward
from vit3.layers import (
    INNER_LOSSES,
    TTTConfig,
    TTTMixer,
    create_inner_model,
    inner_loop,
    loss_grad,
    loss_value,
)


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


MODELS = {
    "linear": {},
    "silu": {},
    "swiglu": {},
    "mlp-gelu-r2": {"mlp_ratio": 2.0, "mlp_act": "gelu"},
    "mlp-silu-add": {"mlp_act": "silu", "mlp_residual": "add"},
    "mlp-silu-identity": {"mlp_act": "silu", "mlp_residual": "identity"},
    "mlp-identity-init": {"mlp_act": "silu", "mlp_identity_init": True},
    "dwconv": {},
}
GRID = (5, 7)


def _model(model_id: str):
    name = model_id.split("-")[0]
    cfg = TTTConfig.create(**MODELS[model_id])
    torch.manual_seed(1)
    model = create_inner_model(name, heads=3, head_dim=8, cfg=cfg).double()
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

    pred = reference_forward(name, p, k, GRID, cfg)
    total = loss_value(loss, pred, v).sum() * (0.37 / n)
    expected = torch.autograd.grad(total, list(p.values()))

    v_hat, cache = model.forward_train(p, k, GRID, need_output=True)
    torch.testing.assert_close(v_hat, pred, rtol=1e-12, atol=1e-12)
    e = loss_grad(loss, v_hat, v) * (0.37 / n)
    got = model.grads(p, k, e, cache, GRID)
    for (key, g_ref), key2 in zip(zip(p, expected), got):
        assert key == key2
        torch.testing.assert_close(got[key], g_ref, rtol=1e-10, atol=1e-12, msg=f"{model_id}/{loss}/{key}")


MIXER_CASES = {
    "official": {},
    "official-rope": {"rope": True},
    "linear-mse-2steps": {"branches": ("linear",), "loss": "mse", "steps": 2},
    "mlp-rmse-minibatch3": {"branches": ("mlp:2", "dwconv:1"), "loss": "rmse", "mini_batches": 3},
    "swiglu-smoothl1-token-lr": {"loss": "smooth_l1", "lr_mode": "token", "inner_lr": 0.5},
    "silu-mae-nonorm": {"branches": ("silu",), "loss": "mae", "grad_norm": False},
    "dwconv-only-minibatch2": {"branches": ("dwconv",), "mini_batches": 2, "steps": 2, "loss": "mse"},
    "three-branches-headdim-scale": {"branches": ("swiglu:2", "linear:2", "dwconv:1"), "scale": "head_dim"},
}


@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_mixer_equals_autograd_reference(case: str):
    torch.manual_seed(2)
    mixer = TTTMixer(32, 4, **MIXER_CASES[case]).double()
    with torch.no_grad():  # larger initial inner weights so the step is not negligible
        for model in mixer.inner:
            for p in model.parameters():
                p.mul_(20)
    x = torch.randn(2, GRID[0] * GRID[1], 32, requires_grad=True)
    assert_mixer_matches_reference(mixer, x, GRID)


@pytest.mark.parametrize("grid", [(1, 13), (5, 11), (7, 9), (3, 1)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_linear_dot_one_step_is_noncausal_linear_attention(grid):
    h, w = grid
    n = h * w
    model = create_inner_model("linear", heads=2, head_dim=6, cfg=TTTConfig()).double()

    q, k, v = (torch.randn(3, 2, n, 6) for _ in range(3))
    w0 = model.w
    params = inner_loop(model, {"w": w0}, k, v, grid, loss="dot", scale=0.3, lr=0.7, grad_norm=False)
    out = model.apply_to(params, q, grid)
    direct = q @ w0 + (0.7 * 0.3 / n) * (q @ k.transpose(-2, -1)) @ v  # non-causal linear attention
    torch.testing.assert_close(out, direct, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "tile_bytes", [10**9, 10**4, 1000], ids=["folded-one-tile", "folded-tiles", "strided-tiles"]
)
@pytest.mark.parametrize("grad_norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("shared_weights", [True, False], ids=["shared-w", "per-sample-w"])
@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["tiles", "cpu-kernel"])
def test_fused_swiglu_path_equals_generic_inner_loop(
    monkeypatch, tile_bytes, grad_norm, shared_weights, cpu_kernel
):
    """The hand-fused SwiGLU path (custom backward; tiled PyTorch or the C++ CPU kernel, whose blocks follow
    the same tile size) against the generic closed-form path + autograd."""
    import vit3.layers.fast_swiglu as fast

    monkeypatch.setattr(fast, "TILE_BYTES", tile_bytes)
    monkeypatch.setattr(fast, "MIN_TILE_TOKENS", 4)
    b, h, grid, d = 3, 2, (5, 7), 8
    n = grid[0] * grid[1]
    model = create_inner_model("swiglu", heads=h, head_dim=d, cfg=TTTConfig())
    qkv = torch.randn(b, n, 3 * h * d, requires_grad=True)
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in qkv.split(h * d, dim=-1))  # strided views
    w1, w2 = (torch.randn(1 if shared_weights else b, h, d, d, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, h, n, d)

    out = fast.swiglu_ttt(q, k, v, w1, w2, scale=0.4, lr=0.8, grad_norm=grad_norm, cpu_kernel=cpu_kernel)
    params = inner_loop(model, {"w1": w1, "w2": w2}, k, v, grid, scale=0.4, lr=0.8, grad_norm=grad_norm)
    ref = model.apply_to(params, q, grid)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((out * dout).sum(), [qkv, w1, w2])
    want = torch.autograd.grad((ref * dout).sum(), [qkv, w1, w2])
    for name, g, g_ref in zip(["qkv", "w1", "w2"], got, want):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")
