"""vit3.data: image-folder checks, corrupt-image policy, resumable sampling, seeded augmentation, demo
data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.train import make_digit_folder
from PIL import Image
from torch.utils.data import DataLoader

from vit3.data import (
    CorruptImageError,
    ImageFolderDataset,
    MNIST5k,
    ResumableDistributedSampler,
    SeededTransform,
    ShardSampler,
    find_classes,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1), n_train=6, n_val=3)


def test_mnist5k_split_is_fixed_stratified_and_disjoint():
    train, val = MNIST5k("train"), MNIST5k("val")
    assert (len(train), len(val)) == (4000, 1000)
    assert (
        np.bincount(train.targets).tolist() == [400] * 10 and np.bincount(val.targets).tolist() == [100] * 10
    )
    img, label = val[0]
    assert img.size == (28, 28) and img.mode == "L" and label == 0
    train_rows = {a.tobytes() for a in train.images}
    assert not any(a.tobytes() in train_rows for a in val.images)


def test_folder_labels_and_split_consistency(folder):
    ds = ImageFolderDataset(folder / "train")
    assert ds.classes == ["digit_0", "digit_1"] and len(ds) == 12
    assert sorted(set(ds.targets)) == [0, 1]
    img, _ = ds[0]
    assert img.mode == "RGB"
    assert ImageFolderDataset(folder / "val", mode="L")[0][0].mode == "L"


def test_missing_dir_and_empty_class_are_named(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        find_classes(tmp_path / "no_such_dir")
    (tmp_path / "empty_root").mkdir()
    with pytest.raises(ValueError, match="has no class folders"):
        find_classes(tmp_path / "empty_root")
    (tmp_path / "one" / "cat").mkdir(parents=True)
    (tmp_path / "one" / "cat" / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match=r"one/cat holds no image files"):
        find_classes(tmp_path / "one")


def test_val_class_unknown_to_training_is_named(folder, tmp_path):
    (tmp_path / "val" / "digit_7").mkdir(parents=True)
    Image.new("L", (8, 8)).save(tmp_path / "val" / "digit_7" / "a.png")
    with pytest.raises(ValueError, match="digit_7"):
        ImageFolderDataset(tmp_path / "val", classes=["digit_0", "digit_1"])


def test_corrupt_image_policy(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / name / "ok.png")
    (tmp_path / "a" / "zz_bad.jpg").write_bytes(b"\xff\xd8 truncated")
    strict = ImageFolderDataset(tmp_path)
    bad = next(i for i, (p, _) in enumerate(strict.samples) if p.endswith("zz_bad.jpg"))
    with pytest.raises(CorruptImageError, match=r"zz_bad\.jpg"):
        strict[bad]
    lenient = ImageFolderDataset(tmp_path, corrupt_images="skip")
    with pytest.warns(UserWarning, match="zz_bad.jpg"):
        img, target = lenient[bad]
    assert img.size == (8, 8) and target == lenient.samples[(bad + 1) % len(lenient)][1]
    with pytest.raises(ValueError, match="corrupt_images"):
        ImageFolderDataset(tmp_path, corrupt_images="ignore")


@pytest.mark.parametrize("world", [1, 2, 3], ids=["1-rank", "2-ranks", "3-ranks"])
def test_sampler_shards_cover_the_epoch_and_resume_mid_epoch(world):
    samplers = [ResumableDistributedSampler(10, world, r, shuffle=True, seed=5) for r in range(world)]
    for s in samplers:
        s.set_epoch(3)
    shards = [list(s) for s in samplers]
    assert len({len(x) for x in shards}) == 1
    assert {i for shard in shards for i in shard} == set(range(10))  # every sample, padded by repetition
    again = ResumableDistributedSampler(10, world, 0, shuffle=True, seed=5)
    again.set_epoch(3, start=2)
    assert list(again) == shards[0][2:] and len(again) == len(shards[0]) - 2
    again.set_epoch(4)
    assert list(again) != shards[0]  # a new order each epoch


def test_shard_sampler_visits_every_sample_once():
    shards = [list(ShardSampler(11, 3, r)) for r in range(3)]
    assert sorted(i for shard in shards for i in shard) == list(range(11))


class _Noise:
    """A random 'augmentation' drawing on python, numpy and torch RNGs."""

    def __call__(self, _img):
        import random

        return torch.tensor([random.random(), float(np.random.rand()), float(torch.rand(()))])  # noqa: NPY002


def test_seeded_transform_is_independent_of_workers_and_leaves_global_rng_alone():
    data = [(None, i) for i in range(8)]
    ds = SeededTransform(data, _Noise(), seed=1)
    ds.set_epoch(2)
    state = torch.get_rng_state()
    direct = torch.stack([ds[i][0] for i in range(8)])
    assert torch.equal(state, torch.get_rng_state())
    via_workers = torch.cat([x for x, _ in DataLoader(ds, batch_size=3, num_workers=2)])
    assert torch.equal(direct, via_workers)
    assert len({tuple(r.tolist()) for r in direct}) == 8  # different draws per sample
    ds.set_epoch(3)
    assert not torch.equal(direct[0], ds[0][0])  # and per epoch
