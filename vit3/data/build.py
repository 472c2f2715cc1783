"""Datasets, transforms, samplers and loaders for classification runs (config sections ``data``/``aug``).
Reproducibility and the posterize correction: ``docs/design/data.md``.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from timm.data import Mixup, create_transform
from timm.data import auto_augment as timm_auto_augment
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ..errors import DataError
from .folder import ImageFolderDataset, find_classes
from .image import apply_transform
from .mnist import MNIST5k

DATASETS = ("folder", "mnist5k")

__all__ = [
    "DATASETS",
    "ResumableDistributedSampler",
    "SeededTransform",
    "ShardSampler",
    "build_datasets",
    "build_mixup",
    "build_train_loader",
    "build_transform",
    "build_val_loader",
    "check_class_count",
    "collate_read",
    "posterize",
]


def _none_if_off(value: Any) -> Any:
    return None if value in (None, "", "none", 0, 0.0) else value


def posterize(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """timm's RandAugment posterize, keeping ``bits_to_keep`` most significant bits; 0 bits gives a black
    image (RandAugment's meaning; Pillow >= 13 refuses 0), 8 or more the image unchanged."""
    bits = int(bits_to_keep)
    if bits >= 8:
        return img
    if bits <= 0:
        return Image.new(img.mode, img.size)  # every bit dropped: black
    return ImageOps.posterize(img, bits)


def _augment_ops(transform: Any) -> Iterator[Any]:
    """timm ``AugmentOp`` s inside a transform (Compose -> RandAugment / AutoAugment / AugMix -> ops)."""
    if isinstance(transform, timm_auto_augment.AugmentOp):
        yield transform
        return
    for attr in ("transforms", "ops", "policy"):
        children = getattr(transform, attr, None)
        if isinstance(children, list | tuple):
            for child in children:
                yield from _augment_ops(child)
    if isinstance(transform, list | tuple):
        for child in transform:
            yield from _augment_ops(child)


def _correct_augment_ops(transform: Callable) -> Callable:
    for op in _augment_ops(transform):
        if op.aug_fn is timm_auto_augment.posterize:
            op.aug_fn = posterize
    return transform


def build_transform(
    cfg, is_train: bool, mean: tuple[float, ...], std: tuple[float, ...], img_size: int | None = None
) -> Callable:
    """timm's ``create_transform`` from the ``data``/``aug`` config sections (posterize corrected: see
    ``docs/design/data.md``).

    Training: RandomResizedCrop(scale, ratio) + flip + RandAugment + color jitter + random erasing.
    Evaluation: resize to ``img_size / crop_pct`` and center-crop ``img_size`` (224/256 by default).
    """
    size = int(img_size or cfg.data.img_size)
    if not is_train:
        return create_transform(
            size, is_training=False, interpolation=cfg.data.interpolation, mean=mean, std=std,
            crop_pct=cfg.data.crop_pct,
        )  # fmt: skip
    aug = cfg.aug
    transform = create_transform(
        size,
        is_training=True,
        scale=tuple(aug.scale),
        ratio=tuple(aug.ratio),
        hflip=aug.hflip,
        color_jitter=_none_if_off(aug.color_jitter),
        auto_augment=_none_if_off(aug.auto_augment),
        interpolation=cfg.data.interpolation,
        mean=mean,
        std=std,
        re_prob=aug.reprob,
        re_mode=aug.remode,
        re_count=aug.recount,
    )
    return _correct_augment_ops(transform)


@contextlib.contextmanager
def _private_rng(seed: int) -> Iterator[None]:
    """Seeds python/numpy/torch-CPU RNGs for the block and restores the caller's states afterwards."""
    # timm/torchvision augmentations draw on the legacy global numpy RNG, hence np.random here.
    py, np_state, th = random.getstate(), np.random.get_state(), torch.get_rng_state()  # noqa: NPY002
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002
    torch.default_generator.manual_seed(seed)  # CPU only: never touches the CUDA generators
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)  # noqa: NPY002
        torch.set_rng_state(th)


