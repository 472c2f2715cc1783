"""The linear op (``vit3.kernels.linear``, non-causal linear attention): its reference against float64 finite
differences and the closed forms it must reduce to (linear attention for the dot loss, the DeltaNet update for
MSE); every fast path — the Triton kernels (``TRITON_INTERPRET=1`` on CPU) and the generic inner loop —
forward and every gradient (q, k, v, w) against the reference."""

from __future__ import annotations

import pytest
import torch
from helpers.ops import assert_matches_reference

from vit3.kernels.linear.reference import linear_ttt_ref
from vit3.layers import TTTConfig, create_inner_model, inner_loop

H = 2


def _inputs(b: int, n: int, d: int, *, shared: bool = True, gain: float = 1.0):
    """A float64 qkv tensor, q, k, v as its strided views ``[B, H, N, d]``, and an initial weight."""
    qkv = torch.randn(b, n, 3 * H * d, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.unflatten(-1, (H, d)).transpose(1, 2) for t in qkv.split(H * d, dim=-1))
    w = (gain * torch.randn(1 if shared else b, H, d, d, dtype=torch.float64)).requires_grad_()
    return qkv, q, k, v, w


def _generic(q, k, v, w, *, scale, lr, grad_norm, loss):
    model = create_inner_model("linear", heads=q.shape[1], head_dim=q.shape[-1], cfg=TTTConfig(loss=loss))
    grid = (1, q.shape[2])
    params = inner_loop(model, {"w": w}, k, v, grid, loss=loss, scale=scale, lr=lr, grad_norm=grad_norm)
    return model.apply_to(params, q, grid)


def _triton(q, k, v, w, *, scale, lr, grad_norm, loss):
    from vit3.kernels import triton_ttt  # imports Triton

    return triton_ttt(
        "linear", q, k, v, {"w": w}, scale=scale, lr=lr, grad_norm=grad_norm, loss=loss, backend="triton"
    )


PATHS = {"triton": _triton, "generic": _generic}
SETTINGS = {
    "dot-norm": {"scale": 1 / 3, "lr": 1.0, "grad_norm": True, "loss": "dot"},
    "dot-no-norm": {"scale": 0.4, "lr": 0.7, "grad_norm": False, "loss": "dot"},
    "mse-norm": {"scale": 1 / 3, "lr": 1.0, "grad_norm": True, "loss": "mse"},
    "mse-no-norm": {"scale": 0.4, "lr": 0.7, "grad_norm": False, "loss": "mse"},
}


# --------------------------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("setting", ["dot-norm", "mse-no-norm", "mse-norm"])
def test_reference_gradients_equal_finite_differences(setting):
    _, q, k, v, w = _inputs(2, 5, 3)
    inputs = tuple(t.detach().clone().requires_grad_() for t in (q, k, v, w))
    hyper = SETTINGS[setting]
    assert torch.autograd.gradcheck(lambda *xs: linear_ttt_ref(*xs, **hyper), inputs, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("path", ["reference", "generic"])
@pytest.mark.parametrize("grid", [(1, 13), (5, 11), (7, 9), (3, 1)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_linear_dot_one_step_is_noncausal_linear_attention(grid, path):
    n = grid[0] * grid[1]
    q, k, v = (torch.randn(3, 2, n, 6, dtype=torch.float64) for _ in range(3))
    w0 = 0.02 * torch.randn(1, 2, 6, 6, dtype=torch.float64)
    fn = linear_ttt_ref if path == "reference" else _generic
    out = fn(q, k, v, w0, scale=0.3, lr=0.7, grad_norm=False, loss="dot")
    direct = q @ w0 + (0.7 * 0.3 / n) * (q @ k.transpose(-2, -1)) @ v  # non-causal linear attention
    torch.testing.assert_close(out, direct, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("path", ["reference", "generic"])
@pytest.mark.parametrize("grid", [(1, 13), (5, 7)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_linear_mse_one_step_is_the_deltanet_update(grid, path):
    """With l = ½‖kW - v‖² per token (losses.py) and loss (s/N) Σ_n l_n, one full-batch step without gradient
    normalisation is W' = W - η (s/N) kᵀ(kW - v) = W + η (s/N) kᵀ(v - kW): the constant is exactly η s / N
    (the ½ cancels the square's 2)."""
    n = grid[0] * grid[1]
    q, k, v = (torch.randn(3, 2, n, 6, dtype=torch.float64) for _ in range(3))
    w0 = 0.6 * torch.randn(1, 2, 6, 6, dtype=torch.float64)  # predicts something: kW - v is not just -v
    eta, s = 0.7, 0.3
    fn = linear_ttt_ref if path == "reference" else _generic
    out = fn(q, k, v, w0, scale=s, lr=eta, grad_norm=False, loss="mse")
    w_delta = w0 + (eta * s / n) * k.transpose(-2, -1) @ (v - k @ w0)
    torch.testing.assert_close(out, q @ w_delta, rtol=1e-10, atol=1e-10)


def test_reference_rejects_other_losses_by_name():
    _, q, k, v, w = _inputs(1, 4, 3)
    with pytest.raises(ValueError, match="'dot' and 'mse' losses, got 'mae'"):
        linear_ttt_ref(q, k, v, w, scale=1.0, lr=1.0, grad_norm=True, loss="mae")


# ------------------------------------------------------------------------------- every fast path vs reference

CASES = [
    pytest.param(path, setting, shared, id=f"{path}-{setting}-{'shared' if shared else 'per-sample'}-w")
    for path in PATHS
    for setting in SETTINGS
    for shared in (True, False)
    if shared or path != "triton"  # the Triton op takes shared initial weights
]


@pytest.mark.parametrize(("path", "setting", "shared"), CASES)
def test_fast_path_output_and_every_gradient_match_reference(path, setting, shared):
    """float64, q, k, v strided views of one qkv tensor; gradients of q, k, v and w."""
    qkv, q, k, v, w = _inputs(2, 35, 16, shared=shared, gain=0.3)
    hyper = SETTINGS[setting]
    out = PATHS[path](q, k, v, w, **hyper)
    assert_matches_reference(out, linear_ttt_ref(q, k, v, w, **hyper), qkv, {"w": w})
