"""The 3x3 depthwise-conv op (``vit3.kernels.dwconv``, the official ViT³ second branch): its reference against
float64 finite differences, the official code's formulation and (through the mixer, ``test_mixer_official``)
the official fixtures; every fast path — the eager closed form (``vit3.kernels.dwconv.eager``, as the mixer's
eager backend runs it), the C++ path on token rows (``vit3.kernels.dwconv.cpp``, the cpu backend), the Triton
kernels (``TRITON_INTERPRET=1`` on CPU), the generic inner loop — forward and every gradient (q, k, v, weight)
against the reference; the eager path's layout contract; the C++ depthwise ops themselves and ``ConvPosEnc``
on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.common import count_calls, load_benchmark
from helpers.ops import assert_matches_reference, branch_node

import vit3.kernels.cpp as cpu_ext
from vit3.kernels.dwconv.eager import dwconv_backward
from vit3.kernels.dwconv.reference import dwconv, dwconv_ttt_ref
from vit3.layers import TTTConfig, create_inner_model, inner_loop

H = 2


def _inputs(b: int, grid: tuple[int, int], d: int, *, shared: bool = True, gain: float = 1.0):
    """A float64 qkv tensor, q, k, v as its strided views ``[B, H, N, d]``, and initial kernels
    ``[1|B, H*d, 3, 3]``."""
    n = grid[0] * grid[1]
    qkv = torch.randn(b, n, 3 * H * d, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.unflatten(-1, (H, d)).transpose(1, 2) for t in qkv.split(H * d, dim=-1))
    w = (gain * torch.randn(1 if shared else b, H * d, 3, 3, dtype=torch.float64)).requires_grad_()
    return qkv, q, k, v, w


def _model(q):
    return create_inner_model("dwconv", heads=q.shape[1], head_dim=q.shape[-1], cfg=TTTConfig())


def _generic(q, k, v, w, grid, *, scale, lr, grad_norm):
    params = inner_loop(_model(q), {"weight": w}, k, v, grid, scale=scale, lr=lr, grad_norm=grad_norm)
    return _model(q).apply_to(params, q, grid)


def _eager(q, k, v, w, grid, *, scale, lr, grad_norm):
    """The eager backend: the closed form of ``dwconv.eager`` in a one-branch mixer op."""
    hyper = {"scale": scale, "lr": lr, "grad_norm": grad_norm}
    return branch_node("dwconv", "eager", q, k, v, {"weight": w}, grid, **hyper)


def _triton(q, k, v, w, grid, *, scale, lr, grad_norm):
    from vit3.kernels import triton_ttt  # imports Triton

    params = {"weight": w}
    return triton_ttt(
        "dwconv", q, k, v, params, grid=grid, scale=scale, lr=lr, grad_norm=grad_norm, backend="triton"
    )


def _cpp(q, k, v, w, grid, *, scale, lr, grad_norm):
    """The cpu backend: the same stages on token rows in the C++ kernel's depthwise ops."""
    hyper = {"scale": scale, "lr": lr, "grad_norm": grad_norm}
    return branch_node("dwconv", "cpu", q, k, v, {"weight": w}, grid, **hyper)


PATHS = {"eager": _eager, "cpp": _cpp, "triton": _triton, "generic": _generic}
SETTINGS = {
    "norm-lr1": {"scale": 1 / 3, "lr": 1.0, "grad_norm": True},
    "no-norm-lr0.7": {"scale": 0.4, "lr": 0.7, "grad_norm": False},
}


# --------------------------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("grad_norm", [True, False], ids=["norm", "no-norm"])
def test_reference_gradients_equal_finite_differences(grad_norm):
    _, q, k, v, w = _inputs(2, (3, 4), 2)
    inputs = tuple(t.detach().clone().requires_grad_() for t in (q, k, v, w))

    def fn(*xs):
        return dwconv_ttt_ref(*xs, (3, 4), scale=0.4, lr=0.8, grad_norm=grad_norm)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8)


