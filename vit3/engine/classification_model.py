"""The classifier of the classification engine and what it reads: the model built from the config (a timm /
vit3 name, optionally from a vit3 checkpoint or an official ViTTT file), its input preprocessing resolved in
the config, the labels of an official classifier, the losses and the validation pass that training
(:mod:`vit3.engine.classification`), evaluation (:mod:`vit3.engine.classification_eval`) and the conversion
share.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from timm.data import resolve_data_config
from torch import nn

from ..data.folder import find_classes
from ..data.mnist import MEAN as MNIST_MEAN
from ..data.mnist import STD as MNIST_STD
from ..errors import DataError
from ..models.record import peek_vit3_checkpoint
from .checkpoint import classifier_prefixes, load_model_weights
from .config import Config, ConfigError, model_arguments, written_keys
from .distributed import sum_tensor
from .process import autocast

__all__ = [
    "build_model",
    "data_stats",
    "input_channels",
    "label_loss",
    "official_eval_classes",
    "resolve_data_cfg",
    "soft_cross_entropy",
    "validate",
]


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``-sum_c probs[b, c] log_softmax(logits)[b, c]``; logits/probs [B, K]."""
    return torch.sum(-probs * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


def label_loss(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Soft targets [B, K] (Mixup, smoothing included) or class indices [B] with label smoothing."""
    if target.ndim == 2:
        return soft_cross_entropy(logits, target)
    return F.cross_entropy(logits.float(), target, label_smoothing=smoothing)


def input_channels(cfg: Config) -> int:
    """The model's input channels (``model.kwargs.in_chans``, default 3)."""
    return int(cfg.model.kwargs.get("in_chans", 3))


def resolve_data_cfg(cfg: Config, model: nn.Module, in_chans: int) -> None:
    """Fills the null ``data.img_size``/``interpolation``/``crop_pct``/``mean``/``std`` in place: the size
    ``model.kwargs.img_size`` built the model at, MNIST's statistics for the demo data, else the model's
    ``pretrained_cfg`` (a one-channel model on RGB statistics
    takes their average); checks that ``data.mean``/``std`` fit the model's channels.

    Raises:
        ConfigError: only one of mean / std given, or a length other than the model's input channels.
    """
    d = cfg.data
    resolved = resolve_data_config({}, model=model)
    if d.img_size is None:  # the size the model was built at (model.kwargs.img_size), else its cfg's
        built = (cfg.model.kwargs or {}).get("img_size")
        d.img_size = int(built) if isinstance(built, int) else int(resolved["input_size"][-1])
    if d.interpolation is None:
        d.interpolation = resolved["interpolation"]
    if d.crop_pct is None:
        d.crop_pct = float(resolved["crop_pct"])
    if (d.mean is None) != (d.std is None):
        given = "data.mean" if d.mean is not None else "data.std"
        raise ConfigError(f"{given} is set but not its partner: give data.mean and data.std together")
    if d.mean is None:
        if d.dataset == "mnist5k":
            mean, std = MNIST_MEAN, MNIST_STD
        else:
            mean, std = tuple(resolved["mean"]), tuple(resolved["std"])
            if in_chans == 1 and len(mean) == 3:  # a one-channel model on RGB statistics: use their average
                mean, std = (sum(mean) / 3,), (sum(std) / 3,)
        d.mean, d.std = [float(v) for v in mean], [float(v) for v in std]
    for key in ("mean", "std"):
        values = d[key]
        if not isinstance(values, list | tuple) or len(values) != in_chans:
            raise ConfigError(
                f"data.{key} must hold one value per input channel of the model ({in_chans}), got {values!r}"
            )


def data_stats(cfg: Config) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The normalisation of a resolved config (:func:`resolve_data_cfg`)."""
    return tuple(cfg.data.mean), tuple(cfg.data.std)


def _official_classes(num_classes: int) -> list[str] | None:
    """The class names of an official (ImageNet-1k) classifier: timm's ImageNet synsets, in label order."""
    if num_classes != 1000:
        return None
    from timm.data import ImageNetInfo

    return list(ImageNetInfo().label_names())


def official_eval_classes(cfg: Config, num_classes: int, path: str) -> list[str] | None:
    """Labels for evaluating an official (ImageNet-1k) classifier on a folder: its synsets, matched to the
    folders by name when every folder is one; else the sorted folders, when there are as many as classes.

    Raises:
        DataError: the folders are neither synsets nor as many as the classifier's classes.
    """
    names = _official_classes(num_classes)
    if cfg.data.dataset != "folder" or not cfg.data.path or names is None:
        return None
    folders = find_classes(Path(cfg.data.path) / cfg.data.val_split)
    if set(folders) <= set(names):
        return names
    if len(folders) == num_classes:
        warnings.warn(
            f"the class folders of {cfg.data.path} are not ImageNet synsets: their sorted order is taken as "
            f"the label order of {path}",
            stacklevel=2,
        )
        return None
    raise DataError(
        f"cannot label the {len(folders)} class folders of {cfg.data.path} for {path}: its "
        f"{num_classes}-class "
        f"classifier knows ImageNet synsets (e.g. {names[0]}), and {folders[0]!r} is not one"
    )


def build_model(
    cfg: Config, num_classes: int, pretrained: str = "", keep_head: bool | None = None
) -> tuple[nn.Module, list[str]]:
    """``timm.create_model(cfg.model.name, ...)``, optionally initialised from ``pretrained``.

    Args:
        cfg: run config (``model`` section).
        num_classes: classifier size K.
        pretrained: a vit3 checkpoint or an official ViTTT file (through the model's
            ``pretrained_cfg_overlay``); "" for random init. The classifier is replaced by a fresh one for
            K classes unless ``keep_head`` (then K must be the checkpoint's class count).
        keep_head: load the pretrained classifier too (default: ``model.keep_head``).

    Returns:
        ``(model, fresh)`` where ``fresh`` names the parameters of a new (re-initialised) head.
    """
    import vit3.models  # noqa: F401  (registers the vit3 models in timm)

    with model_arguments(cfg.model.name, cfg.model.kwargs):
        return _build_model(cfg, num_classes, pretrained, keep_head)


def _build_model(
    cfg: Config, num_classes: int, pretrained: str, keep_head: bool | None
) -> tuple[nn.Module, list[str]]:
    kwargs = dict(cfg.model.kwargs)
    written = written_keys(cfg)
    rate = cfg.model.drop_path_rate
    if "model.drop_path_rate" in written and "drop_path_rate" in kwargs and kwargs["drop_path_rate"] != rate:
        if "model.kwargs.drop_path_rate" in written:
            raise ConfigError(
                f"model.drop_path_rate={rate} and model.kwargs.drop_path_rate={kwargs['drop_path_rate']} "
                "differ: set one of them"
            )
        kwargs["drop_path_rate"] = rate  # written over a checkpoint record's
    kwargs.setdefault("drop_path_rate", rate)
    name = cfg.model.name
    keep_head = bool(cfg.model.get("keep_head", False)) if keep_head is None else keep_head
    if pretrained:
        if not Path(pretrained).is_file():
            raise FileNotFoundError(f"model.pretrained file not found: {pretrained}")
        obj = peek_vit3_checkpoint(pretrained)
        if obj is not None:
            model = timm.create_model(name, num_classes=num_classes, **kwargs)
            fresh = load_model_weights(
                model, obj, cfg.model.pretrained_ema, new_head=not keep_head, source=pretrained
            )
            return model, fresh
        # An official ViTTT file: the vit3 models' loader converts it (EMA weights with pretrained_ema).
        if cfg.model.pretrained_ema:
            kwargs["pretrained_ema"] = True
        model = timm.create_model(
            name,
            pretrained=True,
            pretrained_cfg_overlay={"file": str(pretrained)},
            num_classes=num_classes,
            **kwargs,
        )
        if keep_head:
            return model, []
        heads = tuple(classifier_prefixes(model))
        fresh = [k for k in model.state_dict() if k.startswith(heads)]
        if num_classes == model.pretrained_cfg.get("num_classes"):  # timm kept the file's classifier
            init = timm.create_model(name, num_classes=num_classes, **kwargs).state_dict()
            model.load_state_dict({k: init[k] for k in fresh}, strict=False)
        return model, fresh
    return timm.create_model(name, num_classes=num_classes, **kwargs), []


@torch.no_grad()
def validate(
    model: nn.Module, loader, device: torch.device, amp_dtype: torch.dtype | None = None
) -> dict[str, float]:
    """Top-1/top-5 (%) and mean cross-entropy over the loader, summed over all ranks.

    Returns:
        ``top1``, ``top5``, ``loss``; ``images``: the images counted (all ranks), and ``skipped``: those of
        the loader's dataset left out (corrupt files under ``data.corrupt_images=skip``: a ``None`` batch
        holds none).

    Raises:
        DataError: no image of the dataset could be read.
    """
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, count
    for batch in loader:
        if batch is None:  # every image of the batch skipped
            continue
        x, y = batch
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, amp_dtype):
            logits = model(x)
        logits = logits.float()
        k = min(5, logits.shape[-1])
        topk = logits.topk(k, dim=-1).indices  # [B, k]
        hits = topk.eq(y[:, None])
        batch = [
            F.cross_entropy(logits, y, reduction="sum"),
            hits[:, 0].sum(),
            hits.any(-1).sum(),
            y.new_tensor(len(y)),
        ]
        sums += torch.stack([v.to(sums.dtype) for v in batch])
    loss, top1, top5, n = sum_tensor(sums).tolist()
    skipped = len(loader.dataset) - int(n)
    if n == 0:
        raise DataError(f"none of the {skipped} validation images could be read (all skipped as corrupt)")
    return {
        "top1": 100.0 * top1 / n,
        "top5": 100.0 * top5 / n,
        "loss": loss / n,
        "images": int(n),
        "skipped": skipped,
    }
