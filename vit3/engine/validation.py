"""The one validation layer: the values every option of every script allows, checked before anything runs.

* :data:`CONSTRAINTS`: every config key of every task (``configs/default.yaml``,
  ``configs/dense/dense_base.yaml``, ``configs/generation/default.yaml``) whose value of the right type
  (:func:`vit3.engine.config.check_types`) can still be wrong: ranges (:class:`Range`), choices
  (:class:`Choice`), values to parse or look up and paths (:class:`Check`: timm's auto-augment policies, model
  names, devices, writable output folders, input files) and values that run but may not mean what the user
  expects (:class:`Advice`: a warning). A key is checked where a config has it (one table for all tasks);
  a constraint that depends on the task says so (``only_if``).
* When: most constraints are checked on every config load (:data:`LOAD`); those about the machine that runs
  (an output folder it can write, an input file it can read) at the start of a run of their mode
  (:data:`TRAIN`, :data:`EVAL`: :func:`vit3.engine.config.check_config` with the mode, which each engine calls
  before it writes anything).
* :data:`FLAGS`: the config key each flag of ``train.py`` / ``eval.py`` sets, so that a message names both;
  :data:`EXPORT_FLAGS`: the constraints of ``export.py``'s own flags (it has no config), checked by
  :func:`check_flags`.
* :data:`CHECKED_ON_USE`: what can only be checked once the model or the data exists, and where that is
  (feature indices against the model's feature levels, image sizes against the model, ...).
* :data:`FREE`: the keys whose every value of the right type is valid (names, switches).

Every failure is a :class:`~vit3.errors.ConfigError` with one line per bad value: ``config key <key> (<flag>)
must be <what is allowed>, got <value>[: <why>]`` (or ``--flag must be ...`` for export.py).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib
import itertools
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = [
    "CHECKED_ON_USE",
    "CONSTRAINTS",
    "EVAL",
    "EXPORT_FLAGS",
    "FLAGS",
    "FREE",
    "LOAD",
    "TRAIN",
    "Advice",
    "Check",
    "Choice",
    "Constraint",
    "Range",
    "check_flags",
    "check_input_size",
    "check_values",
    "folder_problem",
    "key_name",
    "model_arguments",
]

LOAD, TRAIN, EVAL = "load", "train", "eval"
_ON_LOAD = frozenset({LOAD})
_ON_TRAIN = frozenset({TRAIN})
_ON_EVAL = frozenset({EVAL})
_ON_RUN = frozenset({TRAIN, EVAL})

# The config key each flag of train.py / eval.py sets (messages about the key name the flag too).
FLAGS = {
    "output": "train.py --output",
    "train.resume": "train.py --resume",
    "train.overwrite": "train.py --overwrite",
    "eval.checkpoint": "eval.py --checkpoint",
    "model.name": "eval.py --model",
    "data.path": "eval.py --data",
    "eval.img_sizes": "eval.py --img-size",
    "eval.use_ema": "eval.py --ema",
    "eval.batch_size": "eval.py --batch-size",
    "eval.json": "eval.py --json",
    "sample.sampler": "eval.py --sampler",
    "sample.steps": "eval.py --steps",
    "sample.cfg_scale": "eval.py --cfg-scale",
    "sample.num_samples": "eval.py --num-samples",
}


def key_name(key: str) -> str:
    """``"config key eval.batch_size (eval.py --batch-size)"``: how messages name a key."""
    return f"config key {key}" + (f" ({FLAGS[key]})" if key in FLAGS else "")


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _show(v: Any) -> str:
    """A value as the user types it (YAML: true/false/null)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg``'s value at ``key`` (``default`` where ``cfg`` is None or lacks it)."""
    try:
        return cfg.get_path(key) if cfg is not None else default
    except ConfigError:
        return default


# -------------------------------------------------------------------------------------- constraint kinds
class Constraint:
    """What one key allows.

    Args:
        null: what null means, for a key that takes it (shown in the message; whether null is accepted at all
            is the type check's :data:`~vit3.engine.config.NULLABLE`). A null value is never checked here.
        when: the checks it belongs to: :data:`LOAD` (every load), :data:`TRAIN` / :data:`EVAL` (the start
            of a run of that mode).
        only_if: ``(cfg, mode) -> bool``: whether the constraint applies to this config at all (e.g. a key
            that one task reads only); ``None``: always.
    """

    def __init__(
        self,
        null: str = "",
        when: frozenset[str] = _ON_LOAD,
        only_if: Callable[[Any, str | None], bool] | None = None,
    ) -> None:
        self.null, self.when, self.only_if = null, when, only_if

    def applies(self, cfg: Any, mode: str | None) -> bool:
        if not (LOAD in self.when or mode in self.when):
            return False
        return self.only_if is None or bool(self.only_if(cfg, mode))

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        """``None`` when ``value`` is allowed, else ``(what is allowed, why not)`` (the second may be "")."""
        raise NotImplementedError


