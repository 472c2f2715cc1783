"""DiT³ (vit3.models.dit3): the official numbers (golden fixture), checkpoint formats, sizes and bad input."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from helpers.common import FIXTURES, default_dtype, load_fixture

import vit3
from vit3.layers import mixer_key_from_official
from vit3.models.dit3 import DIT3_CONFIGS, DiT3, create_dit3, num_params, sincos_pos_embed_2d

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2, num_classes=10)


def _fixture_model(fx: dict, path) -> DiT3:
    """The fixture's weights through create_dit3(checkpoint_path=...), built in float64 (no float32 round
    trip)."""
    with default_dtype(torch.float64):
        return create_dit3("dit3_s_2", checkpoint_path=path, **fx["config"]).eval()


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-12) -> None:
    """Largest error relative to the largest magnitude, in float64 (measured ~3e-13 on the DiT³ fixture)."""
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < rtol, f"{what}: relative error {err:.3g}"


def _randomize(model: DiT3, seed: int = 0) -> DiT3:
    """Random weights everywhere (the official init zeroes the adaLN and output layers)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return model


# ----------------------------------------------------------------------------------------- official parity
@pytest.fixture(scope="module")
def fixture_file(tmp_path_factory):
    fx = load_fixture("dit3_tiny_cfg.pt")
    path = tmp_path_factory.mktemp("dit3") / "official_state_dict.pt"
    torch.save(fx["state_dict"], path)  # a bare state dict, as the official sampler reads released files
    return fx, path


def test_fixture_output_and_every_gradient_match_the_official_model(fixture_file):
    fx, path = fixture_file
    model = _fixture_model(fx, path)
    x = fx["x"].clone().requires_grad_(True)
    out = model(x, fx["t"], fx["y"])
    _close(out, fx["out"], "output")
    (out * fx["out_proj"]).sum().backward()
    params = dict(model.named_parameters())
    grads = {mixer_key_from_official(k): v for k, v in fx["grads"].items() if k != "x"}
    assert set(grads) == set(params), (
        "every parameter has an official gradient (pos_embed is not a parameter)"
    )
    _close(x.grad, fx["grads"]["x"], "d/dx")
    for key, want in grads.items():
        _close(params[key].grad, want, f"d/d {key}")


def test_fixture_forward_with_cfg_matches_the_official_model(fixture_file):
    fx, path = fixture_file
    model = _fixture_model(fx, path)
    c = fx["cfg"]
    with torch.no_grad():
        out = model.forward_with_cfg(c["x"], c["t"], c["y"], c["scale"])
    _close(out, c["out"], "forward_with_cfg")


def test_fixture_pos_embed_is_our_table(fixture_file):
    fx, _ = fixture_file
    table = sincos_pos_embed_2d(64, (4, 4)).double()
    assert torch.equal(fx["state_dict"]["pos_embed"][0], table)


@pytest.mark.parametrize(
    "official", ["DiTTT-S/2", "DiTTT-B/2", "DiTTT-B/4", "DiTTT-B/8", "DiTTT-L/2", "DiTTT-XL/2"]
)
def test_parameter_counts_and_shapes_match_the_official_models(official):
    path = FIXTURES / "official_dit3_state_dict_shapes.json"
    if not path.exists():
        pytest.skip(f"{path} not found")
    want = json.loads(path.read_text())[official]
    with torch.device("meta"):
        model = create_dit3(official)  # the official name is accepted as well as dit3_s_2 ...
    assert num_params(model) == want["params"]
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    theirs = {mixer_key_from_official(k): v for k, v in want["state_dict"].items() if k != "pos_embed"}
    assert ours == theirs


def test_every_official_variant_has_a_name():
    assert sorted(DIT3_CONFIGS) == sorted(f"dit3_{s}_{p}" for s in ("s", "b", "l", "xl") for p in (2, 4, 8))
    assert vit3.create_dit3 is create_dit3 and vit3.models.create_dit3 is create_dit3


def test_dit3_is_not_registered_with_timm():
    import timm

    assert not [n for n in timm.list_models("*dit3*")]


# ---------------------------------------------------------------------------------------- checkpoint files
def _tiny_state() -> dict[str, torch.Tensor]:
    return _randomize(create_dit3("dit3_s_2", **TINY)).state_dict()


