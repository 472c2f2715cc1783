"""vit3 models under code written for timm: the plain ViT³ answers timm's ``VisionTransformer`` API as a
prefix-free ViT does (``forward_intermediates`` options; ``forward_features`` gives the map of its tokens, as
timm's Swin), and a plain and a hierarchical model go through what timm's ``train.py`` (AMP),
``validate.py`` and ``benchmark.py`` do with a model, by the same public timm APIs (the scripts ship in
timm's repository, not in its wheel); every name vit3 puts in timm's registry builds from its defaults and
passes what timm's own tests/test_models.py checks of each name (their real-tensor runs of the paper's
sizes under -m slow)."""

from __future__ import annotations

import fnmatch
import inspect
import math
from functools import partial

import pytest
import timm
import torch
from helpers.models import FULL_MODELS, TINY_MODELS
from helpers.train import make_digit_folder
from timm.data import Mixup, create_dataset, create_loader, resolve_data_config
from timm.layers import get_channel_dim, get_spatial_dim
from timm.loss import SoftTargetCrossEntropy
from timm.models import save_for_hf
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import AverageMeter, ModelEmaV3, NativeScaler, accuracy, dispatch_clip_grad

import vit3  # noqa: F401  (registers the vit3 models)
from vit3.errors import CheckpointMismatchError

pytestmark = pytest.mark.usefixtures("one_thread")

# timm's VisionTransformer in test_vit3_ttt's shape, without prefix tokens (no class or register token)
VIT = dict(img_size=64, patch_size=16, embed_dim=32, depth=3, num_heads=2, mlp_ratio=2.0, num_classes=5,
           class_token=False, global_pool="avg", dynamic_img_size=True)  # fmt: skip


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ours = timm.create_model("test_vit3_ttt", num_classes=5).eval()
    return ours, timm.create_model("vit_tiny_patch16_224", **VIT).eval()


def _structure(out):
    """Types, dict keys, list lengths and tensor shapes of a (nested) output."""
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, dict):
        return {k: _structure(v) for k, v in out.items()}
    return type(out).__name__, [_structure(v) for v in out]


OPTIONS = [
    pytest.param({}, id="default"),
    pytest.param(dict(output_fmt="NLC"), id="NLC"),
    pytest.param(dict(output_dict=True), id="dict"),
    pytest.param(dict(output_dict=True, intermediates_only=True), id="dict-only"),
    pytest.param(dict(return_prefix_tokens=True), id="prefix"),
    pytest.param(dict(return_prefix_tokens=True, output_dict=True, output_fmt="NLC"), id="prefix-dict-NLC"),
    pytest.param(dict(indices=[0, -1], norm=True), id="indices-norm"),
    pytest.param(dict(indices=1, stop_early=True, intermediates_only=True), id="stop-early"),
]


def _as_tokens(out):
    """``forward_intermediates``' output with its final features (a map ``[B, h, w, C]``) as tokens."""
    if isinstance(out, dict):
        return {k: v.flatten(1, 2) if k == "image_features" else v for k, v in out.items()}
    return (out[0].flatten(1, 2), out[1]) if isinstance(out, tuple) else out


@pytest.mark.parametrize("kwargs", OPTIONS)
def test_plain_forward_intermediates_answers_as_timms_vision_transformer(kwargs):
    """The same intermediates; the final features are ``forward_features``' map, timm's tokens flattened."""
    ours, vit = _pair()
    x = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        assert _structure(_as_tokens(ours.forward_intermediates(x, **kwargs))) == _structure(
            vit.forward_intermediates(x, **kwargs)
        )


