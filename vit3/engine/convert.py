"""The ``convert`` task: a pretrained attention model (teacher) turned into a TTT model (student) by
distillation.

``python train.py --config configs/convert/demo_mnist.yaml`` (section ``convert``, documented in
``configs/convert/base.yaml``). The student is the teacher with TTT mixers in place of its attention
(``ttt_swap``), started from its weights; it trains by attention transfer for ``convert.transfer_epochs``,
then end to end with distillation from the teacher's logits (:mod:`vit3.convert`). Everything else is the
classification loop (:mod:`vit3.engine.classification`); the checkpoints are classification checkpoints of
the student. The stages and the metrics rows: ``docs/design/engine.md``.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import timm
import torch
from torch import nn

from ..convert import (
    LayerCapture,
    LayerPair,
    TransferNet,
    distillation_loss,
    init_student,
    layer_pairs,
    transfer_losses,
)
from ..data import build_datasets
from ..errors import CheckpointMismatchError
from ..layers import TTTConfig
from ..models.record import load_checkpoint, model_record, peek_vit3_checkpoint
from ..models.swap import SWAP_MODEL
from . import classification
from .checkpoint import load_model_weights, merge_model_spec
from .config import Config, ConfigError, check_config, load_config, model_arguments
from .distributed import DistInfo, log, sum_tensor
from .process import autocast, wrap_ddp
from .resume import resume_path, start_run
from .run_folder import claim_output, in_process_group

__all__ = [
    "CONVERT_KEYS",
    "SET_BY_CONVERSION",
    "TRANSFER",
    "check_convert_cfg",
    "evaluate",
    "stage_of",
    "train",
]

TRANSFER = "transfer_loss"  # metrics: <prefix>transfer_loss_<layer> and their mean <prefix>transfer_loss
CONVERT_KEYS = (
    "teacher", "teacher_model", "teacher_kwargs", "student_kwargs", "teacher_ema", "teacher_config",
    "ttt_kwargs", "scope", "transfer_epochs", "transfer_lr_scale", "distill", "temperature", "task_weight",
    "distill_weight",
)  # fmt: skip
# The timm kwargs the conversion passes itself, per section: a user's value would clash with them.
SET_BY_CONVERSION = {
    "teacher_kwargs": {
        "num_classes": "a vit3 checkpoint keeps its own classes; a weights file's are model.num_classes, "
        "else "
        "the data's",
        "pretrained": "the teacher's weights are convert.teacher",
        "pretrained_cfg_overlay": "the teacher's weights are convert.teacher",
    },
    "student_kwargs": {
        "num_classes": "the teacher's classes",
        "base": "the teacher's model, from convert.teacher / convert.teacher_model",
        "ttt": "set convert.ttt_kwargs",
        "scope": "set convert.scope",
    },
}


def check_convert_cfg(cfg: Config) -> Config:
    """The ``convert`` section of ``cfg``, checked (the keys of ``configs/convert/base.yaml``): what the
    validation layer cannot say (its values are its table's, :data:`~vit3.engine.config.schema.CONSTRAINTS`,
    checked with the config).

    Raises:
        ConfigError: the section is missing, or a key has a value the conversion cannot run with (named).
    """
    if "convert" not in cfg:
        raise ConfigError("task 'convert' needs a 'convert:' config section (see configs/convert/base.yaml)")
    conv = cfg.convert
    for key in conv:
        if key not in CONVERT_KEYS:
            close = difflib.get_close_matches(key, CONVERT_KEYS, n=3)
            hint = f"; did you mean {', '.join(f'convert.{c}' for c in close)}?" if close else ""
            raise ConfigError(f"unknown config key 'convert.{key}'{hint}")
    if not isinstance(conv.get("teacher"), str) or not conv.teacher:
        raise ConfigError(
            "convert.teacher is empty: name the teacher (a vit3 checkpoint or a timm weights file)"
        )
    for key in ("teacher_kwargs", "student_kwargs", "ttt_kwargs"):
        if not isinstance(conv.get(key), Mapping):
            raise ConfigError(f"convert.{key} must be a mapping (key: value), got {conv.get(key)!r}")
    for section, reserved in SET_BY_CONVERSION.items():
        for key, where in reserved.items():
            if key in conv[section]:
                raise ConfigError(
                    f"convert.{section}.{key} is set by the conversion ({where}): remove it from "
                    f"convert.{section}"
                )
    try:
        TTTConfig.create(dict(conv.ttt_kwargs))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"convert.ttt_kwargs is not a TTT mixer config: {e}") from e
    if cfg.train.mesa:
        raise ConfigError(
            "train.mesa does not apply to the conversion (its teacher is convert.teacher): set it 0"
        )
    if cfg.model.name not in ("", SWAP_MODEL):
        raise ConfigError(
            f"model.name={cfg.model.name!r}: the conversion's model is the teacher swapped ({SWAP_MODEL}); "
            "leave "
            f"model.name empty and name the teacher in convert.teacher"
        )
    if cfg.model.get("pretrained"):
        raise ConfigError(
            f"model.pretrained={cfg.model.pretrained!r}: the conversion's student starts from the "
            "teacher (convert.teacher); to go on from a converted checkpoint, resume it (train.resume) or "
            "fine-tune it (task classification, configs/finetune.yaml)"
        )
    if cfg.train.get("freeze", "none") != "none":
        raise ConfigError(
            f"train.freeze={cfg.train.freeze!r}: the conversion chooses what trains in each stage "
            "(stage 1 the mixers, stage 2 all); set it none"
        )
    return conv


def stage_of(cfg: Config, epoch: int) -> int:
    """The stage (1: attention transfer, 2: fine-tuning with distillation) of the 0-based ``epoch``."""
    return 1 if epoch < int(cfg.convert.transfer_epochs) else 2


# ---------------------------------------------------------------------------------------------- teacher
def _train_missing_teacher(cfg: Config) -> None:
    """Trains the teacher with ``convert.teacher_config`` when ``convert.teacher`` does not exist yet."""
    conv = cfg.convert
    path = Path(conv.teacher)
    if path.is_file() or not conv.get("teacher_config"):
        return
    resume = resume_path(cfg, Path(cfg.output))
    # A folder this run may not write into is refused before the teacher is trained (for minutes).
    claim_output(cfg, resume, load_checkpoint(resume, mmap=True) if resume else None)
    if path.name not in ("best.pt", "last.pt"):
        raise ConfigError(
            f"convert.teacher={path} does not exist, and what convert.teacher_config trains is "
            f"<output>/best.pt or last.pt: name one of those"
        )
    tcfg = load_config(conv.teacher_config, [f"output={path.parent}", "train.resume=auto"])
    if tcfg.get("task", "classification") != "classification":
        raise ConfigError(
            f"convert.teacher_config {conv.teacher_config} is a {tcfg.task} config, not classification"
        )
    print(f"teacher {path} not found: training it first ({conv.teacher_config})", flush=True)
    classification.train(tcfg)
    if not path.is_file():
        raise ConfigError(f"training {conv.teacher_config} did not write {path} (train.keep_best=false?)")


def _teacher_and_data(cfg: Config) -> tuple[nn.Module, dict[str, Any], dict[str, Any], int]:
    """The teacher (frozen, eval mode), its model record, the datasets (labelled by its classes) and its class
    count. A weights file's record has no classes or preprocessing; its classifier is taken to have the data's
    classes (``model.num_classes`` when set).

    Raises:
        FileNotFoundError: no ``convert.teacher`` file.
        ConfigError / CheckpointMismatchError: the teacher cannot be built, or its classes do not fit the
        data.
    """
    conv = cfg.convert
    path = str(conv.teacher)
    if not Path(path).is_file():
        raise FileNotFoundError(f"convert.teacher file not found: {path}")
    ckpt = peek_vit3_checkpoint(path)
    if ckpt is not None:
        record = model_record(ckpt)
        name, kwargs = merge_model_spec(record, conv.teacher_model or None, conv.teacher_kwargs, path)
        in_chans = int(kwargs.get("in_chans", 3))
        data = build_datasets(cfg, in_chans, classes=record["classes"], classes_from=f"the teacher {path}")
        num_classes = int(record["num_classes"])
        with model_arguments(name, conv.teacher_kwargs, "convert.teacher_kwargs"):
            teacher = timm.create_model(name, num_classes=num_classes, **kwargs)
        load_model_weights(teacher, ckpt, use_ema=bool(conv.teacher_ema), source=path)
        record = {**record, "name": name, "kwargs": Config(kwargs).to_dict()}
    else:
        if not conv.teacher_model:
            raise ConfigError(
                f"convert.teacher={path} is not a vit3 checkpoint: name its timm model in "
                "convert.teacher_model"
            )
        if conv.teacher_ema:
            raise ConfigError("convert.teacher_ema applies to vit3 checkpoints; a weights file holds one set")
        name, kwargs = str(conv.teacher_model), conv.teacher_kwargs.to_dict()
        in_chans = int(kwargs.get("in_chans", 3))
        data = build_datasets(cfg, in_chans)
        num_classes = int(cfg.model.num_classes or len(data["classes"]))
        overlay = {
            "file": path,
            "num_classes": num_classes,
        }  # keeps the file's classifier (timm drops others)
        try:
            with model_arguments(name, kwargs, "convert.teacher_kwargs"):
                teacher = timm.create_model(
                    name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=num_classes, **kwargs
                )
        except RuntimeError as e:  # load_state_dict: another architecture or class count
            raise CheckpointMismatchError(
                f"convert.teacher={path} does not fit {name} with {num_classes} classes: {e}"
            ) from e
        record = {"name": name, "kwargs": kwargs, "num_classes": num_classes, "classes": None}
        record.update(dict.fromkeys(("img_size", "mean", "std", "interpolation", "crop_pct")))
    if len(data["classes"]) > num_classes:
        raise ConfigError(
            f"the data has {len(data['classes'])} classes but the teacher {path} predicts {num_classes}"
        )
    teacher.eval().requires_grad_(False)
    return teacher, record, data, num_classes


def _student_spec(cfg: Config, record: Mapping[str, Any]) -> None:
    """Sets ``cfg.model`` to the teacher swapped, with ``convert.student_kwargs`` over the teacher's kwargs
    (and the unset preprocessing of ``cfg.data`` to the teacher's)."""
    conv, d = cfg.convert, cfg.data
    for key in ("img_size", "interpolation", "crop_pct"):
        if d.get(key) is None and record.get(key) is not None:
            d[key] = record[key]
    if d.mean is None and d.std is None and record.get("mean") is not None:
        d.mean, d.std = list(record["mean"]), list(record["std"])
    kwargs = {**dict(record["kwargs"]), **dict(conv.student_kwargs)}
    cfg.model.name = SWAP_MODEL  # what model.name / model.kwargs held before (e.g. inherited) is replaced
    cfg.model.kwargs = {
        "base": record["name"],
        **kwargs,
        "ttt": dict(conv.ttt_kwargs),
        "scope": str(conv.scope),
    }


# -------------------------------------------------------------------------------------------------- run
@dataclass
class _ConvertRun(classification.ClassificationRun):
    """A classification run whose batches, epochs and checkpoints follow the conversion's two stages."""

    teacher: nn.Module | None = None
    pairs: list[LayerPair] = field(default_factory=list)
    teacher_info: dict[str, Any] = field(default_factory=dict)  # file, record and val top-1
    sums: dict[str, float] = field(default_factory=dict)  # the partial epoch's loss terms
    count: int = 0
    built_stage: int = 0  # the stage the trainable set and ``net`` are set up for (0: none yet)
    lr_scales: list[float] = field(default_factory=list)  # each param group's own lr scale (layer decay)

    task: ClassVar[str] = "convert"

    def __post_init__(self) -> None:
        self.lr_scales = [float(g.get("lr_scale", 1.0)) for g in self.optimizer.param_groups]

    def start_epoch(self) -> None:
        """Stage 1 trains the mixers only (at ``transfer_lr_scale`` times the schedule's lr), stage 2
        everything; ``net`` (DDP) is rebuilt for what trains."""
        stage = stage_of(self.cfg, self.progress.epoch)
        if stage == self.built_stage:
            return
        mixers = {id(q) for pair in self.pairs for q in pair.mixer.parameters()}
        for q in self.model.parameters():
            q.requires_grad_(stage == 2 or id(q) in mixers)
        factor = float(self.cfg.convert.transfer_lr_scale) if stage == 1 else 1.0
        for group, scale in zip(self.optimizer.param_groups, self.lr_scales):
            group["lr_scale"] = scale * factor  # the schedule multiplies each group's lr by it
        self.net = wrap_ddp(TransferNet(self.model, self.pairs), self.cfg, self.info)
        self.built_stage = stage
        trained = sum(q.numel() for q in self.model.parameters() if q.requires_grad)
        what = "attention transfer, the TTT mixers" if stage == 1 else "fine-tuning with distillation, all"
        log(
            self.info,
            f"stage {stage} from epoch {self.progress.epoch + 1}: {what} ({trained / 1e6:.3f}M params)",
        )

    def _teacher_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, LayerCapture]:
        with torch.no_grad(), LayerCapture(self.pairs) as capture:
            logits = self.teacher(x)
        return logits, capture

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor, mesa_on: bool) -> torch.Tensor:
        """Stage 1: the mean over layers of the transfer losses; stage 2: task loss plus distillation."""
        conv = self.cfg.convert
        if self.built_stage == 1:
            _, capture = self._teacher_forward(x)
            outputs = self.net(layer_inputs=capture.inputs(), grids=capture.grids())
            losses = transfer_losses(outputs, capture.targets())
            self._add({f"{TRANSFER}_{i}": v for i, v in enumerate(losses.detach().tolist())})
            return losses.mean()
        logits = self.net(x)
        task = classification.label_loss(logits, y, self.cfg.aug.label_smoothing)
        with torch.no_grad():
            teacher_logits = self.teacher(x)
        kd = distillation_loss(logits, teacher_logits, conv.distill, float(conv.temperature))
        self._add({"task_loss": float(task.detach()), "kd_loss": float(kd.detach())})
        return float(conv.task_weight) * task + float(conv.distill_weight) * kd

    def _add(self, terms: Mapping[str, float]) -> None:
        for key, value in terms.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.count += 1

    @torch.no_grad()
    def val_transfer(self) -> dict[str, float]:
        """The student mixers' per-layer transfer loss on the val set (image-weighted mean, all ranks)."""
        self.model.eval()
        dev = self.info.device
        sums = torch.zeros(len(self.pairs) + 1, dtype=torch.float64, device=dev)
        for x, _ in self.val_loader:
            x = x.to(dev, non_blocking=True)
            with autocast(dev, self.amp_dtype):
                _, capture = self._teacher_forward(x)
                outputs = [
                    p.student_output(h, g) for p, h, g in zip(self.pairs, capture.inputs(), capture.grids())
                ]
                losses = transfer_losses(outputs, capture.targets())
            sums[:-1] += losses.double() * len(x)
            sums[-1] += len(x)
        sums = sum_tensor(sums)
        values = (sums[:-1] / sums[-1].clamp(min=1)).tolist()
        return {f"val_{TRANSFER}": sum(values) / len(values)} | {
            f"val_{TRANSFER}_{i}": v for i, v in enumerate(values)
        }

    def epoch_metrics(self, validated: bool) -> dict[str, Any]:
        row: dict[str, Any] = {"stage": stage_of(self.cfg, self.progress.epoch)}
        row.update({f"train_{k}": v / max(self.count, 1) for k, v in self.sums.items()})
        self.sums, self.count = {}, 0
        if validated:
            row.update(self.val_transfer())
        return row

    def initial_row(self) -> dict[str, Any]:
        """The metrics row of epoch 0: the teacher's val top-1 and the swapped model's before any training."""
        dev = self.info.device
        teacher = classification.validate(self.teacher, self.val_loader, dev, self.amp_dtype)
        student = classification.validate(self.model, self.val_loader, dev, self.amp_dtype)
        self.teacher_info["top1"] = teacher["top1"]
        row = {
            "epoch": 0,
            "step": 0,
            "stage": 0,
            "teacher_top1": teacher["top1"],
            "val_loss": student["loss"],
        }
        row.update(val_top1=student["top1"], val_top5=student["top5"], **self.val_transfer())
        return row

    def extra_state(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "convert": {"sums": dict(self.sums), "count": self.count, "teacher": dict(self.teacher_info)},
        }

    def restore_extra(self, ckpt: Mapping[str, Any]) -> None:
        state = ckpt["convert"]
        self.sums, self.count = dict(state["sums"]), int(state["count"])
        self.teacher_info = dict(state["teacher"])

    def summary_extra(self) -> dict[str, Any]:
        teacher_top1 = self.teacher_info.get("top1")
        history = self.progress.history
        final = history[-1].get("val_top1") if history else None
        return {
            "teacher": self.teacher_info.get("file"),
            "teacher_top1": teacher_top1,
            "swapped_top1": history[0].get("val_top1") if history and history[0]["epoch"] == 0 else None,
            "of_teacher": final / teacher_top1 if final is not None and teacher_top1 else None,
            "layers": [p.name for p in self.pairs],
        }


