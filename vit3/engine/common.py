"""The plumbing the training engines share (classification, dense, generation): one of each.

* process set-up: :func:`set_threads`, :func:`seed_process` (per-rank seeds, deterministic algorithms);
* AMP: :func:`amp_dtype` resolves ``train.amp`` (``auto``: bf16 on a CUDA device that supports it, else
  float32) and :func:`autocast` enters it;
* lr scaling lives in :func:`vit3.engine.optim.scaled_lrs` (every engine calls it);
* DDP: :func:`wrap_ddp`, and :func:`check_ranks_agree`, which compares the SHA-1 of every rank's weights at
  the end of a run;
* checkpoints and exact resume: :func:`resume_path`, :func:`check_resume` (data-stream settings a resume
  would change), :func:`check_resume_task`, :func:`save_state` (collective: every rank's RNG state is
  gathered into the checkpoint), :func:`restore_rng`, :class:`Progress` (epoch, batch inside it, optimizer
  step) and :func:`optimizer_step` (scheduler, clipping, scaler, EMA). A run killed at any point and resumed
  from its last checkpoint ends with the weights of an uninterrupted run, bit for bit;
* the output folder: :func:`hold_run_folder`, :func:`claim_output` and :func:`open_output`. A run holds the
  lock of its folder for its whole life (a second run into it is refused while the first lives). No run writes
  into a folder that holds another run's checkpoints (``last.pt`` / ``best.pt``) or results
  (:data:`~vit3.outputs.RESULT_FILES`), or a ``config.yaml`` no run saved (the user's own): it is refused,
  naming the folder and the ways on (resume that run, or another ``output``), unless ``train.overwrite``
  (``--overwrite``), which first moves that run's files
  (:data:`~vit3.outputs.RUN_FILES`) into ``<output>/replaced-<UTC time>/``, deleting nothing. A resume continues in its
  checkpoint's own folder, unless that folder holds a later checkpoint (it would be overwritten).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..models.record import checkpoint_task, load_checkpoint
from ..outputs import CHECKPOINT_FILES, RESULT_FILES, RUN_FILES, RUN_PATTERNS, hold_folder
from .checkpoint import (
    CheckpointError,
    get_rng_state,
    load_model_weights,
    resume_differences,
    save_checkpoint,
    set_rng_state,
)
from .config import Config, ConfigError, config_value, folder_problem, run_metadata, save_config, to_plain
from .distributed import DistInfo, all_gather_objects, barrier, distributed
from .optim import build_optimizer, build_scheduler, lr_factor, scaled_lrs

AMP_MODES = ("auto", "none", "bf16", "fp16")
# train.compile: "auto" compiles with CUDA graphs on a GPU (reduce-overhead) and Inductor's default elsewhere
COMPILE_MODES = ("none", "auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

__all__ = [
    "AMP_MODES",
    "COMPILE_MODES",
    "Optimization",
    "OutputFolder",
    "Progress",
    "TrainRun",
    "amp_dtype",
    "autocast",
    "build_optimization",
    "check_ranks_agree",
    "check_resume",
    "check_resume_task",
    "checkpoint_task",
    "claim_output",
    "compile_mode",
    "cpu_has_bf16_units",
    "epoch_batches",
    "hold_run_folder",
    "in_process_group",
    "log",
    "log_row",
    "log_setup",
    "move_aside",
    "open_output",
    "open_run",
    "optimizer_step",
    "param_digest",
    "restore_rng",
    "resume_path",
    "run_epochs",
    "run_summary",
    "save_state",
    "seed_process",
    "set_threads",
    "start_run",
    "wrap_ddp",
]


def log(info: DistInfo, msg: str) -> None:
    """Prints ``msg`` on rank 0 (through tqdm, so that progress bars stay intact)."""
    if info.is_main:
        tqdm.write(msg, file=sys.stdout)


def log_row(info: DistInfo, row: dict[str, Any]) -> None:
    """Logs a metrics row as ``key value`` pairs (floats to 4 significant digits)."""
    log(info, " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


def in_process_group(cfg: Config, fn: Callable[..., Any], *args: Any, hold_output: bool = False) -> Any:
    """``fn(cfg, *args, info)`` inside the run's process group (``torchrun``; one process otherwise); with
    ``hold_output`` (a training run) while holding its folder (:func:`hold_run_folder`)."""
    with distributed(cfg.device, cfg.dist.backend) as info:
        with hold_run_folder(cfg, info) if hold_output else contextlib.nullcontext():
            return fn(cfg, *args, info)


@contextlib.contextmanager
def hold_run_folder(cfg: Config, info: DistInfo) -> Iterator[None]:
    """Rank 0 holds the lock of the run's folder ``cfg.output`` while the body runs
    (:func:`~vit3.outputs.hold_folder`); a folder that a live run holds is refused on every rank. A
    folder this process cannot write is left to the config checks (no run can write there).

    Raises:
        ConfigError: a live run holds the folder (one line naming it and the holder's process id).
    """
    out = Path(str(cfg.output or "."))
    with contextlib.ExitStack() as stack:
        problem = None
        if info.is_main and folder_problem(out) is None:
            try:
                stack.enter_context(hold_folder(out))
            except ConfigError as e:
                problem = str(e)
        problem = all_gather_objects(problem)[0]  # every rank stops alike
        if problem:
            raise ConfigError(problem)
        yield


def set_threads(cfg: Config) -> None:
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))


def seed_process(cfg: Config, info: DistInfo) -> None:
    """Seeds python, numpy and torch with ``seed + rank``; ``deterministic`` selects deterministic kernels."""
    torch.manual_seed(cfg.seed + info.rank)
    random.seed(cfg.seed + info.rank)
    np.random.seed(cfg.seed + info.rank)  # noqa: NPY002  (timm Mixup draws on the global numpy RNG)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = not cfg.deterministic


def amp_dtype(mode: str, device: torch.device, key: str = "train.amp") -> torch.dtype | None:
    """The autocast dtype of an AMP setting (``None``: float32).

    ``auto`` is bf16 on a CUDA device that supports it and float32 elsewhere; ``fp16`` goes with a GradScaler
    (on a CPU it runs, with a warning: CPUs compute float16 many times slower than float32); ``bf16`` on a CPU
    without bfloat16 matrix instructions (:func:`cpu_has_bf16_units`) runs too, with a warning alike.

    Raises:
        ConfigError: ``mode`` is not one of :data:`AMP_MODES` (the message names ``key``).
    """
    if mode not in AMP_MODES:
        raise ConfigError(f"{key} must be one of {', '.join(AMP_MODES)}, got '{mode}'")
    if mode == "fp16" and device.type == "cpu":
        warnings.warn(
            f"{key}=fp16 on the CPU: float16 autocast runs many times slower there than float32 (CPUs have "
            f"no fast float16 matrix units); {key}=none runs float32",
            stacklevel=2,
        )
    if mode == "bf16" and device.type == "cpu" and not cpu_has_bf16_units():
        warnings.warn(
            f"{key}=bf16 on the CPU: this CPU has no bfloat16 matrix instructions (AVX512-BF16 or AMX), "
            f"where bfloat16 autocast runs many times slower than float32; {key}=none runs float32",
            stacklevel=2,
        )
    if mode == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def cpu_has_bf16_units() -> bool:
    """Whether this CPU computes bfloat16 matrix products in hardware (AVX512-BF16 or AMX tiles, as torch
    detects them), where bfloat16 autocast pays off; without them it runs many times slower than float32."""
    detectors = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in detectors)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in ``dtype``, or a no-op for float32 (``dtype=None``)."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def compile_mode(mode: str, device: torch.device) -> str | None:
    """The ``torch.compile`` mode of ``train.compile`` on ``device``, ``None`` for eager (``"none"``); ``"auto"``
    is ``"reduce-overhead"`` (the whole step replayed as CUDA graphs) on CUDA, ``"default"`` elsewhere."""
    if mode == "none":
        return None
    if mode == "auto":
        return "reduce-overhead" if device.type == "cuda" else "default"
    return mode


def wrap_ddp(model: nn.Module, cfg: Config, info: DistInfo) -> nn.Module:
    """``model`` as a training step calls it: compiled whole when ``train.compile`` asks (the checkpoints keep
    saving ``model`` itself), in DistributedDataParallel when the run has several processes."""
    net = model
    if info.distributed:
        dev_ids = [info.device.index] if info.device.type == "cuda" else None
        net = DistributedDataParallel(
            model, device_ids=dev_ids, find_unused_parameters=cfg.dist.find_unused_parameters
        )
    mode = compile_mode(str(config_value(cfg, "train.compile", "none")), info.device)
    return net if mode is None else torch.compile(net, mode=mode)


def param_digest(model: nn.Module) -> str:
    """SHA-1 of all parameters, sorted by name (not buffers: DDP broadcasts rank 0's BatchNorm statistics at
    each forward, so after the last step the other ranks' running statistics legitimately differ)."""
    h = hashlib.sha1()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def check_ranks_agree(model: nn.Module) -> list[str]:
    """Every rank's :func:`param_digest` (collective), in rank order.

    Raises:
        RuntimeError: the ranks' weights differ (naming the ranks that differ from rank 0).
    """
    digests = all_gather_objects(param_digest(model))
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(f"DDP ranks {differ} disagree with rank 0 on the final weights: {digests}")
    return digests


# ------------------------------------------------------------------------------------- checkpoint / resume
@dataclass
class Progress:
    """Where a run stands: what a checkpoint stores and a resume restores (engines extend it)."""

    epoch: int = 0  # the epoch to run (0-based)
    batch_in_epoch: int = 0  # batches of that epoch already done
    global_step: int = 0  # optimizer updates done
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per epoch (dense: per evaluation)

    def counters(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step}

    def restore(self, ckpt: Mapping[str, Any], batch_size: int, world: int, accum: int) -> None:
        """Restores the counters of ``ckpt``. A (forced) resume with another total batch (``batch_size`` per
        process x ``world``) continues after the samples already seen: the batch inside the epoch is rescaled
        to whole accumulation steps of ``accum`` batches."""
        self.epoch, self.batch_in_epoch = int(ckpt["epoch"]), int(ckpt["batch_in_epoch"])
        self.global_step = int(ckpt["global_step"])
        old = int(ckpt["config"]["data"]["batch_size"]) * int(ckpt.get("world_size", 1))
        new = int(batch_size) * int(world)
        if self.batch_in_epoch and old != new:
            self.batch_in_epoch = self.batch_in_epoch * old // new // accum * accum

    def roll_over(self, batches_per_epoch: int) -> None:
        """Moves to the start of the next epoch when this one's batches are all done."""
        if self.batch_in_epoch >= batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0


@dataclass
class TrainRun:
    """What every epoch-based training run holds (engines extend it with their data and task state)."""

    cfg: Config
    info: DistInfo
    model: nn.Module  # unwrapped
    net: nn.Module  # DDP-wrapped or the model itself
    ema: Any  # timm ModelEmaV3 or None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None

    def training_state(self) -> dict[str, Any]:
        """The weights (model, EMA) and the optimizer, scheduler and scaler states, for a checkpoint."""
        return {
            "model": self.model.state_dict(),
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def run_state(
        self, progress: Progress, model_kwargs: Mapping[str, Any], num_classes: int, classes: Iterable[str]
    ) -> dict[str, Any]:
        """The checkpoint entries every epoch-based run writes: the model (name, ``model_kwargs``, classes),
        :meth:`training_state`, the counters and history of ``progress``, the config and the run metadata
        (an engine adds its own; :func:`save_state` the RNG states)."""
        return {
            "model_name": self.cfg.model.name,
            "model_kwargs": to_plain(model_kwargs),
            "num_classes": num_classes,
            "classes": list(classes),
            **self.training_state(),
            **progress.counters(),
            "history": progress.history,
            "config": self.cfg.to_dict(),
            "meta": run_metadata(),
        }

    def load_training_state(self, ckpt: Mapping[str, Any], source: str, scheduler: bool = True) -> None:
        """Restores :meth:`training_state` from ``ckpt`` (the scheduler's only with ``scheduler``).

        Raises:
            ConfigError: the run has an EMA and ``ckpt`` holds none.
            CheckpointMismatchError: the weights are another model's.
        """
        load_model_weights(self.model, ckpt, source=source)
        if self.ema is not None:
            if ckpt.get("ema") is None:
                raise ConfigError(f"cannot resume with train.ema=true from {source}: it holds no EMA weights")
            self.ema.module.load_state_dict(ckpt["ema"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if scheduler:
            self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])


def epoch_batches(cfg: Config, samples: int) -> int:
    """The batches of an epoch of ``samples`` samples per process: whole accumulation steps of
    ``train.accum_steps`` batches of ``data.batch_size``.

    Raises:
        ConfigError: not one accumulation step fits in an epoch.
    """
    accum, bs = int(cfg.train.accum_steps), int(cfg.data.batch_size)
    batches = samples // bs // accum * accum
    if batches == 0:
        raise ConfigError(f"train.accum_steps={accum} exceeds the {samples // bs} batches per epoch")
    return batches


class Optimization(NamedTuple):
    """What :func:`build_optimization` builds."""

    total_batch: int  # data.batch_size x processes x train.accum_steps
    lrs: dict[str, float]  # train.base_lr / warmup_lr / min_lr scaled to the total batch
    optimizer: torch.optim.Optimizer
    scheduler: Any
    amp_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler  # enabled for fp16 only


def build_optimization(cfg: Config, info: DistInfo, model: nn.Module, batches_per_epoch: int) -> Optimization:
    """Moves ``model`` to the run's device (with gradient checkpointing when ``model.grad_checkpointing``)
    and builds the AdamW optimizer, the warmup + cosine schedule of ``batches_per_epoch // accum_steps``
    steps per epoch, the AMP dtype and the grad scaler of ``cfg.train``."""
    model.to(info.device)
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    accum = int(cfg.train.accum_steps)
    total_batch = int(cfg.data.batch_size) * info.world * accum
    lrs = scaled_lrs(cfg.train, total_batch)
    optimizer = build_optimizer(model, cfg.train, lrs["base_lr"])
    scheduler = build_scheduler(optimizer, cfg.train, lrs, batches_per_epoch // accum)
    amp = amp_dtype(cfg.train.amp, info.device)
    scaler = torch.amp.GradScaler(info.device.type, enabled=amp == torch.float16)
    return Optimization(total_batch, lrs, optimizer, scheduler, amp, scaler)


def log_setup(
    info: DistInfo,
    cfg: Config,
    model: nn.Module,
    opt: Optimization,
    ema: Any,
    name: str,
    about: str,
    data: str,
) -> None:
    """Logs what a run trains: the model (``name``, its size, ``about`` it), the ``data``, the processes,
    total batch, lr (and how it was scaled), AMP and EMA."""
    log(
        info,
        f"model {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {about} | data: {data} | "
        f"{info.world} process(es) on {info.device}, total batch {opt.total_batch}, lr {opt.lrs['base_lr']:.3g} "
        f"(train.base_lr {cfg.train.base_lr:g} x {lr_factor(cfg.train, opt.total_batch):.4g}, "
        f"{cfg.train.get('lr_scale', 'linear')} in the batch) | amp {opt.amp_dtype} | ema {'on' if ema else 'off'}",
    )


def start_run(cfg: Config, info: DistInfo, task: str) -> tuple[str, dict[str, Any] | None]:
    """The opening every task's run shares: this process's threads and seeds, and the checkpoint a resume
    reads (``train.resume``; :func:`resume_path`), checked to be one of ``task``.

    Returns:
        The checkpoint's path ("" for a fresh run) and its contents (None for a fresh run).
    """
    set_threads(cfg)
    seed_process(cfg, info)
    resume = resume_path(cfg, Path(cfg.output))
    ckpt = load_checkpoint(resume) if resume else None
    if ckpt is not None:
        check_resume_task(ckpt, task, resume)
    return resume, ckpt


def resume_path(cfg: Config, out: Path) -> str:
    """The checkpoint ``train.resume`` names (``auto``: ``<output>/last.pt`` if it exists), or ""."""
    resume = cfg.train.resume or ""
    if resume == "auto":
        return str(out / "last.pt") if (out / "last.pt").is_file() else ""
    return str(resume)


@dataclass
class OutputFolder:
    """A run's output folder, checked by :func:`claim_output`; ``replace``: the earlier run's files there
    are moved aside (``train.overwrite``) by :func:`open_output` before the first write."""

    path: Path
    replace: bool = False


def _global_step(path: Path) -> float:
    """The optimizer step a checkpoint was written at (inf for an unreadable one: never overwrite it)."""
    try:
        return int(load_checkpoint(path, mmap=True).get("global_step", 0))
    except (CheckpointError, OSError):
        return float("inf")


def _saved_config(path: Path) -> bool:
    """Whether ``path`` is a config a run saved (:func:`~vit3.engine.config.save_config`: it holds ``_meta``),
    not one a user wrote."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "_meta" in data


def claim_output(cfg: Config, resume: str, ckpt: Mapping[str, Any] | None) -> OutputFolder:
    """Checks that the run of ``cfg`` (resumed from the checkpoint ``resume``, ``ckpt``, or "" / None) may
    write into ``cfg.output`` (see the module docstring). Call it on every rank before anything is written.

    Raises:
        ConfigError: the folder holds another run's checkpoints or results (or, for a resume in its own
            folder, a checkpoint later than the one resumed from), and ``train.overwrite`` is not set.
    """
    out = Path(cfg.output)
    held = [out / name for name in CHECKPOINT_FILES if (out / name).is_file()]
    results = [out / name for name in RESULT_FILES if (out / name).exists()]
    config = out / "config.yaml"
    own_config = config.is_file() and not _saved_config(config)
    if not held and not results and not own_config:
        return OutputFolder(out)
    overwrite = f"--overwrite moves its files into {out / 'replaced-<time>'}/ first"
    if not held and not results:  # e.g. the user's own config file, given with --config, in the run's folder
        problem = (
            f"{config} is a config file that no run saved, which this run would replace with its resolved "
            f"config: keep your config outside the run's folder, or give this run a new folder "
            f"(output=<folder>); {overwrite.replace('its files', 'it')}"
        )
    elif not held:  # the results of a run whose checkpoints are gone
        problem = (
            f"{out} holds the results of another run ({', '.join(p.name for p in results)}), which this run "
            f"would overwrite: give this one a new folder (output=<folder>); {overwrite}"
        )
    elif resume and Path(resume).resolve().parent == out.resolve():  # the run continues in its own folder
        step = int(ckpt["global_step"]) if ckpt is not None else 0
        later = [p for p in held if not p.samefile(resume) and _global_step(p) > step]
        if not later:
            return OutputFolder(out)
        problem = (
            f"{later[0]} was written later than {resume} (step {step}), which this run resumes from, and would "
            f"be overwritten: resume from {later[0]} instead, or continue in a new folder (output=<folder>); "
            f"{overwrite}"
        )
    else:
        names = ", ".join(p.name for p in held)
        problem = (
            f"{out} holds the checkpoints of another run ({names}), which this run would overwrite: continue "
            f"that run with --resume {held[0]}, or give this one a new folder (output=<folder>); {overwrite}"
        )
    if cfg.train.get("overwrite"):
        return OutputFolder(out, replace=True)
    raise ConfigError(problem)


def move_aside(
    folder: Path, names: Iterable[str] = RUN_FILES, patterns: Iterable[str] = RUN_PATTERNS
) -> tuple[Path, list[str]]:
    """Moves the entries of ``folder`` named ``names`` or matching one of ``patterns`` into a new
    ``folder/replaced-<UTC time>/`` (nothing is deleted); returns that folder and the names moved."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = folder / f"replaced-{stamp}", 1
    while target.exists():  # two replacements within one second
        n += 1
        target = folder / f"replaced-{stamp}-{n}"
    names, patterns = set(names), tuple(patterns)
    moved = []
    for entry in sorted(folder.iterdir()):
        if entry.name in names or any(entry.match(pattern) for pattern in patterns):
            target.mkdir(exist_ok=True)
            entry.rename(target / entry.name)
            moved.append(entry.name)
    return target, moved


def open_output(folder: OutputFolder, cfg: Config, info: DistInfo) -> Path:
    """Moves the earlier run's files aside when :func:`claim_output` said so, then saves the run's config
    (rank 0 only; the other ranks do nothing)."""
    if info.is_main:
        if folder.replace:
            target, moved = move_aside(folder.path)
            log(
                info, f"warning: train.overwrite=true: moved the earlier run's {', '.join(moved)} to {target}"
            )
        save_config(cfg, folder.path)
    return folder.path


def open_run(
    folder: OutputFolder,
    cfg: Config,
    info: DistInfo,
    ckpt: Mapping[str, Any] | None,
    resume: str,
    restore: Callable[[], Progress],
) -> None:
    """The close of a run's setup: with ``ckpt`` (read from ``resume``), ``restore()`` the run from it (it
    returns the progress restored, which the log names, or says it holds a finished run); then the config
    saved in ``folder`` (:func:`open_output`); last the RNG states of ``ckpt``, since building the run drew on
    the RNGs."""
    if ckpt is not None:
        p = restore()
        epochs = int(cfg.train.epochs)
        if p.epoch >= epochs:  # nothing left to train: the run's files are only rewritten as they are
            log(
                info,
                f"note: {resume} ends a finished run ({p.epoch} epoch(s) done, train.epochs={epochs}): "
                f"nothing is left to train; raise train.epochs to train on",
            )
        else:
            log(
                info,
                f"resumed from {resume}: epoch {p.epoch + 1}, batch {p.batch_in_epoch}, step {p.global_step}",
            )
    open_output(folder, cfg, info)
    if ckpt is not None:
        restore_rng(ckpt, info)


def check_resume_task(ckpt: Mapping[str, Any], task: str, source: str) -> None:
    """Raises :class:`ConfigError` when ``ckpt`` was written by another task than ``task``."""
    if checkpoint_task(ckpt) != task:
        raise ConfigError(
            f"cannot resume a {task} run from {source}: it is a {checkpoint_task(ckpt)} checkpoint"
        )


def check_resume(cfg: Config, ckpt: Mapping[str, Any], world: int, source: str) -> list[str]:
    """The data-stream settings a resume changes; refused unless ``train.force_resume``.

    Raises:
        ConfigError: a setting of :data:`~vit3.engine.checkpoint.DATA_STREAM_KEYS` or the number of
            processes differs from the run that wrote ``source``.
    """
    changed = resume_differences(ckpt["config"], cfg)
    if int(ckpt.get("world_size", world)) != world:
        changed.append(f"world size (processes): was {ckpt.get('world_size')}, now {world}")
    if changed and not cfg.train.force_resume:
        raise ConfigError(
            f"cannot resume exactly from {source}: settings that decide the data stream changed ("
            + "; ".join(changed)
            + "), so the run would continue at other samples than it stopped at. Set them back, or force "
            "the resume with train.force_resume=true (it continues after the samples already seen)."
        )
    return changed


def save_state(
    make_state: Callable[[], dict[str, Any]], path: Path, info: DistInfo, copies: Iterable[Path] = ()
) -> Path:
    """Writes ``make_state()`` plus every rank's RNG state (``"rng"``, one per rank) to ``path`` (and to
    each of ``copies``, e.g. ``best.pt``) on rank 0.

    Collective: every rank must call it at the same point of the run (``copies`` matters on rank 0 only).
    """
    rng = all_gather_objects(get_rng_state())
    if info.is_main:
        state = {**make_state(), "rng": rng, "world_size": info.world}
        for target in (path, *copies):
            save_checkpoint(target, state)
    barrier()
    return path


def restore_rng(ckpt: Mapping[str, Any], info: DistInfo) -> None:
    """Restores this rank's RNG states of ``ckpt`` (rank r of a run with another process count: r mod n)."""
    rng = ckpt["rng"]
    if len(rng) != info.world:
        log(info, f"warning: checkpoint from {len(rng)} process(es), now {info.world}: RNG streams differ")
    set_rng_state(rng[info.rank % len(rng)])


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    clip_grad: float | None,
    scheduler: Any = None,
    step: int = 0,
    ema: Any = None,
    check_norm: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """One update of accumulated gradients: the scheduler's lr for ``step``, gradient clipping (unscaled;
    ``check_norm`` sees the norm before the step), the (scaled) optimizer step, zeroed gradients, the EMA."""
    if scheduler is not None:
        scheduler.step_update(step)  # lr of this update
    if clip_grad:
        scaler.unscale_(optimizer)
        norm = nn.utils.clip_grad_norm_(model.parameters(), float(clip_grad))
        if check_norm is not None:
            check_norm(norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.update(model)


def run_epochs(
    run: TrainRun,
    progress: Progress,
    batches_per_epoch: int,
    train_epoch: Callable[[], None],
    finish_epoch: Callable[[float, int], Any],
) -> None:
    """Runs the epochs left (``train.epochs``): ``train_epoch()`` from the batch ``progress`` stands at, then
    ``finish_epoch(seconds, images)`` with the epoch's time and the images it trained on (all ranks)."""
    cfg = run.cfg
    while progress.epoch < cfg.train.epochs:
        tick, batch0 = time.perf_counter(), progress.batch_in_epoch
        train_epoch()
        images = (batches_per_epoch - batch0) * int(cfg.data.batch_size) * run.info.world
        finish_epoch(time.perf_counter() - tick, images)


def run_summary(run: TrainRun, out: Path, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary fields every engine reports (collective: the ranks' weights are compared first)."""
    digests = check_ranks_agree(run.model)
    return {
        "output": str(out),
        "last": str(out / "last.pt"),
        "final": history[-1] if history else {},
        "world_size": run.info.world,
        "rank_weights_sha1": digests,  # compared by check_ranks_agree: one per rank, all equal
        "weights_sha1": digests[0],
    }