def test_plain_features_are_a_map_of_timms_tokens_and_its_head_pools_it():
    """``forward_features``: the map ``[B, h, w, C]`` (``output_fmt='NHWC'``, timm's spatial models), whose
    raster-order tokens have the shape of timm's ViT's; ``forward_head`` pools it as timm's ViT its tokens."""
    ours, vit = _pair()
    x = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        feats = ours.forward_features(x)
        assert ours.output_fmt == "NHWC" and feats.shape == (2, 4, 5, 32)
        assert feats.flatten(1, 2).shape == vit.forward_features(x).shape
        assert ours.num_prefix_tokens == vit.num_prefix_tokens == 0
        torch.testing.assert_close(ours.forward_head(feats), ours(x))
        pooled = ours.forward_head(feats, pre_logits=True)
        assert pooled.shape == vit.forward_head(vit.forward_features(x), pre_logits=True).shape
        torch.testing.assert_close(pooled, feats.mean((1, 2)), rtol=0, atol=0)
        last = ours.forward_intermediates(x, indices=1, norm=True, output_fmt="NHWC", intermediates_only=True)
        torch.testing.assert_close(feats, last[0])  # the normed last block
        out = ours.forward_intermediates(x, output_dict=True, return_prefix_tokens=True)
        torch.testing.assert_close(out["image_features"], feats)
        plain = ours.forward_intermediates(x, intermediates_only=True)
        for a, b in zip(out["image_intermediates"], plain):  # no prefix tokens: the same intermediates
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(attn_mask=torch.ones(20, 20, dtype=torch.bool)), r"attn_mask: ViT³ has no attention to mask"),
        (dict(is_causal=True), r"is_causal=True: the TTT mixer is non-causal"),
        (dict(output_fmt="NCL"), r"output_fmt must be 'NCHW', 'NLC' or 'NHWC'"),
    ],
    ids=["attn_mask", "is_causal", "NCL"],
)
def test_plain_refuses_what_a_ttt_model_cannot_honour_saying_why(kwargs, match):
    ours, _ = _pair()
    x = torch.randn(1, 3, 64, 80)
    with pytest.raises(ValueError, match=match):
        ours.forward_intermediates(x, **kwargs)
    if "output_fmt" not in kwargs:
        with pytest.raises(ValueError, match=match):
            ours.forward_features(x, **kwargs)


# ------------------------------------------------------------------------------- timm's scripts as clients
CLIENT_MODELS = ["test_vit3_ttt", "test_h_vit3"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def digit_folder(tmp_path_factory):
    """Real MNIST digits 0-3 as an image folder: 8 train / 4 val images per class."""
    return make_digit_folder(tmp_path_factory.mktemp("digits"), n_train=8, n_val=4)


def _loader(model, root, training: bool, batch: int):
    """``create_dataset`` + ``create_loader`` on the model's resolved data config, as the scripts build them
    (CPU: no prefetcher)."""
    config = resolve_data_config({}, model=model)
    split = "train" if training else "val"
    dataset = create_dataset("", root=str(root), split=split, is_training=training)
    return create_loader(
        dataset, input_size=config["input_size"], batch_size=batch, is_training=training,
        interpolation=config["interpolation"], mean=config["mean"], std=config["std"],
        crop_pct=config["crop_pct"], num_workers=0, use_prefetcher=False, device=CPU,
    )  # fmt: skip


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", CLIENT_MODELS)
def test_timm_train_loop_with_amp(name, amp, digit_folder):
    """train.py's ``train_one_epoch`` with ``--amp``: mixup, the forward and loss under ``torch.autocast``,
    backward after it (through ``NativeScaler`` for fp16), grad clipping, EMA, per-step lr updates."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=4, drop_path_rate=0.1)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=1, updates_per_epoch=4)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=4)
    loss_fn, ema = SoftTargetCrossEntropy(), ModelEmaV3(model, decay=0.9)
    amp_autocast = partial(torch.autocast, device_type="cpu", dtype=amp)
    loss_scaler = NativeScaler(device="cpu") if amp == torch.float16 else None
    before = [p.detach().clone() for p in model.parameters()]
    model.train()
    for step, (x, y) in enumerate(_loader(model, digit_folder, training=True, batch=8)):
        x, y = mixup(x, y)
        with amp_autocast():
            loss = loss_fn(model(x), y)
        assert torch.isfinite(loss)
        optimizer.zero_grad()
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=5.0, parameters=model.parameters())
        else:
            loss.backward()
            dispatch_clip_grad(model.parameters(), 5.0)
            optimizer.step()
        ema.update(model, step=step)
        scheduler.step_update(num_updates=step + 1)
    assert step == 3
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    assert sum(moved) > len(moved) // 2 and all(torch.isfinite(p).all() for p in ema.module.parameters())


@pytest.mark.parametrize("name", CLIENT_MODELS)
def test_timm_validate_loop(name, digit_folder):
    """validate.py: the eval loader, the forward under ``no_grad`` + autocast, ``accuracy`` /
    ``AverageMeter``."""
    model = timm.create_model(name, num_classes=4).eval()
    top1, top3 = AverageMeter(), AverageMeter()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for x, y in _loader(model, digit_folder, training=False, batch=8):
            acc1, acc3 = accuracy(model(x).float(), y, topk=(1, 3))
            top1.update(acc1.item(), x.size(0))
            top3.update(acc3.item(), x.size(0))
    assert top1.count == 16 and 0.0 <= top1.avg <= top3.avg <= 100.0


@pytest.mark.parametrize("name", CLIENT_MODELS)
def test_timm_benchmark_steps(name):
    """benchmark.py's inference and training runners: channels-last model and input, AMP forward, the loss
    and backward after the autocast region, an optimizer step."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).to(memory_format=torch.channels_last)
    shape = (2, *resolve_data_config({}, model=model)["input_size"])
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    amp_autocast = partial(torch.autocast, device_type="cpu", dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad(), amp_autocast():
        assert model(x).shape == (2, 10)
    model.train()
    optimizer = create_optimizer_v2(model, "sgd", lr=1e-4)
    target = torch.empty(2, dtype=torch.long).random_(10)
    for _ in range(2):
        optimizer.zero_grad()
        with amp_autocast():
            output = model(x)
        loss = torch.nn.functional.cross_entropy(output, target)
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)


# ------------------------------------------------------------------ timm's model suite on every vit3 name
def _registered_by_vit3() -> list[str]:
    """Every name vit3 adds to timm's registry: the entrypoints its modules define."""
    return sorted(
        n for n in timm.list_models() if timm.models.model_entrypoint(n).__module__.startswith("vit3.")
    )


REGISTERED = _registered_by_vit3()
# the paper's sizes run their real-tensor checks under -m slow; the meta-device checks run for every name
SUITE_NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in FULL_MODELS else n for n in REGISTERED]
CFG_KEYS = ("input_size", "num_classes", "mean", "std", "interpolation", "crop_pct", "first_conv",
            "classifier")  # fmt: skip