def test_reference_model_is_a_zero_padded_depthwise_conv():
    """The reference's inner model equals ``F.conv2d`` with groups = channels, sample by sample."""
    b, grid, d = 2, (5, 7), 3
    x = torch.randn(b, H, grid[0] * grid[1], d, dtype=torch.float64)
    w = torch.randn(b, H * d, 3, 3, dtype=torch.float64)
    maps = x.permute(0, 1, 3, 2).reshape(b, H * d, *grid)
    conv = torch.stack(
        [
            torch.nn.functional.conv2d(m[None], wb[:, None], padding=1, groups=H * d)[0]
            for m, wb in zip(maps, w)
        ]
    )
    torch.testing.assert_close(
        dwconv(x, w, grid), conv.reshape(b, H, d, -1).transpose(-2, -1), rtol=0, atol=1e-14
    )


def test_official_formulation_equals_the_reference_every_gradient():
    """The benchmarks' transcription of the official eager code (nine shifted slices, ``conv2d`` read-out) on
    maps ``[B, C, h, w]`` computes the reference's numbers: forward and every gradient, float64."""
    grid, d = (6, 8), 4
    qkv, q, k, v, w = _inputs(2, grid, d)
    official = load_benchmark("official_baseline").official_dwconv_branch

    def maps(t):  # [B, G, N, c] -> [B, G*c, h, w]
        return t.transpose(-2, -1).reshape(t.shape[0], -1, *grid)

    out = official(maps(q), maps(k), maps(v), w.reshape(-1, 1, 3, 3))  # [B, C, h, w]
    ref = dwconv_ttt_ref(q, k, v, w, grid, scale=9**-0.5, lr=1.0, grad_norm=True)
    torch.testing.assert_close(out, maps(ref), rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    got = torch.autograd.grad((out * dout).sum(), [qkv, w])
    want = torch.autograd.grad((maps(ref) * dout).sum(), [qkv, w])
    for name, g, g_ref in zip(["qkv", "weight"], got, want):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12, msg=f"gradient of {name}")


# ------------------------------------------------------------------------------- every fast path vs reference

GRIDS = {"5x7": (5, 7), "1x35": (1, 35), "6x1": (6, 1)}
CASES = [
    pytest.param(
        path, setting, grid, shared, id=f"{path}-{setting}-{grid}-{'shared' if shared else 'per-sample'}-w"
    )
    for path in PATHS
    for setting in SETTINGS
    for grid in GRIDS
    for shared in (True, False)
    if shared or path == "generic"  # the eager, C++ and Triton paths take the mixer's shared initial weights
]


@pytest.mark.parametrize(("path", "setting", "grid", "shared"), CASES)
def test_fast_path_output_and_every_gradient_match_reference(path, setting, grid, shared):
    """float64, q, k, v strided views of one qkv tensor; gradients of q, k, v and the kernels."""
    grid = GRIDS[grid]
    qkv, q, k, v, w = _inputs(2, grid, 16, shared=shared)
    hyper = SETTINGS[setting]
    out = PATHS[path](q, k, v, w, grid, **hyper)
    assert_matches_reference(out, dwconv_ttt_ref(q, k, v, w, grid, **hyper), qkv, {"weight": w})


# ---------------------------------------------------------------------------------------------- the eager
# path


