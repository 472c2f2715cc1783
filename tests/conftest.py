"""Shared test helpers: paths to the official fixtures, float64 defaults, seeding."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run through Triton's CPU interpreter where no GPU is present. It must be set before any
# kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
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


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two spinning OpenMP threads are far slower.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_backend_registry():
    """Each test starts with no cached mixer plans, demotions or backend warnings."""
    from vit3.layers import backends

    backends.reset()
    yield


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory):
    """A COCO-format dataset of real MNIST digits on canvases (one per test module)."""
    from conftest_dense import write_coco_digits

    return write_coco_digits(tmp_path_factory.mktemp("coco"))


@pytest.fixture(scope="module")
def ade_root(tmp_path_factory):
    """An ADE20K-format dataset of real MNIST digits on canvases (one per test module)."""
    from conftest_dense import write_ade_digits

    return write_ade_digits(tmp_path_factory.mktemp("ade"))
