"""The table of what every config key of every task allows (:data:`CONSTRAINTS`) and the checks that run it.

A key is checked where a config has it (one table for all tasks; ``only_if`` for task-dependent rules): on
every load (:data:`LOAD`), or at the start of a run of its mode (:data:`TRAIN`, :data:`EVAL`).
:data:`EXPORT_FLAGS` checks ``export.py``'s flags (:func:`check_flags`); :data:`CHECKED_ON_USE` lists what
only the model or the data can decide, :data:`FREE` the keys every value of the right type suits. The kinds
of constraint and their wording are in :mod:`.kinds`, the tests in :mod:`.value_checks` / :mod:`.path_checks`.
Every failure is one :class:`~vit3.errors.ConfigError` line naming the key, its flag and what is allowed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ...errors import ConfigError, UserError
from .kinds import (
    AT_LEAST_ONE,
    EVAL,
    FLAGS,
    LOAD,
    NON_NEGATIVE,
    ON_EVAL,
    ON_RUN,
    ON_TRAIN,
    PAIR,
    POSITIVE,
    PROBABILITY,
    TRAIN,
    Advice,
    Check,
    Choice,
    Constraint,
    Range,
    config_value,
    is_number,
    key_name,
    message,
)
from .path_checks import (
    eval_output_folder,
    existing,
    existing_what,
    file_problem,
    folder_problem,
    report_file,
    writable_folder,
)
from .value_checks import (
    AUTO_AUGMENT,
    TIMM_NAME,
    auto_augment_policy,
    available_device,
    beta_schedule,
    class_names,
    data_folder,
    dense_archs,
    dense_warmup_advice,
    dist_backends,
    dit3_kwargs,
    dit3_model,
    epoch_task,
    fid_inputs,
    interpolation,
    is_generation,
    metrics_read,
    not_generation,
    positive_counts,
    slide_stride,
    task_datasets,
    task_names,
    timm_model,
    torch_device,
    warmup_advice,
)

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
    "check_batch_norm_batch",
    "check_flags",
    "check_input_size",
    "check_values",
    "folder_problem",
    "key_name",
    "model_arguments",
]

# The values each key allows (see the module docstring); one table for every task, a key is checked where a
# config has it. A tuple holds several constraints of one key, checked in order (the first failure is
# reported).
CONSTRAINTS: dict[str, Constraint | tuple[Constraint, ...]] = {
    "task": Choice(task_names),
    "seed": NON_NEGATIVE,
    "output": (
        Check(
            what="a folder (a run writes its checkpoints there)",
            test=lambda value, cfg: (
                None if str(value).strip() else "empty: give the run a folder, output=DIR"
            ),
        ),
        Check(what="a folder this run can write", test=writable_folder, when=ON_TRAIN),
    ),
    "device": Check(what="auto, cpu, cuda or cuda:N (a torch device)", test=torch_device),
    "threads": Range(1, null="torch's default"),
    "model.name": (
        Check(what=TIMM_NAME, test=timm_model, only_if=not_generation),
        Check(what="a DiT³ model: dit3_{s,b,l,xl}_{2,4,8}", test=dit3_model, only_if=is_generation),
    ),
    "model.kwargs": Check(what="create_dit3 overrides", test=dit3_kwargs, only_if=is_generation),
    "model.num_classes": Range(1, null="the classes of the data"),
    "model.drop_path_rate": Range(0, 1, hi_open=True),
    "model.class_dropout_prob": Range(0, 1, hi_open=True),
    "model.mixer": Choice("vit3.models.dit3:MIXERS"),
    "model.pretrained": Check(
        what=existing_what("file"),
        test=existing("file"),
        when=ON_TRAIN,
        only_if=lambda cfg, mode: (
            not config_value(cfg, "train.resume")
        ),  # a resume takes the checkpoint's weights
    ),
    "data.dataset": Choice(task_datasets),
    "data.path": (
        Check(what=existing_what("folder"), test=existing("folder"), when=ON_RUN, only_if=data_folder),
        Check(
            what="empty for data.dataset=mnist5k (the embedded digits, which read no folder; "
            "data.dataset=folder reads one)",
            test=lambda value, cfg: "mnist5k would not read it" if str(value) else None,
            when=ON_RUN,
            only_if=lambda cfg, mode: config_value(cfg, "data.dataset") == "mnist5k",
        ),
        Check(
            what="a folder this run can write the synthetic data to",
            test=lambda value, cfg: None if Path(str(value)).exists() else writable_folder(value, cfg),
            when=ON_TRAIN,
            only_if=lambda cfg, mode: config_value(cfg, "data.dataset") == "digits",
        ),
    ),
    "data.img_size": AT_LEAST_ONE,
    "data.interpolation": Check(
        what="a timm interpolation (bicubic, bilinear, nearest, ..., random)", test=interpolation
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
    "aug.auto_augment": Check(what=AUTO_AUGMENT, test=auto_augment_policy, null="off"),
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
    "train.warmup_epochs": (NON_NEGATIVE, Advice(test=warmup_advice, when=ON_TRAIN, only_if=epoch_task)),
    "train.base_lr": POSITIVE,
    "train.warmup_lr": Range(0, "train.base_lr"),
    "train.min_lr": Range(0, "train.base_lr"),
    "train.lr_batch": POSITIVE,
    "train.lr_batch_rule": Choice("vit3.engine.optim:LR_BATCH_RULES"),
    "train.weight_decay": NON_NEGATIVE,
    "train.betas": Range(0, 1, hi_open=True, length=PAIR),
    "train.eps": POSITIVE,
    "train.layer_decay": Range(0, 1, lo_open=True, null="off"),
    "train.clip_grad": Range(0, lo_open=True, null="no clipping"),
    "train.accum_steps": AT_LEAST_ONE,
    "train.freeze": Choice("vit3.engine.recipe:FREEZE_MODES"),
    "train.amp": Choice("vit3.engine.process:AMP_MODES"),
    "train.compile": Choice("vit3.engine.process:COMPILE_MODES"),
    "train.ema_decay": Range(0, 1, hi_open=True),
    "train.ema_batch": POSITIVE,
    "train.mesa": (
        Range(0, null="off"),
        Check(
            what="0 without train.ema (MESA's teacher is the EMA model)",
            test=lambda mesa, cfg: (
                "set train.ema=true" if mesa > 0 and not config_value(cfg, "train.ema") else None
            ),
        ),
    ),
    "train.mesa_start": PROBABILITY,
    "train.eval_every": AT_LEAST_ONE,
    "train.save_every_steps": NON_NEGATIVE,
    "train.resume": Check(
        what=existing_what("file", ("auto",)), test=existing("file", ("auto",)), when=ON_TRAIN
    ),
    "train.log_every": NON_NEGATIVE,
    "train.progress": Choice((True, False, "run")),
    "dist.backend": Choice(dist_backends),
    "eval.checkpoint": Check(what=existing_what("file"), test=existing("file"), when=ON_EVAL),
    "eval.img_sizes": AT_LEAST_ONE,
    "eval.batch_size": AT_LEAST_ONE,
    "eval.throughput_batches": AT_LEAST_ONE,
    "eval.json": Check(what="a .json file this run can write", test=report_file, when=ON_EVAL),
    # generation
    "vae.path": Check(
        what=existing_what("folder") + " holding a diffusers AutoencoderKL (nothing is downloaded)",
        test=existing("folder"),
        when=ON_RUN,
    ),
    "vae.scaling_factor": Range(0, lo_open=True, null="the VAE config's"),
    "diffusion.num_timesteps": Range(2),
    "diffusion.beta_schedule": Check(
        what="a diffusers beta schedule (linear, scaled_linear, squaredcos_cap_v2, ...)",
        test=lambda value, cfg: beta_schedule(str(value)),
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
    "sample.out": Check(what="a folder this run can write", test=eval_output_folder, when=ON_EVAL),
    "sample.amp": Choice(("none", "bf16", "fp16")),
    "metrics.inception_weights": Check(
        what=existing_what("file") + " (metrics.fid needs it)",
        test=existing("file"),
        when=ON_RUN,
        only_if=fid_inputs,
    ),
    "metrics.reference": Check(
        what=existing_what("file"), test=existing("file"), when=ON_RUN, only_if=fid_inputs
    ),
    "metrics.classifier": Check(
        what=existing_what("file", ("auto",)),
        test=existing("file", ("auto",)),
        when=ON_RUN,
        only_if=metrics_read,
    ),
    "metrics.batch_size": AT_LEAST_ONE,
    "metrics.floor_draws": AT_LEAST_ONE,
    # detection / segmentation
    "dense.arch": Choice(dense_archs),
    "dense.num_classes": Range(1, null="from the data"),
    "dense.iters": NON_NEGATIVE,
    "dense.eval_interval": NON_NEGATIVE,
    "dense.lr_schedule": Choice(("step", "poly")),
    "dense.milestones": Range(0, ordered=True),
    "dense.gamma": Range(0, 1, lo_open=True),
    "dense.poly_power": NON_NEGATIVE,
    "dense.warmup_iters": (NON_NEGATIVE, Advice(test=dense_warmup_advice, when=ON_TRAIN)),
    "dense.warmup_factor": PROBABILITY,
    "dense.backbone_lr_mult": NON_NEGATIVE,
    "dense.out_channels": AT_LEAST_ONE,
    "dense.min_size": AT_LEAST_ONE,
    "dense.max_size": AT_LEAST_ONE,
    "dense.anchor_sizes": Range(0, lo_open=True, ordered=True, length=(5,)),  # one per FPN level
    "dense.detections_per_img": AT_LEAST_ONE,
    "dense.box_head_dim": AT_LEAST_ONE,
    "dense.mask_head_dim": AT_LEAST_ONE,
    "dense.ann_train": Check(
        what=existing_what("file"), test=existing("file"), when=ON_TRAIN, null="the split's"
    ),
    "dense.ann_val": Check(
        what=existing_what("file"), test=existing("file"), when=ON_RUN, null="the split's"
    ),
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
        Check(what="at most dense.slide_crop on each side", test=slide_stride),
    ),
    "dense.class_names": Check(what="a list of one name per class", test=class_names, null="indices"),
    "dense.synthetic.splits": Check(
        what="a mapping of split names to image counts >= 1", test=positive_counts, null="64 train, 16 val"
    ),
    "dense.synthetic.image_size": AT_LEAST_ONE,
    "dense.synthetic.digits": Range(0, 9, min_length=1),
    "dense.synthetic.max_per_image": AT_LEAST_ONE,
    "dense.synthetic.digit_size": Range(1, "dense.synthetic.image_size", ordered=True, length=PAIR),
    # convert
    "convert.scope": Choice("vit3.models.swap:SWIN_SCOPES"),
    "convert.transfer_epochs": Range(0, "train.epochs"),
    "convert.transfer_lr_scale": POSITIVE,
    "convert.distill": Choice("vit3.convert:DISTILL_KINDS"),
    "convert.temperature": POSITIVE,
    "convert.task_weight": NON_NEGATIVE,
    "convert.distill_weight": NON_NEGATIVE,
}

# What depends on the model or the data, checked where they are built (each a ConfigError naming the key).
CHECKED_ON_USE = {
    "model.kwargs": "the arguments of the model (model_arguments, wherever a model is built)",
    "data.mean": "one value per input channel of the model (engine.classification_model.resolve_data_cfg)",
    "data.train_split": "the split folder exists (data.build / dense datasets)",
    "data.val_split": "the split folder exists (data.build / dense datasets)",
    "data.img_size": "a size the model takes (check_input_size, before training)",
    "data.batch_size": "2 or more where a BatchNorm layer of the model would get one value per channel "
    "(check_batch_norm_batch, before anything is written)",
    "eval.img_sizes": "sizes the model takes (check_input_size, before evaluating)",
    "sample.classes": "class indices of the model (engine.generation)",
    "dense.out_indices": "the backbone's feature levels (tasks.backbone.FeatureBackbone)",
    "dense.detector_kwargs": "the arguments of torchvision's detector (model_arguments)",
    "dist.backend": "a backend this machine runs under torchrun (engine.distributed.init_distributed)",
    "device": "a device this machine has (engine.distributed)",
    "convert.teacher": "a vit3 checkpoint or timm weights file of an attention model (engine.convert)",
    "convert.teacher_model": "a timm model of the teacher's weights (engine.convert)",
    "convert.teacher_kwargs": "the arguments of the teacher's timm model (engine.convert)",
    "convert.student_kwargs": "the arguments of the student's timm model (engine.convert)",
    "convert.teacher_config": "a classification config writing convert.teacher (engine.convert)",
    "convert.ttt_kwargs": "a TTTConfig (engine.convert.check_convert_cfg)",
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
        "convert.teacher_ema",
    }
)


def _constraints(entry: Constraint | tuple[Constraint, ...]) -> tuple[Constraint, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


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
                errors.append(message(key_name(key, mode), value, constraint, *found))
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
    "--model": Check(what=TIMM_NAME, test=timm_model),
    "--checkpoint": Check(what=existing_what("file"), test=existing("file")),
    "--img-size": AT_LEAST_ONE,
}
# The constraints of export.py's flags, per command (its switches and choices are argparse's).
EXPORT_FLAGS: dict[str, dict[str, Constraint]] = {
    "features": {
        **_COMMON_EXPORT_FLAGS,
        "--images": Check(what=existing_what("folder"), test=existing("folder")),
        "--out": Check(what="a folder this run can write", test=writable_folder),
        "--crop-pct": Range(0, 1, lo_open=True),
        "--batch-size": AT_LEAST_ONE,
        "--device": Check(what="cpu, cuda or cuda:N (a device of this machine)", test=available_device),
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
            raise ConfigError(message(flag, value, constraint, *found))


# --------------------------------------------------------------------------------- checks on the model
# Keyword arguments of timm's models that are probabilities of dropping (a value of 1 or more, or below 0,
# runs until the first training step, where torch refuses it).
DROP_RATES = ("drop_rate", "drop_path_rate", "attn_drop_rate", "proj_drop_rate", "pos_drop_rate")


@contextlib.contextmanager
def model_arguments(name: str, kwargs: Mapping[str, Any], key: str = "model.kwargs") -> Iterator[None]:
    """Reports a keyword argument the model does not take (``TypeError``), one that vit3 passes itself (e.g.
    ``num_classes``), a drop rate outside [0, 1) (:data:`DROP_RATES`) or values the model refuses as it is
    built (its ``ValueError`` / ``AssertionError``, e.g. ``num_heads`` that do not divide the width), given
    by the user in ``kwargs`` (the config's ``key``), as a :class:`~vit3.errors.ConfigError` naming it; a
    ``TypeError`` of another kind (a value of the wrong type, e.g. an int for a list) names all of them."""
    for rate in DROP_RATES:
        value = kwargs.get(rate)
        if value is not None and not (is_number(value) and 0 <= value < 1):
            raise ConfigError(f"{key}.{rate} must be a number in [0, 1), got {value!r}")
    try:
        yield
    except (ValueError, AssertionError) as e:
        if not kwargs or isinstance(e, UserError):
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(_not_built(key, kwargs, name, reason)) from e
    except TypeError as e:
        match = re.search(r"(unexpected|multiple values for) keyword argument '(\w+)'", str(e))
        if match is None or match.group(2) not in kwargs:
            if not kwargs:
                raise
            raise ConfigError(_not_built(key, kwargs, name, f"TypeError: {e}")) from e  # a value's type
        arg = match.group(2)
        if match.group(1) == "unexpected":
            raise ConfigError(f"{key}.{arg} is not an argument of {name} ({e})") from e
        instead = " and set model.num_classes (null: the classes of the data)" if arg == "num_classes" else ""
        raise ConfigError(
            f"{key}.{arg}={kwargs[arg]!r}: vit3 passes {arg} to {name} itself; leave it out of {key}{instead}"
        ) from e


def _not_built(key: str, kwargs: Mapping[str, Any], name: str, reason: str) -> str:
    given = ", ".join(f"{k}: {v!r}" for k, v in kwargs.items())
    return f"{key} ({given}) do not build {name}: {reason}"


def check_batch_norm_batch(
    model: Any, in_chans: int, size: int, batch: int, model_name: str, only: Any = None
) -> None:
    """Refuses a training batch of one image (``batch``: ``data.batch_size``) that would reach a BatchNorm
    layer as one value per channel (a map of 1x1 there), which torch refuses at the first training step;
    checked before anything is written by running ``model`` once on one ``[1, in_chans, size, size]`` image
    (eval mode, no gradient, RNG states kept). ``only``: the module whose BatchNorm layers train (e.g. the
    classifier of a frozen backbone; default: the whole model).

    Raises:
        ConfigError: naming ``data.batch_size``, the layer and what it would get.
    """
    import torch
    from torch import nn

    if batch != 1:
        return
    norms = [
        (name, m)
        for name, m in (only if only is not None else model).named_modules()
        if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm)
    ]
    if not norms:
        return
    seen: dict[str, tuple[int, ...]] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            seen.setdefault(name, tuple(args[0].shape))

        return hook

    hooks = [m.register_forward_pre_hook(record(name)) for name, m in norms]
    device = next(itertools.chain(model.parameters(), model.buffers())).device
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model(torch.zeros(1, in_chans, size, size, device=device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    for name, shape in seen.items():
        if len(shape) > 1 and shape[0] * math.prod(shape[2:]) == 1:
            raise ConfigError(
                f"data.batch_size=1: a BatchNorm layer of {model_name} gets one value per channel in "
                f"training ({name or 'the model'}: input {list(shape)} for one image at "
                f"data.img_size={size}); use data.batch_size >= 2"
            )


def check_input_size(model: Any, in_chans: int, size: int, name: str, model_name: str = "") -> None:
    """Runs ``model`` once on one ``[1, in_chans, size, size]`` image (no gradient, eval mode, RNG states
    kept) and reports a size it refuses (``ValueError`` / ``AssertionError``, e.g. below its total stride,
    or another size than a fixed-size model's), or one image of which needs more memory than the device has,
    as a :class:`~vit3.errors.ConfigError` naming ``name`` (the key or flag that set the size).
    """
    import torch

    device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    was_training = model.training
    model.eval()
    model_name = model_name or getattr(model, "default_cfg", {}).get("architecture") or type(model).__name__
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model(torch.zeros(1, in_chans, size, size, device=device))
    except (ValueError, AssertionError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{name} must be image sizes {model_name} takes, got {size}: {reason}") from e
    except RuntimeError as e:  # torch.OutOfMemoryError (a RuntimeError) on a GPU, the allocator's on a CPU
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        reason = str(e).strip().splitlines()[0].split("DefaultCPUAllocator: ")[-1]
        raise ConfigError(
            f"{name} must be image sizes {model_name} can run on {device}, got {size}: one image of that "
            "size "
            f"needs more memory than there is ({reason})"
        ) from e
    finally:
        model.train(was_training)
