"""The timm model contract, per vit3 model (tiny variants): what timm's own tests/test_models.py checks, and
more."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from helpers.models import TINY_MODELS, fx_model, fx_output
from timm.layers import get_channel_dim, get_spatial_dim
from timm.models import group_parameters

import vit3  # noqa: F401 - registers the models
from vit3.layers import TTTConfig, TTTMixer

META = torch.device("meta")
REGISTERED = sorted(
    n for n in timm.list_models() if timm.models.model_entrypoint(n).__module__.startswith("vit3.")
)


@pytest.fixture(params=TINY_MODELS)
def name(request) -> str:
    """The tiny model each test of the contract runs on (a test parametrized on ``name`` takes its own)."""
    return request.param


PRETRAINED_CFG_KEYS = (
    "url",
    "num_classes",
    "input_size",
    "pool_size",
    "crop_pct",
    "interpolation",
    "mean",
    "std",
    "first_conv",
    "classifier",
    "license",
    "paper_ids",
    "origin_url",
)


def _input(model, batch: int = 1, size: tuple[int, int] | None = None) -> torch.Tensor:
    c, h, w = model.pretrained_cfg["input_size"]
    return torch.randn(batch, c, *(size or (h, w)))


def _feature_grid(model, feats: torch.Tensor) -> tuple[int, int]:
    """The grid ``(h, w)`` of ``forward_features``' output: its spatial dims by the model's ``output_fmt``."""
    spatial = get_spatial_dim(model.output_fmt)
    return feats.shape[spatial[0]], feats.shape[spatial[1]]


def test_registered_with_complete_pretrained_cfg(name):
    assert name in timm.list_models("*vit3*")
    model = timm.create_model(name)
    cfg = model.pretrained_cfg
    for key in PRETRAINED_CFG_KEYS[1:]:
        assert cfg.get(key) not in (None, ""), key
    assert cfg["fixed_input_size"] is False
    assert model.state_dict()[cfg["first_conv"] + ".weight"].shape[1] == 3
    assert cfg["classifier"] + ".weight" in model.state_dict()


def test_forward_with_and_without_grad_checkpointing(name):
    model = timm.create_model(name).eval()
    x = _input(model)
    out = model(x)
    assert out.shape == (1, 1000) and not out.isnan().any()
    model.set_grad_checkpointing()
    torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-5)
    model.train()
    model(_input(model, batch=2)).mean().backward()  # checkpointed backward runs


def test_backward_reaches_every_parameter(name):
    model = timm.create_model(name, num_classes=42).train()
    out = model(_input(model, batch=2))
    assert out.shape == (2, 42)
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert all(p.grad.isfinite().all() for p in model.parameters())


def test_default_cfg_consistency(name):
    """timm's test_model_default_cfgs, on the model's output_fmt (NHWC plain, as timm's Swin; NCHW
    hierarchical)."""
    model = timm.create_model(name).eval()
    cfg = model.pretrained_cfg
    fmt = model.output_fmt
    x = _input(model)
    feats = model.forward_features(x)
    assert feats.ndim == 4
    assert _feature_grid(model, feats) == tuple(cfg["pool_size"])
    assert feats.shape[get_channel_dim(fmt)] == model.num_features
    assert feats.shape[getattr(model, "feature_dim", 1)] == model.num_features
    pre = model.forward_head(feats, pre_logits=True)
    assert pre.shape == (1, model.head_hidden_size)
    model.reset_classifier(0)
    assert model.num_classes == 0
    torch.testing.assert_close(model(x), pre)
    model.reset_classifier(0, "")
    unpooled = model(x)
    torch.testing.assert_close(unpooled, feats)
    fresh = timm.create_model(name, num_classes=0, global_pool="").eval()
    assert fresh(x).shape == feats.shape
    # a classifier on the unpooled map: logits per position [B, h, w, K] (H-ViT³'s NCHW map broke it)
    model.reset_classifier(5, "")
    grid = [feats.shape[d] for d in model.spatial_dims]
    assert model(x).shape == (1, *grid, 5)


@pytest.mark.parametrize("name", REGISTERED)
def test_every_registered_name_passes_timms_default_cfgs_shape_checks(name):
    """timm's test_model_default_cfgs as timm's tests/test_models.py runs it on every vit3 name (meta device,
    the cfg's input size): ``output_fmt`` has two spatial axes, ``forward_features``' are the cfg's
    ``pool_size`` and its channel axis ``num_features``; pre-logits ``head_hidden_size``;
    ``reset_classifier(0)`` gives them and ``reset_classifier(0, '')`` the unpooled map."""
    with META:
        model = timm.create_model(name, device=META, dtype=torch.float32).eval()
    cfg = model.pretrained_cfg
    fmt = getattr(model, "output_fmt", "NCHW")
    spatial, channel = get_spatial_dim(fmt), get_channel_dim(fmt)
    assert len(spatial) == 2, fmt
    x = torch.empty(2, *cfg["input_size"], device=META)
    feats = model.forward_features(x)
    assert tuple(feats.shape[i] for i in spatial) == tuple(cfg["pool_size"])
    assert feats.shape[channel] == model.num_features
    pre = model.forward_head(feats, pre_logits=True)
    assert pre.shape == (2, model.head_hidden_size)
    model.reset_classifier(0)
    assert model.num_classes == 0 and model(x).shape == pre.shape
    model.reset_classifier(0, "")
    unpooled = model(x)
    assert unpooled.ndim == 4 and tuple(unpooled.shape[i] for i in spatial) == tuple(cfg["pool_size"])


def test_plain_model_takes_an_activation_by_timm_name():
    """``act_layer`` as timm's ViT takes it: a module class or a name timm resolves (``get_act_layer``)."""
    named = timm.create_model("test_vit3_ttt", act_layer="silu")
    assert all(type(b.mlp.act) is torch.nn.SiLU for b in named.blocks)
    assert type(timm.create_model("test_vit3_ttt").blocks[0].mlp.act) is torch.nn.GELU
    assert named(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_reset_classifier_and_get_classifier(name):
    model = timm.create_model(name)
    model.reset_classifier(7, "max")
    assert model.get_classifier().out_features == 7 and model.global_pool == "max"
    assert model(_input(model)).shape == (1, 7)
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(7, "token")


@pytest.mark.parametrize("size", [(64, 64), (50, 70), (33, 97)], ids=["square", "non-square", "odd"])
def test_any_input_size(name, size):
    """Sizes that do not divide the reductions give ceil-sized maps (padded plain, padded convs
    hierarchical)."""
    model = timm.create_model(name).eval()
    x = _input(model, size=size)
    feats = model.forward_features(x)
    r = model.feature_info[-1]["reduction"]
    assert _feature_grid(model, feats) == (math.ceil(size[0] / r), math.ceil(size[1] / r))
    assert model(x).shape == (1, 1000)


def test_plain_padding_is_zero_padding(name):
    """A plain model on a non-multiple size equals the same model on the explicitly zero-padded image."""
    if name != "test_vit3_ttt":
        pytest.skip("plain models only")
    model = timm.create_model(name).eval()
    x = torch.randn(1, 3, 50, 70)
    padded = torch.nn.functional.pad(x, (0, 10, 0, 14))
    torch.testing.assert_close(model(x), model(padded))


def test_features_only(name):
    model = timm.create_model(name, features_only=True).eval()
    channels, reductions = model.feature_info.channels(), model.feature_info.reduction()
    assert len(channels) >= 3
    size = (48, 80)
    outs = model(torch.randn(1, 3, *size))
    assert len(outs) == len(channels)
    for c, r, o in zip(channels, reductions, outs):
        assert o.shape == (1, c, math.ceil(size[0] / r), math.ceil(size[1] / r))


def test_features_only_out_indices(name):
    model = timm.create_model(name, features_only=True, out_indices=(0, -1)).eval()
    base = timm.create_model(name).eval()
    n = len(base.feature_info)
    assert [i["index"] for i in model.feature_info.get_dicts()] == [0, n - 1]
    outs = model(torch.randn(1, 3, 64, 64))
    assert len(outs) == 2


def test_forward_intermediates_matches_forward_features(name):
    model = timm.create_model(name).eval()
    x = _input(model)
    final, inter = model.forward_intermediates(x)
    torch.testing.assert_close(final, model.forward_features(x))
    assert len(inter) == len(model.feature_info)
    for info, t in zip(model.feature_info, inter):
        r = info["reduction"]
        assert t.shape == (1, info["num_chs"], math.ceil(64 / r), math.ceil(64 / r))
    model.set_grad_checkpointing()
    final2, _ = model.forward_intermediates(x)
    torch.testing.assert_close(final2, final, rtol=1e-4, atol=1e-5)


def test_forward_intermediates_options(name):
    model = timm.create_model(name).eval()
    x = _input(model, size=(48, 80))
    n = len(model.feature_info)
    everything = model.forward_intermediates(x, intermediates_only=True)
    last2 = model.forward_intermediates(x, indices=2, intermediates_only=True)
    picked = model.forward_intermediates(x, indices=[0, -1], intermediates_only=True)
    for got, want in zip(last2, everything[-2:]):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(picked[0], everything[0])
    torch.testing.assert_close(picked[1], everything[n - 1])
    nhwc = model.forward_intermediates(x, output_fmt="NHWC", intermediates_only=True)
    for a, b in zip(nhwc, everything):
        torch.testing.assert_close(a, b.permute(0, 2, 3, 1))
    normed = model.forward_intermediates(x, indices=1, norm=True, intermediates_only=True)[0]
    final = model.forward_features(x)
    torch.testing.assert_close(normed, final if model.output_fmt == "NCHW" else final.permute(0, 3, 1, 2))
    _, inter = model.forward_intermediates(x, indices=[0], stop_early=True)
    torch.testing.assert_close(inter[0], everything[0])
    out = model.forward_intermediates(x, output_dict=True)
    torch.testing.assert_close(out["image_features"], final)
    for a, b in zip(out["image_intermediates"], everything, strict=True):
        torch.testing.assert_close(a, b)
    assert list(model.forward_intermediates(x, output_dict=True, intermediates_only=True)) == [
        "image_intermediates"
    ]
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NCL")


def test_prune_intermediate_layers(name):
    model = timm.create_model(name).eval()
    x = _input(model)
    want = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    kept = model.prune_intermediate_layers([0, 1], prune_norm=True)
    assert kept == [0, 1]
    assert model.num_classes == 0 and isinstance(model.norm, torch.nn.Identity)
    got = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    units = model.blocks if hasattr(model, "blocks") else model.stages
    assert len(units) == 2


def test_fx_forward_and_backward(name):
    model = timm.create_model(name).eval()
    x = _input(model)
    with torch.inference_mode():
        out = model(x)
        traced = fx_model(model)
        torch.testing.assert_close(fx_output(traced, x), out, rtol=0, atol=0)
    model = timm.create_model(name, num_classes=42).train()
    traced = fx_model(model)
    out = fx_output(traced, _input(model, batch=2))
    out.mean().backward()
    assert out.shape == (2, 42)
    assert all(p.grad is not None for p in traced.parameters())
    assert sum(p.numel() for p in traced.parameters()) == sum(p.numel() for p in model.parameters())


def test_group_matcher_covers_every_parameter(name):
    """timm's layer-decay grouping: stem first, blocks in order, every parameter in exactly one group."""
    model = timm.create_model(name)
    names = [n for n, _ in model.named_parameters()]
    for coarse in (False, True):
        groups = group_parameters(model, model.group_matcher(coarse=coarse))
        flat = [n for members in groups.values() for n in members]
        assert sorted(flat) == sorted(names)
        ordered = [members for _, members in sorted(groups.items())]
        assert all(n.startswith(("patch_embed", "stem")) for n in ordered[0])
        assert len(groups) >= 3
    assert isinstance(model.no_weight_decay(), set)


def test_set_input_size(name):
    model = timm.create_model(name)
    model.set_input_size(img_size=(96, 128))
    assert timm.models.get_model_input_config(model)["input_size"][-2:] == (96, 128)
    assert model(torch.randn(1, 3, 96, 128)).shape == (1, 1000)


def test_plain_set_input_size_patch_size(name):
    if name != "test_vit3_ttt":
        pytest.skip("patch size exists only for plain models")
    model = timm.create_model(name).eval()
    model.set_input_size(img_size=64, patch_size=8)
    assert model.patch_embed.proj.weight.shape[-2:] == (8, 8)
    assert model.forward_features(torch.randn(1, 3, 64, 64)).shape == (1, 8, 8, 32)
    assert model.feature_info[0]["reduction"] == 8


@pytest.mark.parametrize(
    "ttt_cfg",
    [
        dict(branches=("linear",), loss="mse"),
        dict(branches=("mlp", "dwconv:1"), mlp_ratio=2, steps=2, mini_batches=2),
        dict(lr_mode="token", inner_lr=0.5, grad_norm=False),
    ],
    ids=["linear-mse", "mlp-2steps-2minibatches", "token-lr"],
)
def test_design_space_variants_are_models(name, ttt_cfg):
    model = timm.create_model(name, ttt_cfg=ttt_cfg, num_classes=5)
    mixers = [m for m in model.modules() if isinstance(m, TTTMixer)]
    assert mixers
    for mixer in mixers:
        for key, value in ttt_cfg.items():
            assert getattr(mixer.cfg, key) == (tuple(value) if isinstance(value, tuple) else value), key
    out = model(torch.randn(2, 3, 48, 64))
    out.sum().backward()
    assert out.shape == (2, 5)
    assert all(p.grad is not None for p in model.parameters())


def test_hierarchical_rope_default_and_qkv_bias(name):
    model = timm.create_model(name, qkv_bias=False)
    mixers = [m for m in model.modules() if isinstance(m, TTTMixer)]
    assert all(m.qkv.bias is None for m in mixers)
    assert all(m.cfg.rope == name.startswith("test_h") for m in mixers)
    no_rope = timm.create_model(name, ttt_cfg=dict(rope=False))
    assert not any(m.cfg.rope for m in no_rope.modules() if isinstance(m, TTTMixer))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: torch.randn(1, 4, 64, 64), "input channels"),
        (lambda: torch.randn(1, 3, 8, 64), "too small"),
        (lambda: torch.full((1, 3, 64, 64), float("nan")), "non-finite"),
        (lambda: torch.randn(3, 64, 64), r"\[B, C, H, W\]"),
    ],
    ids=["channels", "too-small", "nan", "rank"],
)
def test_bad_input_raises(name, make, match):
    model = timm.create_model(name).eval()
    with pytest.raises(ValueError, match=match):
        model(make())
    with pytest.raises(ValueError, match=match):
        model.forward_intermediates(make())