META = torch.device("meta")


def _grid(model, feats: torch.Tensor) -> tuple[int, ...]:
    """The spatial size of ``forward_features``' output, by the model's ``output_fmt``."""
    return tuple(feats.shape[i] for i in get_spatial_dim(getattr(model, "output_fmt", "NCHW")))


def _pool_grid(model) -> tuple[int, ...]:
    """What ``_grid`` gives at the cfg's input size: the cfg's ``pool_size``."""
    return tuple(model.pretrained_cfg["pool_size"])


def _suite_input(model, target: int, batch: int = 1) -> torch.Tensor:
    """timm's ``_get_input_size``: the cfg's input size, capped at ``target`` unless the size is fixed."""
    c, h, w = model.pretrained_cfg["input_size"]
    if not model.pretrained_cfg.get("fixed_input_size") and max(h, w) > target:
        h, w = min(h, target), min(w, target)
    return torch.randn(batch, c, h, w)


def test_the_suite_sees_every_name_vit3_registers():
    assert {"vit3_tiny", "h_vit3_base", "test_vit3_ttt", "test_h_vit3", "ttt_swap"} <= set(REGISTERED)
    assert not [n for n in REGISTERED if n.startswith("dit3")]  # DiT³ is no timm classifier


@pytest.mark.parametrize("name", REGISTERED)
def test_every_registered_name_builds_from_its_defaults_on_meta(name):
    """timm's test_model_default_cfgs without the forward: build with the defaults (``device='meta'``, as timm
    does), the cfg keys its tests read, the model API contract, the factory device, reset and resize."""
    from timm.models import group_parameters

    with META:
        model = timm.create_model(name, device=META, dtype=torch.float32).eval()
    cfg = model.default_cfg
    assert cfg == model.pretrained_cfg and all(cfg.get(k) not in (None, "") for k in CFG_KEYS), cfg
    assert model.in_chans == cfg["input_size"][0] == len(cfg["mean"]) == len(cfg["std"])
    assert cfg["num_classes"] == model.num_classes > 0 and model.num_features > 0 < model.head_hidden_size
    assert len(cfg["pool_size"]) == 2 == len(get_spatial_dim(getattr(model, "output_fmt", "NCHW")))
    names = [n for n, _ in model.named_parameters()]
    assert f"{cfg['classifier']}.weight" in names and f"{cfg['first_conv']}.weight" in names
    assert len(set(group_parameters(model, model.group_matcher(coarse=False), reverse=True).values())) > 1
    assert all(any(fnmatch.fnmatch(n, p) for n in names) for p in model.no_weight_decay())
    assert inspect.signature(model.reset_classifier).parameters["global_pool"].default is None
    with pytest.raises(TypeError):
        timm.create_model(name, device=META, not_a_model_arg=1)
    placed = timm.create_model(name, device=META, dtype=torch.float32)  # no device context: the kwarg
    assert all(t.device == META for t in [*placed.parameters(), *placed.buffers()])
    model.to(dtype=torch.float64)
    model.reset_classifier(0)
    model.reset_classifier(2)
    assert all(p.device == META and p.dtype == torch.float64 for p in model.get_classifier().parameters())
    assert not any(m.training for m in model.modules())
    frozen = timm.create_model(name, device=META).requires_grad_(False)
    frozen.reset_classifier(0)
    frozen.reset_classifier(0, "")
    frozen.set_input_size(img_size=tuple(2 * s for s in cfg["input_size"][-2:]))
    assert not [n for n, p in frozen.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("name", SUITE_NAMES)
def test_every_registered_name_forwards_as_timms_suite_checks(name):
    """timm's test_model_forward (grad checkpointing changes nothing) and the forward part of
    test_model_default_cfgs at the cfg's input size: features on the cfg's ``pool_size`` grid, pre-logits,
    the classifier removed by ``reset_classifier`` and by ``num_classes=0`` / ``global_pool=''``."""
    model = timm.create_model(name).eval()
    x = _suite_input(model, 448)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (1, model.num_classes) and not out.isnan().any()
        model.set_grad_checkpointing()
        torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-5)
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert _grid(model, feats) == _pool_grid(model)
        channel_dim = getattr(model, "feature_dim", get_channel_dim(getattr(model, "output_fmt", "NCHW")))
        assert feats.shape[channel_dim] == model.num_features
        assert pre.shape == (1, model.head_hidden_size)
        model.reset_classifier(0)
        torch.testing.assert_close(model(x), pre)
        model.reset_classifier(0, "")
        assert _grid(model, model(x)) == _pool_grid(model)
        headless = timm.create_model(name, num_classes=0).eval()
        assert headless(x).shape == pre.shape
        unpooled = timm.create_model(name, num_classes=0, global_pool="").eval()
        assert _grid(model, unpooled(x)) == _pool_grid(model)
        model.to(torch.bfloat16)
        assert model(x.bfloat16()).dtype == torch.bfloat16  # a dtype change after a forward


