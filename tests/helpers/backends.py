"""Shared by the backend registry's tests (``test_backends_*``) and the mixer's short paths': a mixer with
inner weights large enough that the step matters, its twin with no routes made (on the generic path or its
own), a run that returns the output and every gradient, readers of an explanation, a settled call changed."""

from __future__ import annotations

import torch

from vit3.layers import TTTMixer
from vit3.layers import backends as reg

GRID = (4, 6)  # 24 tokens: below the CPU kernel's 32
BIG_GRID = (10, 12)  # 120 tokens
CPU = torch.device("cpu")


def make_mixer(dim: int = 32, heads: int = 2, dtype=torch.float64, gain: float = 5.0, **cfg) -> TTTMixer:
    """A seeded mixer whose initial inner weights are ``gain`` times larger, so the inner step is not
    negligible."""
    torch.manual_seed(3)
    mixer = TTTMixer(dim, heads, **cfg).to(dtype)
    with torch.no_grad():
        for model in mixer.inner:
            for p in model.parameters():
                p.mul_(gain)
    return mixer


def fresh_twin(mixer: TTTMixer, **cfg) -> TTTMixer:
    """The same mixer (config with ``cfg`` on top, weights, dtype, device) with no routes made."""
    twin = TTTMixer(mixer.dim, mixer.num_heads, mixer.cfg, **cfg).to(next(mixer.parameters()))
    twin.load_state_dict(mixer.state_dict())
    return twin


def generic_twin(mixer: TTTMixer) -> TTTMixer:
    """The same mixer (weights, dtype, device) on the generic backend."""
    return fresh_twin(mixer, backend="generic")


# What a settled call's short path holds, one at a time (``changed_call``).
SHORT_PATH_CHANGES = ("grid", "dtype", "weight-dtype", "routes-cleared")


def changed_call(
    mixer: TTTMixer, qkv: torch.Tensor, grid: tuple[int, int], change: str
) -> tuple[torch.Tensor, tuple[int, int]]:
    """The next call's qkv and grid with one of ``SHORT_PATH_CHANGES`` made: another grid of the same tokens
    (RoPE's angles differ), float32 qkv, ``mixer``'s first inner weight converted to float32 in place (no
    ``Module.to``), or its routes cleared."""
    if change == "grid":
        return qkv, grid[::-1]
    if change == "dtype":
        return qkv.float(), grid
    if change == "weight-dtype":
        mixer.inner[0].w1.data = mixer.inner[0].w1.data.float()
    elif change == "routes-cleared":
        mixer._calls.clear()
    return qkv, grid


def changed_twin(mixer: TTTMixer, qkv: torch.Tensor, change: str) -> TTTMixer:
    """``fresh_twin`` in qkv's dtype with ``changed_call``'s change of ``mixer``'s weights made to it: what
    the changed call must give."""
    twin = fresh_twin(mixer).to(qkv.dtype)
    if change == "weight-dtype":  # float32 w1 beside the other weights: the general path casts it
        twin.inner[0].w1.data = twin.inner[0].w1.data.float()
    return twin


def run_grads(mixer: TTTMixer, x: torch.Tensor, grid, dout: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient."""
    x = x.detach().requires_grad_()
    out = mixer(x, grid)
    return [out, *torch.autograd.grad((out * dout).sum(), [x, *mixer.parameters()])]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str], rtol: float = 1e-10):
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * 1e-2 * w.abs().max().item(), msg=name)


def param_names(mixer: TTTMixer) -> list[str]:
    return ["output", "input grad", *(n for n, _ in mixer.named_parameters())]


def backends_of(expl: reg.MixerExplanation) -> list[str]:
    return [b.backend for b in expl.branches]


def reason_of(expl: reg.MixerExplanation, branch: int, backend: str) -> str:
    return dict(expl.branches[branch].passed_over)[backend]


def tokens(grid, dim=32, b=2, dtype=torch.float64):
    return torch.randn(b, grid[0] * grid[1], dim, dtype=dtype)


def mix_short(mixer: TTTMixer, qkv: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, bool]:
    """``mixer.mix(qkv, grid)`` and whether its short path served it (the general path, ``_mix_tokens``, not
    reached)."""
    general, reached = mixer._mix_tokens, []
    mixer._mix_tokens = lambda *args: reached.append(True) or general(*args)
    try:
        return mixer.mix(qkv, grid), not reached
    finally:
        del mixer._mix_tokens