def _setup(cfg: Config, info: DistInfo) -> _ConvertRun:
    """The conversion run of ``cfg`` (resumed from ``train.resume`` when set)."""
    check_convert_cfg(cfg)
    check_config(cfg, "train")  # the config may have been changed in code since it was loaded
    resume, ckpt = start_run(cfg, info, "convert")
    folder = claim_output(cfg, resume, ckpt)
    teacher, record, data, num_classes = _teacher_and_data(cfg)
    _student_spec(cfg, record)
    if ckpt is not None:
        saved = model_record(ckpt)
        if (saved["name"], saved["kwargs"]) != (cfg.model.name, dict(cfg.model.kwargs)):
            raise ConfigError(
                f"cannot resume from {resume}: it converts to {saved['kwargs']}, this config to "
                f"{dict(cfg.model.kwargs)} (convert.teacher, convert.ttt_kwargs or convert.scope changed)"
            )
    try:
        student, _ = classification.build_model(cfg, num_classes)
    except (TypeError, ValueError) as e:  # no attention to swap, or a kwarg the student's timm model lacks
        raise ConfigError(f"cannot convert the teacher {cfg.convert.teacher} ({record['name']}): {e}") from e
    try:
        pairs = layer_pairs(teacher, student)
        if ckpt is None:
            init_student(student, teacher, pairs)
    except ValueError as e:  # a teacher that is a TTT model already, an attention no mixer can start from
        raise ConfigError(f"cannot convert the teacher {cfg.convert.teacher} ({record['name']}): {e}") from e
    teacher.to(info.device)
    make_run = functools.partial(
        _ConvertRun,
        teacher=teacher,
        pairs=pairs,
        teacher_info={"file": str(cfg.convert.teacher), "record": record},
    )
    run = classification.assemble_run(cfg, info, folder, student, data, num_classes, ckpt, resume, make_run)
    log(
        info,
        f"teacher {record['name']} ({cfg.convert.teacher}) -> {SWAP_MODEL}: {len(pairs)} attention layers",
    )
    if ckpt is None:
        row = run.initial_row()
        run.progress.history.append(row)
        log(
            info,
            f"before training: teacher val top-1 {row['teacher_top1']:.2f}%, swapped {row['val_top1']:.2f}%, "
            f"transfer loss {row[f'val_{TRANSFER}']:.4g}",
        )
    return run


def _train(cfg: Config, info: DistInfo) -> dict[str, Any]:
    return classification.train_in_group(cfg, info, _setup)


def train(cfg: Config) -> dict[str, Any]:
    """Converts ``cfg.convert.teacher`` (see the module docstring); returns the run summary."""
    check_convert_cfg(cfg)
    _train_missing_teacher(cfg)
    return in_process_group(cfg, _train, hold_output=True)


def evaluate(cfg: Config) -> dict[str, Any]:
    """``eval.py`` on a conversion checkpoint: the classification evaluation of the student."""
    return classification.evaluate(cfg)
