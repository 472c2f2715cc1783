"""torchrun process groups: gloo on CPU, nccl on CUDA; helpers that also work without a process group."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from .config import ConfigError

__all__ = [
    "DistInfo",
    "all_gather_objects",
    "barrier",
    "cleanup",
    "distributed",
    "init_distributed",
    "log",
    "log_row",
    "sum_tensor",
]


class DistInfo:
    """Rank, world size and device of this process."""

    def __init__(self, rank: int, world: int, local_rank: int, device: torch.device) -> None:
        self.rank, self.world, self.local_rank, self.device = rank, world, local_rank, device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def _pick_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name} requested but CUDA is not available (use device=cpu)")
        if (device.index or 0) >= torch.cuda.device_count():
            per_node = os.environ.get("LOCAL_WORLD_SIZE")
            launch = f" (torchrun started {per_node} processes on this machine)" if per_node else ""
            raise ConfigError(
                f"device={name}: this machine has {torch.cuda.device_count()} CUDA device(s){launch}; use at "
                "most "
                f"one process per device (torchrun --nproc_per_node={torch.cuda.device_count()})"
            )
        torch.cuda.set_device(device)
    return device


def _backend(backend: str, device: torch.device) -> str:
    """The process-group backend for ``device`` (``auto``: nccl on CUDA, gloo on CPU).

    Raises:
        ConfigError: the backend cannot run this device, or this torch build lacks it.
    """
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"dist.backend=nccl needs CUDA devices, but this run is on {device.type}: use dist.backend=gloo, "
            "or "
            f"auto (nccl on CUDA, gloo on CPU)"
        )
    if not dist.is_backend_available(backend):
        raise ConfigError(f"dist.backend={backend} is not available in this torch build (use auto or gloo)")
    return backend


def init_distributed(device: str = "auto", backend: str = "auto") -> DistInfo:
    """Joins the torchrun process group when ``WORLD_SIZE`` > 1 (env:// rendezvous).

    Args:
        device: "auto" | "cpu" | "cuda" | "cuda:N" (under torchrun "cuda" means cuda:LOCAL_RANK).
        backend: "auto" (nccl for CUDA, gloo for CPU) or an explicit backend name.

    Raises:
        ConfigError: the device is not on this machine, or the backend cannot run it (checked before the
            process group starts, so that every rank stops alike and rank 0 reports it: ``vit3.engine.cli``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        # checked before the group starts: a backend it cannot start is one line, not a trace on every rank
        backend = _backend(backend, dev)
        dist.init_process_group(backend=backend, init_method="env://", world_size=world, rank=rank)
    return DistInfo(rank, world, local_rank, dev)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """All-reduce sum across ranks (identity without a process group)."""
    if dist.is_available() and dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
    return t


def all_gather_objects(obj: Any) -> list[Any]:
    """Python objects of every rank, in rank order (``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(device: str = "auto", backend: str = "auto") -> Iterator[DistInfo]:
    """``init_distributed`` for the body of a run; the process group is destroyed after it, also on errors."""
    info = init_distributed(device, backend)
    try:
        yield info
    finally:
        cleanup()


def log(info: DistInfo, msg: str) -> None:
    """Prints ``msg`` on rank 0 (through tqdm, so that progress bars stay intact)."""
    if info.is_main:
        tqdm.write(msg, file=sys.stdout)


def log_row(info: DistInfo, row: dict[str, Any]) -> None:
    """Logs a metrics row as ``key value`` pairs (floats to 4 significant digits)."""
    log(info, " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
