"""Traced and exported programs accept every size eager accepts: size rules that only choose between eager
paths (the CPU kernel's token rule, the depthwise conv's formulation) are no guards of a torch.export /
torch.compile(dynamic=True) program; a model built under timm's set_scriptable(True) scripts (timm's contract)
into a saved and loaded TorchScript program computing the reference path's numbers, another one refuses naming
what works; the legacy ONNX exporter runs at static shapes and refuses dynamic axes; every exporter leaves the
model as it was."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from torch import nn
from torch.export import Dim

import vit3  # registers the vit3 models
from vit3.layers import TTTMixer, backends
from vit3.layers.blocks import ConvFFN, TTTBlock
from vit3.layers.inner_math import shifted_dwconv, shifted_dwconv_weight_grad
from vit3.models.dit3 import create_dit3
from vit3.models.swap import swap_attention_for_ttt

pytestmark = pytest.mark.usefixtures("one_thread")

DYNAMIC_HW = {2: Dim.AUTO, 3: Dim.AUTO}
# vit3's code: the package and its kernels (installed as ``vit3.kernels``)
PACKAGE_DIRS = [Path(vit3.__file__).resolve().parent, Path(vit3.kernels.__file__).resolve().parent]


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
    """The CPU kernel's rule (>= 32 tokens per head) picks between eager paths only: traced, no class reads
    N."""
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
def test_torchscript_of_a_model_built_with_kernels_is_refused_naming_what_works(make):
    pattern = r"torch\.jit\.script.*set_scriptable\(True\).*torch\.jit\.trace.*torch\.export"
    with pytest.raises(RuntimeError, match=pattern):
        torch.jit.script(make())


@pytest.mark.parametrize(
    ("name", "kwargs"), [("vit3_tiny", dict(img_size=64)), ("test_h_vit3", {})], ids=["plain", "hierarchical"]
)
def test_a_model_built_scriptable_scripts_saves_and_computes_as_eager(name, kwargs, tmp_path):
    """timm's contract (its test_model_forward_torchscript): a model built under set_scriptable(True) scripts.
    The program is TorchScript through and through (saved and loaded: no Python call left in it) and computes
    the reference path's numbers, eager's, which the model built as usual (its kernels) computes too."""
    torch.manual_seed(0)
    with timm.layers.set_scriptable(True):
        model = timm.create_model(name, num_classes=5, **kwargs).double().eval()
    usual = timm.create_model(name, num_classes=5, **kwargs).double().eval()
    usual.load_state_dict(model.state_dict())
    torch.jit.save(torch.jit.script(model), tmp_path / "m.pt")
    loaded = torch.jit.load(tmp_path / "m.pt")
    x = torch.randn(2, 3, 64, 48, dtype=torch.float64)
    # the graph as compiled, without the first run's optimisation passes (seconds, the same numbers)
    with torch.no_grad(), torch.jit.optimized_execution(False):
        want = model(x)
        torch.testing.assert_close(loaded(x), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(usual(x), want, rtol=1e-10, atol=1e-10)


def test_the_fx_graph_of_a_model_built_scriptable_scripts():
    """timm's test_model_forward_fx_torchscript: the FX graph (the mixers and image checks kept whole)
    scripts; its code carries the model's ``forward`` annotations, which must name types, not strings."""
    from timm.models import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    torch.manual_seed(0)
    with timm.layers.set_scriptable(True):
        model = timm.create_model("test_vit3_ttt", num_classes=5, depth=1).eval()
    tracer = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
    last = get_graph_node_names(model, tracer_kwargs=tracer)[1][-1]
    graph = create_feature_extractor(model, return_nodes=[last], tracer_kwargs=tracer)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad(), torch.jit.optimized_execution(False):
        torch.testing.assert_close(torch.jit.script(graph)(x)[last], model(x))


def test_explain_says_a_model_built_scriptable_runs_the_reference_path():
    with timm.layers.set_scriptable(True):
        model = timm.create_model("test_vit3_ttt", num_classes=5, depth=1)
    explained = vit3.explain(model, 64)
    for _, mixer in explained.groups:
        assert mixer.requested == backends.SCRIPTABLE_PATH == "scriptable: reference path"
        assert {b.backend for b in mixer.branches} == {"generic"}
    assert "backend scriptable: reference path" in str(explained)


