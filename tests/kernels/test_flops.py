"""FLOP counts of the custom ops (``vit3.kernels.flops``): ``FlopCounterMode`` counts a model on its C++ ops
as fvcore counts its traced ATen ops (2 FLOPs per multiply-add against fvcore's 1), a backward as autograd's
matmuls on the generic path, a counter entered before the kernel loads counts too, and fvcore's handles count
the ops that a trace records (no unsupported vit3 op)."""

from __future__ import annotations

import pytest
import timm
import torch
from helpers.ops import needs_kernels
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import vit3  # noqa: F401 - registers the models
from vit3.kernels import flops
from vit3.kernels.cpp import cpu_kernel_ops


def _macs(counter: FlopCounterMode, kind: str = "") -> int:
    """The counter's multiply-adds (half its FLOPs), of the ops whose name starts with ``kind``."""
    return sum(v for op, v in counter.get_flop_counts()["Global"].items() if str(op).startswith(kind)) // 2


def test_forward_counts_as_fvcore_counts_the_traced_model():
    """Two ViT³-T blocks at 96 px (36 tokens: every branch on the C++ ops) by ``FlopCounterMode``: fvcore's
    count of the traced (plain ATen) model, but its LayerNorms, which ``FlopCounterMode`` counts nowhere (and
    numpy's estimate of each einsum's, 2 more than its multiply-adds)."""
    from fvcore.nn import FlopCountAnalysis

    needs_kernels(torch.device("cpu"))
    model = timm.create_model("vit3_tiny", img_size=96, depth=2).eval()
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        model(x)
        with FlopCounterMode(display=False) as counter:
            model(x)
        analysis = FlopCountAnalysis(model, x).set_op_handle(**flops.fvcore_handles())
        analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        traced = analysis.total() - analysis.by_operator()["layer_norm"]
    assert _macs(counter, "vit3_cpu.") > 0, "the model ran its C++ ops"
    assert _macs(counter) == pytest.approx(traced, rel=1e-6)


def test_backward_counts_as_autograd_on_the_generic_path():
    """A SwiGLU mixer's training step that keeps its pre-activations (``recompute="never"``): the C++ ops
    count what autograd's matmuls count on the generic path, forward and backward."""
    needs_kernels(torch.device("cpu"))
    x = torch.randn(1, 3, 96, 96)
    counts = {}
    for backend in ("cpu", "generic"):
        torch.manual_seed(0)
        cfg = {"branches": ("swiglu",), "backend": backend, "recompute": "never"}
        model = timm.create_model("vit3_tiny", img_size=96, depth=1, embed_dim=64, num_heads=2, ttt_cfg=cfg)
        for _ in range(2):  # the first calls of a route run guarded
            model(x).sum().backward()
        with FlopCounterMode(display=False) as forward:
            out = model(x)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
        inner = "vit3_cpu." if backend == "cpu" else "aten.bmm"
        counts[backend] = (_macs(forward, inner), _macs(backward, inner))
    assert counts["cpu"][0] > 0
    assert counts["cpu"] == counts["generic"]


def test_a_counter_entered_before_the_ops_load_counts_them(monkeypatch):
    """The first forward of a process loads the C++ kernel inside the counter: ``register`` (called by the
    loader) adds the formulas to the counter already active."""
    ops = cpu_kernel_ops(torch.zeros(1))
    for name in flops.FORMULAS:
        space, op_name = name.split("::")
        if space == "vit3_cpu":
            monkeypatch.delitem(flop_counter.flop_registry, getattr(ops, op_name), raising=False)
    x, w1, w2 = torch.randn(2, 5, 8), torch.randn(16, 8), torch.randn(8, 16)
    with FlopCounterMode(display=False) as counter:
        flops.register("vit3_cpu")
        ops.lean_mlp(x, None, None, None, w1, None, w2, None, "none")
    assert counter.get_total_flops() == 2 * 10 * (16 * 8 + 8 * 16)


def test_fvcore_counts_a_traced_block_op_as_its_parts():
    """A trace that records a vit3 op (the plain block as one op, ``vit3_cpu::ttt_block``): fvcore with
    ``fvcore_handles`` reports no unsupported vit3 op and counts what ``FlopCounterMode`` counts of the ops
    that the block op runs (its CPE + norm, qkv, mixer, projection and MLP ops)."""
    from fvcore.nn import FlopCountAnalysis

    needs_kernels(torch.device("cpu"))
    block = timm.create_model("vit3_tiny", img_size=96).eval().blocks[0]
    x = torch.randn(2, 6, 6, 192)
    with torch.no_grad():
        for _ in range(3):  # a settled mixer call
            block(x)
        args = block.one_op(x)
    assert args is not None

    class OneOp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.vit3_cpu.ttt_block(x, *args[1:], None, None)

    with torch.no_grad():
        with FlopCounterMode(display=False) as counter:
            OneOp()(x)
        analysis = FlopCountAnalysis(OneOp(), x).set_op_handle(**flops.fvcore_handles())
        analysis.uncalled_modules_warnings(False)
        assert analysis.by_operator()["ttt_block"] == analysis.total() == _macs(counter) > 0
        assert not [op for op in analysis.unsupported_ops() if "vit3" in op]
