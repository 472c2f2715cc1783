"""The mixer on awkward shapes, low precision, RoPE tables, the implementation switch and bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.reference import reference_mixer

from vit3.layers import TTTConfig, TTTMixer, apply_rope_2d, rope
from vit3.layers.backends import BACKEND_ENV

SHAPES = [
    pytest.param(2, 8, 2, (1, 13), id="grid1x13"),
    pytest.param(2, 8, 2, (13, 1), id="grid13x1"),
    pytest.param(2, 16, 4, (5, 11), id="grid5x11"),
    pytest.param(1, 16, 4, (7, 9), id="batch1-grid7x9"),
    pytest.param(3, 8, 1, (3, 3), id="one-head-odd-N"),
    pytest.param(1, 8, 2, (1, 1), id="single-token"),
]


@pytest.mark.parametrize(("b", "dim", "heads", "grid"), SHAPES)
@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
def test_awkward_shapes_match_reference(b, dim, heads, grid, rope):
    mixer = TTTMixer(dim, heads, rope=rope).double()
    n = grid[0] * grid[1]
    x = torch.randn(b, n, dim, dtype=torch.float64, requires_grad=True)
    out = mixer(x, grid)
    assert out.shape == (b, n, dim)
    ref = reference_mixer(mixer, x, grid)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    g, g_ref = (torch.autograd.grad(o.sum(), x)[0] for o in (out, ref))
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_runs_inner_loop_in_float32(dtype):
    torch.manual_seed(0)
    mixer = TTTMixer(32, 4)
    ref_mixer = TTTMixer(32, 4).double()
    ref_mixer.load_state_dict(mixer.state_dict())
    x = torch.randn(2, 35, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        out = mixer(x, (5, 7))
    assert out.dtype == dtype
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in mixer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    ref = ref_mixer(x.detach().double(), (5, 7))
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 3e-2, f"relative error {rel:.2e} against float64"


def test_low_precision_inputs_give_low_precision_output():
    mixer = TTTMixer(16, 2).to(torch.bfloat16)
    x = torch.randn(1, 12, 16, dtype=torch.bfloat16)
    out = mixer(x, (3, 4))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("grid", [(6, 8), (5, 3), (1, 7)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_rope_equals_official_tables(grid):
    h, w = grid
    dim = 16
    # Official construction: RoPE(shape=(h, w, dim)) tables, complex multiply on channel pairs.
    k_max = dim // 4
    theta = 1 / (10000 ** (torch.arange(k_max, dtype=torch.float64) / k_max))
    coords = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    angles = torch.cat([c.unsqueeze(-1).double() * theta for c in coords], dim=-1)  # [h, w, dim/2]
    rot = torch.polar(torch.ones_like(angles), angles)
    x = torch.randn(2, h, w, dim, dtype=torch.float64)
    expected = torch.view_as_real(rot * torch.view_as_complex(x.reshape(2, h, w, -1, 2))).flatten(-2)
    got = apply_rope_2d(x.reshape(2, h * w, dim), grid)
    torch.testing.assert_close(got, expected.reshape(2, h * w, dim), rtol=1e-12, atol=1e-12)


def test_rope_tables_are_made_once_per_key_in_eager_mode(monkeypatch):
    """Eager calls share one (cos, sin) per grid, size, base, device and dtype, equal to freshly made tables;
    another key makes its own; traced calls (``torch.jit.trace``) make theirs, not the cache's."""
    made = []
    real = rope._grid_angles
    monkeypatch.setattr(rope, "_grid_angles", lambda *a: made.append(a) or real(*a))
    monkeypatch.setattr(rope, "_TABLES", {})
    first = rope.rope_tables((3, 4), 16, 10000.0, torch.device("cpu"), torch.float32)
    again = rope.rope_tables((3, 4), 16, 10000.0, "cpu", torch.float32)
    assert len(made) == 1 and all(a is b for a, b in zip(first, again))
    angles = real((3, 4), 16, 10000.0, torch.device("cpu"), torch.float32)
    assert torch.equal(first[0], angles.cos()) and torch.equal(first[1], angles.sin())
    rope.rope_tables((3, 4), 16, 10000.0, "cpu", torch.float64)
    rope.rope_tables((4, 3), 16, 10000.0, "cpu", torch.float32)
    assert len(made) == 3
    torch.jit.trace(lambda x: rope.apply_rope_2d(x, (3, 4)), torch.randn(1, 12, 16))
    assert len(made) > 3 and len(rope._TABLES) == 3  # made while tracing (its sizes are traced), not kept