class Range(Constraint):
    """The values a numeric key allows: ``lo``/``hi`` bounds (a number, or another key's dotted name whose
    value is the bound), each closed unless ``lo_open``/``hi_open``. A list value must hold allowed values
    only, in increasing order with ``ordered`` (a ``(min, max)`` pair), as many as one of ``length`` (empty:
    any number) and at least ``min_length``.
    """

    def __init__(
        self,
        lo: float | str | None = None,
        hi: float | str | None = None,
        lo_open: bool = False,
        hi_open: bool = False,
        ordered: bool = False,
        length: tuple[int, ...] = (),
        min_length: int = 0,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.lo, self.hi, self.lo_open, self.hi_open, self.ordered = lo, hi, lo_open, hi_open, ordered
        self.length, self.min_length = length, min_length

    def bounds(self, cfg: Any) -> tuple[float | None, float | None]:
        """The numeric bounds in ``cfg`` (a bound named by a key that ``cfg`` lacks or sets to a non-number
        is no bound)."""

        def value(bound: float | str | None) -> float | None:
            if isinstance(bound, str):
                bound = _get(cfg, bound)
            return float(bound) if is_number(bound) else None

        return value(self.lo), value(self.hi)

    def allows(self, value: Any, cfg: Any) -> bool:
        """Whether ``value`` (a number, or a list of numbers) is allowed; other values are the type check's."""
        lo, hi = self.bounds(cfg)

        def inside(v: float) -> bool:
            above = lo is None or (v > lo if self.lo_open else v >= lo)
            below = hi is None or (v < hi if self.hi_open else v <= hi)
            return above and below

        if isinstance(value, list | tuple):
            numbers = [v for v in value if is_number(v)]
            in_order = not self.ordered or all(a <= b for a, b in itertools.pairwise(numbers))
            counted = (not self.length or len(value) in self.length) and len(value) >= self.min_length
            return all(inside(v) for v in numbers) and in_order and counted
        return not is_number(value) or inside(value)

    def describe(self, cfg: Any) -> str:
        """``"> 0"``, ``"in [0, 1)"``, ``"<= train.base_lr (0.001)"``, ... (for messages)."""
        lo, hi = self.bounds(cfg)

        def shown(bound: float | str | None, number: float | None) -> str:
            return f"{bound} ({number:g})" if isinstance(bound, str) else f"{number:g}"

        if lo is not None and hi is not None:
            return (
                f"in {'(' if self.lo_open else '['}{shown(self.lo, lo)}, {shown(self.hi, hi)}"
                f"{')' if self.hi_open else ']'}"
            )
        if lo is not None:
            return f"{'>' if self.lo_open else '>='} {shown(self.lo, lo)}"
        if hi is not None:
            return f"{'<' if self.hi_open else '<='} {shown(self.hi, hi)}"
        return "any number"

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        if self.allows(value, cfg):
            return None
        what = self.describe(cfg)
        if isinstance(value, list | tuple):
            count = " or ".join(map(str, self.length)) + " " if self.length else ""
            some = "a non-empty list" if self.min_length and not count else "a list"
            what = f"{some} of {count}values {what}" + (", in increasing order" if self.ordered else "")
        return what, ""


class Choice(Constraint):
    """One of a few values: ``values``, or ``values(cfg)`` (e.g. the task's datasets), or the name
    ``"module:ATTRIBUTE"`` of the tuple that the code using the value defines (imported when checked; a module
    that cannot be imported, e.g. of an optional extra, leaves the value to the code that needs it)."""

    def __init__(self, values: tuple[Any, ...] | str | Callable[[Any], Sequence[Any]], **common: Any) -> None:
        super().__init__(**common)
        self.values = values

    def options(self, cfg: Any) -> tuple[Any, ...] | None:
        """The allowed values (``None``: unknown here, e.g. an optional dependency is missing)."""
        if isinstance(self.values, str):
            module, _, attr = self.values.partition(":")
            try:
                return tuple(getattr(importlib.import_module(module), attr))
            except ImportError:
                return None
        values = self.values(cfg) if callable(self.values) else self.values
        return None if values is None else tuple(values)

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        options = self.options(cfg)
        if options is None or any(value == o and type(value) is type(o) for o in options):
            return None
        close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.6)
        return f"one of {', '.join(map(_show, options))}", f"did you mean {close[0]}?" if close else ""


class Check(Constraint):
    """A value to parse, look up or find on disk: ``test(value, cfg)`` returns ``None`` when it is fine,
    else why it is not; ``what`` says what is allowed."""

    def __init__(self, what: str, test: Callable[[Any, Any], str | None], **common: Any) -> None:
        super().__init__(**common)
        self.what, self.test = what, test

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        why = self.test(value, cfg)
        return None if why is None else (self.what, why)