class SeededTransform(Dataset):
    """Wraps a dataset of PIL images; sample ``i`` of epoch ``e`` is transformed under seed (seed, e, i).

    ``transform=None``: the dataset augments its samples itself (the dense datasets); ``dataset[i]`` is then
    read under that seed. ``drop_skipped``: a sample the dataset skips (a corrupt file under
    ``data.corrupt_images=skip``: its ``read_sample`` returns ``None``) is ``None`` here, for
    :func:`collate_read` to leave out; else the dataset's ``load_sample`` puts the next readable one in its
    place.
    """

    def __init__(self, dataset: Dataset, transform: Callable | None, seed: int, drop_skipped: bool = False):
        self.dataset, self.transform, self.seed, self.epoch = dataset, transform, int(seed), 0
        self.drop_skipped = drop_skipped

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        seed = int(np.random.SeedSequence([self.seed, self.epoch, int(index)]).generate_state(1)[0])
        if self.transform is None:
            with _private_rng(seed):
                return self.dataset[index]
        # (image, label, file) where the dataset can say which file: a failing transform names it
        load = getattr(self.dataset, "read_sample" if self.drop_skipped else "load_sample", None)
        load = load or getattr(self.dataset, "load_sample", None)
        sample = load(index) if load else (*self.dataset[index], f"sample {index}")
        if sample is None:
            return None
        img, target, source = sample
        with _private_rng(seed):
            return apply_transform(self.transform, img, source), target


def collate_read(batch: list[Any]) -> Any:
    """``default_collate`` of the samples read: the ``None`` of skipped ones (:class:`SeededTransform`
    ``drop_skipped``) left out; ``None`` for a batch of skipped samples only."""
    kept = [sample for sample in batch if sample is not None]
    return default_collate(kept) if kept else None


