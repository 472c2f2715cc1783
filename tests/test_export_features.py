"""Feature export: safetensors files of multi-scale backbone features for a folder of images, with a
manifest."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torchvision import transforms as T

import vit3  # noqa: F401  (registers the vit3 models)
from vit3.data.synthetic_dense import make_canvases
from vit3.export import FeatureExtractor, export_features

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the test models' pretrained_cfg


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """Three real-digit canvases of different sizes and aspect ratios."""
    root = tmp_path_factory.mktemp("images")
    for i, size in enumerate([(64, 64), (72, 96), (90, 70)]):
        Image.fromarray(make_canvases(1, size, digit_size=(20, 30), seed=i)[0].image).save(
            root / f"img{i}.png"
        )
    return root


def _reference_features(model: FeatureExtractor, path, size: int) -> list[torch.Tensor]:
    """Independent preprocessing (torchvision resize + center crop + normalise) and the raw timm feature
    model."""
    tf = T.Compose(
        [
            T.Resize(size, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(MEAN, STD),
        ]
    )
    with torch.no_grad():
        return model.backbone.body(tf(Image.open(path).convert("RGB"))[None])


@pytest.mark.parametrize(
    "name, strides",
    [("test_h_vit3", [4, 8, 16, 32]), ("test_vit3_ttt", [16, 16, 16])],
    ids=["hierarchical", "plain"],
)
def test_features_and_manifest(image_dir, tmp_path, name, strides):
    model = FeatureExtractor(name)
    manifest = json.loads(
        export_features(model, image_dir, tmp_path, img_size=64, crop_pct=1.0, batch_size=2).read_text()
    )
    assert manifest["model"] == name and [f["stride"] for f in manifest["features"]] == strides
    assert manifest["preprocessing"]["mean"] == list(MEAN) and manifest["preprocessing"]["input_size"] == [
        3,
        64,
        64,
    ]
    assert [f["shape"] for f in manifest["features"]] == [
        [f["channels"], 64 // s, 64 // s] for f, s in zip(manifest["features"], strides)
    ]
    assert [f["image"] for f in manifest["files"]] == ["img0.png", "img1.png", "img2.png"]
    for entry in manifest["files"]:
        stored = load_file(tmp_path / entry["file"])
        ref = _reference_features(model, image_dir / entry["image"], 64)
        assert list(stored) == [f["name"] for f in manifest["features"]]
        for f, r in zip(manifest["features"], ref):
            torch.testing.assert_close(stored[f["name"]], r[0], rtol=1e-4, atol=1e-4)


def test_half_precision_export_and_its_metadata(image_dir, tmp_path):
    model = FeatureExtractor("test_h_vit3")
    export_features(model, image_dir, tmp_path, img_size=64, dtype=torch.float16)
    from safetensors import safe_open

    with safe_open(tmp_path / "img1.safetensors", "pt") as f:
        assert f.metadata() == {"image": "img1.png", "model": "test_h_vit3"}
        t = f.get_tensor("feat0_s4")
    ref = _reference_features(model, image_dir / "img1.png", 64)[0][0]
    assert t.dtype == torch.float16 and torch.allclose(t.float(), ref, rtol=1e-2, atol=1e-2)


def test_bad_image_folders_are_named(tmp_path):
    model = FeatureExtractor("test_vit3_ttt")
    with pytest.raises(FileNotFoundError, match="image folder not found"):
        export_features(model, tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        export_features(model, tmp_path / "empty", tmp_path / "out")
    (tmp_path / "dup").mkdir()
    for suffix in (".png", ".jpg"):
        Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "dup" / f"a{suffix}")
    with pytest.raises(ValueError, match="share file stems"):
        export_features(model, tmp_path / "dup", tmp_path / "out")


def test_a_feature_keeps_its_name_whichever_out_indices_chose_it():
    """Names come from the model's feature index (the last stage was ``feat0_s32`` under
    ``--out-indices 3`` and ``feat3_s32`` by default: code keyed by name broke)."""
    every = FeatureExtractor("test_h_vit3").names
    assert every == ["feat0_s4", "feat1_s8", "feat2_s16", "feat3_s32"]
    for indices, want in (((3,), ["feat3_s32"]), ((-1,), ["feat3_s32"]), ((1, 3), ["feat1_s8", "feat3_s32"])):
        assert FeatureExtractor("test_h_vit3", out_indices=indices).names == want, indices


def test_export_script_features_command(image_dir, tmp_path):
    from helpers.train import load_script

    out = tmp_path / "feats"
    args = [
        "features",
        "--model",
        "test_h_vit3",
        "--images",
        str(image_dir),
        "--out",
        str(out),
        "--img-size",
        "64",
        "--random-init",
    ]
    with pytest.warns(UserWarning, match="--random-init: exporting a randomly initialised test_h_vit3"):
        assert load_script("export").main(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["files"]) == 3 and all((out / f["file"]).exists() for f in manifest["files"])
    assert manifest["weights"] == "random init"
    assert (
        load_script("export").main(
            [
                "features",
                "--model",
                "test_h_vit3",
                "--random-init",
                "--images",
                str(tmp_path / "nope"),
                "--out",
                str(out),
            ]
        )
        == 2
    )


# ------------------------------------------------------------------------------ from a vit3 checkpoint
@pytest.fixture(scope="module")
def one_channel_checkpoint(tmp_path_factory):
    """A fine-tuned-style vit3 checkpoint: a custom one-channel H-ViT³ at 32 px with its own normalisation."""
    from helpers.train import make_digit_folder, tiny_cfg

    from vit3.engine import run

    data = make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1), n_train=20, n_val=5)
    out = tmp_path_factory.mktemp("run")
    extra = ("train.epochs=1", "model.kwargs.dims=[16, 32, 48, 80]", "data.mean=[0.2]", "data.std=[0.3]")
    with torch.random.fork_rng():
        run(tiny_cfg(data, out, *extra), "train")
    return out / "last.pt"


def test_features_take_the_model_and_preprocessing_from_the_checkpoint(
    one_channel_checkpoint, image_dir, tmp_path
):
    """No --model: the checkpoint's model (custom dims, one channel) on RGB photos read as grayscale, at its
    32 px with its mean / std; the safetensors files get the manifest's permissions."""
    from helpers.train import load_script

    out = tmp_path / "feats"
    args = [
        "features",
        "--checkpoint",
        str(one_channel_checkpoint),
        "--images",
        str(image_dir),
        "--out",
        str(out),
    ]
    assert load_script("export").main(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    pre = manifest["preprocessing"]
    assert manifest["model"] == "test_h_vit3" and [f["channels"] for f in manifest["features"]] == [
        16,
        32,
        48,
        80,
    ]
    assert pre["input_size"] == [1, 32, 32] and pre["mean"] == [0.2] and pre["std"] == [0.3]
    assert pre["image_mode"] == "L" and pre["crop_pct"] == 1.0
    mode = (out / "manifest.json").stat().st_mode & 0o777
    for entry in manifest["files"]:
        assert (out / entry["file"]).stat().st_mode & 0o777 == mode
    # the stored features are the checkpoint's model on the grayscale image, normalised with its statistics
    model = FeatureExtractor(checkpoint=str(one_channel_checkpoint))
    trained = torch.load(one_channel_checkpoint, weights_only=True)["model"]
    # timm's features_only wrapper prefixes the model's keys with "model."
    body = {k.removeprefix("model."): v for k, v in model.backbone.body.state_dict().items()}
    shared = [k for k in body if k in trained]
    assert len(shared) == len(body) and all(torch.equal(body[k], trained[k]) for k in shared)
    tf = T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(32), T.ToTensor()])
    x = tf(Image.open(image_dir / "img1.png").convert("L"))[None]
    with torch.no_grad():
        ref = model.backbone.body((x - 0.2) / 0.3)
    stored = load_file(out / "img1.safetensors")
    for f, r in zip(manifest["features"], ref):
        torch.testing.assert_close(stored[f["name"]], r[0], rtol=1e-4, atol=1e-4)


def test_a_model_name_is_needed_without_a_vit3_checkpoint(tmp_path, capsys):
    from helpers.train import load_script

    torch.save({"model": {}}, tmp_path / "official.pth")
    args = [
        "features",
        "--checkpoint",
        str(tmp_path / "official.pth"),
        "--images",
        ".",
        "--out",
        str(tmp_path),
    ]
    assert load_script("export").main(args) == 2
    assert "carries no model record): name its model with --model" in capsys.readouterr().err