class Advice(Constraint):
    """A value that runs but may not mean what the user expects: ``test(value, cfg)`` returns the warning
    (what the value means, and how to get the usual behaviour), or ``None``. Never an error."""

    def __init__(self, test: Callable[[Any, Any], str | None], **common: Any) -> None:
        super().__init__(**common)
        self.test = test

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        return None


POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
PROBABILITY = Range(0, 1)
PAIR = (2,)


# ------------------------------------------------------------------------------------ tests of values
def _task(cfg: Any) -> str:
    return str(_get(cfg, "task", "classification"))


def _generation(cfg: Any, mode: str | None = None) -> bool:
    return _task(cfg) == "generation"


def _not_generation(cfg: Any, mode: str | None = None) -> bool:
    return _task(cfg) != "generation"


def _epoch_task(cfg: Any, mode: str | None = None) -> bool:
    """The task counts its schedule in ``train.epochs`` (a dense task counts ``dense.iters``)."""
    return _task(cfg) in ("classification", "generation")


def _suggest(name: str, names: Sequence[str], fallback: str) -> str:
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f"did you mean {', '.join(close)}?" if close else fallback


def _timm_model(name: Any, cfg: Any) -> str | None:
    """Why timm cannot build ``name`` (``""``: the config's other way to name it; ``source:...`` names, e.g.
    ``hf-hub:...``, are resolved by timm when the model is built)."""
    if not name or ":" in str(name):
        return None
    import timm

    import vit3.models  # noqa: F401  (registers the vit3 models in timm)

    if timm.is_model(str(name)):
        return None
    return _suggest(str(name), timm.list_models(), "no model of that name is registered (timm.list_models())")


def _dit3_model(name: Any, cfg: Any) -> str | None:
    try:
        from vit3.models.dit3 import DIT3_CONFIGS, _model_args
    except ImportError:  # the generation extra is missing: the engine says so
        return None
    try:
        _model_args(str(name), {})
    except ValueError:
        return _suggest(str(name), sorted(DIT3_CONFIGS), "")
    return None


def _dit3_kwargs(kwargs: Any, cfg: Any) -> str | None:
    try:
        from vit3.models.dit3 import DIT3_OVERRIDES
    except ImportError:
        return None
    # what the data and the VAE decide is not the user's to set (vit3.engine.generation._model_kwargs)
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


def _auto_augment_policy(value: Any, cfg: Any) -> str | None:
    text = str(value)
    return None if text in ("", "none") else _auto_augment(text)


def _interpolation(value: Any, cfg: Any) -> str | None:
    from timm.data.transforms import str_to_pil_interp

    if value == "random":  # timm's training crops draw bilinear or bicubic per image
        return None
    try:
        str_to_pil_interp(str(value))
    except KeyError:
        return ""
    return None


def _device(value: Any, cfg: Any) -> str | None:
    import torch

    if value == "auto":
        return None
    try:
        torch.device(str(value))
    except (RuntimeError, ValueError):
        return "torch knows no such device"
    return None


def _available_device(value: Any, cfg: Any) -> str | None:
    """A device this machine has (export.py runs on it directly)."""
    import torch

    why = _device(value, cfg)
    if why is not None:
        return why
    device = torch.device(str(value))
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            return f"this machine has {count} CUDA device(s)"
    return None


def _backends(cfg: Any) -> tuple[str, ...]:
    import torch.distributed as dist

    return ("auto", *(b for b in dist.Backend.backend_list if b not in ("undefined", "fake")))


@functools.cache
def _beta_schedule(name: str) -> str | None:
    try:
        from diffusers import DDPMScheduler
    except ImportError:
        return None
    try:
        DDPMScheduler(beta_schedule=name)
    except NotImplementedError:
        return "diffusers' DDPMScheduler does not implement it"
    return None


def _positive_counts(splits: Any, cfg: Any) -> str | None:
    if not isinstance(splits, Mapping):
        return f"a {type(splits).__name__}"
    bad = {k: v for k, v in splits.items() if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)}
    return (
        f"{', '.join(map(str, bad))} {'has' if len(bad) == 1 else 'have'} no positive count" if bad else None
    )


def _class_names(names: Any, cfg: Any) -> str | None:
    count = _get(cfg, "dense.num_classes")
    if not isinstance(names, list | tuple):
        return f"a {type(names).__name__}"
    if is_number(count) and len(names) != int(count):
        return f"{len(names)} names for dense.num_classes={count}"
    return None


