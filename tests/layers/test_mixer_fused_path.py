"""The mixer's fused eager path (``vit3.layers.fused_mix``): when it serves, and that it computes what the
mixer defines (float64 autograd reference), every gradient included, in each tiling mode, without gradients,
under activation checkpointing and for low-precision inputs."""

from __future__ import annotations

import pytest
import torch
from helpers.backends import SHORT_PATH_CHANGES, changed_call, changed_twin, fresh_twin, mix_short
from helpers.common import count_calls, count_cpp_swiglu, saved_values
from helpers.reference import assert_mixer_matches_reference
from torch.utils.checkpoint import checkpoint

import vit3.kernels.mix.cpp as mix_cpp
import vit3.kernels.swiglu.eager as fast
import vit3.layers.ttt as ttt
from vit3.kernels.dwconv.eager import fold_batch, token_map, write_tokens
from vit3.layers import TTTMixer

GRID = (5, 7)


@pytest.fixture
def calls(monkeypatch):
    """Counts the mixer's calls of the fused path, the Python node on every call (settled calls on the C++
    kernel otherwise take the whole-mixer C++ op: ``tests/layers/test_mixer_cpp_node.py``)."""
    monkeypatch.setattr(ttt, "CPP_NODE", False)
    return count_calls(monkeypatch, ttt, "fused_mix")


def _mixer(dim: int = 32, heads: int = 4, **cfg) -> TTTMixer:
    torch.manual_seed(3)
    mixer = TTTMixer(dim, heads, **cfg).double()
    with torch.no_grad():  # larger initial inner weights so the step is not negligible
        for model in mixer.inner:
            for p in model.parameters():
                p.mul_(20)
    return mixer


SERVED = {
    "official": ({}, True),
    "official-rope": ({"rope": True}, True),
    "official-no-norm-lr": ({"grad_norm": False, "inner_lr": 0.3}, True),
    "swiglu-only": ({"branches": ("swiglu",)}, True),
    "dwconv-only": ({"branches": ("dwconv",)}, True),
    "with-linear": ({"branches": ("swiglu:2", "linear:2", "dwconv:1")}, False),
    "token-lr": ({"lr_mode": "token"}, False),
    "two-steps": ({"steps": 2}, False),
    "mini-batches": ({"mini_batches": 2}, False),
    "mse-loss": ({"loss": "mse"}, False),
    "generic-named": ({"backend": "generic"}, False),
    # head dim 8 is below the kernels' 16: the named backend steps aside with a warning, auto's path serves
    "triton-named-narrow-heads": ({"backend": "triton"}, True),
}


@pytest.mark.parametrize(("cfg", "served"), list(SERVED.values()), ids=list(SERVED))
def test_fused_path_serves_exactly_the_supported_configs(calls, cfg, served):
    mixer = _mixer(**cfg)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64)
    if cfg.get("backend") == "triton":
        with pytest.warns(UserWarning, match="branch: head dim 8 < 16"):
            mixer(x, GRID)
    else:
        mixer(x, GRID)
    assert calls["n"] == int(served)
    assert mixer.explain(x, GRID).fused is served


def test_fused_path_is_skipped_under_tracing(calls):
    mixer = _mixer()
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64)
    wrapped = torch.nn.Module()
    wrapped.mixer = mixer
    wrapped.forward = lambda t: wrapped.mixer(t, GRID)
    torch.jit.trace(wrapped, x, check_trace=False)
    assert calls["n"] == 0


TILINGS = {
    "folded-one-tile": 10**9,  # one sample is tiny: samples folded together, one tile
    "folded-tiles": 6000,  # folded, tiles spanning samples
    "strided-tiles": 300,  # per-sample tiles of a few tokens, read and written in place
}


