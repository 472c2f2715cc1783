"""The ViT³ block's memory-lean training backward (``TTTConfig.recompute`` other than ``"never"``):
``LeanMlp`` (the MLP's GELU output recomputed) and the CPE output recomputed (one node with the
first norm on the C++ kernel, checkpointed elsewhere) give the saving variant's numbers, forward and every
gradient, and save per token what docs/mixer.md's table states."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers.common import count_calls, saved_values
from timm.layers import Mlp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import vit3.layers.blocks as blocks
from vit3.layers.blocks import ConvPosEnc, LeanMlp, TTTBlock
from vit3.layers.embed import ConvDownsample, ConvStem

C = 12


def _grads(out: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return list(torch.autograd.grad((out * torch.randn_like(out)).sum(), leaves))


def _per_token(fn, tokens: tuple[int, int] = (20, 40)) -> float:
    """Values saved per token: the slope of ``saved_values(fn(n))`` between two token counts."""
    a, b = (saved_values(lambda n=n: fn(n)) for n in tokens)
    return (b - a) / (tokens[1] - tokens[0])


# The lean MLP's two nodes, by the backend that picks them on CPU tensors: the C++ node and the Python node.
LEAN_NODES = [pytest.param("cpu", "LeanMlpFunction", id="cpp-node"),
              pytest.param("generic", "_LeanMlpFnBackward", id="python-node")]  # fmt: skip


@pytest.mark.parametrize(("backend", "node"), LEAN_NODES)
@pytest.mark.parametrize("approx", ["none", "tanh"], ids=["gelu", "gelu-tanh"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("norm", [True, False], ids=["layernorm", "no-norm"])
def test_lean_mlp_matches_norm_then_mlp_every_gradient(monkeypatch, approx, bias, norm, backend, node):
    monkeypatch.setenv("VIT3_TTT_BACKEND", backend)
    torch.manual_seed(0)
    mlp = LeanMlp(C, 4 * C, bias=bias, act_layer=partial(nn.GELU, approximate=approx)).double()
    ln = nn.LayerNorm(C, eps=1e-6).double() if norm else None
    if ln is not None:
        with torch.no_grad():
            ln.weight.normal_(), ln.bias.normal_()
    x = torch.randn(
        2, 3, 5, C, dtype=torch.float64, requires_grad=True
    )  # a channels-last map, as in the block
    leaves = [x, *mlp.parameters(), *(ln.parameters() if ln is not None else [])]
    got = mlp(x, norm=ln)
    assert node in got.grad_fn.name()  # C++ nodes read "torch::autograd::CppNode<...LeanMlpFunction>"
    want = Mlp.forward(mlp, ln(x) if ln is not None else x)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    for name, g, g_ref in zip(["x", "mlp", "norm"], _grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-12, msg=f"gradient of {name}")


@pytest.mark.parametrize(("backend", "node"), LEAN_NODES)
def test_lean_mlp_saves_all_but_the_gelu_output(monkeypatch, backend, node):
    """Per token: x (C), the norm's output (C), fc1's output (4C) and the LayerNorm statistics (2), where
    autograd through LayerNorm + Mlp keeps the GELU output (4C) too."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", backend)
    mlp, ln = LeanMlp(C, 4 * C).double(), nn.LayerNorm(C).double()

    def run(n: int, lean: bool):
        x = torch.randn(n, C, dtype=torch.float64, requires_grad=True)
        return mlp(x, norm=ln) if lean else Mlp.forward(mlp, ln(x))

    assert _per_token(partial(run, lean=True)) == 6 * C + 2
    assert _per_token(partial(run, lean=False)) == 10 * C + 2