def _slide_stride(stride: Any, cfg: Any) -> str | None:
    crop = _get(cfg, "dense.slide_crop")
    if isinstance(crop, list | tuple) and any(s > c for s, c in zip(stride, crop)):
        return "a stride larger than the window leaves pixels that no window covers"
    return None


# ------------------------------------------------------------------------------------------------ paths
def folder_problem(path: Path) -> str | None:
    """Why this process could not write into the folder ``path`` (creating it first if need be), or ``None``.

    The check runs before anything is written: ``path`` must not be a file, none of its existing ancestors a
    file, and the deepest one that exists must be writable (``os.access``; it says yes to root, except on a
    read-only file system).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{path} is a file"
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return f"{base} is a file, so nothing can be made under it"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{base} is not writable here (permission denied or a read-only file system)"
    return None


def file_problem(path: Path, suffix: str = "") -> str | None:
    """Why this process could not write the file ``path`` (ending in ``suffix`` when given), or ``None``."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder"
    if suffix and path.suffix.lower() != suffix:
        return f"the file name must end in {suffix}, so that no other file (a checkpoint, say) is overwritten"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is not writable here"
    if path.parent.is_file():
        return f"{path.parent} is a file, so nothing can be made under it"
    return folder_problem(path.parent)


def _writable_folder(value: Any, cfg: Any) -> str | None:
    return folder_problem(Path(str(value))) if value else None


def _checkpoint_folder(cfg: Any) -> Path | None:
    checkpoint = _get(cfg, "eval.checkpoint")
    return Path(str(checkpoint)).parent if checkpoint else None


def _eval_output_folder(value: Any, cfg: Any) -> str | None:
    """``sample.out``: the folder it names, or (empty) the default next to the checkpoint."""
    if value:
        return folder_problem(Path(str(value)))
    folder = _checkpoint_folder(cfg)
    why = folder_problem(folder) if folder is not None else None
    return f"the default output next to the checkpoint cannot be written: {why}" if why else None


def _report(value: Any, cfg: Any) -> str | None:
    """``eval.json``: the file it names, or (empty) the default next to the checkpoint."""
    if value:
        return file_problem(Path(str(value)), ".json")
    folder = _checkpoint_folder(cfg)
    why = folder_problem(folder) if folder is not None else None
    return f"the default report next to the checkpoint cannot be written: {why}" if why else None


def _existing(kind: str, special: tuple[str, ...] = ()) -> Callable[[Any, Any], str | None]:
    """A test for a path that must exist (``kind``: ``"file"`` or ``"folder"``); "" and ``special`` values
    (e.g. ``"auto"``) are not paths."""

    def test(value: Any, cfg: Any) -> str | None:
        if not value or value in special:
            return None
        path = Path(str(value))
        if not path.exists():
            return "not found"
        if kind == "file" and path.is_dir():
            return "it is a folder"
        if kind == "folder" and not path.is_dir():
            return "it is a file"
        return None

    return test


def _input(kind: str, special: tuple[str, ...] = ()) -> str:
    word = {"file": "an existing file", "folder": "an existing folder"}[kind]
    return word + (f" (or {', '.join(special)})" if special else "")


def _fid_inputs(cfg: Any, mode: str | None) -> bool:
    """The FID inputs are read: ``metrics.fid`` in an evaluation, or after training with ``train.final_eval``."""
    return bool(_get(cfg, "metrics.fid")) and (mode == EVAL or bool(_get(cfg, "train.final_eval")))


def _metrics_read(cfg: Any, mode: str | None) -> bool:
    return mode == EVAL or bool(_get(cfg, "train.final_eval"))


def _data_folder(cfg: Any, mode: str | None) -> bool:
    """``data.path`` is read: a folder, COCO or ADE20K dataset (a generation evaluation may not need it)."""
    read = _get(cfg, "data.dataset") in ("folder", "coco", "ade20k")
    return read and not (mode == EVAL and _generation(cfg))


def _warmup(warmup: Any, cfg: Any) -> str | None:
    epochs = _get(cfg, "train.epochs")
    if not (is_number(warmup) and is_number(epochs)) or warmup <= 0 or warmup < epochs:
        return None
    reached = min(1.0, epochs / warmup)
    return (
        f"train.warmup_epochs={warmup:g} is not below train.epochs={epochs}: the whole run is warmup (the lr "
        f"climbs linearly from train.warmup_lr and ends at {reached:.0%} of the way to train.base_lr, with no "
        f"cosine decay); lower train.warmup_epochs for the full schedule"
    )


def _dense_warmup(warmup: Any, cfg: Any) -> str | None:
    iters = _get(cfg, "dense.iters")
    if not (is_number(iters) and iters > 0 and is_number(warmup)) or warmup < iters:
        return None
    return (
        f"dense.warmup_iters={warmup} is not below dense.iters={iters}: the whole run is warmup (the lr climbs "
        f"from dense.warmup_factor x lr and never decays); lower dense.warmup_iters for the full schedule"
    )


