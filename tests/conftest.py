"""Shared test helpers: paths to the official fixtures, float64 defaults, seeding."""

from __future__ import annotations

import os

import pytest
import torch

# Where no GPU is present Triton's CPU interpreter is the only Triton there is, and the tests that run the
# kernels on ``helpers.ops.DEVICE`` run them there. It is set before any kernel module is imported:
# ``triton.jit`` reads it when a kernel is decorated, and the op registers as an opaque custom op under it.
# On a GPU host the kernels compile and a test asks for what it needs itself: ``interpreter`` for the
# registry's decisions on CPU tensors, ``triton_device`` (the GPU, else the interpreter) to launch kernels.
# ``TRITON_INTERPRET=0 pytest ...`` here imports Triton as a GPU host does: tests that would launch a kernel
# on the CPU skip (``helpers.ops.needs_kernels``), the others run as they would there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _triton_marked(request, monkeypatch):
    """A test marked ``triton`` runs its kernels on the GPU, or through the interpreter where there is
    none."""
    if request.node.get_closest_marker("triton") and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def no_backend_env(monkeypatch):
    """No ``VIT3_TTT_BACKEND`` or ``VIT3_TTT_STRICT`` from the caller's environment."""
    from vit3.layers import backends

    for name in (backends.BACKEND_ENV, backends.STRICT_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter for this test's CPU tensors, on any host (``TRITON_INTERPRET=1`` for the test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretends one GPU with device properties ``props`` is present (``torch.cuda.get_device_properties``),
    from a ROCm build of PyTorch where ``hip`` is its version; the launcher's per-device caches are emptied
    around the test. For code that only asks about the device: nothing may allocate on it."""
    from vit3.kernels.triton import device as tdev
    from vit3.kernels.triton import tiles as ttiles

    caches = (tdev._cuda_arch, tdev.hip_arch, ttiles.fits_arch)

    def use(props, hip: str | None = None) -> torch.device:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
        monkeypatch.setattr(torch.version, "hip", hip)
        for cache in caches:
            cache.cache_clear()
        return torch.device("cuda", 0)

    yield use
    for cache in caches:
        cache.cache_clear()


@pytest.fixture
def triton_device(monkeypatch) -> torch.device:
    """Where this test's Triton kernels run: the GPU, or the CPU through the interpreter where there is none
    (skipped where Triton was decorated for a GPU that is not there: ``helpers.ops.needs_kernels``)."""
    from helpers.ops import needs_kernels

    if torch.cuda.is_available():
        return torch.device("cuda")
    needs_kernels(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cpu")


@pytest.fixture
def registry(monkeypatch):
    """The inner-model registry, restored after the test (a registration there stays out of other tests)."""
    from vit3.layers import inner_models

    monkeypatch.setattr(inner_models, "_REGISTRY", dict(inner_models._REGISTRY))


@pytest.fixture(scope="module")
def four_digits(tmp_path_factory):
    """Real MNIST digits 0-3 as an image folder: 20 train / 10 val images per class, 80 training images
    (one per test module)."""
    from helpers.train import make_digit_folder

    return make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1, 2, 3), n_train=20, n_val=10)


@pytest.fixture
def float64():
    """float64 as the default dtype: modules of float64 math opt in with
    ``pytestmark = pytest.mark.usefixtures("float64")``."""
    from helpers.common import default_dtype

    with default_dtype(torch.float64):
        yield


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
def _backend_env_follows(monkeypatch):
    """The backends read the ``VIT3_*`` variables once (``backends.refresh_env``): each test starts from the
    environment as it is, and a test's ``monkeypatch.setenv`` / ``delenv`` refreshes them at once."""
    from vit3.layers import backends

    def refreshing(method):
        def call(*args, **kwargs):
            method(*args, **kwargs)
            backends.refresh_env()

        return call

    for name in ("setenv", "delenv"):
        monkeypatch.setattr(monkeypatch, name, refreshing(getattr(monkeypatch, name)))
    backends.refresh_env()


@pytest.fixture(autouse=True)
def _fresh_backend_registry():
    """Each test starts with no cached mixer routes, demotions or backend warnings."""
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