class _Casts(TorchDispatchMode):
    """The ATen ops dispatched under it by name, and the casts as ``(from dtype, to dtype)``."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.casts: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(func._schema.name)
        if func._schema.name == "aten::_to_copy":
            self.casts.append((args[0].dtype, out.dtype))
        return out


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_lean_mlp_under_autocast_keeps_what_its_layers_read(amp, x_dtype):
    """Under autocast the Python node's output and every gradient are autograd's through LayerNorm + Mlp, bit
    for bit, and its backward neither reruns the norm nor casts anything to 16 bits again (the norm's output
    and the weights are kept as fc1 and fc2 read them): no float32 tensor is cast, only gradients back to
    their tensors' dtypes."""
    torch.manual_seed(0)
    mlp, ln = LeanMlp(C, 4 * C), nn.LayerNorm(C)
    x = torch.randn(2, 5, C).to(x_dtype)
    results = []
    for lean in (True, False):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=amp):
            out = mlp(leaf, norm=ln) if lean else Mlp.forward(mlp, ln(leaf))
        with _Casts() as seen:
            grads = torch.autograd.grad(out, [leaf, *mlp.parameters(), *ln.parameters()], out.detach())
        results.append([out, *grads])
        if lean:
            assert "_LeanMlpFnBackward" in out.grad_fn.name()
            assert "aten::native_layer_norm" not in seen.names
            assert all(source != torch.float32 for source, _ in seen.casts), seen.casts
    for got, want in zip(*results):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_lean_mlp_steps_aside_where_it_does_not_apply(monkeypatch):
    """The saving variant (``Mlp.forward``) under recompute="never", without gradients, with dropout in
    training and with another activation."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", "generic")  # the Python node, whose calls are counted
    lean_calls = count_calls(monkeypatch, blocks._LeanMlpFn, "apply")
    x = torch.randn(4, C, requires_grad=True)
    LeanMlp(C, 4 * C, recompute="never")(x)
    with torch.no_grad():
        LeanMlp(C, 4 * C)(x)
    LeanMlp(C, 4 * C, drop=0.1).train()(x)
    LeanMlp(C, 4 * C, act_layer=nn.SiLU)(x)
    monkeypatch.setenv("VIT3_TTT_RECOMPUTE", "never")
    LeanMlp(C, 4 * C)(x)
    assert lean_calls["n"] == 0
    monkeypatch.setenv("VIT3_TTT_RECOMPUTE", "always")
    LeanMlp(C, 4 * C, drop=0.1).eval()(x)  # dropout is off in eval
    assert lean_calls["n"] == 1


def _node_names(node, seen: set | None = None) -> set[str]:
    """The names of every autograd node reachable from ``node``."""
    seen = set() if seen is None else seen
    if node is None or node in seen:
        return set()
    seen.add(node)
    names = {node.name()}
    for parent, _ in node.next_functions:
        names |= _node_names(parent, seen)
    return names


def _block(recompute: str) -> TTTBlock:
    torch.manual_seed(4)
    block = TTTBlock(32, 4, ttt_cfg={"recompute": recompute}).double()
    with torch.no_grad():  # a non-trivial CPE and norms
        for p in (block.cpe.weight, block.cpe.bias, block.norm1.weight, block.norm2.bias):
            p.normal_()
    return block


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_lean_block_matches_the_saving_block_every_gradient(monkeypatch, backend):
    """On ``cpu`` the CPE and first norm form one C++ node (``vit3_cpu::cpe_norm``), and the MLP is the lean
    MLP's C++ node; elsewhere they are checkpointed and the MLP is the Python node."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", backend)
    lean, saving = _block("always"), _block("never")
    x = torch.randn(2, 5, 8, 32, dtype=torch.float64, requires_grad=True)
    got, want = lean(x), saving(x)
    nodes = " ".join(_node_names(got.grad_fn))
    assert ("CpeNormFunction" in nodes, "LeanMlpFunction" in nodes) == (backend == "cpu",) * 2, nodes
    assert ("_LeanMlpFnBackward" in nodes) == (backend != "cpu"), nodes
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_lean = _grads(got, [x, *lean.parameters()])
    g_saving = _grads(want, [x, *saving.parameters()])
    names = ["x", *(name for name, _ in lean.named_parameters())]
    for name, g, g_ref in zip(names, g_lean, g_saving):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-11, msg=f"gradient of {name}")