class ResumableDistributedSampler(Sampler[int]):
    """DistributedSampler-like shuffling (seed + epoch, padded to a multiple of the world size) that can
    start part-way through an epoch.

    Args:
        size: dataset length.
        num_replicas: world size; rank: this process.
        shuffle: permute each epoch (else dataset order).
        seed: base seed shared by all ranks.
    """

    def __init__(self, size: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0):
        if size <= 0:
            raise DataError("cannot sample from an empty dataset")
        self.size, self.num_replicas, self.rank, self.shuffle, self.seed = (
            size,
            num_replicas,
            rank,
            shuffle,
            seed,
        )
        self.num_samples = -(-size // num_replicas)  # ceil: every rank gets the same count
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Selects the epoch's order and skips its first ``start`` samples of this rank."""
        self.epoch, self.start = int(epoch), int(start)

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        total = self.num_samples * self.num_replicas
        order += (order * (-(-total // len(order))))[: total - len(order)]  # pad by repeating
        return order[self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start


class ShardSampler(Sampler[int]):
    """Rank ``r`` of ``w`` takes indices ``r, r + w, ...`` in order (evaluation: every sample once)."""

    def __init__(self, size: int, num_replicas: int = 1, rank: int = 0) -> None:
        self.order = list(range(rank, size, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def build_datasets(
    cfg,
    in_chans: int = 3,
    splits: tuple[str, ...] = ("train", "val"),
    classes: list[str] | None = None,
    classes_from: str = "the model",
    min_classes: int = 1,
) -> dict[str, Any]:
    """Untransformed datasets (PIL images) of ``cfg.data`` for the given splits, plus ``"classes"``.

    Args:
        cfg: run config (``data`` section).
        in_chans: model input channels (1: grayscale images, else RGB).
        splits: "train" and/or "val".
        classes: class names in label order (e.g. a checkpoint's): class folders are mapped to them by name
            (a subset or another order is fine, an unknown name is an error). ``None``: the training
            folder's classes (sorted), or the split's own when there is no training folder.
        classes_from: what ``classes`` are, for the error naming an unknown class.
        min_classes: the fewest classes the labels may have (classification: 2, as with one class every
            prediction is right).

    Raises:
        FileNotFoundError / DataError: missing data directory, empty class folder, unknown class or dataset,
            fewer than ``min_classes`` classes (naming the folder, or ``classes_from``, they come from).
    """
    data = cfg.data
    out: dict[str, Any] = {}
    if data.dataset == "mnist5k":
        if in_chans != 1:
            raise DataError(f"data.dataset=mnist5k is grayscale: the model needs in_chans=1, not {in_chans}")
        names = {"train": data.train_split, "val": data.val_split}  # e.g. train on the 1,000 held-out digits
        for split in splits:
            if names[split] not in ("train", "val"):
                raise DataError(
                    f"data.{split}_split={names[split]!r}: data.dataset=mnist5k has the splits 'train' "
                    f"(4,000 digits) and 'val' (1,000)"
                )
            out[split] = MNIST5k(names[split], classes=classes, classes_from=classes_from)
        out["classes"] = list(classes) if classes is not None else list(MNIST5k.classes)
        check_class_count(out["classes"], min_classes, classes_from if classes is not None else "mnist5k")
        return out
    if data.dataset != "folder":
        raise DataError(f"unknown data.dataset '{data.dataset}': expected one of {', '.join(DATASETS)}")
    if not data.path:
        raise DataError("data.path is empty: give the dataset root holding train/ and val/ (data.path=DIR)")
    root = Path(data.path)
    if not root.is_dir():
        raise FileNotFoundError(f"data directory not found: {root}")
    mode = "L" if in_chans == 1 else "RGB"
    split_dirs = {"train": data.train_split, "val": data.val_split}
    # Labels come from the training folders whenever they exist, so val labels always match training.
    origin, labels_from = classes_from, classes_from
    if classes is None and (root / data.train_split).is_dir():
        classes, origin = find_classes(root / data.train_split), "the training data"
        labels_from = f"image folder {root / data.train_split}"
    for split in splits:
        out[split] = ImageFolderDataset(
            root / split_dirs[split], None, classes, data.corrupt_images, mode, classes_from=origin
        )
        if classes is None:
            classes, labels_from = out[split].classes, f"image folder {root / split_dirs[split]}"
    check_class_count(classes, min_classes, labels_from)
    out["classes"] = classes
    return out


def check_class_count(classes: list[str], min_classes: int, source: str) -> None:
    """Refuses labels with fewer than ``min_classes`` classes.

    Raises:
        DataError: naming ``source`` (the folder or model the labels come from) and its classes.
    """
    if len(classes) >= min_classes:
        return
    raise DataError(
        f"{source} has {len(classes)} class{'' if len(classes) == 1 else 'es'} ({', '.join(classes)}): "
        f"classification needs at least {min_classes} classes (one folder of images per class), as with one "
        f"class every prediction is right"
    )


def build_mixup(cfg, num_classes: int) -> Mixup | None:
    """timm Mixup/CutMix with label smoothing (``None`` when both alphas are 0 or null and no minmax is
    set)."""
    aug = cfg.aug
    mixup, cutmix = float(aug.mixup or 0.0), float(aug.cutmix or 0.0)
    if not (mixup > 0 or cutmix > 0 or aug.cutmix_minmax is not None):
        return None
    return Mixup(
        mixup_alpha=mixup,
        cutmix_alpha=cutmix,
        cutmix_minmax=aug.cutmix_minmax,
        prob=aug.mixup_prob,
        switch_prob=aug.mixup_switch_prob,
        mode=aug.mixup_mode,
        label_smoothing=aug.label_smoothing,
        num_classes=num_classes,
    )


def _usable_cpus() -> int:
    """The CPUs this process may run on: more loader workers only compete (torch warns about them each
    epoch)."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _loader(
    dataset: Dataset,
    sampler: Sampler,
    batch_size: int,
    cfg,
    drop_last: bool,
    seed: int,
    collate_fn: Callable | None = None,
) -> DataLoader:
    workers = min(int(cfg.data.num_workers), _usable_cpus())
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=bool(cfg.data.pin_memory) and torch.cuda.is_available(),
        drop_last=drop_last,
        persistent_workers=False,  # workers must see SeededTransform.set_epoch of each epoch
        generator=torch.Generator().manual_seed(seed),  # keeps the global RNG untouched by loader setup
    )


def build_train_loader(
    dataset: Dataset,
    transform: Callable | None,
    cfg,
    rank: int = 0,
    world: int = 1,
    drop_last: bool = True,
    collate_fn: Callable | None = None,
) -> tuple[DataLoader, SeededTransform, ResumableDistributedSampler]:
    """Shuffled, sharded training loader (full batches unless ``drop_last=False``); call ``set_epoch`` on the
    returned wrapper and sampler. ``transform=None``: the dataset augments its samples itself."""
    wrapped = SeededTransform(dataset, transform, cfg.seed)
    sampler = ResumableDistributedSampler(len(dataset), world, rank, shuffle=True, seed=cfg.seed)
    if sampler.num_samples < cfg.data.batch_size:
        raise DataError(
            f"data.batch_size={cfg.data.batch_size} exceeds the {sampler.num_samples} training images per "
            f"process ({len(dataset)} images over {world} process(es)): lower data.batch_size, or let "
            "data.fit_batch=8 fit it (configs/finetune.yaml does)"
        )
    loader = _loader(wrapped, sampler, cfg.data.batch_size, cfg, drop_last, cfg.seed, collate_fn)
    return loader, wrapped, sampler


def build_val_loader(
    dataset: Dataset, transform: Callable, cfg, batch_size: int, rank: int = 0, world: int = 1
) -> DataLoader:
    """In-order loader over this rank's shard (every image is evaluated exactly once over all ranks; one
    skipped as corrupt is left out of its batch, and a batch of skipped images only is ``None``)."""
    wrapped = SeededTransform(dataset, transform, cfg.seed, drop_skipped=True)
    sampler = ShardSampler(len(dataset), world, rank)
    return _loader(wrapped, sampler, batch_size, cfg, False, cfg.seed, collate_read)
