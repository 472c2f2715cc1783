"""A settled training step of the backbones: no host synchronisation, so a GPU step can be captured whole.

A host sync is an op that reads a device value back to Python (``aten._local_scalar_dense``, what ``.item()``,
``bool()`` and ``float()`` dispatch, and ``aten.is_nonzero`` / ``aten.equal``); on a GPU it stalls the host
until the queue drains and breaks CUDA graph capture. The step is counted on CPU, where the same Python and
ATen ops are dispatched as on a GPU.
"""

from __future__ import annotations

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vit3  # noqa: F401  (registers the models)
from vit3.layers.inner_math import assert_finite

SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}


class SyncCounter(TorchDispatchMode):
    """Records every host-sync op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["vit3_tiny", "h_vit3_tiny"])
def test_settled_training_step_has_no_host_sync(name):
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=64, num_classes=10).train()
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([1, 7])
    for _ in range(2):  # settle: routes decided, verifications done
        _step(model, x, y)
    with SyncCounter() as counter:
        _step(model, x, y)
    assert counter.syncs == []


@pytest.mark.parametrize("name", ["vit3_tiny", "h_vit3_tiny"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_image_is_still_refused(name, bad):
    """The finiteness check kept its meaning without its sync: one clear error on CPU."""
    model = timm.create_model(name, img_size=64, num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    x[1, 2, 5, 7] = bad
    with pytest.raises(ValueError, match="non-finite"):
        model(x)


def test_finite_check_has_no_false_alarm_on_large_values():
    """Finite values whose float32 sum overflows are finite: the check sums in float64."""
    assert_finite(torch.full((2, 3, 64, 64), 3e38), ValueError, "non-finite")


@pytest.mark.parametrize("name", ["vit3_tiny", "h_vit3_tiny"])
def test_whole_model_compiles_with_fullgraph_and_trains(name):
    """The whole backbone is one graph (no break: what CUDA graphs of a whole step need, and what timm's
    ``--torchcompile`` compiles): its loss and every gradient are eager's (no drop path: its draws differ).
    Gradients are compared by norm, to 1e-3 of their own and 1e-6 of the largest: float32 rounding through
    BatchNorm over 2 images leaves ~1e-4, and a bias in front of a BatchNorm has a zero gradient that either
    run gives as rounding noise."""
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, num_classes=10, drop_path_rate=0.0).train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

    def loss_and_grads(net):
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = loss_and_grads(model)
    got, got_grads = loss_and_grads(compiled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    largest = max(g.norm().item() for g in want_grads)
    for g, g_ref in zip(got_grads, want_grads):
        assert (g - g_ref).norm().item() <= 1e-3 * g_ref.norm().item() + 1e-6 * largest