def test_the_interleaved_rope_table_is_the_tables_bits_made_once_per_key(monkeypatch):
    """``rope_cos_sin``: each channel pair's cos and sin side by side (what the Triton kernels read), the bits
    of ``rope_tables``; one tensor per key, kept."""
    monkeypatch.setattr(rope, "_COS_SIN", {})
    table = rope.rope_cos_sin((3, 4), 16, 10000.0, torch.device("cpu"), torch.float32)
    cos, sin = rope.rope_tables((3, 4), 16, 10000.0, torch.device("cpu"), torch.float32)
    assert table.shape == (12, 8, 2) and table.is_contiguous()
    assert torch.equal(table[..., 0], cos.reshape(12, 8)) and torch.equal(table[..., 1], sin.reshape(12, 8))
    assert rope.rope_cos_sin((3, 4), 16, 10000.0, "cpu", torch.float32) is table
    assert rope.rope_cos_sin((3, 4), 16, 10000.0, "cpu", torch.float64) is not table


def test_rope_tables_made_under_inference_mode_serve_training(monkeypatch):
    """Tables first made under ``inference_mode`` are normal tensors: a later training call saves them."""
    monkeypatch.setattr(rope, "_TABLES", {})
    x = torch.randn(2, 12, 16, requires_grad=True)
    with torch.inference_mode():
        rope.apply_rope_2d(x.detach(), (3, 4))
    rope.apply_rope_2d(x, (3, 4)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


class TestBackendSwitch:
    def test_config_wins_over_environment(self, monkeypatch):
        monkeypatch.setenv(BACKEND_ENV, "generic")
        x = torch.randn(2, 12, 16)
        assert [b.backend for b in TTTMixer(16, 2).explain(x, (3, 4)).branches] == ["generic", "generic"]
        named = TTTMixer(16, 2, backend="eager").explain(x, (3, 4))
        assert [b.backend for b in named.branches] == ["eager", "eager"]
        assert named.requested == "TTTConfig.backend='eager'"

    def test_forced_kernel_on_unsupported_config_falls_back_with_a_message(self):
        torch.manual_seed(0)
        fast = TTTMixer(16, 2, loss="mse", steps=2, backend="triton")
        ref = TTTMixer(16, 2, loss="mse", steps=2, backend="generic")
        ref.load_state_dict(fast.state_dict())
        x = torch.randn(2, 12, 16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fast(x, (3, 4))
        assert any("backend 'triton'" in str(w.message) and "cannot serve" in str(w.message) for w in caught)
        torch.testing.assert_close(out, ref(x, (3, 4)))


class TestBadInput:
    def test_dim_not_divisible_by_heads(self):
        with pytest.raises(ValueError, match="divisible by num_heads"):
            TTTMixer(30, 4)

    def test_grid_does_not_fit_tokens(self):
        with pytest.raises(ValueError, match=r"grid 4x4 = 16 tokens does not fit N=12"):
            TTTMixer(16, 2)(torch.randn(1, 12, 16), (4, 4))

    @pytest.mark.parametrize("shape", [(12, 16), (1, 1, 12, 16)], ids=["rank2", "rank4"])
    def test_wrong_rank(self, shape):
        with pytest.raises(ValueError, match="expects tokens \\[B, N, C\\]"):
            TTTMixer(16, 2)(torch.randn(*shape), (3, 4))

    def test_wrong_channels(self):
        with pytest.raises(ValueError, match="C=16 channels got C=8"):
            TTTMixer(16, 2)(torch.randn(1, 12, 8), (3, 4))

    @pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
    def test_non_finite_values(self, bad):
        x = torch.randn(1, 12, 16)
        x[0, 5, 3] = bad
        with pytest.raises(ValueError, match="non-finite"):
            TTTMixer(16, 2)(x, (3, 4))

    def test_too_many_mini_batches(self):
        with pytest.raises(ValueError, match="mini_batches=20 is larger than the sequence length N=12"):
            TTTMixer(16, 2, mini_batches=20)(torch.randn(1, 12, 16), (3, 4))

    @pytest.mark.parametrize(
        ("overrides", "match"),
        [
            ({"loss": "huber2"}, "unknown inner loss"),
            ({"branches": ("transformer",)}, "unknown inner model"),
            ({"inner_lrr": 1.0}, "unknown TTT config keys"),
            ({"mlp_residual": "identity", "mlp_ratio": 2.0, "branches": ("mlp",)}, "need mlp_ratio 1"),
            ({"rope": True, "branches": ("swiglu:1",)}, "divisible by 4"),
            ({"inner_norm": "rms"}, "inner_norm must be one of"),
            ({"inner_norm": "ln", "branches": ("conv", "dwconv:1")}, "wraps token-wise inner models"),
            ({"inner_bias": True, "branches": ("swiglu", "dwconv:1")}, "inner_bias applies to"),
            ({"mlp_act": "relu"}, "mlp_act must be one of"),
            ({"mlp_residual": "skip"}, "mlp_residual must be one of"),
            ({"scale": "1/d"}, "scale must be a number"),
            ({"mlp_identity_init": True, "mlp_ratio": 2.0, "branches": ("swiglu_out",)}, "needs mlp_ratio 1"),
        ],
        ids=[
            "loss",
            "model",
            "key",
            "mlp-identity-ratio",
            "rope-width",
            "norm-name",
            "norm-grid-only",
            "bias-no-fc",
            "act",
            "residual",
            "scale",
            "swiglu_out-identity-ratio",
        ],
    )
    def test_bad_config(self, overrides, match):
        with pytest.raises(ValueError, match=match):
            TTTMixer(6, 3, **overrides) if "rope" in overrides else TTTMixer(16, 2, **overrides)

    def test_scale_names(self):
        assert TTTConfig(scale="head_dim").resolve_scale(64) == 0.125
        assert TTTConfig(scale="1/head_dim").resolve_scale(64) == 1 / 64

    def test_config_roundtrip_from_dict(self):
        cfg = TTTConfig.create({"loss": "mse", "branches": "linear,dwconv:1"})
        assert cfg.branches == ("linear", "dwconv:1") and cfg.loss == "mse"


def test_mix_refuses_gates_its_lr_mode_does_not_take():
    """``mix`` takes token lr gates exactly when ``lr_mode="token"``: a fixed-lr mixer's fused path would
    ignore them, a token-lr mixer cannot run without them."""
    x = torch.randn(2, 16, 32)
    fixed, token = TTTMixer(32, 2), TTTMixer(32, 2, TTTConfig(lr_mode="token"))
    gates = torch.rand(2, 3, 16)
    with pytest.raises(ValueError, match="lr_mode='fixed' takes no token lr gates"):
        fixed.mix(fixed.qkv(x), (4, 4), gates)
    with pytest.raises(ValueError, match="lr_mode='token' needs token lr gates"):
        token.mix(token.qkv(x), (4, 4))
    out = token.mix(token.qkv(x), (4, 4), gates)
    assert out.shape == (2, 16, sum(token.widths)) and torch.isfinite(out).all()