def test_timm_dynamic_input_kwargs_are_accepted(name):
    """timm's ViTs take dynamic_img_size / dynamic_img_pad; vit3 models always run on any size."""
    model = timm.create_model(name, dynamic_img_size=True, dynamic_img_pad=True).eval()
    assert model(_input(model, size=(70, 90))).shape == (1, model.num_classes)
    feats = timm.create_model(name, features_only=True, dynamic_img_size=True)
    assert len(feats(_input(model, size=(70, 90)))) == len(feats.feature_info)
    if name != "test_vit3_ttt":
        with pytest.raises(ValueError, match=r"does not support dynamic_img_size=False: H-ViT³ always"):
            timm.create_model(name, dynamic_img_size=False)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"class_token": True}, "no class token"),
        ({"reg_tokens": 4}, "no register tokens"),
        ({"attn_drop_rate": 0.1}, "no attention probabilities"),
        ({"qk_norm": True}, "no attention logits"),
        ({"init_values": 1e-5}, "no LayerScale"),
        ({"pos_embed": "learn"}, "convolution"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_timm_vit_kwargs_that_make_no_sense_are_refused_by_name(name, kwargs, why):
    if name != "test_vit3_ttt":
        pytest.skip("timm's VisionTransformer kwargs: plain models")
    key, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"does not support {key}={value!r}: .*{why}"):
        timm.create_model(name, **kwargs)


