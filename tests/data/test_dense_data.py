"""Dense-task data: the synthetic digit canvases, COCO and ADE20K readers, and their bad-input messages."""

from __future__ import annotations

import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from helpers.dense import DIGITS
from PIL import Image

from vit3.data.ade import IGNORE_INDEX, ADESegmentation, rescale_size
from vit3.data.coco import CocoDetection, load_coco
from vit3.data.synthetic_dense import make_canvases, write_coco


# ---------------------------------------------------------------------------------- synthetic canvases
def test_canvases_have_exact_boxes_masks_and_label_maps():
    canvases = make_canvases(
        6, image_size=(64, 80), digits=DIGITS, digit_size=(18, 30), empty_images=2, seed=3
    )
    assert [len(c.instances) == 0 for c in canvases][-2:] == [True, True]
    assert sum(len(c.instances) for c in canvases[:4]) >= 4
    for c in canvases:
        assert c.image.shape == (64, 80, 3) and c.image.dtype == np.uint8
        labels = c.label_map(DIGITS)
        for inst in c.instances:
            ys, xs = np.nonzero(inst.alpha > 0.5)
            x, y, w, h = inst.box
            assert (x, y, x + w - 1, y + h - 1) == (xs.min(), ys.min(), xs.max(), ys.max())
            assert (labels[inst.mask] == 1 + DIGITS.index(inst.digit)).all()
            # The digit is pasted in a bright colour over a dark background: its pixels stand out.
            assert c.image[inst.mask].mean() > c.image[labels == 0].mean() + 60
        rim = labels == IGNORE_INDEX
        assert rim.any() == bool(c.instances)
        assert set(np.unique(labels)) <= {0, 255, *(1 + i for i in range(len(DIGITS)))}


def test_canvases_are_deterministic_and_seeded():
    a, b, c = (make_canvases(2, 48, digit_size=(16, 24), seed=s)[0].image for s in (5, 5, 6))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"digit_size": (20, 80)}, "does not fit"),
        ({"digits": (1, 12)}, "subset of 0..9"),
        ({"digits": ()}, "subset"),
    ],
    ids=["digit-too-large", "digit-out-of-range", "no-digits"],
)
def test_canvases_reject_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_canvases(1, 64, **kwargs)


# ---------------------------------------------------------------------------------------------- COCO
def test_coco_round_trip_gives_the_pasted_boxes_masks_and_labels(tmp_path):
    canvases = make_canvases(3, 64, digits=DIGITS, digit_size=(18, 26), seed=1)
    ann = write_coco(tmp_path, "val", canvases, DIGITS)
    ds = CocoDetection(tmp_path / "val", ann)
    assert ds.label_to_cat_id == {1: 4, 2: 8} and ds.num_classes == 2 and len(ds) == 3
    for (image, target), canvas in zip((ds[i] for i in range(3)), canvases):
        assert image.shape == (3, 64, 64) and torch.allclose(
            image * 255, torch.from_numpy(canvas.image).permute(2, 0, 1).float()
        )
        want_boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (i.box for i in canvas.instances)])
        assert torch.equal(target["boxes"], want_boxes)
        assert target["labels"].tolist() == [1 + DIGITS.index(i.digit) for i in canvas.instances]
        assert torch.equal(
            target["masks"].bool(), torch.from_numpy(np.stack([i.mask for i in canvas.instances]))
        )


def test_coco_training_flip_moves_boxes_with_masks(coco_root):
    ds = CocoDetection(
        coco_root / "train", coco_root / "annotations" / "instances_train.json", train=True, flip_prob=1.0
    )
    image, target = ds[0]
    plain = CocoDetection(coco_root / "train", coco_root / "annotations" / "instances_train.json")
    image0, _ = plain[plain.ids.index(ds.ids[0])]
    assert torch.equal(image, image0.flip(-1))
    for box, mask in zip(target["boxes"], target["masks"]):
        ys, xs = torch.nonzero(mask, as_tuple=True)
        assert box.tolist() == [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]


def test_coco_images_without_annotations_are_skipped_for_training_only(coco_root, caplog):
    ann = coco_root / "annotations" / "instances_train.json"
    with caplog.at_level(logging.WARNING):
        train = CocoDetection(coco_root / "train", ann, train=True)
    assert "skipping 1 of 8 images" in caplog.text
    val = CocoDetection(coco_root / "train", ann, train=False)
    assert len(train) == 7 and len(val) == 8
    _, target = val[val.ids.index(8)]  # the last canvas has no digit
    assert target["boxes"].shape == (0, 4) and target["masks"].shape == (0, 64, 64)