@pytest.mark.parametrize("name", SUITE_NAMES)
def test_every_registered_name_trains_and_gives_features_as_timms_suite_checks(name):
    """timm's test_model_backward (every parameter gets a gradient) and test_model_forward_features (at least
    three levels, each of its ``feature_info`` channels, on a grid of about input / reduction)."""
    model = timm.create_model(name, num_classes=42).train()
    out = model(_suite_input(model, 128, batch=2))
    out.mean().backward()
    assert out.shape == (2, 42) and not out.isnan().any()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    features = timm.create_model(name, features_only=True).eval()
    channels, reductions = features.feature_info.channels(), features.feature_info.reduction()
    x = _suite_input(features, 96)
    with torch.no_grad():
        outs = features(x)
    assert len(channels) >= 3 and len(outs) == len(channels)
    fmt = getattr(features, "output_fmt", "NCHW")
    for c, r, o in zip(channels, reductions, outs):
        assert o.shape[get_channel_dim(fmt)] == c and not o.isnan().any()
        for axis, size in zip(get_spatial_dim(fmt), x.shape[-2:]):
            assert size / (2 * r) < o.shape[axis] <= math.ceil(size / r) + 1


# ------------------------------------------------------------------------ saved models load the timm way
def _tiny(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=5, in_chans=1, img_size=48, **kwargs).eval()


