"""Fitting a classification recipe to its data: one fine-tuning config (``configs/finetune.yaml``) for a
folder of tens of images per class as for an ImageNet-sized one.

``data.fit_batch`` (at least n batches per epoch) and ``train.min_steps`` (at least s optimizer steps) fit the
batch and the epochs; a value the user wrote (:func:`~vit3.engine.config.written_keys`) is never fitted, only
kept or refused in one line. Fitted values land in the saved config and are logged; the lrs follow the total
batch (:func:`vit3.engine.optim.scaled_lrs`); ``train.freeze=backbone``: a linear probe. Details:
``docs/design/engine.md``.
"""

from __future__ import annotations

import math

from torch import nn

from .config import Config, ConfigError, written_keys

__all__ = [
    "FREEZE_MODES",
    "eval_frozen",
    "fit_batch_size",
    "fit_epochs",
    "freeze_for_training",
    "trainable_names",
]

FREEZE_MODES = ("none", "backbone")


def fit_batch_size(cfg: Config, images_per_process: int, even: bool) -> str | None:
    """Lowers ``cfg.data.batch_size`` in place to give ``data.fit_batch`` batches per epoch (module
    docstring), unless the user wrote the batch (:func:`~vit3.engine.config.written_keys`): then it is kept.

    Args:
        cfg: run config (``data.batch_size``, ``data.fit_batch``).
        images_per_process: training images each process sees per epoch.
        even: the batch must be even (Mixup/CutMix pair its images).

    Returns:
        The log line of the change, or of the batch kept as written; ``None`` when the recipe has nothing to
        say (fitting off, or a batch of the recipe's that fits).

    Raises:
        ConfigError: a written batch above the training images per process, or one that gives fewer than a
            written ``data.fit_batch`` batches per epoch.
    """
    want = int(cfg.data.fit_batch)
    batch = int(cfg.data.batch_size)
    written = written_keys(cfg)
    if want == 0:
        return None
    fitted = max(images_per_process // want, min(2, images_per_process))
    if even:
        fitted = max(fitted - fitted % 2, 2)
    if "data.batch_size" in written:
        if batch > images_per_process:
            raise ConfigError(
                f"data.batch_size={batch} exceeds the {images_per_process} training images per process: "
                "write "
                f"at most {images_per_process}, or leave data.batch_size to the recipe "
                f"(data.fit_batch={want} "
                f"fits {fitted})"
            )
        per_epoch = images_per_process // batch
        if per_epoch < want and "data.fit_batch" in written:
            raise ConfigError(
                f"data.batch_size={batch} and data.fit_batch={want} are both written, but "
                f"{images_per_process} "
                f"training images per process make {per_epoch} batches of {batch} per epoch: drop one of them"
            )
        return (
            f"data.batch_size={batch} as written ({per_epoch} batches per epoch; not fitted to "
            "data.fit_batch)"
        )
    if batch * want <= images_per_process or fitted >= batch:
        return None
    cfg.data.batch_size = fitted
    return (
        f"data.batch_size: {batch} -> {fitted} (fitted, data.fit_batch={want}: {images_per_process} training "
        f"images per process, {images_per_process // fitted} batches per epoch)"
    )


def fit_epochs(cfg: Config, updates_per_epoch: int) -> str | None:
    """Raises ``cfg.train.epochs`` (and ``warmup_epochs`` alike) in place to reach ``train.min_steps``, unless
    the user wrote them (:func:`~vit3.engine.config.written_keys`): then they are kept.

    Args:
        cfg: run config (``train.epochs``, ``train.warmup_epochs``, ``train.min_steps``).
        updates_per_epoch: optimizer updates per epoch (``optim.epoch_steps``).

    Returns:
        The log line of the change, or of the epochs kept as written; ``None`` when the recipe has nothing
        to say (fitting off, or epochs of the recipe's that reach ``train.min_steps``).

    Raises:
        ConfigError: written epochs that give fewer optimizer steps than a written ``train.min_steps``.
    """
    t = cfg.train
    want = int(t.min_steps)
    epochs = int(t.epochs)
    written = written_keys(cfg)
    if want == 0:
        return None
    steps = epochs * updates_per_epoch
    if "train.epochs" in written:
        if steps < want and "train.min_steps" in written:
            raise ConfigError(
                f"train.epochs={epochs} and train.min_steps={want} are both written, but {epochs} epochs of "
                f"{updates_per_epoch} optimizer steps make {steps}: drop one of them"
            )
        return f"train.epochs={epochs} as written ({steps} optimizer steps; not fitted to train.min_steps)"
    if steps >= want:
        return None
    fitted = math.ceil(want / updates_per_epoch)
    warmup = float(t.warmup_epochs)
    t.epochs = fitted
    if "train.warmup_epochs" in written:
        kept = f"train.warmup_epochs={warmup:g} as written"
    else:
        t.warmup_epochs = warmup * fitted / epochs
        kept = f"train.warmup_epochs: {warmup:g} -> {t.warmup_epochs:g}"
    return (
        f"train.epochs: {epochs} -> {fitted}, {kept} (fitted, train.min_steps={want} at {updates_per_epoch} "
        "steps "
        "per epoch)"
    )


def trainable_names(model: nn.Module, freeze: str) -> list[str]:
    """The parameters that train under ``train.freeze``: all of them (``none``) or the classifier's
    (``backbone``: ``model.get_classifier()``, timm's classifier API).

    Raises:
        ConfigError: an unknown mode, or ``backbone`` for a model without a classifier.
    """
    if freeze not in FREEZE_MODES:
        raise ConfigError(f"train.freeze must be one of {', '.join(FREEZE_MODES)}, got {freeze!r}")
    names = [n for n, _ in model.named_parameters()]
    if freeze == "none":
        return names
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    kept = {id(p) for p in head.parameters()} if head is not None else set()
    if not kept:
        raise ConfigError(
            f"train.freeze=backbone needs a classifier with weights; {type(model).__name__} has none"
        )
    return [n for n, p in model.named_parameters() if id(p) in kept]


def freeze_for_training(model: nn.Module, freeze: str) -> list[str]:
    """Freezes (``requires_grad=False``) every parameter that does not train under ``train.freeze``, before
    the optimizer is built (frozen parameters get no optimizer state); returns the names of those that
    train."""
    train = trainable_names(model, freeze)
    if freeze != "none":
        keep = set(train)
        for n, p in model.named_parameters():
            if n not in keep:
                p.requires_grad_(False)
    return train


def eval_frozen(model: nn.Module, freeze: str) -> None:
    """After ``model.train()``: puts a frozen backbone's modules back in eval mode (its BatchNorm statistics,
    dropout and drop-path stay those of the pretrained model's inference); the classifier keeps training."""
    if freeze == "backbone":
        model.eval()
        model.get_classifier().train()
