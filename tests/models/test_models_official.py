"""Official ViTTT checkpoints load through timm and reproduce the official models (golden fixtures)."""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import timm
import torch
from helpers.common import FIXTURES, default_dtype, load_fixture
from torch import nn

import vit3  # noqa: F401 - registers the models
from vit3.layers import mixer_key_from_official
from vit3.models import _pretrained, h_vit3
from vit3.models import vit3 as plain

# Float64 throughout: measured ~5e-15 (plain). The official RoPE casts to float32 before rotating (H-ViT³
# only): that fixture carries float32 rounding (measured ~4e-7).
FIXTURE_CASES = [
    pytest.param("vit3_plain_tiny_cfg.pt", "vit3_tiny", mixer_key_from_official, 1e-12, id="plain"),
    pytest.param(
        "vit3_hier_tiny_cfg.pt", "h_vit3_tiny", h_vit3.key_from_official, 1e-5, id="hierarchical-rope"
    ),
]
MANIFEST_CASES = [
    pytest.param(official, ours, id=ours)
    for official, ours in [
        ("vittt_tiny", "vit3_tiny"),
        ("vittt_small", "vit3_small"),
        ("vittt_base", "vit3_base"),
        ("h_vittt_tiny", "h_vit3_tiny"),
        ("h_vittt_small", "h_vit3_small"),
        ("h_vittt_base", "h_vit3_base"),
    ]
]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item(), msg=what)


def _model_kwargs(fx: dict) -> dict:
    cfg = dict(fx["config"])
    if fx["kind"] == "h_vit":
        cfg.pop("img_size")  # the official H-ViT³ fixes its grid from img_size; ours reads it from the input
    return cfg


def _fixture_model(fx: dict, arch: str, tmp_path: Path, **extra) -> torch.nn.Module:
    path = tmp_path / "official.pth"
    torch.save({"model": fx["state_dict"], "epoch": 300}, path)
    overlay = dict(file=str(path), num_classes=fx["config"]["num_classes"])
    return timm.create_model(
        arch, pretrained=True, pretrained_cfg_overlay=overlay, **_model_kwargs(fx), **extra
    )


@pytest.mark.parametrize(("fixture", "arch", "convert", "rtol"), FIXTURE_CASES)
def test_official_checkpoint_reproduces_outputs_and_every_gradient(tmp_path, fixture, arch, convert, rtol):
    fx = load_fixture(fixture)
    with default_dtype(torch.float64):  # built in float64: the fixture's weights load without rounding
        model = _fixture_model(fx, arch, tmp_path).eval()  # eval: H-ViT³ BatchNorm on running stats
    x = fx["x"].clone().requires_grad_(True)
    out = model(x)
    _close(out, fx["out"], rtol, "logits")
    if "pooled_features" in fx:
        _close(
            model.forward_head(model.forward_features(x), pre_logits=True),
            fx["pooled_features"],
            rtol,
            "pooled",
        )
    (out * fx["out_proj"]).sum().backward()
    params = dict(model.named_parameters())
    grads = {convert(k): v for k, v in fx["grads"].items() if k != "input0"}
    assert set(grads) == set(params), "the fixture has a gradient for every parameter"
    _close(x.grad, fx["grads"]["input0"], rtol, "gradient of the input")
    for key, want in grads.items():
        _close(params[key].grad, want, rtol, f"gradient of {key}")


@pytest.mark.parametrize(("fixture", "arch", "convert", "rtol"), FIXTURE_CASES)
def test_official_checkpoint_loads_into_features_only_and_other_heads(tmp_path, fixture, arch, convert, rtol):
    fx = load_fixture(fixture)
    path = tmp_path / "official.pth"
    torch.save({"model": fx["state_dict"]}, path)
    kwargs = _model_kwargs(fx)
    kwargs.pop("num_classes")
    feats = timm.create_model(
        arch, pretrained=True, features_only=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs
    )
    stem = "patch_embed.proj.weight" if arch.startswith("vit3") else "patch_embed.conv.0.conv.weight"
    ours = "patch_embed.proj.weight" if arch.startswith("vit3") else "stem.0.conv.weight"
    assert torch.equal(feats.model.state_dict()[ours], fx["state_dict"][stem].float())
    overlay = dict(file=str(path), num_classes=10)
    new_head = timm.create_model(
        arch, pretrained=True, num_classes=3, pretrained_cfg_overlay=overlay, **kwargs
    )
    assert new_head.get_classifier().out_features == 3
    gray = timm.create_model(
        arch, pretrained=True, in_chans=1, num_classes=10, pretrained_cfg_overlay=overlay, **kwargs
    )
    torch.testing.assert_close(gray.state_dict()[ours][:, 0], fx["state_dict"][stem].sum(1).float())


