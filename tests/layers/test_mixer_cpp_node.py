"""The whole-mixer C++ op (``torch.ops.vit3_cpu.mix``, ``kernels/mix/csrc/mix.cpp``): settled mixer calls
whose branches all run the C++ CPU kernel take it, one C++ autograd node. It computes what the Python node
(``vit3.layers.fused_mix``, the same C++ call) computes, forward and every gradient, and what the mixer
defines (the float64 reference; against each branch's own hooks: ``test_mixer_op_cpu.py``); its RoPE is
``apply_rope_2d`` bit for bit; it honours no-grad, autocast, saved-tensor hooks, checkpointing and the
once-differentiable contract, and sees parameters replaced after its route was made. ``mix`` reaches it by a
short path (``vit3.layers.mixer_calls.Calls``) that steps aside wherever the settled call's key, weights or
the absence of tracing no longer hold."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from helpers.backends import SHORT_PATH_CHANGES, changed_call, changed_twin, fresh_twin, make_mixer, mix_short
from helpers.common import OpNames, count_calls
from helpers.reference import assert_mixer_matches_reference
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import vit3.layers.ttt as ttt
from vit3.kernels import OPS
from vit3.kernels.cpp import load
from vit3.kernels.swiglu import cpp as swiglu_cpp
from vit3.layers import TTTMixer, backends
from vit3.layers.fused_mix import mix_layout
from vit3.layers.rope import apply_rope_2d

GRID = (5, 7)
NODE = "MixFunction"  # the C++ node's name in autograd graphs (CppNode<...MixFunction>)


def _ops():
    ops, why = load()
    if ops is None:
        pytest.skip(f"the C++ CPU kernel is not built here ({why})")
    return ops


def _mixer(dim: int = 32, heads: int = 4, dtype: torch.dtype = torch.float64, **cfg) -> TTTMixer:
    return make_mixer(dim, heads, dtype, gain=20.0, **cfg)


def _settle(mixer: TTTMixer, x: torch.Tensor, grid: tuple[int, int] = GRID) -> None:
    """Calls the mixer (with and without gradients) until its routes run unguarded on the C++ op."""
    _ops()
    for _ in range(8):
        mixer(x, grid).sum().backward()
        with torch.no_grad():
            mixer(x, grid)
        if mixer._calls.routes and all(c.settled and c.cpp is not None for c in mixer._calls.routes.values()):
            return
    pytest.fail(f"the mixer's calls did not settle on the C++ op: {list(mixer._calls.routes.values())}")


def _run(mixer: TTTMixer, x: torch.Tensor, dout: torch.Tensor, grid: tuple[int, int] = GRID):
    """Output, its autograd node's name and the gradients of x and every parameter."""
    out = mixer.mix(mixer.qkv(x), grid)
    grads = torch.autograd.grad((out * dout).sum(), [x, *mixer.parameters()], allow_unused=True)
    return out.detach(), out.grad_fn.name(), grads


def _python_node(mixer: TTTMixer, monkeypatch) -> None:
    """The mixer re-routes its calls on the Python node."""
    monkeypatch.setattr(ttt, "CPP_NODE", False)
    mixer._calls.clear()


def _assert_same(got, want, rtol: float, atol: float) -> None:
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(
    ("grid", "width"), [((14, 14), 64), ((5, 7), 32), ((3, 5), 12)], ids=["14x14-64", "5x7-32", "3x5-12"]
)
@pytest.mark.parametrize("inverse", [False, True], ids=["rotate", "inverse"])
def test_rope_2d_is_apply_rope_2d_bit_for_bit(dtype, grid, width, inverse):
    ops = _ops()
    torch.manual_seed(0)
    x = torch.randn(2, grid[0] * grid[1], 3 * width, dtype=dtype)[..., width : 2 * width]  # a strided view
    assert torch.equal(
        ops.rope_2d(x, *grid, 10000.0, inverse), apply_rope_2d(x, grid, 10000.0, inverse=inverse)
    )


CONFIGS = {
    "official": {},
    "official-rope": {"rope": True},
    "no-norm-lr": {"grad_norm": False, "inner_lr": 0.3, "rope": True},
    "swiglu-only": {"branches": ("swiglu",), "rope": True},
    "dwconv-only": {"branches": ("dwconv",)},
    "two-swiglu": {"branches": ("swiglu:2", "swiglu:1", "dwconv:1"), "rope": True},
    "saving-z-y": {"recompute": "never", "rope": True},
    "recompute-qkv": {"recompute": "qkv", "rope": True},
}