def test_timm_vit_kwargs_that_describe_vit3_are_accepted_or_take_effect(name):
    if name != "test_vit3_ttt":
        pytest.skip("timm's VisionTransformer kwargs: plain models")
    same = dict(
        class_token=False, reg_tokens=0, pos_embed="none", no_embed_class=True, fc_norm=None, qk_norm=False
    )
    reference = timm.create_model(name).eval()
    model = timm.create_model(name, **same).eval()
    model.load_state_dict(reference.state_dict())
    x = _input(model)
    torch.testing.assert_close(model(x), reference(x))
    assert isinstance(timm.create_model(name, final_norm=False).norm, torch.nn.Identity)
    assert timm.create_model(name, pos_drop_rate=0.25).pos_drop.p == 0.25
    assert next(timm.create_model(name, dtype=torch.float64).parameters()).dtype == torch.float64
    strict = timm.create_model(name, dynamic_img_size=False)
    with pytest.raises(ValueError, match=r"built for 64x64 only \(dynamic_img_size=False\)"):
        strict(_input(model, size=(64, 80)))
    unpadded = timm.create_model(name, dynamic_img_pad=False)
    with pytest.raises(ValueError, match=r"multiples of the patch size 16x16 \(dynamic_img_pad=False\)"):
        unpadded(_input(model, size=(64, 70)))
    assert unpadded(_input(model, size=(64, 80))).shape == (1, model.num_classes)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_kwarg'"):
        timm.create_model(name, no_such_kwarg=1)