@pytest.mark.parametrize(("fixture", "arch", "convert", "rtol"), FIXTURE_CASES)
def test_official_file_loads_through_every_state_dict_route(tmp_path, fixture, arch, convert, rtol):
    """An official file's weights in their own names load through ``load_state_dict``, timm's
    ``load_checkpoint`` and ``create_model(checkpoint_path=...)`` as through the pretrained overlay, and
    under a prefix (the model inside another one); the official names go, ours come (a renaming hook)."""
    fx = load_fixture(fixture)
    path = tmp_path / "official.pth"
    torch.save({"model": fx["state_dict"], "epoch": 300}, path)
    kwargs = _model_kwargs(fx)
    with default_dtype(torch.float64):
        want = _fixture_model(fx, arch, tmp_path).state_dict()
        routes = {
            "checkpoint_path": timm.create_model(arch, checkpoint_path=str(path), **kwargs),
            "load_checkpoint": timm.create_model(arch, **kwargs),
            "load_state_dict": timm.create_model(arch, **kwargs),
            "under a prefix": nn.Sequential(timm.create_model(arch, **kwargs)),
        }
    timm.models.load_checkpoint(routes["load_checkpoint"], str(path))
    routes["load_state_dict"].load_state_dict(fx["state_dict"])
    routes["under a prefix"].load_state_dict({f"0.{k}": v for k, v in fx["state_dict"].items()})
    for how, model in routes.items():
        got = model.state_dict()
        got = {k.removeprefix("0."): v for k, v in got.items()} if how == "under a prefix" else got
        assert got.keys() == want.keys(), how
        assert all(torch.equal(got[k], want[k]) for k in want), how


def test_classifier_size_mismatch_says_how_to_declare_it(tmp_path):
    fx = load_fixture("vit3_plain_tiny_cfg.pt")
    path = tmp_path / "official.pth"
    torch.save({"model": fx["state_dict"]}, path)
    kwargs = _model_kwargs(fx)
    kwargs.pop("num_classes")
    with pytest.raises(ValueError, match=r"(?s)another class count.*num_classes=.*head.weight"):
        timm.create_model("vit3_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs)


def test_model_and_ema_weights_are_chosen_explicitly(tmp_path):
    """The ``model`` entry is the default; ``pretrained_ema=True`` takes ``state_dict_ema``."""
    fx = load_fixture("vit3_plain_tiny_cfg.pt")
    ema = {k: v + 1.0 for k, v in fx["state_dict"].items()}
    path = tmp_path / "train_state.pth"
    torch.save({"model": fx["state_dict"], "state_dict_ema": ema, "optimizer": {}, "epoch": 3}, path)
    overlay = dict(file=str(path), num_classes=10)
    kw = _model_kwargs(fx)
    main = timm.create_model("vit3_tiny", pretrained=True, pretrained_cfg_overlay=overlay, **kw)
    avg = timm.create_model(
        "vit3_tiny", pretrained=True, pretrained_ema=True, pretrained_cfg_overlay=overlay, **kw
    )
    key = "blocks.0.attn.inner.0.w1"
    assert torch.equal(main.state_dict()[key], fx["state_dict"]["blocks.0.attn.w1"].float())
    assert torch.equal(avg.state_dict()[key], ema["blocks.0.attn.w1"].float())
    assert "state_dict" not in main.pretrained_cfg  # the weights do not stay on the model's config
    torch.save({"model": fx["state_dict"]}, path)
    with pytest.raises(KeyError, match="no EMA weights"):
        timm.create_model(
            "vit3_tiny", pretrained=True, pretrained_ema=True, pretrained_cfg_overlay=overlay, **kw
        )


class TrainingConfig(dict):
    """Stands in for the yacs ``CfgNode`` the official scripts pickle into their checkpoints."""


def test_checkpoint_with_pickled_training_objects_loads_without_running_them(tmp_path):
    fx = load_fixture("vit3_plain_tiny_cfg.pt")
    path = tmp_path / "full.pth"
    torch.save({"model": fx["state_dict"], "config": TrainingConfig(MODEL={"TYPE": "vittt_tiny"})}, path)
    weights = _pretrained.load_checkpoint_file(path)
    assert set(weights) == set(fx["state_dict"])
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)  # plain weights-only loading refuses it


def _official_shapes(official: str) -> dict[str, list[int]]:
    """The state-dict shapes of a full-size official checkpoint (``../shared``'s manifest); skips where
    absent."""
    path = FIXTURES / "official_state_dict_shapes.json"
    if not path.exists():
        pytest.skip(f"{path} not found (../shared is not laid out beside the repo)")
    return json.loads(path.read_text())[official]


