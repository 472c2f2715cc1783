"""Paths and small helpers shared by the test modules: the repository, the official fixtures, error metrics,
call counting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures" / "official"


def load_fixture(name: str) -> dict:
    """Loads an official golden fixture, skipping the test when ``../shared`` is absent."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"official fixture {path} not found (../shared is not laid out beside the repo)")
    return torch.load(path, weights_only=True)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise error relative to the largest magnitude of ``b``."""
    return float(((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).detach())


def count_calls(monkeypatch, owner, name: str) -> dict[str, int]:
    """Replaces ``owner.name`` by a wrapper counting its calls (``["n"]``) for one test."""
    count = {"n": 0}
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return count
