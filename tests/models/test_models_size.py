"""The registered models are the paper's: parameter counts (within 0.1%), fvcore FLOPs at 224² (within 1%),
and half of ``FlopCounterMode``'s count (2 FLOPs per multiply-add) of the tiny ones on their eager paths."""

from __future__ import annotations

import pytest
import timm
import torch

import vit3  # noqa: F401 - registers the models

# (model, params in millions, GFLOPs at 224x224): the paper's table and the official README
PAPER = [
    pytest.param("vit3_tiny", 6.15, 1.22, id="vit3_tiny"),
    pytest.param("vit3_small", 23.80, 4.82, id="vit3_small"),
    pytest.param("vit3_base", 90.06, 17.96, id="vit3_base"),
    pytest.param("h_vit3_tiny", 28.70, 4.92, id="h_vit3_tiny"),
    pytest.param("h_vit3_small", 54.36, 8.76, id="h_vit3_small"),
    pytest.param("h_vit3_base", 94.37, 16.72, id="h_vit3_base"),
]


@pytest.mark.parametrize(("name", "params_m", "gflops"), PAPER)
def test_parameter_count_matches_paper(name, params_m, gflops):
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = timm.create_model(name)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert count == pytest.approx(params_m, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "params_m", "gflops"), PAPER)
def test_fvcore_flops_match_paper(name, params_m, gflops):
    from fvcore.nn import FlopCountAnalysis

    model = timm.create_model(name).eval()
    with torch.no_grad():
        analysis = FlopCountAnalysis(model, torch.randn(1, 3, 224, 224))
        analysis.unsupported_ops_warnings(False)
        analysis.uncalled_modules_warnings(False)
        total = analysis.total() / 1e9
    assert total == pytest.approx(gflops, rel=1e-2)
    ops = analysis.by_operator()
    # Under tracing the mixer runs its plain ops, so fvcore sees (and counts) every inner-loop matmul.
    assert ops.get("matmul", 0) > 0, "the inner-loop matmuls are counted"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "params_m", "gflops"), [p for p in PAPER if p.id.endswith("_tiny")])
def test_flop_counter_matches_paper(name, params_m, gflops):
    """``torch.utils.flop_counter.FlopCounterMode`` on the eager model (the C++ ops on CPU, counted by their
    formulas, ``vit3.kernels.flops``) counts 2 FLOPs per multiply-add: half its count is the paper's figure,
    which is fvcore's (1 per multiply-add)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = timm.create_model(name).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, 224, 224))
    assert counter.get_total_flops() / 2e9 == pytest.approx(gflops, rel=1e-2)
