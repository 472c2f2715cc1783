"""Shared test helpers: paths to the official fixtures, float64 defaults, seeding."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run through Triton's CPU interpreter where no GPU is present. It must be set before any
# kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    from helpers.dense import write_coco_digits

    return write_coco_digits(tmp_path_factory.mktemp("coco"))


@pytest.fixture(scope="module")
def ade_root(tmp_path_factory):
    """An ADE20K-format dataset of real MNIST digits on canvases (one per test module)."""
    from helpers.dense import write_ade_digits

    return write_ade_digits(tmp_path_factory.mktemp("ade"))


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Real MNIST digits 0-3 as an image folder: 60 train / 25 val images per class (one per test module;
    a module that needs another folder defines its own ``digits``)."""
    from helpers.train import make_digit_folder

    return make_digit_folder(tmp_path_factory.mktemp("digits"))