def test_one_sample_depthwise_backward_stays_channels_last_and_matches_nchw():
    """A one-sample map keeps its layout: reshaping it would lose channels-last (and cost two NCHW copies)."""
    c, (h, w) = 6, (5, 7)
    grad_out, x = (torch.randn(1, c, h, w, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(1, c, 3, 3, dtype=torch.float64)
    cl = [t.contiguous(memory_format=torch.channels_last) for t in (grad_out, x)]
    gx, gw = dwconv_backward(*cl, weight)
    assert gx.is_contiguous(memory_format=torch.channels_last)
    gx_ref, gw_ref = dwconv_backward(grad_out, x, weight)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------- the C++ path's depthwise ops


@pytest.mark.parametrize(
    "grid",
    [(5, 7), (1, 6), (4, 1), (3, 19), (2, 16)],
    ids=["5x7", "one-row", "one-column", "column-blocks-and-tail", "whole-column-blocks"],
)
@pytest.mark.parametrize("channels", [8, 12], ids=["whole-vectors", "vector-tail"])
def test_depthwise_ops_match_torch_conv_on_strided_token_rows(grid, channels):
    """``dwconv`` (per-sample or shared taps) and ``dwconv_weight_grad`` against float64 ``F.conv2d`` and its
    weight gradient, reading and writing [B, N, C] views strided across a wider tensor."""
    ops, _ = cpu_ext.load()
    b, (h, w), c = 3, grid, channels
    wide = torch.randn(b, h * w, 3 * c, dtype=torch.float64)
    x, g = wide[..., :c], wide[..., c : 2 * c]  # [B, N, C] views with row stride 3C

    def maps(t):  # [B, N, C] -> [B, C, h, w]
        return t.transpose(1, 2).unflatten(-1, (h, w))

    for shared in (False, True):
        weight = torch.randn(1 if shared else b, c, 3, 3, dtype=torch.float64)
        taps = weight.flatten(2).transpose(1, 2).contiguous()  # [B|1, 9, C]
        dest = torch.zeros(b, h * w, 2 * c, dtype=torch.float64)[..., :c]
        ops.dwconv(x, taps, dest, h, w)
        want = torch.cat(
            [
                F.conv2d(maps(x)[i : i + 1], weight[0 if shared else i, :, None], padding=1, groups=c)
                for i in range(b)
            ]
        )
        torch.testing.assert_close(maps(dest), want, rtol=1e-12, atol=1e-12)
        if shared:  # a conv weight [C, 1, 3, 3] as it is gives the same as its taps
            dest.zero_()
            ops.dwconv(x, weight[0, :, None].contiguous(), dest, h, w)
            torch.testing.assert_close(maps(dest), want, rtol=1e-12, atol=1e-12)
    xs = maps(x).clone().requires_grad_()
    per_sample = torch.zeros(b, c, 3, 3, dtype=torch.float64, requires_grad=True)
    out = torch.cat([F.conv2d(xs[i : i + 1], per_sample[i, :, None], padding=1, groups=c) for i in range(b)])
    (want,) = torch.autograd.grad(out, per_sample, maps(g))
    got = torch.empty(b, 9, c, dtype=torch.float64)
    ops.dwconv_weight_grad(g, x, got, h, w)
    torch.testing.assert_close(got.transpose(1, 2).unflatten(-1, (3, 3)), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="does not fit N"):
        ops.dwconv(x, taps, dest, h + 1, w)
    with pytest.raises(RuntimeError, match=r"taps must be \[1\|B, 9, C\] or a weight \[C, 1, 3, 3\]"):
        ops.dwconv(x, torch.randn(c + 1, 1, 3, 3, dtype=torch.float64), dest, h, w)


def test_fused_step_ops_reject_a_weight_of_another_shape_by_name():
    ops, _ = cpu_ext.load()
    q = torch.randn(2, 12, 8)
    with pytest.raises(RuntimeError, match=r"depthwise weight must be \[1\|B, C, 3, 3\] = \[1\|2, 8, 3, 3\]"):
        ops.dwconv_ttt_forward(q, q, q, torch.randn(1, 9, 8), torch.empty_like(q), 3, 4, 0.1, 1.0, True)
    with pytest.raises(RuntimeError, match="does not fit N"):
        ops.dwconv_ttt_forward(q, q, q, torch.randn(1, 8, 3, 3), torch.empty_like(q), 3, 3, 0.1, 1.0, True)


@pytest.mark.parametrize("batch", [1, 3])
def test_conv_pos_enc_on_the_kernel_matches_onednn_every_gradient(monkeypatch, batch):
    """ConvPosEnc (x + dwconv(x) + bias, shared weights) takes the kernel's depthwise op on CPU float64 and
    gives the oneDNN convolution's output and gradients; VIT3_TTT_BACKEND=generic keeps oneDNN."""
    from vit3.layers.blocks import ConvPosEnc

    kernel = count_calls(monkeypatch, torch.ops.vit3_cpu, "cpe")
    torch.manual_seed(2)
    cpe = ConvPosEnc(12).double()
    x = torch.randn(batch, 5, 7, 12, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(batch, 5, 7, 12, dtype=torch.float64)
    leaves = [x, cpe.weight, cpe.bias]
    got = [out := cpe(x), *torch.autograd.grad((out * dout).sum(), leaves)]
    assert kernel["n"] == 1 and "CpeFunction" in out.grad_fn.name()
    monkeypatch.setenv("VIT3_TTT_BACKEND", "generic")
    want = [ref := cpe(x), *torch.autograd.grad((ref * dout).sum(), leaves)]
    assert kernel["n"] == 1
    for name, a, b in zip(["out", "x", "weight", "bias"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_conv_pos_enc_builds_its_autograd_node_only_where_a_gradient_is_wanted(monkeypatch):
    """Under no_grad the kernel's op (``vit3_cpu::cpe``) runs without its C++ node, with the same output; a
    trainable bias alone still gets the node (and its gradient)."""
    from vit3.layers import blocks

    op = count_calls(monkeypatch, torch.ops.vit3_cpu, "cpe")
    torch.manual_seed(4)
    cpe = blocks.ConvPosEnc(20).double()
    x = torch.randn(2, 3, 11, 20, dtype=torch.float64)
    with torch.no_grad():
        got = cpe(x)
    assert op["n"] == 1 and got.grad_fn is None
    want = x + F.conv2d(x.permute(0, 3, 1, 2), cpe.weight, cpe.bias, padding=1, groups=20).permute(0, 2, 3, 1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    cpe.weight.requires_grad_(False)  # only the bias trains: the node must still be built
    out = cpe(x)
    assert "CpeFunction" in out.grad_fn.name()
    (dbias,) = torch.autograd.grad(out.sum(), cpe.bias)
    torch.testing.assert_close(dbias, torch.full_like(dbias, x[..., 0].numel()), rtol=1e-12, atol=1e-12)


def test_the_cpe_node_is_once_differentiable():
    """A backward with ``create_graph=True`` through ``vit3_cpu::cpe`` gives the first gradients;
    differentiating them again raises and names the node."""
    from vit3.layers.blocks import ConvPosEnc

    cpe = ConvPosEnc(8).double()
    x = torch.randn(1, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(cpe(x).square().sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(cpe(x).square().sum(), x)
    torch.testing.assert_close(g, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"vit3_cpu\.cpe .* once differentiable"):
        g.sum().backward()


@pytest.mark.parametrize("backend", ["eager", "generic", "cpu"])
def test_the_depthwise_steps_of_a_block_follow_its_ttt_config_backend(monkeypatch, backend):
    """TTTConfig.backend wins over $VIT3_TTT_BACKEND for the whole block, as for its mixer: the CPE in front
    of a ViT³ / DiT³ block and the depthwise step of an H-ViT³ ConvFFN take the C++ kernel under cpu (and
    auto) only."""
    from vit3.layers import blocks
    from vit3.models.dit3 import DiT3Block

    monkeypatch.setenv("VIT3_TTT_BACKEND", "auto")
    plain = count_calls(monkeypatch, torch.ops.vit3_cpu, "cpe")
    cfg = {"backend": backend}
    block = blocks.TTTBlock(16, 2, ttt_cfg=cfg, mlp_layer=blocks.ConvFFN).double().eval()
    steps = [block.cpe, block.mlp.dwc, DiT3Block(16, 2, ttt_cfg=cfg).cpe.double()]
    with torch.no_grad():
        for step in steps:
            step(torch.randn(1, 4, 4, step.in_channels, dtype=torch.float64))
    assert [step.backend for step in steps] == [backend] * 3
    assert plain["n"] == (3 if backend == "cpu" else 0)