def _task_datasets(cfg: Any) -> tuple[str, ...] | None:
    return {
        "classification": ("folder", "mnist5k"),
        "generation": ("folder", "mnist5k"),
        "detection": ("coco", "digits"),
        "segmentation": ("ade20k", "digits"),
    }.get(_task(cfg))  # another task is the task key's error


def _dense_archs(cfg: Any) -> tuple[str, ...] | None:
    if _task(cfg) == "detection":
        from ..tasks.detection import ARCHS

        return ARCHS
    if _task(cfg) == "segmentation":
        from ..tasks.segmentation import HEADS

        return HEADS
    return None


def _tasks(cfg: Any) -> tuple[str, ...]:
    from . import TASKS

    return TASKS


_TIMM_NAME = "a timm model name (e.g. vit3_tiny, h_vit3_small; import vit3 registers them)"
_AUTO_AUGMENT = "a timm auto-augment policy (e.g. rand-m9-mstd0.5-inc1, augmix-m5-w4, original, v0)"

# The values each key allows (see the module docstring); one table for every task, a key is checked where a
# config has it. A tuple holds several constraints of one key, checked in order (the first failure is
# reported).
CONSTRAINTS: dict[str, Constraint | tuple[Constraint, ...]] = {
    "task": Choice(_tasks),
    "seed": NON_NEGATIVE,
    "output": Check(what="a folder this run can write", test=_writable_folder, when=_ON_TRAIN),
    "device": Check(what="auto, cpu, cuda or cuda:N (a torch device)", test=_device),
    "threads": Range(1, null="torch's default"),
    "model.name": (
        Check(what=_TIMM_NAME, test=_timm_model, only_if=_not_generation),
        Check(what="a DiT³ model: dit3_{s,b,l,xl}_{2,4,8}", test=_dit3_model, only_if=_generation),
    ),
    "model.kwargs": Check(what="create_dit3 overrides", test=_dit3_kwargs, only_if=_generation),
    "model.num_classes": Range(1, null="the classes of the data"),
    "model.drop_path_rate": Range(0, 1, hi_open=True),
    "model.class_dropout_prob": Range(0, 1, hi_open=True),
    "model.mixer": Choice("vit3.models.dit3:MIXERS"),
    "model.pretrained": Check(
        what=_input("file"),
        test=_existing("file"),
        when=_ON_TRAIN,
        only_if=lambda cfg, mode: not _get(cfg, "train.resume"),  # a resume takes the checkpoint's weights
    ),
    "data.dataset": Choice(_task_datasets),
    "data.path": (
        Check(what=_input("folder"), test=_existing("folder"), when=_ON_RUN, only_if=_data_folder),
        Check(
            what="a folder this run can write the synthetic data to",
            test=lambda value, cfg: None if Path(str(value)).exists() else _writable_folder(value, cfg),
            when=_ON_TRAIN,
            only_if=lambda cfg, mode: _get(cfg, "data.dataset") == "digits",
        ),
    ),
    "data.img_size": AT_LEAST_ONE,
    "data.interpolation": Check(
        what="a timm interpolation (bicubic, bilinear, nearest, ..., random)", test=_interpolation
    ),
    "data.crop_pct": Range(0, 1, lo_open=True, null="the model's"),
    "data.std": Range(0, lo_open=True, null="the model's"),
    "data.channels": Choice((1, 3)),
    "data.hflip": PROBABILITY,
    "data.batch_size": AT_LEAST_ONE,
    "data.fit_batch": NON_NEGATIVE,
    "data.num_workers": NON_NEGATIVE,
    "data.corrupt_images": Choice("vit3.data.folder:CORRUPT_POLICIES"),
    "aug.scale": Range(0, 1, lo_open=True, ordered=True, length=PAIR),
    "aug.ratio": Range(0, lo_open=True, ordered=True, length=PAIR),
    "aug.hflip": PROBABILITY,
    "aug.auto_augment": Check(what=_AUTO_AUGMENT, test=_auto_augment_policy, null="off"),
    "aug.color_jitter": Range(0, null="off", length=(3, 4)),
    "aug.reprob": PROBABILITY,
    "aug.remode": Choice(("pixel", "rand", "const")),
    "aug.recount": AT_LEAST_ONE,
    "aug.mixup": Range(0, null="off"),
    "aug.cutmix": Range(0, null="off"),
    "aug.cutmix_minmax": Range(0, 1, lo_open=True, ordered=True, length=PAIR, null="from aug.cutmix"),
    "aug.mixup_prob": PROBABILITY,
    "aug.mixup_switch_prob": PROBABILITY,
    "aug.mixup_mode": Choice(("batch", "pair", "elem")),
    "aug.label_smoothing": Range(0, 1, hi_open=True),
    "train.epochs": AT_LEAST_ONE,
    "train.min_steps": NON_NEGATIVE,
    "train.warmup_epochs": (NON_NEGATIVE, Advice(test=_warmup, when=_ON_TRAIN, only_if=_epoch_task)),
    "train.base_lr": POSITIVE,
    "train.warmup_lr": Range(0, "train.base_lr"),
    "train.min_lr": Range(0, "train.base_lr"),
    "train.lr_batch": POSITIVE,
    "train.lr_scale": Choice("vit3.engine.optim:LR_SCALES"),
    "train.weight_decay": NON_NEGATIVE,
    "train.betas": Range(0, 1, hi_open=True, length=PAIR),
    "train.eps": POSITIVE,
    "train.layer_decay": Range(0, 1, lo_open=True, null="off"),
    "train.clip_grad": Range(0, lo_open=True, null="no clipping"),
    "train.accum_steps": AT_LEAST_ONE,
    "train.freeze": Choice("vit3.engine.recipe:FREEZE_MODES"),
    "train.amp": Choice("vit3.engine.common:AMP_MODES"),
    "train.ema_decay": Range(0, 1, hi_open=True),
    "train.ema_batch": POSITIVE,
    "train.mesa": (
        Range(0, null="off"),
        Check(
            what="0 without train.ema (MESA's teacher is the EMA model)",
            test=lambda mesa, cfg: "set train.ema=true" if mesa > 0 and not _get(cfg, "train.ema") else None,
        ),
    ),
    "train.mesa_start": PROBABILITY,
    "train.eval_every": AT_LEAST_ONE,
    "train.save_every_steps": NON_NEGATIVE,
    "train.resume": Check(what=_input("file", ("auto",)), test=_existing("file", ("auto",)), when=_ON_TRAIN),
    "train.log_every": NON_NEGATIVE,
    "train.progress": Choice((True, False, "run")),
    "dist.backend": Choice(_backends),
    "eval.checkpoint": Check(what=_input("file"), test=_existing("file"), when=_ON_EVAL),
    "eval.img_sizes": AT_LEAST_ONE,
    "eval.batch_size": AT_LEAST_ONE,
    "eval.throughput_batches": AT_LEAST_ONE,
    "eval.json": Check(what="a .json file this run can write", test=_report, when=_ON_EVAL),
    # generation
    "vae.path": Check(
        what=_input("folder") + " holding a diffusers AutoencoderKL (nothing is downloaded)",
        test=_existing("folder"),
        when=_ON_RUN,
    ),
    "vae.scaling_factor": Range(0, lo_open=True, null="the VAE config's"),
    "diffusion.num_timesteps": Range(2),
    "diffusion.beta_schedule": Check(
        what="a diffusers beta schedule (linear, scaled_linear, squaredcos_cap_v2, ...)",
        test=lambda value, cfg: _beta_schedule(str(value)),
    ),
    "diffusion.beta_start": Range(0, 1, lo_open=True, hi_open=True),
    "diffusion.beta_end": Range("diffusion.beta_start", 1, hi_open=True),
    "sample.sampler": Choice("vit3.tasks.diffusion:SAMPLERS"),
    "sample.steps": Range(1, "diffusion.num_timesteps"),
    "sample.guided_channels": Range(1, null="the official 3, capped at the latent channels"),
    "sample.cfg_scale": NON_NEGATIVE,
    "sample.num_samples": AT_LEAST_ONE,
    "sample.classes": Range(0, null="all classes"),
    "sample.batch_size": AT_LEAST_ONE,
    "sample.seed": NON_NEGATIVE,
    "sample.grid": NON_NEGATIVE,
    "sample.out": Check(what="a folder this run can write", test=_eval_output_folder, when=_ON_EVAL),
    "sample.amp": Choice(("none", "bf16", "fp16")),
    "metrics.inception_weights": Check(
        what=_input("file") + " (metrics.fid needs it)",
        test=_existing("file"),
        when=_ON_RUN,
        only_if=_fid_inputs,
    ),
    "metrics.reference": Check(
        what=_input("file"), test=_existing("file"), when=_ON_RUN, only_if=_fid_inputs
    ),
    "metrics.classifier": Check(
        what=_input("file", ("auto",)), test=_existing("file", ("auto",)), when=_ON_RUN, only_if=_metrics_read
    ),
    "metrics.batch_size": AT_LEAST_ONE,
    "metrics.floor_draws": AT_LEAST_ONE,
    # detection / segmentation
    "dense.arch": Choice(_dense_archs),
    "dense.num_classes": Range(1, null="from the data"),
    "dense.iters": NON_NEGATIVE,
    "dense.eval_interval": NON_NEGATIVE,
    "dense.lr_schedule": Choice(("step", "poly")),
    "dense.milestones": Range(0, ordered=True),
    "dense.gamma": Range(0, 1, lo_open=True),
    "dense.poly_power": NON_NEGATIVE,
    "dense.warmup_iters": (NON_NEGATIVE, Advice(test=_dense_warmup, when=_ON_TRAIN)),
    "dense.warmup_factor": PROBABILITY,
    "dense.backbone_lr_mult": NON_NEGATIVE,
    "dense.out_channels": AT_LEAST_ONE,
    "dense.min_size": AT_LEAST_ONE,
    "dense.max_size": AT_LEAST_ONE,
    "dense.anchor_sizes": Range(0, lo_open=True, ordered=True, length=(5,)),  # one per FPN level
    "dense.detections_per_img": AT_LEAST_ONE,
    "dense.box_head_dim": AT_LEAST_ONE,
    "dense.mask_head_dim": AT_LEAST_ONE,
    "dense.ann_train": Check(what=_input("file"), test=_existing("file"), when=_ON_TRAIN, null="the split's"),
    "dense.ann_val": Check(what=_input("file"), test=_existing("file"), when=_ON_RUN, null="the split's"),
    "dense.head_channels": Range(1, null="the head's default"),
    "dense.aux_weight": NON_NEGATIVE,
    "dense.scale": Range(1, length=PAIR),
    "dense.crop_size": Range(1, length=PAIR),
    "dense.ratio_range": Range(0, lo_open=True, ordered=True, length=PAIR),
    "dense.cat_max_ratio": Range(0, 1, lo_open=True),
    "dense.inference": Choice(("whole", "slide")),
    "dense.slide_crop": Range(1, length=PAIR),
    "dense.slide_stride": (
        Range(1, length=PAIR),
        Check(what="at most dense.slide_crop on each side", test=_slide_stride),
    ),
    "dense.class_names": Check(what="a list of one name per class", test=_class_names, null="indices"),
    "dense.synthetic.splits": Check(
        what="a mapping of split names to image counts >= 1", test=_positive_counts, null="64 train, 16 val"
    ),
    "dense.synthetic.image_size": AT_LEAST_ONE,
    "dense.synthetic.digits": Range(0, 9, min_length=1),
    "dense.synthetic.max_per_image": AT_LEAST_ONE,
    "dense.synthetic.digit_size": Range(1, "dense.synthetic.image_size", ordered=True, length=PAIR),
}

