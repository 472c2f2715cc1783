"""The tests of config values that the validation table (:data:`vit3.engine.config.schema.CONSTRAINTS`) runs:
names to look up (timm models, DiT³ models, devices, auto-augment policies, beta schedules), values that
depend on other keys, when a constraint applies (``only_if``) and the choices that depend on the task.

A test takes ``(value, cfg)`` and returns ``None`` when the value is fine, else why not ("" for no reason
beyond what the constraint allows); an ``only_if`` predicate takes ``(cfg, mode)``.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .kinds import EVAL, config_value, is_number

TIMM_NAME = "a timm model name (e.g. vit3_tiny, h_vit3_small; import vit3 registers them)"
AUTO_AUGMENT = "a timm auto-augment policy (e.g. rand-m9-mstd0.5-inc1, augmix-m5-w4, original, v0)"


def _task(cfg: Any) -> str:
    return str(config_value(cfg, "task", "classification"))


def is_generation(cfg: Any, mode: str | None = None) -> bool:
    return _task(cfg) == "generation"


def not_generation(cfg: Any, mode: str | None = None) -> bool:
    return _task(cfg) != "generation"


def epoch_task(cfg: Any, mode: str | None = None) -> bool:
    """The task counts its schedule in ``train.epochs`` (a dense task counts ``dense.iters``)."""
    return _task(cfg) in ("classification", "generation")


def _suggest(name: str, names: Sequence[str], fallback: str) -> str:
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f"did you mean {', '.join(close)}?" if close else fallback


def timm_model(name: Any, cfg: Any) -> str | None:
    """Why timm cannot build ``name`` (``""``: the config's other way to name it; ``source:...`` names, e.g.
    ``hf-hub:...``, are resolved by timm when the model is built)."""
    if not name or ":" in str(name):
        return None
    import timm

    import vit3.models  # noqa: F401  (registers the vit3 models in timm)

    if timm.is_model(str(name)):
        return None
    return _suggest(str(name), timm.list_models(), "no model of that name is registered (timm.list_models())")


def dit3_model(name: Any, cfg: Any) -> str | None:
    try:
        from vit3.models.dit3 import DIT3_CONFIGS, dit3_model_args
    except ImportError:  # the generation extra is missing: the engine says so
        return None
    try:
        dit3_model_args(str(name), {})
    except ValueError:
        return _suggest(str(name), sorted(DIT3_CONFIGS), "")
    return None


def dit3_kwargs(kwargs: Any, cfg: Any) -> str | None:
    try:
        from vit3.models.dit3 import DIT3_OVERRIDES
    except ImportError:
        return None
    # what the data and the VAE decide is not the user's to set
    # (vit3.engine.generation_sampling._model_kwargs)
    unknown = sorted(set(kwargs or {}) - set(DIT3_OVERRIDES))
    return (
        f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not create_dit3 overrides"
        if unknown
        else None
    )


# The sections of timm's auto-augment strings (timm.data.auto_augment), which timm's own parsers skip when
# they hold no number ('rand-garbage' trains as plain RandAugment): key -> policy kinds.
_AA_SECTIONS = {
    "rand": ("m", "n", "mstd", "mmax", "inc", "p"),
    "augmix": ("m", "w", "d", "a", "b", "mstd"),
    "auto": ("mstd",),
}


@functools.cache
def _auto_augment(text: str) -> str | None:
    """Why ``text`` is no timm auto-augment policy: every section is checked, then timm builds it once."""
    from timm.data import create_transform

    head, *sections = text.split("-")
    kind = head if head in ("rand", "augmix") else "auto"
    for section in sections:
        if kind == "rand" and section.startswith("t"):  # t<transform names>: timm looks them up below
            continue
        match = re.fullmatch(r"([a-z]+)(\d.*)", section)
        if match is None or match.group(1) not in _AA_SECTIONS[kind]:
            keys = ", ".join(f"{k}<number>" for k in _AA_SECTIONS[kind])
            article = "an" if kind[0] in "aeiou" else "a"
            return f"unknown section {section!r} ({article} {kind} policy takes {keys})"
    try:
        create_transform(8, is_training=True, auto_augment=text)
    except (AssertionError, ValueError, KeyError, TypeError) as e:
        return f"timm cannot build it ({str(e) or type(e).__name__})"
    return None


def auto_augment_policy(value: Any, cfg: Any) -> str | None:
    text = str(value)
    return None if text in ("", "none") else _auto_augment(text)


def interpolation(value: Any, cfg: Any) -> str | None:
    from timm.data.transforms import str_to_pil_interp

    if value == "random":  # timm's training crops draw bilinear or bicubic per image
        return None
    try:
        str_to_pil_interp(str(value))
    except KeyError:
        return ""
    return None


def torch_device(value: Any, cfg: Any) -> str | None:
    import torch

    if value == "auto":
        return None
    try:
        device = torch.device(str(value))
    except (RuntimeError, ValueError):
        return "torch knows no such device"
    if device.type not in ("cpu", "cuda"):
        return f"vit3 runs on cpu or cuda, not {device.type}"
    return None


def available_device(value: Any, cfg: Any) -> str | None:
    """A device this machine has (export.py runs on it directly)."""
    import torch

    why = torch_device(value, cfg)
    if why is not None:
        return why
    device = torch.device(str(value))
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            return f"this machine has {count} CUDA device(s)"
    return None


def dist_backends(cfg: Any) -> tuple[str, ...]:
    import torch.distributed as dist

    return ("auto", *(b for b in dist.Backend.backend_list if b not in ("undefined", "fake")))


@functools.cache
def beta_schedule(name: str) -> str | None:
    try:
        from diffusers import DDPMScheduler
    except ImportError:
        return None
    try:
        DDPMScheduler(beta_schedule=name)
    except NotImplementedError:
        return "diffusers' DDPMScheduler does not implement it"
    return None


def positive_counts(splits: Any, cfg: Any) -> str | None:
    if not isinstance(splits, Mapping):
        return f"a {type(splits).__name__}"
    bad = {k: v for k, v in splits.items() if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)}
    return (
        f"{', '.join(map(str, bad))} {'has' if len(bad) == 1 else 'have'} no positive count" if bad else None
    )


def class_names(names: Any, cfg: Any) -> str | None:
    count = config_value(cfg, "dense.num_classes")
    if not isinstance(names, list | tuple):
        return f"a {type(names).__name__}"
    if is_number(count) and len(names) != int(count):
        return f"{len(names)} names for dense.num_classes={count}"
    return None


def slide_stride(stride: Any, cfg: Any) -> str | None:
    crop = config_value(cfg, "dense.slide_crop")
    if isinstance(crop, list | tuple) and any(s > c for s, c in zip(stride, crop)):
        return "a stride larger than the window leaves pixels that no window covers"
    return None


def fid_inputs(cfg: Any, mode: str | None) -> bool:
    """The FID inputs are read: ``metrics.fid`` in an evaluation, or after training with
    ``train.final_eval``."""
    return bool(config_value(cfg, "metrics.fid")) and (
        mode == EVAL or bool(config_value(cfg, "train.final_eval"))
    )


def metrics_read(cfg: Any, mode: str | None) -> bool:
    return mode == EVAL or bool(config_value(cfg, "train.final_eval"))


def data_folder(cfg: Any, mode: str | None) -> bool:
    """``data.path`` is read: a folder, COCO or ADE20K dataset (a generation evaluation may not need it), or
    the synthetic digits an evaluation reads (their training run writes them)."""
    dataset = config_value(cfg, "data.dataset")
    read = dataset in ("folder", "coco", "ade20k") or (dataset == "digits" and mode == EVAL)
    return read and not (mode == EVAL and is_generation(cfg))


def warmup_advice(warmup: Any, cfg: Any) -> str | None:
    epochs = config_value(cfg, "train.epochs")
    if not (is_number(warmup) and is_number(epochs)) or warmup <= 0 or warmup < epochs:
        return None
    reached = min(1.0, epochs / warmup)
    return (
        f"train.warmup_epochs={warmup:g} is not below train.epochs={epochs}: the whole run is warmup (the lr "
        f"climbs linearly from train.warmup_lr and ends one update short of {reached:.0%} of the way to "
        "train.base_lr, with no cosine decay); lower train.warmup_epochs for the full schedule"
    )


def dense_warmup_advice(warmup: Any, cfg: Any) -> str | None:
    iters = config_value(cfg, "dense.iters")
    if not (is_number(iters) and iters > 0 and is_number(warmup)) or warmup < iters:
        return None
    milestones = config_value(cfg, "dense.milestones")
    step = config_value(cfg, "dense.lr_schedule") == "step" and milestones
    decay = (
        f"dense.milestones {list(milestones)}, counted in iterations as dense.iters is set" if step else ""
    )
    return (
        f"dense.warmup_iters={warmup} is not below dense.iters={iters}: the whole run is warmup (the lr "
        "climbs from dense.warmup_factor x lr, times the schedule's decay"
        f"{f' at {decay}' if decay else ''}, and never reaches its full value); lower dense.warmup_iters for "
        "the full schedule"
    )


def task_datasets(cfg: Any) -> tuple[str, ...] | None:
    return {
        "classification": ("folder", "mnist5k"),
        "generation": ("folder", "mnist5k"),
        "detection": ("coco", "digits"),
        "segmentation": ("ade20k", "digits"),
    }.get(_task(cfg))  # another task is the task key's error


def dense_archs(cfg: Any) -> tuple[str, ...] | None:
    if _task(cfg) == "detection":
        from ...tasks.detection import ARCHS

        return ARCHS
    if _task(cfg) == "segmentation":
        from ...tasks.segmentation import HEADS

        return HEADS
    return None


def task_names(cfg: Any) -> tuple[str, ...]:
    from .. import TASKS

    return TASKS