def _broken_coco(tmp_path, coco_root, kind: str):
    """A copy of the train split broken in one way; returns (image_dir, annotation file)."""
    images = tmp_path / "train"
    shutil.copytree(coco_root / "train", images)
    ann = tmp_path / "ann.json"
    data = json.loads((coco_root / "annotations" / "instances_train.json").read_text())
    if kind == "missing-file":
        return images, tmp_path / "nope.json"
    if kind == "invalid-json":
        ann.write_text("{not json")
        return images, ann
    if kind == "missing-key":
        del data["categories"]
    elif kind == "unknown-category":
        data["annotations"][0]["category_id"] = 99
    elif kind == "unknown-image":
        data["annotations"][0]["image_id"] = 1234
    elif kind == "missing-image":
        (images / data["images"][0]["file_name"]).unlink()
    elif kind == "all-empty":
        data["annotations"] = []
    ann.write_text(json.dumps(data))
    return images, ann


@pytest.mark.parametrize(
    "kind, error, match",
    [
        ("missing-file", FileNotFoundError, "annotation file not found"),
        ("invalid-json", ValueError, "not valid JSON"),
        ("missing-key", ValueError, "must hold"),
        ("unknown-category", ValueError, "category_id 99 outside"),
        ("unknown-image", ValueError, "unknown image_id 1234"),
        ("missing-image", FileNotFoundError, "missing in"),
        ("all-empty", ValueError, "no usable images"),
    ],
)
def test_coco_bad_input_is_named(tmp_path, coco_root, kind, error, match):
    images, ann = _broken_coco(tmp_path, coco_root, kind)
    with pytest.raises(error, match=match):
        CocoDetection(images, ann, train=True)


def test_coco_image_size_mismatch_is_named(tmp_path, coco_root):
    images, ann = _broken_coco(tmp_path, coco_root, "none")
    name = json.loads(ann.read_text())["images"][0]["file_name"]
    Image.new("RGB", (50, 64)).save(images / name)
    ds = CocoDetection(images, ann)
    with pytest.raises(ValueError, match="is 50x64 but the annotation file says 64x64"):
        ds[0]


def test_coco_boxes_outside_the_image_are_clipped_or_skipped_with_a_warning(tmp_path, coco_root):
    """A box reaching outside its image is clipped (and kept), one wholly outside or under 1 px is skipped;
    each is named (file, annotation id) in a warning, and a detector trains on the result (torchvision would
    stop at the first invalid box with an AssertionError naming neither)."""
    images, ann = _broken_coco(tmp_path, coco_root, "none")
    data = json.loads(ann.read_text())
    first = data["annotations"][0]
    image = next(i for i in data["images"] if i["id"] == first["image_id"])
    extra = [
        {**first, "id": 9001, "bbox": [image["width"] - 10, 5, 30, 20]},  # reaches out on the right
        {**first, "id": 9002, "bbox": [image["width"] + 5, 5, 10, 10]},  # wholly outside
        {**first, "id": 9003, "bbox": [10, 10, 0.5, 12]},  # under 1 px wide
        {**first, "id": 9004, "bbox": [-8, -4, 20, 20]},  # reaches out on the top left
    ]
    data["annotations"] += extra
    ann.write_text(json.dumps(data))
    with pytest.warns(UserWarning) as caught:
        ds = CocoDetection(images, ann, train=True, flip_prob=0.0)
    messages = " | ".join(str(w.message) for w in caught)
    name = image["file_name"]
    assert re.search(
        rf"2 box\(es\) reaching outside their image were clipped.*{name} annotation 9001", messages
    )
    assert f"{name} annotation 9004" in messages
    assert re.search(
        rf"2 degenerate box\(es\) .* skipped.*{name} annotation 9002.*{name} annotation 9003", messages
    )
    _, target = ds[ds.ids.index(image["id"])]
    boxes = target["boxes"]
    assert (boxes[:, 2:] > boxes[:, :2]).all() and boxes.min() >= 0 and boxes[:, 2].max() <= image["width"]
    assert [image["width"] - 10, 5, image["width"], 25] in boxes.tolist() and [0, 0, 12, 16] in boxes.tolist()
    assert len(boxes) == len(target["labels"]) == len(target["masks"])
    from vit3.tasks.detection import build_detector

    model = build_detector(
        "test_h_vit3", ds.num_classes, min_size=64, max_size=64, out_channels=16, box_head_dim=32,
        mask_head_dim=8, anchor_sizes=(8, 16, 32, 64, 128),
    )  # fmt: skip
    losses = model([ds[ds.ids.index(image["id"])][0]], [target])
    assert all(torch.isfinite(v) for v in losses.values())