def _official_on_meta(official: str, ours: str) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """A full-size official checkpoint as meta tensors of its shapes, and ``ours`` built on the meta
    device."""
    shapes = _official_shapes(official)
    with torch.device("meta"):
        return {k: torch.empty(s) for k, s in shapes.items()}, timm.create_model(ours)


def _filter_fn(ours: str) -> Callable[[dict, torch.nn.Module], dict]:
    """The timm ``checkpoint_filter_fn`` of ``ours``'s family (plain or hierarchical)."""
    return plain.checkpoint_filter_fn if ours.startswith("vit3") else h_vit3.checkpoint_filter_fn


@pytest.mark.parametrize(("official", "ours"), MANIFEST_CASES)
def test_full_size_conversion_uses_every_key_and_fills_every_parameter(official, ours):
    fake, model = _official_on_meta(official, ours)
    converted = _filter_fn(ours)(fake, model)
    target = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in converted.items()} == target
    rope_tables = [k for k in fake if k.endswith(".rope.rotations")]  # recomputed per grid, not weights
    assert len(rope_tables) == (
        sum(1 for k in fake if k.endswith(".cpe.weight")) if ours.startswith("h") else 0
    )
    assert len(converted) == len(fake) - len(rope_tables), "every other official key is used, none merged"
    model.load_state_dict(converted, strict=True, assign=True)


@pytest.mark.parametrize(
    ("official", "ours"),
    [("vittt_small", "vit3_tiny"), ("h_vittt_tiny", "h_vit3_small"), ("vittt_tiny", "h_vit3_tiny")],
    ids=["plain-other-size", "hier-other-depth", "other-family"],
)
def test_checkpoint_of_another_model_lists_missing_unexpected_and_misshaped_keys(official, ours):
    fake, model = _official_on_meta(official, ours)
    with pytest.raises(ValueError, match="does not fit") as err:
        _filter_fn(ours)(fake, model)
    msg = str(err.value)
    assert "missing keys" in msg and "unexpected keys" in msg and "mis-shaped keys" in msg
    assert sum(int(n) for n in re.findall(r"keys \((\d+)\)", msg)) > 0
    if official == "vittt_small":
        ours_shape = tuple(model.state_dict()["blocks.0.attn.qkv.weight"].shape)
        assert (
            f"blocks.0.attn.qkv.weight: checkpoint {tuple(fake['blocks.0.attn.qkv.weight'].shape)} vs "
            f"model {ours_shape}" in msg
        )
    if official == "h_vittt_tiny":
        assert "stages.0.blocks.1.cpe.weight" in msg.split("unexpected")[0]  # missing: S has more blocks


@pytest.mark.parametrize(("name", "depth"), [("test_vit3_ttt", 2), ("test_vit3_ttt", 4), ("test_h_vit3", 1)])
def test_pretrained_strict_false_loads_what_fits(tmp_path, name, depth):
    """timm's ``pretrained_strict=False`` loads the keys that fit and leaves the rest as built, as with timm's
    own models (a deeper model: missing keys; a shallower one: unexpected keys); strict, the default, lists
    them; a mis-shaped key is refused either way."""
    torch.manual_seed(0)
    source = timm.create_model(name)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    other = dict(depth=depth) if name == "test_vit3_ttt" else dict(depths=(1, 1, 1, 2))
    with pytest.raises(ValueError, match="does not fit"):
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **other)
    torch.manual_seed(1)
    model = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), pretrained_strict=False, **other
    )
    theirs, ours = source.state_dict(), model.state_dict()
    shared = set(theirs) & set(ours)
    assert shared and set(ours) != set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in shared)
    torch.save({k: v[..., :1] if k.endswith("qkv.weight") else v for k, v in theirs.items()}, path)
    with pytest.raises(ValueError, match="mis-shaped keys"):
        timm.create_model(
            name,
            pretrained=True,
            pretrained_cfg_overlay=dict(file=str(path)),
            pretrained_strict=False,
            **other,
        )


def test_pretrained_without_file_explains_how_to_pass_one_when_offline(monkeypatch, tmp_path):
    def offline(url, dst, *args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    with pytest.raises(RuntimeError, match=r"pretrained_cfg_overlay=dict\(file=") as err:
        timm.create_model("vit3_tiny", pretrained=True)
    assert "cloud.tsinghua.edu.cn" in str(err.value)


def test_pretrained_downloads_official_url_once_into_the_hub_cache(monkeypatch, tmp_path):
    fx = load_fixture("vit3_plain_tiny_cfg.pt")
    calls = []

    def fake_download(url, dst, *args, **kwargs):
        calls.append(url)
        torch.save({"model": fx["state_dict"]}, dst)

    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    for _ in range(2):
        model = timm.create_model("vit3_tiny", pretrained=True, **_model_kwargs(fx))
    assert calls == [model.pretrained_cfg["url"]]
    assert "tsinghua" in calls[0]