# What depends on the model or the data, checked where they are built (each a ConfigError naming the key).
CHECKED_ON_USE = {
    "model.kwargs": "the arguments of the model (model_arguments, wherever a model is built)",
    "data.mean": "one value per input channel of the model (engine.classification.resolve_data_cfg)",
    "data.train_split": "the split folder exists (data.build / dense datasets)",
    "data.val_split": "the split folder exists (data.build / dense datasets)",
    "data.img_size": "a size the model takes (check_input_size, before training)",
    "eval.img_sizes": "sizes the model takes (check_input_size, before evaluating)",
    "sample.classes": "class indices of the model (engine.generation)",
    "dense.out_indices": "the backbone's feature levels (tasks.backbone.FeatureBackbone)",
    "dense.detector_kwargs": "the arguments of torchvision's detector (model_arguments)",
    "dist.backend": "a backend this machine runs under torchrun (engine.distributed.init_distributed)",
    "device": "a device this machine has (engine.distributed)",
}

# Keys whose every value of the right type is valid: switches, names, free-form lists.
FREE = frozenset(
    {
        "deterministic",
        "cpu_malloc",
        "model.grad_checkpointing",
        "model.pretrained_ema",
        "model.keep_head",
        "model.learn_sigma",
        "data.mean",
        "data.train_split",
        "data.val_split",
        "data.pin_memory",
        "train.ema",
        "train.keep_best",
        "train.overwrite",
        "train.force_resume",
        "train.final_eval",
        "dist.find_unused_parameters",
        "eval.use_ema",
        "eval.flops",
        "vae.sample_posterior",
        "sample.use_ema",
        "metrics.fid",
        "dense.out_indices",
        "dense.no_decay_keys",
        "dense.detector_kwargs",
        "dense.reduce_zero_label",
    }
)


