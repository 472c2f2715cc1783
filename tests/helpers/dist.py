"""Helpers for the tests that run a real 2-process gloo group (``torch.multiprocessing.spawn`` workers)."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def ranks_agree_worker(rank: int, world: int, store: str, perturb_rank: int | None, result_dir: str) -> None:
    """Builds the same seeded model on every rank, changes one weight of ``perturb_rank``'s copy, and writes
    what :func:`vit3.engine.process.check_ranks_agree` returns or raises to ``result_dir/<rank>.txt``."""
    from vit3.engine.process import check_ranks_agree

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        model[1].running_mean += rank  # buffers may differ between ranks (DDP broadcasts them)
        if rank == perturb_rank:
            with torch.no_grad():
                model[0].weight[1, 2] += 1e-6
        try:
            text = "ok " + " ".join(check_ranks_agree(model))
        except RuntimeError as exc:
            text = f"error {exc}"
    except Exception:
        text = "crash " + traceback.format_exc()
    finally:
        dist.destroy_process_group()
    Path(result_dir, f"{rank}.txt").write_text(text)


def ddp_step_worker(rank: int, world: int, store: str, result_dir: str) -> None:
    """One DDP training step of an H-ViT³ downsampling (``ConvDownsample``) on a channels-last map, as the
    stages hand it on, on every rank; writes the warnings it raised (one per line) to
    ``result_dir/<rank>.txt``, or ``crash`` and the traceback."""
    import warnings

    from vit3.layers.embed import ConvDownsample

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(ConvDownsample(8, 16))
        x = torch.randn(2, 6, 6, 8).permute(0, 3, 1, 2)  # [B, H, W, C] -> [B, C, H, W]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).sum().backward()
        text = "\n".join(str(w.message) for w in caught)
    except Exception:
        text = "crash " + traceback.format_exc()
    finally:
        dist.destroy_process_group()
    Path(result_dir, f"{rank}.txt").write_text(text)
