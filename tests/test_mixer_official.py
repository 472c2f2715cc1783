"""The default TTTMixer computes exactly what the official ViT³ TTT module computes (golden fixtures)."""

from __future__ import annotations

import pytest
import torch
from helpers.common import load_fixture

from vit3.layers import TTTMixer, convert_official_mixer_key

CASES = [
    pytest.param("block_swiglu_dwc.pt", 1e-6, id="swiglu+dwconv"),
    # The official RoPE casts to float32 before rotating, so this fixture carries float32 rounding.
    pytest.param("block_swiglu_dwc_rope.pt", 1e-5, id="swiglu+dwconv+rope"),
]


def build_from_fixture(fx: dict) -> TTTMixer:
    cfg = fx["config"]
    mixer = TTTMixer(cfg["dim"], cfg["num_heads"], qkv_bias=cfg["qkv_bias"], rope=cfg["rope"]).double()
    state = {convert_official_mixer_key(k): v for k, v in fx["state_dict"].items()}
    mixer.load_state_dict(state, strict=True)
    return mixer


@pytest.mark.parametrize(("name", "rtol"), CASES)
def test_output_and_every_gradient_match_official(name: str, rtol: float):
    fx = load_fixture(name)
    mixer = build_from_fixture(fx)
    x = fx["x"].clone().requires_grad_(True)
    out = mixer(x, (fx["config"]["h"], fx["config"]["w"]))
    torch.testing.assert_close(out, fx["out"], rtol=rtol, atol=rtol * fx["out"].abs().max().item())
    (out * fx["out_proj"]).sum().backward()
    params = dict(mixer.named_parameters())
    grads = fx["grads"]
    assert set(grads) == {"input0"} | set(fx["state_dict"]), (
        "fixture gradients cover input and every parameter"
    )
    for key, expected in grads.items():
        got = x.grad if key == "input0" else params[convert_official_mixer_key(key)].grad
        assert got is not None, key
        torch.testing.assert_close(
            got, expected, rtol=rtol, atol=rtol * expected.abs().max().item(), msg=f"gradient of {key}"
        )


def test_conversion_is_a_pure_rename():
    fx = load_fixture("block_swiglu_dwc.pt")
    mixer = build_from_fixture(fx)
    ours = mixer.state_dict()
    for key, value in fx["state_dict"].items():
        assert torch.equal(ours[convert_official_mixer_key(key)], value)
    assert len(ours) == len(fx["state_dict"])
