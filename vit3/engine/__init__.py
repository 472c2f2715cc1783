"""vit3.engine: run configs (``vit3.engine.config``) and the task engines behind ``train.py``/``eval.py``.

``run(cfg, mode)`` dispatches on ``cfg.task``: ``classification`` -> ``vit3.engine.classification``,
``detection``/``segmentation`` -> ``vit3.engine.dense``, ``generation`` -> ``vit3.engine.generation``,
``convert`` -> ``vit3.engine.convert`` (an attention model distilled into a TTT model). Each is imported
lazily, so a missing dense or diffusion stack never breaks classification.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import Config, ConfigError, check_whole, load_config, save_config
from .config.load import TASKS
from .cpu import tune_malloc

__all__ = ["TASKS", "Config", "ConfigError", "load_config", "run", "save_config", "tune_malloc"]


def run(cfg: Config, mode: str) -> Any:
    """Runs ``mode`` ("train" or "eval") of the engine that ``cfg.task`` names.

    Raises:
        ConfigError: ``cfg.task`` or ``mode`` is not one of the known names, or ``cfg`` lacks keys of its
            task's config (a file without a ``base:``: :func:`~vit3.engine.config.check_whole`).
    """
    task = cfg.get("task", "classification")
    if task not in TASKS:
        raise ConfigError(f"unknown task '{task}': expected one of {', '.join(TASKS)}")
    if mode not in ("train", "eval"):
        raise ConfigError(f"unknown mode '{mode}': expected train or eval")
    check_whole(cfg)
    device = str(cfg.get("device", "auto"))
    if cfg.get("cpu_malloc", True) and (
        device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    ):
        tune_malloc()  # large activations reuse freed heap blocks instead of fresh pages (see engine/cpu.py)
    if task == "classification":
        from . import classification as engine
    elif task == "generation":
        from . import generation as engine  # DiT³ on diffusers: train(cfg), evaluate(cfg)
    elif task == "convert":
        from . import convert as engine  # attention teacher -> TTT student: train(cfg), evaluate(cfg)
    else:
        from . import dense as engine  # detection / segmentation: train(cfg), evaluate(cfg)
    return engine.train(cfg) if mode == "train" else engine.evaluate(cfg)