@pytest.mark.parametrize("batch", [1, 3], ids=["batch1", "batch3"])
@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_cpp_node_matches_the_python_node_and_the_reference(monkeypatch, cfg, batch):
    mixer = _mixer(**cfg)
    x = torch.randn(batch, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(batch, GRID[0] * GRID[1], sum(mixer.widths), dtype=torch.float64)
    _settle(mixer, x)
    out, node, grads = _run(mixer, x, dout)
    assert NODE in node
    assert_mixer_matches_reference(mixer, x, GRID)  # the mixer's definition (float64 autograd), 1e-10
    _python_node(mixer, monkeypatch)
    ref, ref_node, ref_grads = _run(mixer, x, dout)
    assert NODE not in ref_node
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    _assert_same(grads, ref_grads, rtol=1e-12, atol=1e-14)


def test_cpp_node_matches_the_python_node_in_float32(monkeypatch):
    mixer = _mixer(dtype=torch.float32, rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, requires_grad=True)
    dout = torch.randn(2, GRID[0] * GRID[1], sum(mixer.widths))
    _settle(mixer, x)
    out, node, grads = _run(mixer, x, dout)
    assert NODE in node
    _python_node(mixer, monkeypatch)
    ref, _, ref_grads = _run(mixer, x, dout)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    _assert_same(grads, ref_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_without_gradients_the_op_saves_nothing_and_gives_the_same_output(mode):
    mixer = _mixer(rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    _settle(mixer, x)
    want = mixer(x, GRID).detach()
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context, OpNames() as seen:
        out = mixer(x.detach(), GRID)
    assert "vit3_cpu.mix_forward.default" in seen.names or "vit3_cpu.mix.default" in seen.names
    assert out.grad_fn is None
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_under_cpu_autocast_the_mixer_gives_what_the_python_node_gives(monkeypatch):
    mixer = _mixer(dtype=torch.float32, rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, requires_grad=True)
    _settle(mixer, x)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mixer(x, GRID)
            mixed = mixer.mix(mixer.qkv(x).float(), GRID)  # float32 qkv under autocast: the C++ op
        grads = torch.autograd.grad(out.float().sum() + mixed.sum(), [x, *mixer.parameters()])
        return out.detach(), mixed.detach(), mixed.grad_fn, grads

    for _ in range(4):  # the bf16 key's routes settle too
        out, mixed, _, grads = run()
    _python_node(mixer, monkeypatch)
    for _ in range(4):
        ref, ref_mixed, _, ref_grads = run()
    assert out.dtype == torch.bfloat16 and mixed.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(mixed, ref_mixed, rtol=1e-6, atol=1e-7)
    _assert_same(grads, ref_grads, rtol=1e-5, atol=1e-5)


def test_saved_tensor_hooks_see_the_node_and_checkpointing_gives_the_same_gradients():
    mixer = _mixer(rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    _settle(mixer, x)
    params = [x, *mixer.parameters()]
    plain = torch.autograd.grad(mixer(x, GRID).square().sum(), params)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.clone()  # the node must unpack what the hook hands back

    qkv = mixer.qkv(x)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mixer.mix(qkv, GRID)
    # per branch its step statistics, then qkv and the weights
    assert NODE in out.grad_fn.name() and len(packed) >= 6
    hooked = torch.autograd.grad(mixer.proj(out).square().sum(), params)
    ckpt = checkpoint(lambda t: mixer(t, GRID), x, use_reentrant=False)
    got = torch.autograd.grad(ckpt.square().sum(), params)
    for g, h, g_ref in zip(got, hooked, plain):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(h, g_ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_a_rope_branch_on_the_op_saves_what_one_without_rope_saves(recompute):
    """The C++ op rotates a RoPE branch's q, k again in its backward instead of saving them: a settled call
    saves the same tensors with and without RoPE, under either recompute setting."""
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    saved = {}
    for rope in (False, True):
        torch.manual_seed(0)
        mixer = _mixer(rope=rope, recompute=recompute)
        _settle(mixer, x)
        packed: list[torch.Size] = []
        saved[rope] = packed
        qkv = mixer.qkv(x)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, into=packed: into.append(t.shape) or t, lambda t: t
        ):
            out = mixer.mix(qkv, GRID)
        assert NODE in out.grad_fn.name()
    assert saved[True] == saved[False]


def _settled_call(monkeypatch, node: str) -> tuple[TTTMixer, torch.Tensor, torch.Tensor]:
    """A settled RoPE'd mixer's ``mix`` on the C++ op (``node="cpp"``) or the Python node: the mixer, qkv, the
    output."""
    mixer = _mixer(rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    _settle(mixer, x)
    if node == "python":
        _python_node(mixer, monkeypatch)
        for _ in range(4):
            mixer(x, GRID)
    qkv = mixer.qkv(x)
    out = mixer.mix(qkv, GRID)
    assert (NODE in out.grad_fn.name()) == (node == "cpp")
    return mixer, qkv, out


@pytest.mark.parametrize("node", ["cpp", "python"])
def test_changing_qkv_in_place_before_the_backward_raises(monkeypatch, node):
    _, qkv, out = _settled_call(monkeypatch, node)
    out.sum().backward(retain_graph=True)
    with torch.no_grad():
        qkv.add_(1)
    # both nodes save qkv itself, and its version
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation|modified inplace"):
        out.sum().backward()


@pytest.mark.parametrize("node", ["cpp", "python"])
def test_a_second_backward_raises_as_the_python_node_does(monkeypatch, node):
    mixer, qkv, out = _settled_call(monkeypatch, node)
    (dqkv,) = torch.autograd.grad(out.square().sum(), qkv, create_graph=True)  # first order: fine
    plain = torch.autograd.grad(mixer.mix(qkv, GRID).square().sum(), qkv)[0]
    torch.testing.assert_close(dqkv.detach(), plain, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"once.differentiable"):
        dqkv.sum().backward()


def test_parameters_changed_after_routing_are_seen():
    mixer = _mixer(rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    _settle(mixer, x)
    fresh = _mixer(rope=True)
    torch.manual_seed(5)
    new = {k: torch.randn_like(v) * 0.1 for k, v in fresh.state_dict().items()}
    fresh.load_state_dict(new)
    mixer.load_state_dict(new)  # in place
    torch.testing.assert_close(mixer(x, GRID), fresh(x, GRID), rtol=0, atol=0)
    # replaced objects: a new Parameter (assignment), a converted module (.to)
    mixer.inner[0].w1 = nn.Parameter(fresh.inner[0].w1.detach() * 2)
    with torch.no_grad():
        fresh.inner[0].w1.mul_(2)
    torch.testing.assert_close(mixer(x, GRID), fresh(x, GRID), rtol=0, atol=0)
    mixer.float().double()
    torch.testing.assert_close(mixer(x, GRID), fresh.float().double()(x, GRID), rtol=0, atol=0)
    # requires_grad switched off: the node serves the qkv gradient alone, the same
    qkv = mixer.qkv(x).detach().requires_grad_()
    (want,) = torch.autograd.grad(mixer.mix(qkv, GRID).sum(), qkv)
    for p in mixer.inner.parameters():
        p.requires_grad_(False)
    for _ in range(4):  # the key without weight gradients settles
        out = mixer.mix(qkv, GRID)
    assert NODE in out.grad_fn.name()
    torch.testing.assert_close(torch.autograd.grad(out.sum(), qkv)[0], want, rtol=0, atol=0)


class _Double(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def test_a_parametrization_added_after_routing_is_seen():
    mixer = _mixer(rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    _settle(mixer, x)
    fresh = _mixer(rope=True)
    with torch.no_grad():
        fresh.inner[0].w1.mul_(2)
    parametrize.register_parametrization(mixer.inner[0], "w1", _Double())
    for _ in range(2):  # the call after the change, and the one after its re-routing
        torch.testing.assert_close(mixer(x, GRID), fresh(x, GRID), rtol=0, atol=0)


def test_bad_arguments_raise_clear_errors():
    ops = _ops()
    mixer = _mixer()
    x = torch.randn(1, GRID[0] * GRID[1], 32, dtype=torch.float64)
    _settle(mixer, x.requires_grad_())
    call = next(iter(mixer._calls.routes.values()))
    flat = [p for m in mixer.inner for p in m.initial_params().values()]
    qkv = mixer.qkv(x).detach()
    with pytest.raises(RuntimeError, match="qkv has 95 channels"):
        ops.mix(qkv[..., :95], flat, *call.cpp)
    with pytest.raises(RuntimeError, match="weights must be CPU tensors of qkv's dtype"):
        ops.mix(qkv, [w.float() for w in flat], *call.cpp)
    with pytest.raises(RuntimeError, match="does not fit N=35"):
        ops.mix(qkv, flat, call.cpp[0], 6, 6, *call.cpp[3:])


def test_an_op_without_a_branch_in_the_cpp_op_keeps_the_python_node(monkeypatch):
    """The whole-mixer C++ op serves the ops whose ``cpu`` node names their branch there (``Node.mix``): with
    SwiGLU's taken away (and with it the whole call, ``Node.whole``), a settled official mixer runs each
    branch's hooks in the Python node, with the same numbers."""
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    mixer = _mixer(rope=True)
    dout = torch.randn(2, GRID[0] * GRID[1], sum(mixer.widths), dtype=torch.float64)
    _settle(mixer, x)
    out, node, grads = _run(mixer, x, dout)
    assert NODE in node
    op = OPS["swiglu"]
    cpu = op.paths["cpu"]
    cpu = dataclasses.replace(cpu, node=cpu.node._replace(mix=None, whole=None))
    monkeypatch.setitem(OPS, "swiglu", dataclasses.replace(op, paths={**op.paths, "cpu": cpu}))
    mixer._calls.clear()
    mix_layout.cache_clear()
    hooks = count_calls(monkeypatch, swiglu_cpp.PASSES, "forward")
    for _ in range(4):  # routed again, and settled
        mixer(x, GRID)
    ref, ref_node, ref_grads = _run(mixer, x, dout)
    assert NODE not in ref_node and "FusedMix" in ref_node and hooks["n"] > 0
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    _assert_same(grads, ref_grads, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------------------------------ mix's short path


def _short_path_mixer() -> tuple[TTTMixer, torch.Tensor]:
    """A settled RoPE'd mixer (the grid then changes the numbers) and a qkv of its settled key, no
    gradients."""
    mixer = _mixer(rope=True)
    x = torch.randn(2, GRID[0] * GRID[1], 32, dtype=torch.float64, requires_grad=True)
    _settle(mixer, x)
    return mixer, mixer.qkv(x).detach()


def test_a_settled_call_takes_the_short_path_without_the_route_key(monkeypatch):
    mixer, qkv = _short_path_mixer()
    with torch.no_grad():
        want = mixer.mix(qkv, GRID)

        def refused(*args, **kwargs):
            raise AssertionError("the route key was built")

        monkeypatch.setattr(mixer, "settled_cpp_args", refused)
        monkeypatch.setattr(mixer, "_call", refused)
        with OpNames() as seen:
            out, short = mix_short(mixer, qkv, GRID)
    assert short
    # without gradients its autograd kernel steps aside: the output, then the forward writing into it
    assert seen.names == ["aten.empty.memory_format", "vit3_cpu.mix_forward.default"]
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def _change(mixer: TTTMixer, qkv: torch.Tensor, change: str) -> tuple[torch.Tensor, tuple[int, int], bool]:
    """One thing the route key (or the op's weights) holds, changed: qkv, grid and grad mode of the next
    call (``changed_call``, and two of this path's own)."""
    if change == "grad-mode":  # only the short path of calls without gradients kept
        mixer._calls.short[True] = None
        return qkv.requires_grad_(), GRID, True
    if change == "environment":  # ``$VIT3_TTT_BACKEND`` read again: ``forget_routes`` clears the caches
        backends.refresh_env()
        return qkv, GRID, False
    return *changed_call(mixer, qkv, GRID, change), False


@pytest.mark.parametrize("change", [*SHORT_PATH_CHANGES, "grad-mode", "environment"])
def test_the_short_path_steps_aside_where_the_settled_key_does_not_hold(change):
    """The call is not served by the short path, and gives what a mixer without routes (the same change made
    to it) gives."""
    mixer, qkv = _short_path_mixer()
    qkv, grid, grad = _change(mixer, qkv, change)
    twin = changed_twin(mixer, qkv, change)
    with torch.set_grad_enabled(grad):
        got, short = mix_short(mixer, qkv, grid)
        want = twin.mix(qkv, grid)
    assert not short
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_a_qkv_on_another_device_does_not_take_the_short_path(monkeypatch):
    mixer, qkv = _short_path_mixer()
    general = object()
    monkeypatch.setattr(mixer, "_mix_tokens", lambda *args: general)  # meta tensors: no general path to run
    with torch.no_grad():
        assert mixer.mix(qkv.to("meta"), GRID) is general
        assert mixer.mix(qkv, GRID) is not general  # the same call on the CPU: the short path


def test_a_new_backend_in_the_environment_ends_the_short_path(monkeypatch):
    """``$VIT3_TTT_BACKEND=generic`` read after the call settled: the named backend runs, no C++ op."""
    mixer, qkv = _short_path_mixer()
    monkeypatch.setenv("VIT3_TTT_BACKEND", "generic")
    backends.refresh_env()
    try:
        with torch.no_grad(), OpNames() as seen:
            got, short = mix_short(mixer, qkv, GRID)
    finally:
        monkeypatch.delenv("VIT3_TTT_BACKEND")
        backends.refresh_env()
    assert not short
    assert not any(name.startswith("vit3_cpu") for name in seen.names)
    with torch.no_grad():
        torch.testing.assert_close(got, fresh_twin(mixer).mix(qkv, GRID), rtol=1e-12, atol=1e-13)


def test_a_copy_of_a_settled_mixer_runs_its_own_weights():
    mixer, qkv = _short_path_mixer()
    for clone in (copy.deepcopy(mixer), pickle.loads(pickle.dumps(mixer))):
        assert clone._call_cache is None  # routes are this object's: not copied
        with torch.no_grad():
            clone.inner[0].w1.mul_(2)
            for _ in range(4):  # the copy's own calls settle
                clone.mix(qkv, GRID)
            got, short = mix_short(clone, qkv, GRID)
            assert short
            torch.testing.assert_close(got, fresh_twin(clone).mix(qkv, GRID), rtol=1e-12, atol=1e-13)
            assert not torch.allclose(got, mixer.mix(qkv, GRID))


@pytest.mark.parametrize("tracer", ["jit.trace", "export"])
def test_traced_calls_of_a_settled_mixer_hold_no_cpp_op(tracer):
    """``torch.jit.trace`` (and ONNX export, which runs it) and ``torch.export`` record the general path, not
    the CPU op a settled call takes; in float64 it gives the settled call's numbers (a traced token count
    divided in float32 gave 5e-9 off)."""
    mixer, qkv = _short_path_mixer()

    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = mixer

        def forward(self, qkv: torch.Tensor) -> torch.Tensor:
            return self.mixer.mix(qkv, GRID)

    with torch.no_grad():
        want = mixer.mix(qkv, GRID)
        if tracer == "jit.trace":
            traced = torch.jit.trace(Mix(), qkv, check_trace=False)
            graph, got = str(traced.graph), traced(qkv)
        else:
            program = torch.export.export(Mix(), (qkv,), strict=False)
            graph, got = str(program.graph), program.module()(qkv)
    assert "vit3_cpu" not in graph and "vit3.mix" not in graph  # the portable path, not the mixer op
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_a_model_cast_to_bf16_after_calls_under_autocast_still_runs():
    """Calls under bf16 autocast make routes for bf16 qkv, which reach the C++ kernel through a cast to
    float32. Cast to bf16 afterwards (weights in qkv's dtype), the model's settled calls took the whole-mixer
    C++ op with bf16 qkv, which refuses it (a RuntimeError): that op takes float32 and float64 only."""
    torch.manual_seed(0)
    mixer, x = TTTMixer(32, 2).eval(), torch.randn(2, 64, 32)
    fresh = copy.deepcopy(mixer).to(torch.bfloat16)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(3):  # settled
                mixer(x, (8, 8))
        mixer.to(torch.bfloat16)
        got = [mixer(x.bfloat16(), (8, 8)) for _ in range(2)]
        want = fresh(x.bfloat16(), (8, 8))
    assert all(torch.equal(g, want) for g in got)
    assert not mixer.explain(x.bfloat16(), (8, 8)).cpp_op