def test_a_model_built_scriptable_refuses_a_kernel_backend_in_one_line():
    pattern = r"^TTTConfig\.backend='cpu': a model built scriptable .* use backend 'auto' or 'generic'$"
    with pytest.raises(ValueError, match=pattern):
        timm.create_model("test_vit3_ttt", scriptable=True, ttt_cfg=dict(backend="cpu"))


@pytest.mark.parametrize(
    "name",
    ["test_vit3_ttt", pytest.param("test_h_vit3", marks=pytest.mark.slow)],
    ids=["plain", "hierarchical"],
)
def test_legacy_onnx_exporter_runs_at_static_shapes(name, tmp_path):
    """``torch.onnx.export(dynamo=False)`` (a jit.trace): its Unfold refused the depthwise conv's taps. Each
    shape is exported for itself (the plain model with 8x8 patches: 64 to 192 tokens, past the token rule)."""
    import onnxruntime as ort

    torch.manual_seed(0)
    kwargs = dict(depth=1, patch_size=8) if name == "test_vit3_ttt" else {}
    model = timm.create_model(name, num_classes=5, **kwargs).eval()
    for shape in [(1, 3, 64, 64), (2, 3, 96, 96), (3, 3, 128, 96)]:
        x = torch.randn(shape)
        torch.onnx.export(model, (x,), tmp_path / "m.onnx", dynamo=False, input_names=["x"])
        session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
        with torch.no_grad():
            want = model(x).numpy()
        got = session.run(None, {"x": x.numpy()})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(shape))


Inputs = tuple[torch.Tensor, ...]


def _images(name: str) -> tuple[nn.Module, Inputs, list[Inputs]]:
    """A model that takes any image size, its example and other batches and sizes (the same token count on
    another grid, another count)."""
    shapes = [(3, 3, 64, 64), (2, 3, 32, 128), (1, 3, 96, 96)]
    return _model(name), (torch.randn(2, 3, 64, 64),), [(torch.randn(shape),) for shape in shapes]


def _swapped_deit() -> tuple[nn.Module, Inputs, list[Inputs]]:
    torch.manual_seed(0)
    model = swap_attention_for_ttt(timm.create_model("deit_tiny_patch16_224", depth=1, img_size=64))
    return model.eval(), (torch.randn(2, 3, 64, 64),), [(torch.randn(3, 3, 64, 64),)]


def _dit3() -> tuple[nn.Module, Inputs, list[Inputs]]:
    torch.manual_seed(0)
    model = create_dit3("dit3_s_8", depth=1, input_size=16, num_classes=10).eval()
    other = (torch.randn(3, 4, 16, 16), torch.tensor([1.0, 40.0, 900.0]), torch.tensor([0, 4, 9]))
    return model, (torch.randn(2, 4, 16, 16), torch.tensor([3.0, 500.0]), torch.tensor([1, 7])), [other]


# Each model, its example and the other inputs its trace takes: ViT³ and H-ViT³ any batch and image size,
# the others any batch (DiT³'s position table and timm's position embedding are made for one size).
TRACED = {
    "test_vit3_ttt": partial(_images, "test_vit3_ttt"),
    "test_h_vit3": partial(_images, "test_h_vit3"),
    "deit with TTT swapped in": _swapped_deit,
    "dit3": _dit3,
}


@pytest.mark.parametrize("exporter", ["torch.jit.trace", "onnx-legacy"])
@pytest.mark.parametrize("name", list(TRACED))
def test_a_trace_meets_no_python_test_of_a_traced_size_in_vit3(name, exporter, tmp_path):
    """Under a trace (``torch.jit.trace``, the legacy ONNX exporter) sizes read off a shape are tensors, and
    every Python test of one warns (``TracerWarning``): a trace of ``vit3_tiny`` gave 171 such warnings from
    vit3's checks and branches, none of timm's models more than 4 (from torch). vit3 reads them as ints
    where it only checks or chooses (``static_shape``): none is left in its code, and the trace computes
    what eager does, at the example and at the other batches and sizes it took before."""
    model, args, others = TRACED[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if exporter == "torch.jit.trace":
            traced = torch.jit.trace(model, args)
        else:
            torch.onnx.export(model, args, tmp_path / "m.onnx", dynamo=False)
    ours = [
        f"{w.filename}:{w.lineno}"
        for w in caught
        if issubclass(w.category, torch.jit.TracerWarning)
        and any(Path(w.filename).resolve().is_relative_to(d) for d in PACKAGE_DIRS)
    ]
    assert not ours, ours
    if exporter == "torch.jit.trace":
        for inputs in [args, *others]:
            with torch.no_grad():
                got, want = traced(*inputs), model(*inputs)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(inputs[0].shape))