def test_load_coco_builds_the_pycocotools_index(coco_root):
    coco = load_coco(coco_root / "annotations" / "instances_val.json")
    assert sorted(coco.getCatIds()) == [4, 8] and len(coco.getImgIds()) == 4


# --------------------------------------------------------------------------------------------- ADE20K
def test_ade_eval_sample_keeps_full_size_labels(ade_root):
    ds = ADESegmentation(ade_root, "validation", num_classes=3, scale=(96, 96), mean=(0, 0, 0), std=(1, 1, 1))
    x, y = ds[0]
    label = np.asarray(Image.open(ade_root / "annotations" / "validation" / "validation_00000.png"))
    image = np.asarray(Image.open(ade_root / "images" / "validation" / "validation_00000.png"))
    assert x.shape == (3, 96, 96) and torch.equal(y, torch.from_numpy(label.astype(np.int64)))
    assert torch.allclose(x.mean((1, 2)), torch.from_numpy(image / 255.0).float().mean((0, 1)), atol=0.01)


def test_ade_training_crops_pad_with_ignore(ade_root):
    ds = ADESegmentation(
        ade_root,
        "training",
        num_classes=3,
        train=True,
        scale=(64, 64),
        crop_size=(80, 72),
        ratio_range=(0.5, 0.6),
    )
    x, y = ds[0]
    assert x.shape == (3, 80, 72) and y.shape == (80, 72)
    # The image was rescaled to at most 64 * 0.6 < 72 pixels: the padded border is ignored and zero.
    assert (y[-10:] == IGNORE_INDEX).all() and (y[:, -10:] == IGNORE_INDEX).all() and (x[:, -10:] == 0).all()
    assert set(y.unique().tolist()) <= {0, 1, 2, IGNORE_INDEX}


def test_ade_reduce_zero_label_shifts_classes(tmp_path):
    for sub in ("images/s", "annotations/s"):
        (tmp_path / sub).mkdir(parents=True)
    Image.new("RGB", (4, 2)).save(tmp_path / "images/s/a.jpg")
    Image.fromarray(np.array([[0, 1, 2, 3], [150, 255, 1, 0]], np.uint8)).save(
        tmp_path / "annotations/s/a.png"
    )
    _, y = ADESegmentation(tmp_path, "s", num_classes=150, reduce_zero_label=True, scale=(4, 4)).load(0)
    assert y.tolist() == [[255, 0, 1, 2], [149, 255, 0, 255]]


def _ade_pair(tmp_path, image_size=(8, 6), label=None):
    for sub in ("images/s", "annotations/s"):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
    Image.new("RGB", image_size).save(tmp_path / "images/s/a.png")
    if label is not None:
        Image.fromarray(label).save(tmp_path / "annotations/s/a.png")


@pytest.mark.parametrize(
    "size, label, error, match",
    [
        ((8, 6), np.full((6, 8), 7, np.uint8), ValueError, r"labels \[7\] outside 0..2"),
        ((8, 6), np.zeros((5, 8), np.uint8), ValueError, "is 8x5 but image"),
        ((8, 6), None, FileNotFoundError, "have no label map"),
        ((8, 6), np.zeros((6, 8, 3), np.uint8), ValueError, "single-channel PNG"),
    ],
    ids=["label-out-of-range", "size-mismatch", "missing-label-map", "rgb-label-map"],
)
def test_ade_bad_input_is_named(tmp_path, size, label, error, match):
    _ade_pair(tmp_path, size, label)
    with pytest.raises(error, match=match):
        ADESegmentation(tmp_path, "s", num_classes=3).load(0)


def test_ade_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="ADE20K-format folder not found"):
        ADESegmentation(tmp_path, "training", num_classes=3)


def test_rescale_size_follows_mmcv_keep_ratio():
    assert rescale_size((512, 683), (2048, 512)) == (512, 683)
    assert rescale_size((256, 1024), (2048, 512)) == (512, 2048)
    assert rescale_size((100, 3000), (2048, 512)) == (68, 2048)