@pytest.mark.parametrize("tile_bytes", list(TILINGS.values()), ids=list(TILINGS))
@pytest.mark.parametrize("cfg", ["official", "official-rope", "official-no-norm-lr"])
@pytest.mark.parametrize("backend", ["eager", "cpu"], ids=["tiles", "cpu-kernel"])
@pytest.mark.parametrize("recompute", ["always", "never"], ids=["recompute-zy", "save-zy"])
def test_fused_path_output_and_every_gradient_match_reference(
    calls, monkeypatch, tile_bytes, cfg, backend, recompute
):
    kernel = count_cpp_swiglu(monkeypatch)
    monkeypatch.setenv("VIT3_TTT_BACKEND", backend)
    monkeypatch.setattr(fast, "TILE_BYTES", tile_bytes)
    monkeypatch.setattr(fast, "MIN_TILE_TOKENS", 4)
    mixer = _mixer(**SERVED[cfg][0], recompute=recompute)
    x = torch.randn(3, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    assert_mixer_matches_reference(mixer, x, GRID)
    assert calls["n"] == 1  # the checked call took the fused path (the reference only reads the weights)
    assert kernel["n"] == int(backend == "cpu")


def _saved_per_token(mixer: TTTMixer, n_tokens: tuple[int, int], batch: int = 2) -> float:
    """Values the mixer's inner loops save for the backward per token (the slope over two grids: the per-token
    state, without the small weights)."""

    def saved(n: int) -> int:
        qkv = torch.randn(batch, n, mixer.qkv.out_features, dtype=torch.float64, requires_grad=True)
        return saved_values(lambda: mixer.mix(qkv, (n, 1)))

    return (saved(n_tokens[1]) - saved(n_tokens[0])) / (batch * (n_tokens[1] - n_tokens[0]))


@pytest.mark.parametrize("backend", ["eager", "cpu"], ids=["tiles", "cpu-kernel"])
def test_memory_lean_backward_saves_q_k_v_per_token_and_the_saving_variant_z_y_too(monkeypatch, backend):
    """The per-token saved state of the fused node, as docs/mixer.md's per-token table states it: q, k, v of
    every branch (3 values per channel; the SwiGLU heads' 3·H·d and the depthwise head's 3·d), plus
    Z = k W, Y = q W' (4·H·d) when they are saved instead of recomputed."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", backend)
    heads, d = 4, 8
    lean = _saved_per_token(_mixer(recompute="always"), (40, 80))
    saving = _saved_per_token(_mixer(recompute="never"), (40, 80))
    assert lean == 3 * heads * d + 3 * d
    assert saving == lean + 4 * heads * d


def test_recompute_switch_config_wins_over_env_and_explain_says_which(monkeypatch):
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    lean = str(_mixer().explain(x, (5, 8), grad=True))
    assert "recomputes Z = k W, Y = q W' (auto: memory-lean" in lean
    big = torch.randn(1, 520, 32, dtype=torch.float64)  # one rule for every length
    assert "recomputes Z = k W" in _mixer().explain(big, (20, 26), grad=True).recompute
    assert _mixer().explain(x, (5, 8), grad=False).recompute == ""  # inference saves nothing
    monkeypatch.setenv("VIT3_TTT_RECOMPUTE", "never")
    assert (
        "saves Z = k W, Y = q W' (VIT3_TTT_RECOMPUTE=never"
        in _mixer().explain(x, (5, 8), grad=True).recompute
    )
    cfg = _mixer(recompute="always").explain(x, (5, 8), grad=True).recompute
    assert "recomputes" in cfg and "TTTConfig.recompute='always'" in cfg
    generic = _mixer(backend="generic").explain(x, (5, 8), grad=True)
    assert generic.recompute == ""  # autograd's own graph: the switch does not apply
    monkeypatch.setenv("VIT3_TTT_RECOMPUTE", "sometimes")
    with pytest.raises(ValueError, match=r"\$VIT3_TTT_RECOMPUTE must be one of auto, always, never, qkv"):
        _mixer().explain(x, (5, 8), grad=True)
    with pytest.raises(ValueError, match="recompute must be one of"):
        TTTMixer(32, 4, recompute="yes")


@pytest.mark.parametrize("backend", ["cpu", "eager", "generic"])
def test_recompute_qkv_saves_only_the_mixer_input_and_matches_reference(monkeypatch, backend):
    """recompute="qkv": the mixer's backward reruns its qkv projection and inner loops (any backend), the
    output and every gradient are the reference's, and per token the mixer saves only its input (dim values)
    and the output projection's input (sum of branch widths), against 3·widths more by default."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", backend)
    mixer = _mixer(recompute="qkv")
    x = torch.randn(3, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    assert_mixer_matches_reference(mixer, x, GRID)
    expl = mixer.explain(x, GRID, grad=True)
    assert "recomputes its qkv projection" in expl.recompute

    def saved(m: TTTMixer, n: int) -> int:
        storages: dict[int, int] = {}
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
            return t

        tokens = torch.randn(2, n, 32, dtype=torch.float64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(tokens, (n, 1))
        return sum(storages.values())

    widths = sum(mixer.widths)
    per_token = (saved(mixer, 80) - saved(mixer, 40)) / (2 * 40)
    assert per_token == 32 + widths
    if backend != "generic":  # the fused node saves q, k, v (autograd's graph of the generic path more)
        default = _mixer()
        assert (saved(default, 80) - saved(default, 40)) / (2 * 40) == 32 + 3 * widths + widths


def test_without_gradients_nothing_is_saved_and_output_is_unchanged(calls, monkeypatch):
    saves = []
    real = mix_cpp.forward  # the C++ kernel serves both branches here (auto, 36 tokens): one whole call

    def spy(cache, spec, qkv, out, weights, save, calls):
        saves.append(save)
        return real(cache, spec, qkv, out, weights, save, calls)

    monkeypatch.setattr(mix_cpp, "forward", spy)
    mixer = _mixer()
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64)
    with torch.no_grad():
        out = mixer(x, GRID)
    ref = mixer(x.requires_grad_(), GRID)
    assert saves == [False, True]
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)


def test_activation_checkpointing_gives_the_same_gradients(calls):
    mixer = _mixer(rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    params = [x, *mixer.parameters()]
    plain = torch.autograd.grad(mixer(x, GRID).square().sum(), params)
    ckpt = checkpoint(lambda t: mixer(t, GRID), x, use_reentrant=False)
    got = torch.autograd.grad(ckpt.square().sum(), params)
    assert calls["n"] == 3  # forward, checkpointed forward, its recomputation
    for g, g_ref in zip(got, plain):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)


def test_bfloat16_tokens_run_in_float32_and_come_back_in_bfloat16(calls):
    mixer = _mixer().float()
    x = torch.randn(2, GRID[0] * GRID[1], 32)
    ref = mixer(x, GRID)
    out = mixer.to(torch.bfloat16)(x.to(torch.bfloat16).requires_grad_(), GRID)
    assert out.dtype == torch.bfloat16 and calls["n"] == 2
    out.float().sum().backward()
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 3e-2
    assert all(torch.isfinite(p.grad).all() for p in mixer.parameters())


def test_depthwise_maps_fold_the_batch_into_channels_last_and_back():
    b, (h, w), c = 3, GRID, 4
    qkv = torch.randn(b, h * w, 5 * c)
    tokens = qkv[..., c : 2 * c]  # a strided view, as the mixer's q, k, v are
    m = token_map(tokens, GRID)  # [B, C, h, w]
    folded = fold_batch(m)
    assert folded.shape == (1, b * c, h, w) and folded.is_contiguous(memory_format=torch.channels_last)
    assert folded.data_ptr() == m.data_ptr()  # the fold is a view
    # ... with a true channels-last batch stride (a plain reshape leaves C there, and the conv ops then copy)
    assert folded.stride() == (b * c * h * w, 1, w * b * c, b * c)
    # channel b*C + c of the folded map is channel c of sample b, in raster order
    torch.testing.assert_close(folded[0].view(b, c, h * w).transpose(1, 2), tokens, rtol=0, atol=0)
    dest = torch.zeros(b, h * w, 3 * c)[..., c : 2 * c]
    write_tokens(m, dest)
    torch.testing.assert_close(dest, tokens, rtol=0, atol=0)


# ------------------------------------------------------------------------------- the node's short path


def _settled_on_the_node(monkeypatch) -> tuple[TTTMixer, torch.Tensor]:
    """A RoPE'd mixer settled on the Python node (the C++ op off) in both grad modes, and its input."""
    monkeypatch.setattr(ttt, "CPP_NODE", False)
    mixer = _mixer(rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    for _ in range(4):
        mixer(x, GRID).sum().backward()
        with torch.no_grad():
            mixer(x, GRID)
    return mixer, x


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_a_settled_call_on_the_node_takes_its_short_path_with_the_same_bits(monkeypatch, grad):
    """A settled call on the fused node skips the mixer's route (``Calls.node``): the same output and
    gradients as a mixer that routes every call."""
    mixer, x = _settled_on_the_node(monkeypatch)
    twin = fresh_twin(mixer)
    for _ in range(4):
        twin(x, GRID)  # settled too, through the general path below
    qkv = mixer.qkv(x.detach()).detach().requires_grad_(grad)
    monkeypatch.setattr(mixer, "_call", lambda *args: pytest.fail("the route was asked"))
    with torch.set_grad_enabled(grad):
        got, short = mix_short(mixer, qkv, GRID)
    assert short
    qkv2 = qkv.detach().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        want = twin._mix_tokens(qkv2, GRID, None, "")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if grad:
        dout = torch.randn_like(got)
        params = [qkv, *mixer.inner.parameters()]
        grads = torch.autograd.grad(got, params, dout)
        ref = torch.autograd.grad(want, [qkv2, *twin.inner.parameters()], dout)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("change", SHORT_PATH_CHANGES)
def test_the_nodes_short_path_steps_aside_where_the_settled_call_does_not_hold(monkeypatch, change):
    """The call goes the general way and gives what a mixer without routes (the same change made to it)
    gives."""
    mixer, x = _settled_on_the_node(monkeypatch)
    qkv, grid = changed_call(mixer, mixer.qkv(x.detach()).detach(), GRID, change)
    twin = changed_twin(mixer, qkv, change)
    with torch.no_grad():
        got, short = mix_short(mixer, qkv, grid)
        want = twin.mix(qkv, grid)
    assert not short
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_a_qkv_on_another_device_does_not_take_the_nodes_short_path(monkeypatch):
    mixer, x = _settled_on_the_node(monkeypatch)
    qkv = mixer.qkv(x.detach()).detach()
    general = object()
    monkeypatch.setattr(mixer, "_mix_tokens", lambda *args: general)  # meta tensors: no general path to run
    with torch.no_grad():
        assert mixer.mix(qkv.to("meta"), GRID) is general
        assert mixer.mix(qkv, GRID) is not general  # the same call on the CPU: the short path