def _constraints(entry: Constraint | tuple[Constraint, ...]) -> tuple[Constraint, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def _message(name: str, value: Any, constraint: Constraint, what: str, why: str) -> str:
    null = f" (or null: {constraint.null})" if constraint.null else ""
    return f"{name} must be {what}{null}, got {value!r}" + (f": {why}" if why else "")


def _main_process() -> bool:
    """Not a process of rank > 0 under torchrun (rank 0 speaks for the run)."""
    return os.environ.get("RANK", "0") in ("", "0")


def check_values(cfg: Any, mode: str | None = None) -> None:
    """Checks every key of :data:`CONSTRAINTS` that ``cfg`` has against the values it allows: the
    :data:`LOAD` constraints, and with ``mode`` (``"train"`` / ``"eval"``) those of a run of that mode. A null
    value is left to the type check; :class:`Advice` becomes a warning (rank 0 only).

    Raises:
        ConfigError: naming each key with a value it does not allow and what it allows.
    """
    errors, notes, bad = [], [], set()
    for key, entry in CONSTRAINTS.items():
        try:
            value = cfg.get_path(key)
        except ConfigError:  # a key of another task's config
            continue
        if value is None:
            continue
        for constraint in _constraints(entry):
            if not constraint.applies(cfg, mode):
                continue
            if isinstance(constraint, Range) and {constraint.lo, constraint.hi} & bad:
                continue  # bounded by a key already reported
            if isinstance(constraint, Advice):
                note = constraint.test(value, cfg)
                if note:
                    notes.append(note)
                continue
            found = constraint.problem(value, cfg)
            if found is not None:
                bad.add(key)
                errors.append(_message(key_name(key), value, constraint, *found))
                break
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else "bad config values:\n  " + "\n  ".join(errors))
    if _main_process():
        for note in notes:
            warnings.warn(note, stacklevel=3)


