"""Fitting a classification recipe to its data, so that one fine-tuning config serves a folder of tens of images
per class as well as an ImageNet-sized one (``configs/finetune.yaml``).

* ``data.fit_batch`` = n > 0: an epoch is to have at least n batches per process. A training set too small for
  that at ``data.batch_size`` gets the batch ``images per process // n`` instead (at least 2, since BatchNorm, as
  in H-ViT³'s head, cannot train on one image; with Mixup/CutMix, which pair a batch's images, rounded down to
  an even number); a large one keeps
  ``data.batch_size``. 0: the batch is used as given (a batch above the training images per process is an
  error).
* ``train.min_steps`` = s > 0: the run is to take at least s optimizer steps. When ``train.epochs`` give fewer,
  the epochs become ``ceil(s / steps per epoch)`` and ``train.warmup_epochs`` grows by the same factor (the
  warmup keeps its share of the run). 0: the epochs are used as given.
* The learning rates follow the total batch through :func:`vit3.engine.optim.scaled_lrs` (``train.lr_scale``).
* ``train.freeze``: ``backbone`` trains the classifier alone (a linear probe: every other parameter frozen and
  its modules kept in eval mode, so normalisation statistics, dropout and drop-path do not move); ``none``
  trains everything.

A fitted value replaces the configured one in the run's config, so ``<output>/config.yaml`` and the
checkpoints hold what the run used (a config saved by a run fits to itself again: resuming changes nothing),
and each change is logged as one line naming the key, e.g.
``data.batch_size: 64 -> 6 (data.fit_batch=8: 48 training images per process, 8 batches per epoch)``.
"""

from __future__ import annotations

import math

from torch import nn

from .config import Config, ConfigError

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
    """Lowers ``cfg.data.batch_size`` in place to give ``data.fit_batch`` batches per epoch (module docstring).

    Args:
        cfg: run config (``data.batch_size``, ``data.fit_batch``).
        images_per_process: training images each process sees per epoch.
        even: the batch must be even (Mixup/CutMix pair its images).

    Returns:
        The log line of the change, or ``None`` when the batch stays.
    """
    want = int(cfg.data.fit_batch)
    batch = int(cfg.data.batch_size)
    if want == 0 or batch * want <= images_per_process:
        return None
    fitted = max(images_per_process // want, min(2, images_per_process))
    if even:
        fitted = max(fitted - fitted % 2, 2)
    if fitted >= batch:
        return None
    cfg.data.batch_size = fitted
    return (
        f"data.batch_size: {batch} -> {fitted} (data.fit_batch={want}: {images_per_process} training images per "
        f"process, {images_per_process // fitted} batches per epoch)"
    )


def fit_epochs(cfg: Config, steps_per_epoch: int) -> str | None:
    """Raises ``cfg.train.epochs`` (and ``warmup_epochs`` alike) in place to reach ``train.min_steps``.

    Args:
        cfg: run config (``train.epochs``, ``train.warmup_epochs``, ``train.min_steps``).
        steps_per_epoch: optimizer steps per epoch (batches per epoch / ``train.accum_steps``).

    Returns:
        The log line of the change, or ``None`` when the epochs stay.
    """
    t = cfg.train
    want = int(t.min_steps)
    epochs = int(t.epochs)
    if epochs * steps_per_epoch >= want:
        return None
    fitted = math.ceil(want / steps_per_epoch)
    warmup = float(t.warmup_epochs)
    t.epochs = fitted
    t.warmup_epochs = warmup * fitted / epochs
    return (
        f"train.epochs: {epochs} -> {fitted}, train.warmup_epochs: {warmup:g} -> {t.warmup_epochs:g} "
        f"(train.min_steps={want} at {steps_per_epoch} steps per epoch)"
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
    """Freezes (``requires_grad=False``) every parameter that does not train under ``train.freeze``, before the
    optimizer is built (frozen parameters get no optimizer state); returns the names of those that train."""
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
