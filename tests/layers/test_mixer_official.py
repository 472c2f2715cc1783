"""The TTTMixer computes exactly what the official ViT³ TTT module computes (golden fixtures), on every CPU
backend, and so do the op references (``vit3.kernels.swiglu.reference``,
``vit3.kernels.dwconv.reference``)."""

from __future__ import annotations

import pytest
import torch
from helpers.common import load_fixture
from helpers.ops import reference_mixer

from vit3.layers import TTTMixer, mixer_key_from_official

CASES = [
    # float64 throughout: measured ~8e-16 on every backend.
    pytest.param("block_swiglu_dwc.pt", 1e-12, id="swiglu+dwconv"),
    # The official RoPE casts to float32 before rotating, so this fixture carries float32 rounding (~6e-8).
    pytest.param("block_swiglu_dwc_rope.pt", 1e-5, id="swiglu+dwconv+rope"),
]
BACKENDS = ["generic", "eager", "cpu"]


def build_from_fixture(fx: dict, backend: str = "auto") -> TTTMixer:
    cfg = fx["config"]
    mixer = TTTMixer(
        cfg["dim"], cfg["num_heads"], qkv_bias=cfg["qkv_bias"], rope=cfg["rope"], backend=backend
    ).double()
    state = {mixer_key_from_official(k): v for k, v in fx["state_dict"].items()}
    mixer.load_state_dict(state, strict=True)
    return mixer


def _official_forward(
    name: str, backend: str, use_reference: bool
) -> tuple[dict, TTTMixer, torch.Tensor, torch.Tensor]:
    fx = load_fixture(name)
    mixer = build_from_fixture(fx, backend)
    x = fx["x"].clone().requires_grad_(True)
    grid = (fx["config"]["h"], fx["config"]["w"])
    return fx, mixer, x, (reference_mixer(mixer, x, grid) if use_reference else mixer(x, grid))


@pytest.mark.parametrize("path", [*BACKENDS, "op-references"])
@pytest.mark.parametrize(("name", "rtol"), CASES)
def test_output_and_every_gradient_match_official(name: str, rtol: float, path: str):
    reference = path == "op-references"
    fx, mixer, x, out = _official_forward(name, "generic" if reference else path, reference)
    if not reference:  # the SwiGLU branch runs where it is sent
        assert mixer.explain(x, (fx["config"]["h"], fx["config"]["w"])).branches[0].backend == path
    torch.testing.assert_close(out, fx["out"], rtol=rtol, atol=rtol * fx["out"].abs().max().item())
    (out * fx["out_proj"]).sum().backward()
    params = dict(mixer.named_parameters())
    grads = fx["grads"]
    assert set(grads) == {"input0"} | set(fx["state_dict"]), (
        "fixture gradients cover input and every parameter"
    )
    for key, expected in grads.items():
        got = x.grad if key == "input0" else params[mixer_key_from_official(key)].grad
        assert got is not None, key
        torch.testing.assert_close(
            got, expected, rtol=rtol, atol=rtol * expected.abs().max().item(), msg=f"gradient of {key}"
        )


def test_conversion_is_a_pure_rename():
    fx = load_fixture("block_swiglu_dwc.pt")
    mixer = build_from_fixture(fx)
    ours = mixer.state_dict()
    for key, value in fx["state_dict"].items():
        assert torch.equal(ours[mixer_key_from_official(key)], value)
    assert len(ours) == len(fx["state_dict"])