def test_qkv_bias_and_ttt_cfg_set_the_qkv_bias_once(name):
    """``qkv_bias`` (timm's kwarg) and ``ttt_cfg``'s ``qkv_bias`` both set it; a contradiction names both."""

    def qkv_biases(model):
        return [k for k in model.state_dict() if k.endswith("qkv.bias")]

    assert qkv_biases(timm.create_model(name)) and timm.create_model(name).ttt_cfg.qkv_bias is True
    for kwargs in (
        {"qkv_bias": False},
        {"ttt_cfg": {"qkv_bias": False}},
        {"ttt_cfg": TTTConfig(qkv_bias=False)},
    ):
        model = timm.create_model(name, **kwargs)
        assert model.ttt_cfg.qkv_bias is False and not qkv_biases(model), kwargs
    agree = timm.create_model(name, qkv_bias=False, ttt_cfg={"qkv_bias": False, "inner_lr": 0.5})
    assert agree.ttt_cfg.qkv_bias is False and agree.ttt_cfg.inner_lr == 0.5
    for ttt_cfg in ({"qkv_bias": False}, TTTConfig(qkv_bias=False)):
        with pytest.raises(ValueError, match=r"qkv_bias=True contradicts ttt_cfg qkv_bias=False"):
            timm.create_model(name, qkv_bias=True, ttt_cfg=ttt_cfg)