def _official_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    back = {"inner.0.w1": "w1", "inner.0.w2": "w2", "inner.1.weight": "w3"}
    out = {}
    for k, v in state.items():
        for ours, theirs in back.items():
            k = k.replace(f"attn.{ours}", f"attn.{theirs}")
        out[k] = v
    h = w = TINY["input_size"] // TINY["patch_size"]
    out["pos_embed"] = sincos_pos_embed_2d(TINY["hidden_size"], (h, w))[None]
    return out


@pytest.mark.parametrize(
    "layout",
    ["bare", "official-train", "ema-and-model", "module-prefix", "safetensors"],
)
def test_checkpoint_formats_load_the_right_weights(tmp_path, layout):
    """Bare official state dicts, official train.py files (ema first, pickled args), DDP prefixes,
    safetensors."""
    ema, raw = _tiny_state(), {k: v + 1 for k, v in _tiny_state().items()}
    path = tmp_path / "ckpt.pt"
    if layout == "bare":
        torch.save(_official_names(ema), path)
    elif layout == "official-train":  # what dittt/train.py saves: model, ema, opt and an argparse Namespace
        torch.save(
            {
                "model": _official_names(raw),
                "ema": _official_names(ema),
                "opt": {},
                "args": argparse.Namespace(a=1),
            },
            path,
        )
    elif layout == "ema-and-model":
        torch.save({"model": raw, "ema": ema}, path)
    elif layout == "module-prefix":
        torch.save({f"module.{k}": v for k, v in _official_names(ema).items()}, path)
    else:
        from safetensors.torch import save_file

        path = tmp_path / "ckpt.safetensors"
        save_file(_official_names(ema), path)
    model = create_dit3("dit3_s_2", checkpoint_path=path, **TINY)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ema[k]), k


def test_a_vit3_training_checkpoint_without_ema_loads_its_model(tmp_path):
    state = _tiny_state()
    path = tmp_path / "last.pt"
    torch.save({"format": "vit3-checkpoint", "model": state, "ema": None, "optimizer": {}}, path)
    model = create_dit3("dit3_s_2", checkpoint_path=path, **TINY)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_foreign_checkpoint_names_missing_unexpected_and_misshaped_keys(tmp_path):
    state = _official_names(_tiny_state())
    state.pop("final_layer.linear.bias")
    state["blocks.0.attn.extra"] = torch.zeros(3)
    state["y_embedder.embedding_table.weight"] = torch.zeros(5, TINY["hidden_size"])
    path = tmp_path / "foreign.pt"
    torch.save(state, path)
    with pytest.raises(ValueError) as err:
        create_dit3("dit3_s_2", checkpoint_path=path, **TINY)
    msg = str(err.value)
    assert "foreign.pt" in msg and "missing keys (1): ['final_layer.linear.bias']" in msg
    assert "unexpected keys (1): ['blocks.0.attn.extra']" in msg
    assert "y_embedder.embedding_table.weight: checkpoint (5, 32) vs model (11, 32)" in msg


def test_classifier_checkpoint_is_refused_with_its_keys(tmp_path):
    import timm

    path = tmp_path / "vit3_tiny.pt"
    torch.save({"model": timm.create_model("test_vit3_ttt").state_dict()}, path)
    with pytest.raises(
        ValueError, match=r"(?s)missing keys .*x_embedder.proj.weight.*unexpected keys .*patch_embed"
    ):
        create_dit3("dit3_s_2", checkpoint_path=path, **TINY)