# ------------------------------------------------------------------------------------------- export.py
def _onnx_opsets() -> tuple[int, int]:
    try:
        from torch.onnx import _constants
    except ImportError:  # pragma: no cover - every torch vit3 supports has it
        return 7, 23
    return int(_constants.ONNX_MIN_OPSET), int(_constants.ONNX_MAX_OPSET)


_COMMON_EXPORT_FLAGS: dict[str, Constraint] = {
    "--model": Check(what=_TIMM_NAME, test=_timm_model),
    "--checkpoint": Check(what=_input("file"), test=_existing("file")),
    "--img-size": AT_LEAST_ONE,
}
# The constraints of export.py's flags, per command (its switches and choices are argparse's).
EXPORT_FLAGS: dict[str, dict[str, Constraint]] = {
    "features": {
        **_COMMON_EXPORT_FLAGS,
        "--images": Check(what=_input("folder"), test=_existing("folder")),
        "--out": Check(what="a folder this run can write", test=_writable_folder),
        "--crop-pct": Range(0, 1, lo_open=True),
        "--batch-size": AT_LEAST_ONE,
        "--device": Check(what="cpu, cuda or cuda:N (a device of this machine)", test=_available_device),
    },
    "onnx": {
        **_COMMON_EXPORT_FLAGS,
        "--out": Check(
            what="a .onnx file this run can write", test=lambda value, cfg: file_problem(Path(value), ".onnx")
        ),
        "--opset": Range(*_onnx_opsets()),
    },
}


def check_flags(args: argparse.Namespace, table: Mapping[str, Constraint]) -> None:
    """Checks the flags of ``args`` that ``table`` holds (a flag not given is not checked).

    Raises:
        ConfigError: ``--flag must be <what is allowed>, got <value>`` for the first bad flag.
    """
    for flag, constraint in table.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        found = constraint.problem(value, None)
        if found is not None:
            raise ConfigError(_message(flag, value, constraint, *found))


# --------------------------------------------------------------------------------- checks on the model
@contextlib.contextmanager
def model_arguments(name: str, kwargs: Mapping[str, Any], key: str = "model.kwargs") -> Iterator[None]:
    """Reports a keyword argument the model does not take (``TypeError``), given by the user in ``kwargs``
    (the config's ``key``), as a :class:`~vit3.errors.ConfigError` naming it."""
    try:
        yield
    except TypeError as e:
        match = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if match is None or match.group(1) not in kwargs:
            raise
        raise ConfigError(f"{key}.{match.group(1)} is not an argument of {name} ({e})") from e


def check_input_size(model: Any, in_chans: int, size: int, name: str, model_name: str = "") -> None:
    """Runs ``model`` once on one ``[1, in_chans, size, size]`` image (no gradient, eval mode, RNG states
    kept) and reports a size it refuses (``ValueError`` / ``AssertionError``, e.g. below its total stride,
    or another size than a fixed-size model's) as a :class:`~vit3.errors.ConfigError` naming ``name`` (the
    key or flag that set the size).
    """
    import torch

    device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model(torch.zeros(1, in_chans, size, size, device=device))
    except (ValueError, AssertionError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        model_name = (
            model_name or getattr(model, "default_cfg", {}).get("architecture") or type(model).__name__
        )
        raise ConfigError(f"{name} must be image sizes {model_name} takes, got {size}: {reason}") from e
    finally:
        model.train(was_training)
