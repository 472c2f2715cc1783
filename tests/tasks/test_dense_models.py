"""Dense models on vit3 backbones: feature pyramids, torchvision detectors, segmentation heads and inference,
and the backbone fine-tuning controls (layer ids, drop path, gradient checkpointing; their lr groups:
``tests/engine/test_optim.py``)."""

from __future__ import annotations

import pytest
import timm
import torch
from helpers.common import load_fixture
from torch import nn

import vit3  # noqa: F401  (registers the vit3 models)
from vit3.engine.dense import load_backbone_weights
from vit3.tasks.backbone import (
    FeatureBackbone,
    PyramidBackbone,
    SimplePyramid,
    block_layer_ids,
    pyramid_backbone,
)
from vit3.tasks.detection import build_detector
from vit3.tasks.segmentation import SegmentationModel, build_segmenter

BACKBONES = {"hierarchical": "test_h_vit3", "plain": "test_vit3_ttt"}
TINY_DET = dict(
    min_size=64,
    max_size=96,
    out_channels=32,
    box_head_dim=64,
    mask_head_dim=16,
    anchor_sizes=(8, 16, 32, 64, 128),
    rpn_pre_nms_top_n_train=100,
    rpn_post_nms_top_n_train=50,
    rpn_pre_nms_top_n_test=50,
    rpn_post_nms_top_n_test=20,
    box_batch_size_per_image=32,
)


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ pyramids
@pytest.mark.parametrize("kind", BACKBONES)
def test_pyramid_backbone_gives_strides_4_to_32(kind):
    body = pyramid_backbone(BACKBONES[kind])
    assert body.backbone.hierarchical == (kind == "hierarchical")
    feats = body(torch.rand(2, 3, 64, 96))
    assert [tuple(f.shape) for f in feats] == [
        (2, c, 64 // s, 96 // s) for c, s in zip(body.channels, (4, 8, 16, 32))
    ]


def test_simple_pyramid_halves_channels_per_upsampling_and_pools_down():
    sp = SimplePyramid(32, in_stride=16)
    assert sp.channels == [8, 16, 32, 32]
    x = torch.rand(1, 32, 4, 6)
    assert [tuple(f.shape) for f in sp(x)] == [(1, 8, 16, 24), (1, 16, 8, 12), (1, 32, 4, 6), (1, 32, 2, 3)]
    assert torch.equal(sp(x)[2], x)  # stride 16 -> 16 is the identity without out_channels
    assert torch.equal(sp(x)[3], nn.functional.max_pool2d(x, 2))
    assert SimplePyramid(32, 16, out_channels=24).channels == [24] * 4
    with pytest.raises(ValueError, match="power-of-two"):
        SimplePyramid(32, in_stride=12)


# ----------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize("arch", ["mask_rcnn", "faster_rcnn"])
@pytest.mark.parametrize("kind", BACKBONES)
def test_detector_trains_and_predicts(kind, arch):
    model = build_detector(BACKBONES[kind], num_classes=2, arch=arch, **TINY_DET)
    images = [torch.rand(3, 64, 80), torch.rand(3, 72, 64)]
    targets = []
    for img in images:
        mask = torch.zeros(1, *img.shape[1:], dtype=torch.uint8)
        mask[0, 10:40, 12:30] = 1
        targets.append(
            {"boxes": torch.tensor([[12.0, 10.0, 30.0, 40.0]]), "labels": torch.tensor([2]), "masks": mask}
        )
    losses = model(images, targets)
    want = {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"} | (
        {"loss_mask"} if arch == "mask_rcnn" else set()
    )
    assert set(losses) == want and all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    assert (
        model.backbone.backbone.body.model.stem[0].conv.weight.grad is not None
        if kind == "hierarchical"
        else True
    )
    model.eval()
    out = model([images[0]])[0]
    assert out["boxes"].shape[1] == 4 and ("masks" in out) == (arch == "mask_rcnn")
    assert model.transform.image_mean == list(model.backbone.backbone.data_config["mean"])


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"arch": "yolo"}, "unknown detection arch"),
        ({"num_classes": 0}, "num_classes"),
        ({"anchor_sizes": (8, 16)}, "one size per level"),
    ],
)
def test_detector_rejects_bad_arguments(bad, match):
    kwargs = {"num_classes": 2, **bad}
    with pytest.raises(ValueError, match=match):
        build_detector("test_h_vit3", **kwargs)