def test_checkpoint_of_another_input_size_names_pos_embed(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save(_official_names(_tiny_state()), path)
    with pytest.raises(ValueError, match=r"pos_embed \(1, 16, 32\) does not fit input_size \(16, 16\)"):
        create_dit3("dit3_s_2", checkpoint_path=path, **{**TINY, "input_size": 16})


def test_missing_checkpoint_and_unknown_names(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.pt"):
        create_dit3("dit3_s_2", checkpoint_path=tmp_path / "nowhere.pt", **TINY)
    with pytest.raises(ValueError, match=r"unknown DiT³ model 'dit3_m_2'"):
        create_dit3("dit3_m_2")
    with pytest.raises(ValueError, match=r"unknown create_dit3 overrides \['embed_dim'\]"):
        create_dit3("dit3_s_2", embed_dim=64)


# ------------------------------------------------------------------------------------------ sizes and mixers
@pytest.mark.parametrize("mixer", ["ttt", "attention"])
@pytest.mark.parametrize("size", [(8, 8), (8, 12), (7, 9)], ids=["square", "non-square", "not-divisible"])
def test_any_latent_size_gives_a_prediction_of_the_same_size(mixer, size):
    model = _randomize(create_dit3("dit3_s_2", **{**TINY, "mixer": mixer})).eval()
    x = torch.randn(2, 4, *size)
    out = model(x, torch.tensor([3, 999]), torch.tensor([1, 10]))
    assert out.shape == (2, 8, *size)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("mixer", ["ttt", "attention"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_model_runs_without_autocast(mixer, dtype):
    """A model cast to bfloat16 / float16 (``.to(dtype)``, diffusers' ``torch_dtype``) takes float timesteps'
    float32 sinusoid cast to its Linear's dtype, and predicts what the float32 model does to half
    precision."""
    model = _randomize(create_dit3("dit3_s_2", **{**TINY, "mixer": mixer})).eval()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 999]), torch.tensor([1, 10])
    with torch.no_grad():
        want = model(x, t, y)
        half = model.to(dtype)
        got = half(x.to(dtype), t, y)
        assert half.t_embedder(t.float() + 0.5).dtype == dtype  # fractional timesteps too
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < (5e-2 if dtype == torch.bfloat16 else 1e-2), f"{dtype}: relative error {err:.3g}"


def test_non_square_grid_uses_the_grid_of_the_input():
    """Tokens on a 4 x 6 grid: the sin-cos rows follow the row index, its columns the column index."""
    table = sincos_pos_embed_2d(8, (4, 6)).double()
    rows, cols = torch.arange(24) // 6, torch.arange(24) % 6
    assert torch.allclose(table[:, 0], torch.sin(cols.double()), atol=1e-7)
    assert torch.allclose(table[:, 4], torch.sin(rows.double()), atol=1e-7)
    assert torch.equal(sincos_pos_embed_2d(8, (4, 4)), sincos_pos_embed_2d(8, (4, 4)))


def test_torch_export_takes_any_batch_and_latent_size_and_leaves_eager_calls_running():
    """``torch.export`` of DiT³ with a dynamic batch and latent size gives eager's numbers at others, and
    eager calls still run afterwards. The sin-cos table, kept per grid for eager calls, was made and kept
    under the export's fake tensors (the next eager call at that grid failed: a fake tensor in a CPU op),
    and made from ints, which fixed the exported program's latent size at the example's."""
    model = _randomize(create_dit3("dit3_s_2", **TINY)).eval()
    sample = (torch.randn(2, 4, 8, 8), torch.tensor([3.0, 500.0]), torch.tensor([1, 7]))
    batch, side = torch.export.Dim("batch", min=1, max=16), torch.export.Dim.AUTO
    dims = ({0: batch, 2: side, 3: side}, {0: batch}, {0: batch})
    program = torch.export.export(model, sample, dynamic_shapes=dims).module()
    x, t, y = torch.randn(3, 4, 12, 10), torch.tensor([1.0, 40.0, 900.0]), torch.tensor([0, 4, 9])
    with torch.no_grad():
        torch.testing.assert_close(program(x, t, y), model(x, t, y))
        torch.testing.assert_close(program(*sample), model(*sample))  # eager at the example's grid


def test_padding_never_leaks_into_the_kept_pixels():
    """A 7x9 latent is padded to 8x10: the prediction is cropped back, and equals the padded input's crop."""
    model = _randomize(create_dit3("dit3_s_2", **TINY)).eval()
    x = torch.randn(1, 4, 7, 9)
    t, y = torch.tensor([5]), torch.tensor([2])
    padded = torch.nn.functional.pad(x, (0, 1, 0, 1))
    torch.testing.assert_close(model(x, t, y), model(padded, t, y)[..., :7, :9])


def test_attention_baseline_has_the_same_layout_except_the_mixer():
    ttt = create_dit3("dit3_s_2", **TINY)
    att = create_dit3("dit3_s_2", **{**TINY, "mixer": "attention"})
    strip = lambda keys: {k for k in keys if ".attn." not in k}  # noqa: E731
    assert strip(ttt.state_dict()) == strip(att.state_dict())
    assert type(att.blocks[0].attn).__name__ == "Attention"


def test_learn_sigma_off_and_zero_init_output():
    model = create_dit3("dit3_s_2", **{**TINY, "learn_sigma": False})
    out = model(torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.tensor([0, 1]))
    assert out.shape == (2, 4, 8, 8)
    assert torch.equal(out, torch.zeros_like(out))  # adaLN-Zero: the output layer starts at zero


def test_label_dropout_only_in_training():
    model = create_dit3("dit3_s_2", **{**TINY, "class_dropout_prob": 0.5})
    y = torch.zeros(1000, dtype=torch.long)
    torch.manual_seed(0)
    dropped = model.y_embedder.token_drop(y)
    assert 400 < int((dropped == 10).sum()) < 600
    table = model.y_embedder.embedding_table.weight
    assert torch.equal(model.y_embedder(y, train=False), table[y])


def test_grad_checkpointing_gives_the_same_gradients():
    model = _randomize(create_dit3("dit3_s_2", **TINY))
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 7]), torch.tensor([1, 2])
    model(x, t, y).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x, t, y).square().sum().backward()
    for a, b in zip(want, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b)