def test_lean_block_saves_what_the_readme_table_states(monkeypatch):
    """Per token of a ViT³ block (C = 32, 4 SwiGLU heads of 8 plus a depthwise head of 8: W = 40, MLP 128):
    the saving variant keeps the CPE input, the norms' inputs and statistics, the qkv input, q, k, v and Z, Y
    of the mixer, the projection input and the MLP's fc1 input, fc1 output and GELU output; the lean one drops
    the CPE output (the first norm's input, recomputed; its statistics are kept), Z, Y and the GELU output."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", "cpu")
    dim, width, hidden = 32, 40, 128

    def run(n: int, recompute: str):
        x = torch.randn(1, 1, n, dim, dtype=torch.float64, requires_grad=True)
        return _block(recompute)(x)

    lean = (
        dim + 2 + dim + 3 * width + width + dim + 2 + dim + hidden
    )  # CPE in, LN1 stats, qkv in, q k v, proj in, LN2 in + stats, LN2 out, h
    assert _per_token(partial(run, recompute="always")) == lean
    dropped = dim + 4 * 32 + hidden  # CPE out, Z and Y, GELU out
    assert _per_token(partial(run, recompute="never")) == lean + dropped


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_auto_recomputes_the_cpe_output_where_one_cpp_node_does(monkeypatch, backend):
    """``auto`` drops the CPE output where the C++ node recomputes it (one op); elsewhere (a GPU, a backend
    without the C++ kernel) a checkpoint's rerun would cost more host ops than the C++ node's, so ``auto``
    keeps it (C + 2 values per token, with the norm's statistics) and only ``always`` checkpoints."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", backend)
    dim = 32

    def run(n: int, recompute: str):
        x = torch.randn(1, 1, n, dim, dtype=torch.float64, requires_grad=True)
        return _block(recompute)(x)

    always = _per_token(partial(run, recompute="always"))
    kept = 0 if backend == "cpu" else dim + 2  # the CPE output, the first norm's statistics
    assert _per_token(partial(run, recompute="auto")) == always + kept


def test_the_cpp_block_nodes_are_once_differentiable(monkeypatch):
    """A backward with ``create_graph=True`` through the C++ nodes (the CPE + norm, the lean MLP) gives the
    first gradients; differentiating those again raises and names the node, as the Python nodes'
    ``once_differentiable``."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", "cpu")
    block = _block("always")
    x = torch.randn(1, 3, 4, 32, dtype=torch.float64, requires_grad=True)
    t = x.detach().clone().requires_grad_()  # the MLP's own input, so that only its node is on the path
    cases = ((x, block._cpe_norm(x)[1], "vit3_cpu.cpe_norm"),
             (t, block.mlp(t, norm=block.norm2), "vit3_cpu.lean_mlp"))  # fmt: skip
    for leaf, out, name in cases:
        (g,) = torch.autograd.grad(out.square().sum(), leaf, create_graph=True)
        (want,) = torch.autograd.grad(out.square().sum(), leaf, retain_graph=True)
        torch.testing.assert_close(g, want, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match=f"{name} .* once differentiable"):
            g.sum().backward()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_without_gradients_the_block_runs_its_cpe_norm_and_mlp_as_one_op_each(mode):
    """On CPU tensors a block without gradients calls ``vit3_cpu::cpe_norm`` once (the CPE and first norm) and
    ``vit3_cpu::lean_mlp`` once (the second norm and the MLP), and computes the same bits as its layers called
    one by one (the CPE on its kernel, the norm, the mixer, the norm, ``Mlp``)."""
    block = _block("always").float().eval()
    x = torch.randn(2, 5, 8, 32)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context(), _OpCounter() as ops:
        got = block(x)
    assert ops.count("vit3_cpu.cpe_norm") == 1 and ops.count("vit3_cpu.lean_mlp") == 1, ops.names
    assert ops.count("vit3_cpu.dwconv") == 0 and ops.count("aten.gelu") == 0, ops.names
    with context():
        t = block.cpe(x)
        y = block.attn(block.norm1(t).reshape(2, 40, 32), grid=(5, 8)).reshape(2, 5, 8, 32)
        want = t + y
        want = want + Mlp.forward(block.mlp, block.norm2(want))
    assert torch.equal(got, want)


class _OpCounter(TorchDispatchMode):
    """The ops dispatched under it, by ``namespace.name``."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(f"{func.namespace}.{func._opname}")
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return self.names.count(name)


def _conv_ffn(hidden: int = 4 * C, **kwargs) -> blocks.ConvFFN:
    torch.manual_seed(0)
    ffn = blocks.ConvFFN(C, hidden, **kwargs).double()
    with torch.no_grad():
        ffn.dwc.weight.normal_(), ffn.dwc.bias.normal_()
    return ffn


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_lean_conv_ffn_matches_the_layers_every_gradient(monkeypatch, backend):
    """The lean ConvFFN (x and fc1(x) saved, act -> dwconv -> act recomputed) gives autograd's numbers through
    the layers, on the C++ depthwise node and on PyTorch's convolution."""
    monkeypatch.setenv("VIT3_TTT_BACKEND", backend)
    ffn = _conv_ffn()
    x = torch.randn(2, 5, 6, C, dtype=torch.float64, requires_grad=True)
    leaves = [x, *ffn.parameters()]
    got = ffn(x)
    assert "_LeanConvFfnFn" in got.grad_fn.name()
    want = ffn.fc2(ffn.middle(ffn.fc1(x)))
    assert "_LeanConvFfnFn" not in want.grad_fn.name()
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    names = ["x", *(n for n, _ in ffn.named_parameters())]
    for name, g, g_ref in zip(names, _grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-12, msg=f"gradient of {name}")


def test_lean_conv_ffn_saves_x_and_the_hidden_pre_activation_only():
    """Per token: C (x) + hidden (fc1(x)) values, where autograd through the layers keeps the hidden map
    about five times; recompute="never" keeps autograd's saving."""
    hidden = 4 * C

    def run(ffn):
        return lambda n: ffn(torch.randn(1, 2, n // 2, C, dtype=torch.float64, requires_grad=True))

    lean = _per_token(run(_conv_ffn(hidden)))
    plain = _per_token(run(_conv_ffn(hidden, recompute="never")))
    assert lean == C + hidden
    assert plain >= 4 * hidden


def test_lean_conv_ffn_steps_aside_for_dropout_hooks_and_tracing():
    ffn = _conv_ffn(drop=0.1).train()
    x = torch.randn(1, 4, 4, C, dtype=torch.float64, requires_grad=True)
    assert "_LeanConvFfnFn" not in ffn(x).grad_fn.name()
    ffn = _conv_ffn()
    handle = ffn.fc2.register_forward_hook(lambda *_: None)
    assert "_LeanConvFfnFn" not in ffn(x).grad_fn.name()
    handle.remove()
    assert "_LeanConvFfnFn" in ffn(x).grad_fn.name()
    traced = torch.jit.trace(ffn, x.detach())
    torch.testing.assert_close(traced(x.detach()), ffn(x).detach(), rtol=1e-13, atol=1e-13)


def _stacks(recompute: str) -> list[nn.Module]:
    """The H-ViT³ stem and a downsampling, float64, in training, their weights from one seed."""
    torch.manual_seed(0)
    stacks = [ConvStem(3, 16, recompute=recompute), ConvDownsample(8, 16, recompute=recompute)]
    return [s.double().train() for s in stacks]


def _stack_step(stack: nn.Module, seed: int = 1) -> list[torch.Tensor]:
    """Output, every gradient and every buffer after one training step of ``stack`` (BatchNorm updates)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, stack[0].conv.in_channels, 16, 12)
    x = torch.randn(shape, dtype=torch.float64, generator=g, requires_grad=True)
    out = stack(x)
    (out * torch.randn(out.shape, dtype=torch.float64, generator=g)).sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in stack.parameters()), *stack.buffers()]


@pytest.mark.parametrize("index", [0, 1], ids=["stem", "downsample"])
def test_recomputed_stem_and_downsampling_match_the_layers_bitwise(index):
    """The rerun in the backward gives autograd's own gradients, and leaves BatchNorm's running statistics
    and batch count as one plain step does (not updated twice)."""
    lean, plain = _stacks("auto")[index], _stacks("never")[index]
    got, want = _stack_step(lean), _stack_step(plain)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i} differs"
    assert all(int(t) == 1 for t in lean.buffers() if t.dtype == torch.long)


@pytest.mark.parametrize("index", [0, 1], ids=["stem", "downsample"])
def test_recomputed_stem_and_downsampling_save_only_their_input(index):
    lean, plain = _stacks("auto")[index], _stacks("never")[index]
    x = torch.randn(2, lean[0].conv.in_channels, 16, 16, dtype=torch.float64, requires_grad=True)
    assert saved_values(lambda: lean(x)) == x.numel()
    assert saved_values(lambda: plain(x)) > 8 * x.numel()


def test_recomputed_stack_steps_aside_for_hooks_on_its_layers_and_no_grad():
    stem = _stacks("auto")[0]
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64, requires_grad=True)
    assert saved_values(lambda: stem(x)) == x.numel()
    calls = []
    handle = stem[1].register_forward_hook(lambda *_: calls.append(1))
    assert saved_values(lambda: stem(x)) > x.numel()
    stem(x).sum().backward()
    assert len(calls) == 2  # once per forward above: no rerun in the backward
    handle.remove()
    own = stem.register_forward_hook(lambda *_: calls.append(1))
    assert saved_values(lambda: stem(x)) == x.numel()  # a hook on the stack itself runs once either way
    own.remove()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_cpe_copies_its_map_to_nchw_on_cpus_only(device):
    """A CPU's depthwise kernels want NCHW-contiguous input (one copy); elsewhere (``meta`` stands in for a
    GPU: the rule reads the device type) the convolution takes the channels-last view as it is."""
    cpe = ConvPosEnc(8, backend="generic").to(device)
    x = torch.randn(2, 5, 6, 8, device=device)
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Ops():
        y = cpe(x)
    assert ops.count("aten::clone") == (device == "cpu"), ops
    assert y.shape == x.shape and y.stride() == x.stride()
    if device == "cpu":
        nchw = cpe._conv_forward(x.permute(0, 3, 1, 2), cpe.weight, cpe.bias).permute(0, 2, 3, 1)
        torch.testing.assert_close(y, x + nchw, rtol=1e-6, atol=1e-6)
