"""ONNX export of the multi-scale feature extractor, checked against PyTorch with onnxruntime, and the
export-time formulation of the depthwise-conv inner model (nine shifted multiply-adds) against the native
one."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

import vit3  # noqa: F401  (registers the vit3 models)
from vit3.errors import ConfigError
from vit3.export import FeatureExtractor, check_onnx, export_onnx
from vit3.layers import TTTMixer
from vit3.layers.inner_math import shifted_dwconv, shifted_dwconv_weight_grad

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- export-time DWConv formulation
@pytest.mark.parametrize("per_sample", [False, True], ids=["shared-weight", "per-sample-weight"])
def test_shifted_dwconv_matches_conv2d_with_gradients(per_sample):
    b, c, h, w = 3, 4, 5, 7
    x = torch.randn(b, c, h, w, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(b if per_sample else 1, c, 3, 3, dtype=torch.float64, requires_grad=True)
    ref = torch.cat(
        [
            F.conv2d(x[i : i + 1], weight[i if per_sample else 0][:, None], padding=1, groups=c)
            for i in range(b)
        ]
    )
    got = shifted_dwconv(x, weight)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x, weight), g)
    got_grads = torch.autograd.grad(got, (x, weight), g)
    for a, b_ in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)


def test_shifted_weight_grad_is_the_conv_weight_gradient():
    k = torch.randn(2, 3, 6, 4, dtype=torch.float64, requires_grad=True)
    e = torch.randn(2, 3, 6, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.zeros(2, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    # G = d/dW sum(dwconv(k; W) * e), per sample: autograd of conv2d is the independent reference.
    out = torch.cat([F.conv2d(k[i : i + 1], weight[i][:, None], padding=1, groups=3) for i in range(2)])
    (ref,) = torch.autograd.grad((out * e).sum(), weight, create_graph=True)
    got = shifted_dwconv_weight_grad(k, e)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)  # and its own gradients (k and e), as the outer loop needs them
    for a, b in zip(torch.autograd.grad(got, (k, e), g), torch.autograd.grad(ref, (k, e), g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_mixer_output_is_unchanged_by_the_export_formulation():
    mixer = TTTMixer(32, 2).double()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    ref = mixer(x, grid=(3, 4))
    traced = torch.jit.trace(_OnGrid(mixer, (3, 4)), x, check_trace=False)
    torch.testing.assert_close(traced(x), ref, rtol=1e-12, atol=1e-12)


class _OnGrid(torch.nn.Module):
    """A mixer on a fixed grid, as ``torch.jit.trace`` takes it (tensor inputs only)."""

    def __init__(self, mixer: TTTMixer, grid: tuple[int, int]) -> None:
        super().__init__()
        self.mixer, self.grid = mixer, grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixer(x, grid=self.grid)


# -------------------------------------------------------------------------------------------- ONNX


@pytest.mark.slow
def test_onnx_hierarchical_dynamic_batch(tmp_path):
    # A fixed image size keeps this export quick; the plain model's test below covers a dynamic size.
    model = FeatureExtractor("test_h_vit3")
    info = export_onnx(model, tmp_path / "h.onnx", 64, dynamic_size=False, exporter="dynamo")
    assert info["exporter"] == "dynamo" and info["dynamic_batch"] and not info["dynamic_size"]
    assert check_onnx(info["path"], model, [torch.rand(1, 3, 64, 64), torch.rand(3, 3, 64, 64)]) < 1e-4


@pytest.mark.slow
def test_export_script_onnx_command_checks_against_pytorch(tmp_path, capsys):
    import onnx
    from helpers.train import load_script

    out = tmp_path / "plain.onnx"
    assert (
        load_script("export").main(
            ["onnx", "--model", "test_vit3_ttt", "--random-init", "--img-size", "64", "--out", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    info = json.loads(
        text[text.rindex("\n{") + 1 :]
    )  # the script's JSON comes last, after the exporter's log
    assert info["exporter"] == "dynamo" and info["max_abs_err"] < 1e-4 and info["weights"] == "random init"
    graph = onnx.load(str(out)).graph
    dims = graph.input[0].type.tensor_type.shape.dim
    assert dims[1].dim_value == 3 and all(d.dim_param for d in (dims[0], dims[2], dims[3]))  # dynamic B, H, W
    assert [o.name for o in graph.output] == ["feat0_s16", "feat1_s16", "feat2_s16"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the (quick) TorchScript exporter is deprecated
def test_export_script_torchscript_exporter_writes_a_static_graph(tmp_path, capsys, caplog):
    """The legacy exporter fixes the sizes it traces: ``--exporter torchscript`` writes one image of
    ``--img-size`` (it asked for a dynamic batch, which the TTT mixer refuses, and always failed), says so in
    one line and checks that graph at its shape."""
    import onnx
    from helpers.train import load_script

    out = tmp_path / "plain.onnx"
    argv = ["onnx", "--model", "test_vit3_ttt", "--random-init", "--img-size", "64", "--out", str(out)]
    with caplog.at_level(logging.WARNING, logger="vit3.export"):
        assert load_script("export").main([*argv, "--exporter", "torchscript"]) == 0
    text = capsys.readouterr().out
    info = json.loads(text[text.rfind("\n{") + 1 :])  # the script's JSON comes last
    assert info["exporter"] == "torchscript" and not info["dynamic_batch"] and not info["dynamic_size"]
    assert info["max_abs_err"] < 1e-4
    dims = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [1, 3, 64, 64]
    assert "the TorchScript exporter writes a static graph: batch 1, 64x64 images only" in caplog.messages


def test_torchscript_exporter_refuses_a_dynamic_graph_in_one_line(tmp_path):
    pattern = (
        r"^exporter='torchscript' writes a static graph .* or exporter='dynamo' for a dynamic batch or size$"
    )
    with pytest.raises(ValueError, match=pattern):
        export_onnx(FeatureExtractor("test_vit3_ttt"), tmp_path / "m.onnx", 64, exporter="torchscript")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the (quick) TorchScript exporter is deprecated
def test_an_opset_the_dynamo_exporter_cannot_write_is_never_replaced(tmp_path):
    """Opset 17 (below what the dynamo exporter writes, which torch fails to convert down): a dynamic graph,
    or any from dynamo, is refused before anything runs, naming the way that works (it ended in the exporters'
    RuntimeError, a traceback from export.py); a static one is the TorchScript exporter's, which writes it."""
    import onnx

    extractor = FeatureExtractor("test_vit3_ttt")
    for kwargs in (dict(), dict(dynamic_size=False), dict(exporter="dynamo", dynamic_batch=False)):
        with pytest.raises(ConfigError, match=r"opset 17: .* writes opset 18 and up.*--exporter torchscript"):
            export_onnx(extractor, tmp_path / "dynamic.onnx", 64, opset=17, **kwargs)
    assert not (tmp_path / "dynamic.onnx").exists()
    info = export_onnx(
        extractor, tmp_path / "static.onnx", 64, opset=17, dynamic_batch=False, dynamic_size=False
    )
    assert info["exporter"] == "torchscript" and info["errors"]["dynamo"].startswith("not tried")
    assert onnx.load(tmp_path / "static.onnx").opset_import[0].version == 17


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the (quick) TorchScript exporter is deprecated
def test_check_onnx_reports_shape_mismatch(tmp_path):
    class Tiny(torch.nn.Module):
        names = ("a",)

        def forward(self, x):
            return (x[:, :1],)

    torch.onnx.export(
        Tiny(), (torch.rand(1, 3, 8, 8),), tmp_path / "t.onnx", input_names=["images"], dynamo=False
    )

    class Other(Tiny):
        def forward(self, x):
            return (x[:, :2],)

    with pytest.raises(ValueError, match="has shape"):
        check_onnx(tmp_path / "t.onnx", Other(), [torch.rand(1, 3, 8, 8)])