def test_guided_channels_default_is_official_and_capped():
    four = _randomize(create_dit3("dit3_s_2", **TINY)).eval()
    x, t, y = torch.randn(4, 4, 8, 8), torch.tensor([5, 6, 5, 6]), torch.tensor([1, 2, 10, 10])
    with torch.no_grad():
        out = four.forward_with_cfg(x, t, y, 4.0)
        plain = four(torch.cat([x[:2], x[:2]]), t, y)
    torch.testing.assert_close(out[:2, 3:], plain[:2, 3:])  # channel 3 and the variance stay conditional
    assert not torch.allclose(out[:2, :3], plain[:2, :3])
    one = _randomize(create_dit3("dit3_s_2", **{**TINY, "in_channels": 1})).eval()
    x1 = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        out1 = one.forward_with_cfg(x1, t, y, 4.0)
        plain1 = one(torch.cat([x1[:2], x1[:2]]), t, y)
    torch.testing.assert_close(out1[:2, 1:], plain1[:2, 1:])  # a 1-channel model never guides its variance


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("x", "t", "y", "match"),
    [
        (
            torch.randn(2, 3, 8, 8),
            torch.tensor([1, 2]),
            torch.tensor([0, 1]),
            r"built for 4 latent channels got 3",
        ),
        (
            torch.randn(2, 4, 8, 8),
            torch.tensor([1, 2]),
            torch.tensor([0, 11]),
            r"labels must lie in \[0, 10\] \(10 is the null",
        ),
        (
            torch.randn(2, 4, 8, 8),
            torch.tensor([1, 2]),
            torch.tensor([-1, 1]),
            r"labels must lie in \[0, 10\]",
        ),
        (torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.tensor([0.0, 1.0]), r"integer class indices"),
        (
            torch.randn(2, 4, 8, 8),
            torch.tensor([1]),
            torch.tensor([0, 1]),
            r"timesteps must be \[B\] = \[2\]",
        ),
        (torch.randn(4, 8, 8), torch.tensor([1]), torch.tensor([0]), r"latents \[B, C, H, W\]"),
        (torch.full((1, 4, 8, 8), math.nan), torch.tensor([1]), torch.tensor([0]), r"non-finite"),
    ],
    ids=["channels", "label-too-big", "label-negative", "float-labels", "timesteps", "rank", "nan"],
)
def test_bad_inputs_are_named(x, t, y, match):
    model = create_dit3("dit3_s_2", **TINY)
    with pytest.raises(ValueError, match=match):
        model(x, t, y)


def test_null_label_is_out_of_range_without_class_dropout():
    model = create_dit3("dit3_s_2", **{**TINY, "class_dropout_prob": 0.0})
    with pytest.raises(ValueError, match=r"\[0, 9\] \(no null class"):
        model(torch.randn(1, 4, 8, 8), torch.tensor([1]), torch.tensor([10]))


def test_guidance_without_the_null_class_is_refused():
    model = create_dit3("dit3_s_2", **{**TINY, "class_dropout_prob": 0.0})
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 1]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"cfg_scale=4.0 needs the null class.*class_dropout_prob=0"):
        model.forward_with_cfg(x, t, y, 4.0)
    assert model.forward_with_cfg(x, t, y, 1.0).shape == (2, 8, 8, 8)
    with pytest.raises(ValueError, match="even batch"):
        model.forward_with_cfg(x[:1], t[:1], y[:1], 1.0)
