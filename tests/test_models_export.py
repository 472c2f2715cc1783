"""Traced and exported programs accept every size eager accepts: size rules that only choose between eager
paths (the CPU kernel's token rule, the depthwise conv's formulation) are no guards of a torch.export /
torch.compile(dynamic=True) program; TorchScript is refused naming what works; the legacy ONNX exporter
runs at static shapes."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from torch.export import Dim

import vit3  # noqa: F401  (registers the vit3 models)
from vit3.layers import TTTMixer, backends
from vit3.layers.inner_math import shifted_dwconv, shifted_dwconv_weight_grad

pytestmark = pytest.mark.usefixtures("one_thread")

DYNAMIC_HW = {2: Dim.AUTO, 3: Dim.AUTO}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = dict(depth=1) if name == "test_vit3_ttt" else {}
    return timm.create_model(name, num_classes=5, **kwargs).eval()


def _matches_eager(program, model: torch.nn.Module, sizes: list[tuple[int, int]]) -> None:
    for h, w in sizes:
        x = torch.randn(2, 3, h, w)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x), rtol=1e-5, atol=1e-5, msg=f"{h}x{w}")


# ----------------------------------------------------------------------------------------- torch.export
def test_the_token_rule_is_one_class_under_tracing():
    """The CPU kernel's rule (>= 32 tokens per head) picks between eager paths only: traced, no class reads N."""
    assert backends.token_class(4) != backends.token_class(400)
    assert backends.token_class(4, "compile") == backends.token_class(400, "compile")
    assert backends.token_class(4, "trace") == backends.token_class(400, "trace")


def test_exported_depthwise_conv_takes_every_grid():
    """The traceable depthwise conv and its weight gradient: no guard on the grid (the elementwise form made
    torch.export require every side >= 3)."""

    class Conv(torch.nn.Module):
        def forward(self, x, w):
            return shifted_dwconv(x, w), shifted_dwconv_weight_grad(x, x)

    x, w = torch.randn(2, 4, 6, 5), torch.randn(2, 4, 3, 3)
    program = torch.export.export(Conv(), (x, w), dynamic_shapes={"x": DYNAMIC_HW, "w": None}).module()
    for h, wd in [(1, 1), (2, 7), (9, 2)]:
        y = torch.randn(2, 4, h, wd)
        for got, want in zip(program(y, w), Conv()(y, w)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("name", "example", "sizes"),
    [
        # 4x4 patches exported; 2x2, 5x6, 2x32 (64 tokens: the other side of the token rule) and 2x2 again
        pytest.param("test_vit3_ttt", (64, 64), [(32, 32), (80, 96), (32, 512), (17, 20)], id="plain"),
        # 3x3 deepest grid exported; a 64-px side makes it 2 (the depthwise conv's old guard: >= 3)
        pytest.param(
            "test_h_vit3", (96, 96), [(64, 64), (64, 96), (40, 33)], id="hierarchical", marks=pytest.mark.slow
        ),
    ],
)
def test_export_with_dynamic_size_runs_every_size_eager_runs(name, example, sizes):
    """Exported once with a dynamic height and width, the program takes every size down to the smallest
    whose deepest grid has two patches a side (PyTorch specialises sizes of 1) and matches eager."""
    model = _model(name)
    program = torch.export.export(model, (torch.randn(2, 3, *example),), dynamic_shapes={"x": DYNAMIC_HW})
    _matches_eager(program.module(), model, sizes)


# ---------------------------------------------------------------------------------------- torch.compile
def test_compile_dynamic_builds_one_graph_for_every_size():
    """torch.compile(dynamic=True): one graph for sizes on both sides of the token rule and of the old grid
    guard (the first call non-square: a square one would make PyTorch's duck sizing tie H to W)."""
    model = _model("test_vit3_ttt")
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting, dynamic=True)
    try:
        _matches_eager(compiled, model, [(64, 80), (80, 96), (32, 512), (48, 48)])
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1


# -------------------------------------------------------------------------------- TorchScript and ONNX
@pytest.mark.parametrize(
    "make", [lambda: _model("test_h_vit3"), lambda: TTTMixer(16, 2)], ids=["model", "mixer"]
)
def test_torchscript_is_refused_naming_what_works(make):
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script.*torch\.jit\.trace.*torch\.export"):
        torch.jit.script(make())


@pytest.mark.parametrize(
    "name",
    ["test_vit3_ttt", pytest.param("test_h_vit3", marks=pytest.mark.slow)],
    ids=["plain", "hierarchical"],
)
def test_legacy_onnx_exporter_runs_at_static_shapes(name, tmp_path):
    """``torch.onnx.export(dynamo=False)`` (a jit.trace): its Unfold refused the depthwise conv's taps."""
    import onnxruntime as ort

    model, x = _model(name), torch.randn(1, 3, 64, 64)
    torch.onnx.export(model, (x,), tmp_path / "m.onnx", dynamo=False, input_names=["x"])
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], want, rtol=1e-4, atol=1e-5)