# ------------------------------------------------------------------------------- export cost and inputs
def test_export_time_dwconv_has_no_slices_of_symbolic_extent():
    """Under a dynamic image size every slice of the grid is a chain of shape ops in the exported graph; the
    nine shifted slices per depthwise conv made H-ViT³-T's ONNX export spend >10 min in onnxscript."""

    class Conv(torch.nn.Module):
        def forward(self, x, w):
            return shifted_dwconv(x, w), shifted_dwconv_weight_grad(x, x)

    x, w = torch.randn(2, 4, 6, 5), torch.randn(2, 4, 3, 3)
    dims = {"x": {2: torch.export.Dim.AUTO, 3: torch.export.Dim.AUTO}, "w": None}
    graph = torch.export.export(Conv(), (x, w), dynamic_shapes=dims).graph
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert not [op for op in ops if "slice" in op], ops


@pytest.mark.slow
def test_default_export_skips_onnxscripts_pattern_rewrites(tmp_path, monkeypatch):
    """The rewrite rules' matcher is the part of onnxscript's optimiser that takes minutes on larger graphs:
    by default only constant folding runs (optimize=True keeps the whole optimiser)."""
    import onnxscript.rewriter

    def refuse(*args, **kwargs):
        raise AssertionError("onnxscript's rewriter ran")

    monkeypatch.setattr(onnxscript.rewriter.RewritePass, "call", refuse)
    model = FeatureExtractor("test_h_vit3")
    info = export_onnx(model, tmp_path / "h.onnx", 64, exporter="dynamo")
    assert info["exporter"] == "dynamo" and info["optimized"] == "folded" and info["dynamic_size"]
    inputs = [torch.rand(1, 3, 64, 64), torch.rand(3, 3, 96, 128)]
    assert check_onnx(info["path"], model, inputs) < 1e-4


@pytest.mark.slow
def test_onnx_of_a_one_channel_checkpoint_takes_its_model(tmp_path, capsys):
    import onnx
    from helpers.train import load_script, make_digit_folder, tiny_cfg

    from vit3.engine import run

    data = make_digit_folder(tmp_path / "digits", digits=(0, 1), n_train=20, n_val=5)
    run(tiny_cfg(data, tmp_path / "run", "train.epochs=1"), "train")
    out = tmp_path / "f.onnx"
    args = ["onnx", "--checkpoint", str(tmp_path / "run" / "last.pt"), "--out", str(out), "--static-size"]
    assert load_script("export").main(args) == 0
    text = capsys.readouterr().out
    assert json.loads(text[text.rindex("\n{") + 1 :])["max_abs_err"] < 1e-4
    dims = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims[1:]] == [1, 32, 32]  # the checkpoint's channels and image size
