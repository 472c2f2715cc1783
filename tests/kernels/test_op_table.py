"""The table of ops (``vit3.kernels.ops``) is the one place an op is added (``kernels/README.md``): a toy op
registered here — an elementwise inner model ``v_hat = x ⊙ w`` with an eager path given only as fused eager
node hooks — is chosen by the backend registry, named by ``explain``, run (as a one-branch fused node) and
matches its reference, forward and every gradient; the shipped ops are all in the table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.ops import branch_node
from torch import Tensor

from vit3.kernels import OPS, common, ops_with
from vit3.kernels.ops import Hyper, Node, NodeCall, Op, Path, register
from vit3.kernels.paths import eager_supports
from vit3.kernels.reference import reference_ttt
from vit3.layers import TTTConfig
from vit3.layers import backends as reg

TOY = "toy_scale"
B, HEADS, N, D = 2, 3, 12, 4
GRID = (3, 4)


def _scale(x: Tensor, w: Tensor) -> Tensor:
    """The toy inner model: ``x ⊙ w``, tokens ``[B, G, N, c]``, weight ``[1|B, G, 1, c]``."""
    return x * w


def _reference(q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], h: Hyper) -> Tensor:
    return common.ttt_reference(
        _scale, (params["w"],), q, k, v, scale=h.scale, lr=h.lr, grad_norm=h.grad_norm
    )


def _forward(x: NodeCall):
    """One dot-loss step in closed form: ``G = -(s/N) Σ_n k ⊙ v``, the step, ``out = q ⊙ W'``."""
    (q, k, v, (w,), dest, h, save, _) = x
    g = (k * v).sum(-2, keepdim=True).mul_(-h.scale / q.shape[-2])  # [B, G, 1, c]
    w_new, norm = common.step(g, w, h.lr, h.grad_norm)
    torch.mul(q, w_new, out=dest)
    return ([q, k, v, g, norm, w_new] if save else []), ""


def _backward(d_out, saved, tag, dq, dk, dv, h: Hyper):
    q, k, v, g, norm, w_new = saved
    dw_new = (d_out * q).sum(-2, keepdim=True)
    dg = common.step_backward(dw_new, g, norm, h.lr, h.grad_norm).mul_(-h.scale / q.shape[-2])
    torch.mul(d_out, w_new, out=dq)
    torch.mul(v, dg, out=dk)
    torch.mul(k, dg, out=dv)
    return (dw_new,)


@pytest.fixture
def toy():
    """The toy op in the table for one test (the registry's caches cleared before and after)."""
    op = register(
        Op(
            name=TOY,
            reference=_reference,
            weights=("w",),
            rope=False,
            paths={
                "eager": Path(
                    supports=eager_supports, node=Node(heads=True, forward=_forward, backward=_backward)
                )
            },
        )
    )
    reg.reset()
    yield op
    del OPS[TOY]
    reg.reset()


def _inputs() -> tuple[Tensor, ...]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, HEADS, N, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w = (1 + 0.1 * torch.randn(1, HEADS, 1, D, dtype=torch.float64)).requires_grad_()
    return q, k, v, w


def test_the_shipped_ops_are_the_table_and_each_backend_runs_the_ops_with_its_path():
    assert list(OPS) == ["swiglu", "linear", "dwconv"]
    assert all(op.name == name and set(op.paths) <= {"triton", "cpu", "eager"} for name, op in OPS.items())
    for backend in ("triton", "cpu", "eager"):
        assert reg.BACKENDS[backend].models == ops_with(backend)
    assert OPS["swiglu"].weights == ("w1", "w2") and OPS["dwconv"].weights == ("weight",)


def test_a_registered_op_is_chosen_explained_and_matches_its_reference(toy):
    cfg = TTTConfig()
    settings = (cfg.loss, cfg.steps, cfg.mini_batches, cfg.lr_mode)
    branches = ((TOY, HEADS, D, True),)
    cpu = torch.device("cpu")
    assert TOY in reg.BACKENDS["eager"].models and TOY not in reg.BACKENDS["cpu"].models
    route = reg.route(settings, "auto", branches, cpu, torch.float64, reg.token_class(N), True, "")
    assert route.backends == ("eager",)

    mixer = SimpleNamespace(
        cfg=cfg, route_branches=branches, dim=HEADS * D, num_heads=HEADS, scriptable=False
    )
    expl = reg.explain_mixer(mixer, cpu, torch.float64, GRID, grad=True)
    assert expl.branches[0].backend == "eager" and expl.fused
    passed = dict(expl.branches[0].passed_over)
    assert f"no '{TOY}' in the C++ CPU kernel" in passed["cpu"] and "ranks higher" in passed["generic"]

    q, k, v, w = _inputs()
    out = branch_node(TOY, "eager", q, k, v, {"w": w}, GRID, scale=0.5, recompute=route.recompute)
    hyper = {"grid": GRID, "scale": 0.5, "lr": cfg.inner_lr, "grad_norm": cfg.grad_norm}
    want = reference_ttt(TOY, q, k, v, {"w": w}, **hyper)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, w), d_out)
    expected = torch.autograd.grad(want, (q, k, v, w), d_out)
    for name, g, e in zip("qkvw", got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


def test_a_path_that_refuses_the_branch_is_passed_over_with_its_reason(toy):
    """The registry asks the op's own ``supports``: a loss its eager path does not fuse sends it to
    generic."""
    cfg = TTTConfig(loss="mse")
    mixer = SimpleNamespace(
        cfg=cfg, route_branches=((TOY, HEADS, D, True),), dim=HEADS * D, num_heads=HEADS, scriptable=False
    )
    expl = reg.explain_mixer(mixer, torch.device("cpu"), torch.float64, GRID, grad=False)
    assert expl.branches[0].backend == "generic" and not expl.fused
    assert dict(expl.branches[0].passed_over)["eager"].startswith("loss 'mse' is not fused")


def test_the_triton_weight_names_are_the_tables():
    """``triton.device.WEIGHT_NAMES`` names each Triton op's weights as its table entry does (``Op.weights``),
    in the same order: the Triton path zips them with the weights it is given."""
    from vit3.kernels.triton.device import WEIGHT_NAMES

    triton_ops = {name for name, op in OPS.items() if "triton" in op.paths}
    assert set(WEIGHT_NAMES) == triton_ops
    for name in triton_ops:
        assert WEIGHT_NAMES[name] == OPS[name].weights, name


def test_each_cpu_nodes_mix_code_is_the_mix_ops_code_for_it():
    """The code a ``cpu`` node hands the whole-mixer C++ op (``Node.mix``) is the one ``mix.cpp``'s
    ``OpCode`` gives the op (``kSwiGLU``, ``kDwconv``), and every op the C++ op knows has a ``cpu`` node."""
    import re
    from pathlib import Path as FilePath

    import vit3.kernels

    source = (FilePath(vit3.kernels.__file__).parent / "mix" / "csrc" / "mix.cpp").read_text()
    enum = re.search(r"enum OpCode : int64_t \{([^}]*)\}", source)
    assert enum, "mix.cpp has no enum OpCode"
    codes = {name.lower(): int(code) for name, code in re.findall(r"k(\w+) = (\d+)", enum.group(1))}
    qkv = torch.zeros(1, 49, 3 * 64)
    nodes = {name: op.paths["cpu"].node for name, op in OPS.items() if "cpu" in op.paths}
    given = {name: node.mix(32, qkv)[0] for name, node in nodes.items() if node.mix is not None}
    assert given == codes