def _same_outputs(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """``a`` and ``b`` give the same logits (eval mode) on one-channel 48 px images."""
    x = torch.randn(2, 1, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(b.eval()(x), a.eval()(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_save_for_hf_folder_loads_with_local_dir(name, tmp_path):
    """timm's ``save_for_hf`` then ``create_model("local-dir:<folder>", pretrained=True)``: the model and its
    weights, as for timm's own models (the folder is timm's to read, not a checkpoint file)."""
    model = _tiny(name)
    save_for_hf(model, tmp_path / "saved")
    loaded = timm.create_model(f"local-dir:{tmp_path / 'saved'}", pretrained=True).eval()
    assert loaded.num_classes == 5 and loaded.in_chans == 1
    _same_outputs(model, loaded)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_an_hf_hub_id_loads_from_the_local_hub_cache(name, tmp_path, monkeypatch):
    """``create_model("hf-hub:org/name", pretrained=True)`` offline, from a Hugging Face cache (the layout
    ``huggingface_hub`` downloads into: ``models--org--name/snapshots/<commit>/``, ``refs/main``)."""
    from huggingface_hub import constants

    model = _tiny(name)
    repo, commit = tmp_path / "hub" / "models--org--tiny", "0123456789abcdef0123456789abcdef01234567"
    save_for_hf(model, repo / "snapshots" / commit, safe_serialization=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _same_outputs(model, timm.create_model("hf-hub:org/tiny", pretrained=True).eval())
    with pytest.raises(ValueError, match="pretrained_ema=True takes the EMA weights of a checkpoint file"):
        timm.create_model("hf-hub:org/tiny", pretrained=True, pretrained_ema=True)


def _record_checkpoint(path, name: str, model: torch.nn.Module, ema: torch.nn.Module) -> str:
    """A vit3 training checkpoint of ``model`` (trained at 48 px on normalised one-channel images)."""
    from vit3.engine.checkpoint import save_checkpoint

    kwargs = {"in_chans": 1, "mlp_ratio": 3.0, "drop_path_rate": 0.1}
    record = {
        "name": name, "kwargs": kwargs, "in_chans": 1, "img_size": 48, "num_classes": 4,
        "classes": ["a", "b", "c", "d"], "mean": [0.25], "std": [0.5], "interpolation": "bilinear",
        "crop_pct": 0.9,
    }  # fmt: skip
    state = {"record": record, "model": model.state_dict(), "ema": ema.state_dict(), "model_name": name}
    return str(save_checkpoint(path, {**state, "model_kwargs": kwargs, "num_classes": 4}))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_vit3_checkpoint_builds_the_model_and_preprocessing_of_its_record(name, tmp_path):
    """``pretrained_cfg_overlay=dict(file=<vit3 checkpoint>)``: the record's kwargs, channels, classes, size
    and normalisation, so that timm's data config is the one the weights were trained with."""
    torch.manual_seed(0)
    trained, ema = (timm.create_model(name, num_classes=4, in_chans=1, mlp_ratio=3.0).eval() for _ in "ab")
    path = _record_checkpoint(tmp_path / "best.pt", name, trained, ema)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path)).eval()
    _same_outputs(trained, model)
    config = timm.data.resolve_model_data_config(model)
    assert config["input_size"] == (1, 48, 48) and config["interpolation"] == "bilinear"
    assert config["mean"] == (0.25,) and config["std"] == (0.5,) and config["crop_pct"] == 0.9
    assert model.pretrained_cfg["label_names"] == ("a", "b", "c", "d") and model.num_classes == 4
    with torch.no_grad():  # the cfg's pool_size is the feature grid at its input size
        assert _grid(model, model.forward_features(torch.randn(1, 1, 48, 48))) == _pool_grid(model)
    file = dict(file=path)
    _same_outputs(
        ema, timm.create_model(name, pretrained=True, pretrained_ema=True, pretrained_cfg_overlay=file)
    )
    with pytest.warns(UserWarning, match=r"drop_path_rate=0 differs from .*best.pt's 0.1: using 0"):
        head = timm.create_model(
            name, pretrained=True, pretrained_cfg_overlay=file, num_classes=3, drop_path_rate=0
        )
    stem = head.pretrained_cfg["first_conv"] + ".weight"
    assert head.num_classes == 3 and torch.equal(head.state_dict()[stem], trained.state_dict()[stem])
    other = next(n for n in TINY_MODELS if n != name)
    with pytest.raises(CheckpointMismatchError, match=rf"holds a '{name}' .*, not a '{other}'"):
        timm.create_model(other, pretrained=True, pretrained_cfg_overlay=dict(file=path))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_meta_device_forward_gives_the_shapes(name):
    """timm's config tests run the forward on the meta device (no memory): it gives the logits' and the
    features' shapes, as a real forward does."""
    model = timm.create_model(name, device="meta")
    x = torch.empty(2, *model.pretrained_cfg["input_size"], device="meta")
    with torch.no_grad():
        real = timm.create_model(name).eval()
        want = real.forward_features(torch.randn(2, *model.pretrained_cfg["input_size"]))
    assert model(x).shape == (2, model.num_classes)
    assert model.forward_features(x).shape == want.shape