# -------------------------------------------------------------------------------------- segmentation
@pytest.mark.parametrize("head", ["upernet", "semantic_fpn"])
@pytest.mark.parametrize("kind", BACKBONES)
def test_segmenter_losses_and_prediction_shapes(kind, head):
    model = build_segmenter(BACKBONES[kind], num_classes=3, head=head, head_channels=16)
    x, y = torch.rand(2, 3, 64, 64), torch.randint(0, 3, (2, 64, 64))
    y[0, :8] = 255
    losses = model(x, y)
    assert set(losses) == {"loss_seg", "loss_aux"} and all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    model.eval()
    assert model(x).shape == (2, 3, 16, 16)
    prob = model.predict(torch.rand(1, 3, 70, 50), out_size=(35, 25))
    assert prob.shape == (1, 3, 35, 25) and torch.allclose(prob.sum(1), torch.ones(1, 35, 25))


def test_segmentation_loss_ignores_255():
    model = build_segmenter(
        "test_h_vit3", num_classes=3, head="semantic_fpn", head_channels=8, aux_weight=0
    ).eval()
    x, y = torch.rand(2, 3, 64, 64), torch.randint(0, 3, (2, 64, 64))
    y2 = y.clone()
    y2[:, :32] = 255
    logits = nn.functional.interpolate(model(x), size=(64, 64), mode="bilinear", align_corners=False)
    want = nn.functional.cross_entropy(logits[:, :, 32:], y[:, 32:])
    assert torch.allclose(model(x, y2)["loss_seg"], want, atol=1e-6)


class _PointwiseSegmenter(nn.Module):
    """A 1x1-conv "segmenter": its logits at a pixel depend on that pixel only, so every window agrees."""

    predict = SegmentationModel.predict
    _logits = SegmentationModel._logits

    def __init__(self) -> None:
        super().__init__()
        self.num_classes = 4
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return self.conv(x)


@pytest.mark.parametrize(
    "crop, stride",
    [((32, 32), (16, 16)), ((40, 24), (30, 20)), ((64, 64), (64, 64))],
    ids=["overlap", "uneven", "one-window"],
)
def test_slide_inference_matches_whole_for_a_pointwise_model(crop, stride):
    model = _PointwiseSegmenter()
    x = torch.rand(2, 3, 50, 70)
    whole = model.predict(x, mode="whole", size_divisor=1)
    slide = model.predict(x, mode="slide", crop_size=crop, stride=stride, size_divisor=1)
    torch.testing.assert_close(slide, whole)
    with pytest.raises(ValueError, match="unknown inference mode"):
        model.predict(x, mode="tiles")


def test_slide_inference_of_a_real_model_equals_whole_when_one_window_covers_the_image():
    model = build_segmenter("test_vit3_ttt", num_classes=3, head="upernet", head_channels=16).eval()
    x = torch.rand(1, 3, 64, 64)
    torch.testing.assert_close(
        model.predict(x, mode="slide", crop_size=(64, 64), stride=(48, 48)), model.predict(x)
    )


# ------------------------------------------------------------------------------- fine-tuning controls
@pytest.mark.parametrize("kind", BACKBONES)
def test_layer_ids_follow_block_depth(kind):
    body = FeatureBackbone(BACKBONES[kind]).body
    ids, n = block_layer_ids(body)
    names = list(ids)
    blocks = [m for k, m in body.named_modules() if k.endswith(".blocks")]
    assert n == sum(len(b) for b in blocks) + 2
    values = [ids[k] for k in names]
    assert values[0] == 0 and values == sorted(values)  # registration order is depth order
    assert set(range(1, n - 1)) <= set(values)  # every block has its own id
    assert ids[next(k for k in names if ".blocks.0." in k)] == 1  # the first block of the model
    if kind == "hierarchical":  # stage 2's downsampling takes the id of the stage's first block
        down = next(k for k in names if k.startswith("model.stages.1.") and ".blocks." not in k)
        assert ids[down] == ids[next(k for k in names if k.startswith("model.stages.1.blocks.0."))]


def test_drop_path_reaches_the_backbone():
    model = build_segmenter(
        "test_h_vit3", 3, "semantic_fpn", head_channels=8, backbone_kwargs={"drop_path_rate": 0.2}
    )
    rates = [m.drop_prob for m in model.modules() if type(m).__name__ == "DropPath"]
    assert rates and max(rates) == pytest.approx(0.2)