@pytest.mark.parametrize("axes", [{0: "batch"}, [2, 3]], ids=["batch", "size"])
def test_legacy_onnx_exporter_refuses_dynamic_axes_naming_what_works(axes, tmp_path):
    """The legacy exporter's trace fixes the sizes it sees (token counts, RoPE grids): a graph it declared
    dynamic failed in onnxruntime at another batch and was off by up to 4% at another size. Refused in one
    line, before any file is written, and the model runs as before."""
    model, x = _model("test_h_vit3"), torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = model(x)
    path = tmp_path / "m.onnx"
    pattern = r"^dynamic_axes: the legacy ONNX exporter .*dynamo=True, dynamic_shapes=.*export\.py onnx$"
    with pytest.raises(ValueError, match=pattern):
        torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"], dynamic_axes={"x": axes})
    assert not path.exists()
    with torch.no_grad():
        assert torch.equal(model(x), want)


# ---------------------------------------------------------------------- every exporter leaves the model as it
# was
class _Blocks(nn.Module):
    """A plain ViT³ block and an H-ViT³ one (RoPE, ConvFFN) on ``[B, 8, 8, 32]`` maps: once settled, the first
    runs as one C++ op (``TTTBlock.one_op``), the second's mixer takes its C++ op by the short path."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = TTTBlock(32, 2, mlp_ratio=2.0)
        norm = partial(nn.LayerNorm, eps=1e-5)
        self.hier = TTTBlock(32, 2, mlp_ratio=2.0, ttt_cfg={"rope": True}, mlp_layer=ConvFFN, norm_layer=norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hier(self.plain(x))


def _outputs_and_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The output without gradients, then with them, and the gradients of x and every parameter."""
    with torch.no_grad():
        frozen = model(x)
    x = x.detach().requires_grad_()
    model.zero_grad()
    out = model(x)
    out.sum().backward()
    return [frozen, out.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("name", ["test_vit3_ttt", "test_h_vit3"])
def test_jit_trace_passes_its_own_check(name):
    """``torch.jit.trace`` with its defaults traces the model again under ``no_grad`` and compares the graphs
    (names included): the traced path must not depend on the grad mode. It did: the gradient's norm was
    another op without gradients, and the C++ kernels' checks read sizes (ops a tracer records, naming
    values after the frame that asked) only without gradients."""
    model, x = _model(name), torch.randn(2, 3, 64, 64)
    traced = torch.jit.trace(model, x)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)


EXPORTERS = {
    "onnx-dynamo": lambda m, x, path: torch.onnx.export(m, (x,), path, dynamo=True, optimize=False),
    "onnx-dynamo-dynamic_axes": lambda m, x, path: torch.onnx.export(
        m, (x,), path, dynamo=True, optimize=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}}
    ),
    "onnx-dynamo-dynamic_shapes": lambda m, x, path: torch.onnx.export(
        m, (x,), path, dynamo=True, optimize=False, dynamic_shapes={"x": {0: Dim.AUTO}}
    ),
    "onnx-legacy": lambda m, x, path: torch.onnx.export(m, (x,), path, dynamo=False),
    "torch.export": lambda m, x, path: torch.export.export(m, (x,)),
    "torch.jit.trace": lambda m, x, path: torch.jit.trace(m, x, check_trace=False),
}


@pytest.mark.parametrize("exporter", list(EXPORTERS))
def test_every_exporter_leaves_the_model_as_it_was(exporter, tmp_path):
    """After an export the eager model gives the same bits, with and without gradients, on the same C++ ops.
    torch.export writes back a pytree snapshot of every module's attributes taken under its fake-tensor trace:
    the mixers' list of their weights' places came back as copies holding fake weights, and the next settled
    call raised ``UnsupportedOperatorException: vit3_cpu.mix_forward``."""
    torch.manual_seed(0)
    model, x = _Blocks().eval(), torch.randn(2, 8, 8, 32)
    for _ in range(3):  # settled: good first calls of each grad mode, then the C++ ops
        want = _outputs_and_grads(model, x)

    def on_cpp_ops() -> bool:
        return model.plain.one_op(x) is not None and all(model.hier.attn._call_cache.short)

    assert on_cpp_ops()
    EXPORTERS[exporter](model, x, tmp_path / "m.onnx")
    got = _outputs_and_grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert on_cpp_ops()