@pytest.mark.parametrize("kind", BACKBONES)
def test_grad_checkpointing_saves_fewer_activations_and_keeps_gradients(kind):
    backbone = FeatureBackbone(
        BACKBONES[kind]
    ).eval()  # eval: no dropout, both passes compute the same function
    x = torch.rand(2, 3, 64, 64)

    def run():
        """Gradients, and the number of values autograd kept for the backward pass."""
        saved = [0]

        def pack(t):
            saved[0] += t.numel()
            return t

        backbone.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = sum((f**2).mean() for f in backbone(x))
        loss.backward()
        return [p.grad.clone() for p in backbone.parameters() if p.grad is not None], saved[0]

    ref, saved_plain = run()
    backbone.set_grad_checkpointing(True)
    got, saved_ckpt = run()
    assert saved_ckpt < 0.7 * saved_plain  # the blocks' activations are recomputed, not stored
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_backbone_weights_load_from_a_classification_state_dict(tmp_path):
    full = timm.create_model("test_h_vit3", num_classes=5)
    torch.save({"model": full.state_dict()}, tmp_path / "cls.pth")
    backbone = FeatureBackbone("test_h_vit3")
    missing = load_backbone_weights(backbone, str(tmp_path / "cls.pth"))
    assert all(k.startswith("norm") or "norm" in k for k in missing)
    src = full.state_dict()
    body = backbone.body.state_dict()
    assert torch.equal(body["model.stem.0.conv.weight"], src["stem.0.conv.weight"])
    torch.save({"model": {"unrelated.weight": torch.zeros(3)}}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="none of its 1 weights fit"):
        load_backbone_weights(backbone, str(tmp_path / "bad.pth"))


@pytest.mark.parametrize(
    ("fixture", "arch"),
    [("vit3_plain_tiny_cfg.pt", "vit3_tiny"), ("vit3_hier_tiny_cfg.pt", "h_vit3_tiny")],
    ids=["plain", "hierarchical"],
)
def test_backbone_weights_of_an_official_file_are_timms_pretrained_weights(fixture, arch, tmp_path):
    """An official ViTTT file (its own key names) fills the backbone as timm's pretrained path does: every
    weight the two share, the mixers' inner weights and H-ViT³'s renamed stages included."""
    fx = load_fixture(fixture)
    path = tmp_path / "official.pth"
    torch.save({"model": fx["state_dict"], "epoch": 300}, path)
    kwargs = {k: v for k, v in fx["config"].items() if k != "num_classes"}
    if arch.startswith("h_"):
        kwargs.pop("img_size")  # the official H-ViT³ fixes its grid from img_size; ours reads the input
    want = FeatureBackbone(arch, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs)
    backbone = FeatureBackbone(arch, **kwargs)
    missing = load_backbone_weights(backbone, str(path))
    got, ref = backbone.body.state_dict(), want.body.state_dict()
    assert all("norm" in k for k in missing)
    assert all(torch.equal(got[k], ref[k]) for k in ref if k not in missing)
    assert any(".inner." in k for k in ref)


def test_pyramid_backbone_requires_the_strides():
    class Fake(nn.Module):
        hierarchical, strides, channels = True, [4, 8, 16], [8, 8, 8]

    with pytest.raises(ValueError, match="missing \\[32\\]"):
        PyramidBackbone(Fake())


@pytest.mark.parametrize(
    "config, num_classes, millions",
    [("mask_rcnn_h_vit3_tiny_coco_1x.yaml", 80, 48.4), ("upernet_h_vit3_tiny_ade20k.yaml", 150, 57.9)],
    ids=["mask-rcnn", "upernet"],
)
def test_param_counts_match_the_official_dense_models(config, num_classes, millions):
    """The official README: Mask R-CNN H-ViT³-T 48.4M, UperNet H-ViT³-T 57.9M (without the auxiliary head)."""
    from vit3.engine import load_config
    from vit3.engine.config import CONFIG_DIR
    from vit3.engine.dense import build_dense_model

    model = build_dense_model(load_config(CONFIG_DIR / "dense" / config), num_classes)
    aux = getattr(model, "aux_head", None)
    n = sum(p.numel() for p in model.parameters()) - (sum(p.numel() for p in aux.parameters()) if aux else 0)
    assert n / 1e6 == pytest.approx(millions, abs=0.05)
