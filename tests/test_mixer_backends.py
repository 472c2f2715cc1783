"""The mixer's backend registry (``vit3.layers.backends``): what it chooses and why (``explain``), that every
backend it can be forced onto computes the generic path's output and gradients, that plans are resolved once
per key, that a backend failing in the forward or in the backward steps aside with one warning (or raises
under ``VIT3_TTT_STRICT=1``), that the first call of each new input specialisation of the Triton kernels is
verified, that a sticky GPU fault is reported as the kernels', that a double backward works, that the removed
variables warn, and the model-level ``explain`` and its CLI.

The registry's decisions for CPU tensors under the interpreter ask for it (``interpreter``); the tests that
launch kernels run where Triton runs (``triton_device``: the GPU, else the interpreter), failures injected at
the launch layer (``triton_op.Launch``), which runs compiled and interpreted kernels alike.
``TRITON_INTERPRET=0 pytest tests/test_mixer_backends.py`` imports Triton as a GPU host does: the launching
tests skip (no GPU to run them), the others pass."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import pytest
import timm
import torch
from helpers.common import REPO, count_calls
from helpers.ops import AMD_GPUS
from torch.utils.checkpoint import checkpoint
from triton.runtime.errors import OutOfResources

import vit3
import vit3.kernels.swiglu.eager as fast
from vit3.kernels import cpp as cpu_ext
from vit3.kernels import triton_op, triton_path
from vit3.layers import TTTConfig, TTTMixer
from vit3.layers import backends as reg
from vit3.layers.backends import guard
from vit3.layers.backends.plan import _demoted, _pending
from vit3.scripts.explain import main as cli_main

GRID = (4, 6)  # 24 tokens: below the CPU kernel's 32
BIG_GRID = (10, 12)  # 120 tokens
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    for name in (reg.BACKEND_ENV, reg.STRICT_ENV, *reg.REMOVED_ENV):
        monkeypatch.delenv(name, raising=False)


def _mixer(dim: int = 32, heads: int = 2, dtype=torch.float64, **cfg) -> TTTMixer:
    torch.manual_seed(3)
    mixer = TTTMixer(dim, heads, **cfg).to(dtype)
    with torch.no_grad():  # larger initial inner weights so the step is not negligible
        for model in mixer.inner:
            for p in model.parameters():
                p.mul_(5)
    return mixer


def _generic_twin(mixer: TTTMixer) -> TTTMixer:
    """The same mixer (weights, dtype, device) on the generic backend."""
    twin = TTTMixer(mixer.dim, mixer.num_heads, mixer.cfg, backend="generic").to(next(mixer.parameters()))
    twin.load_state_dict(mixer.state_dict())
    return twin


def _run(mixer: TTTMixer, x: torch.Tensor, grid, dout: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient."""
    x = x.detach().requires_grad_()
    out = mixer(x, grid)
    return [out, *torch.autograd.grad((out * dout).sum(), [x, *mixer.parameters()])]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str], rtol: float = 1e-10):
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * 1e-2 * w.abs().max().item(), msg=name)


def _names(mixer: TTTMixer) -> list[str]:
    return ["output", "input grad", *(n for n, _ in mixer.named_parameters())]


def _backends(expl: reg.MixerExplanation) -> list[str]:
    return [b.backend for b in expl.branches]


def _reason(expl: reg.MixerExplanation, branch: int, backend: str) -> str:
    return dict(expl.branches[branch].passed_over)[backend]


def _tokens(grid, dim=32, b=2, dtype=torch.float64):
    return torch.randn(b, grid[0] * grid[1], dim, dtype=dtype)


# ------------------------------------------------------------------------------------------------ explain


@pytest.mark.usefixtures("interpreter")
def test_explain_default_cpu_config_cpu_kernel_from_32_tokens():
    mixer = _mixer(dtype=torch.float32)
    big = mixer.explain(_tokens(BIG_GRID, dtype=torch.float32), BIG_GRID)
    assert _backends(big) == ["cpu", "cpu"] and big.fused
    assert "ranks higher on cpu" in _reason(big, 0, "eager")
    assert "'cpu' ranks higher on cpu" in _reason(big, 1, "eager")  # the depthwise branch too
    assert "unless named" in _reason(big, 0, "triton")  # the interpreter serves only when named
    small = mixer.explain(_tokens(GRID, dtype=torch.float32), GRID)
    assert _backends(small) == ["eager", "cpu"] and small.fused  # the token rule is SwiGLU's only
    assert "fewer than 32 tokens per head" in _reason(small, 0, "cpu")
    text = str(big)
    assert "one fused eager node" in text and "0 swiglu x2 d=16" in text and "cpu" in text
    assert json.loads(json.dumps(big.to_dict()))["branches"][0]["backend"] == "cpu"


def test_explain_says_triton_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expl = _mixer().explain(_tokens(GRID), GRID)
    assert _reason(expl, 0, "triton") == "CPU tensors: Triton runs them only under TRITON_INTERPRET=1"


def test_explain_default_cuda_plan_is_triton_then_generic():
    """The CUDA plan is resolved without a GPU: the registry only reads the device type."""
    mixer = _mixer(dim=64, heads=2)
    expl = reg.explain_mixer(mixer, torch.device("cuda"), torch.bfloat16, BIG_GRID, grad=True)
    assert _backends(expl) == ["triton", "triton"] and not expl.fused
    assert _reason(expl, 0, "cpu") == "cuda tensors: the C++ kernel runs CPU tensors"
    assert _reason(expl, 0, "generic") == "'triton' ranks higher on cuda"
    wide = reg.explain_mixer(_mixer(dim=512, heads=2), torch.device("cuda"), torch.bfloat16, GRID, grad=True)
    assert _backends(wide) == ["generic", "generic"]  # the eager tile walk is tuned for CPU caches
    assert "head dim 256 > 128" in _reason(wide, 0, "triton")
    assert _reason(wide, 0, "eager") == "'generic' ranks higher on cuda"


def test_a_gpu_that_cannot_run_the_kernels_steps_aside_with_a_warning(fake_gpu):
    """ROCm on an MI250 (Triton's AMD backend takes no TF32 dots there): auto says why, warns once and lets
    the generic path serve; with IEEE dots (float64) the kernels serve."""
    gpu = fake_gpu(AMD_GPUS["gfx90a"], hip="6.3")
    mixer = _mixer(dim=64, heads=2)
    expl = reg.explain_mixer(mixer, gpu, torch.bfloat16, BIG_GRID, grad=True)
    assert _backends(expl) == ["generic", "generic"]
    assert _reason(expl, 0, "triton").startswith("ROCm gfx90a: Triton's AMD backend takes")
    args = ((mixer.cfg.loss, 1, 1, "fixed"), "auto", mixer.plan_branches, gpu)
    with pytest.warns(reg.BackendWarning) as caught:
        assert reg.plan(*args, torch.bfloat16, "N>=32", True, "").backends == ("generic", "generic")
        reg.plan(*args, torch.bfloat16, "N>=32", False, "")  # another key: no second warning
    warned = [str(w.message) for w in caught if "'swiglu' branch" in str(w.message)]
    assert len(warned) == 1
    for part in (
        "the Triton kernels cannot run",
        "AMD Instinct MI250X/MI250 (cuda:0)",
        "ROCm gfx90a",
        "'generic'",
    ):
        assert part in warned[0], warned[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.plan(*args, torch.float64, "N>=32", True, "").backends == ("triton", "triton")


def test_explain_without_triton_names_the_import_error_and_keeps_the_cpp_kernel(monkeypatch):
    monkeypatch.setattr(
        triton_path,
        "_kernels",
        lambda: (None, "the Triton kernels cannot be imported (ImportError: no triton)"),
    )
    expl = reg.explain_mixer(_mixer(), torch.device("cuda"), torch.float16, GRID, grad=False)
    assert _backends(expl) == ["generic", "generic"]
    assert "ImportError: no triton" in _reason(expl, 0, "triton")
    cpu = _mixer().explain(_tokens(BIG_GRID), BIG_GRID)  # the C++ kernel needs no Triton
    assert _backends(cpu) == ["cpu", "cpu"] and "ImportError: no triton" in _reason(cpu, 0, "triton")


VARIANTS = {
    # name: (config, expected backends per branch, (branch, backend, reason substring))
    "mse-loss": ({"loss": "mse"}, ["generic", "generic"], (0, "eager", "loss 'mse' is not fused")),
    "two-steps": ({"steps": 2}, ["generic", "generic"], (0, "cpu", "steps=2")),
    "mini-batches": ({"mini_batches": 2}, ["generic", "generic"], (1, "eager", "mini_batches=2")),
    "token-lr": ({"lr_mode": "token"}, ["generic", "generic"], (0, "triton", "lr_mode='token'")),
    "mlp": ({"branches": ("mlp",)}, ["generic"], (0, "triton", "no 'mlp' in the Triton kernels")),
    "with-linear": (
        {"branches": ("swiglu:2", "linear:2", "dwconv:1")},
        ["cpu", "generic", "cpu"],
        (1, "eager", "no 'linear' in the fused eager path"),
    ),
    "named-generic": ({"backend": "generic"}, ["generic", "generic"], (0, "cpu", "'generic' is named")),
    "named-triton": ({"backend": "triton"}, ["triton", "triton"], (0, "cpu", "'triton' is named")),
    "named-eager": ({"backend": "eager"}, ["eager", "eager"], (0, "cpu", "'eager' is named")),
    "named-triton-narrow-heads": (
        {"backend": "triton", "heads": 4},
        ["cpu", "cpu"],
        (0, "triton", "head dim 8 < 16"),
    ),
}


@pytest.mark.parametrize(("cfg", "expected", "why"), list(VARIANTS.values()), ids=list(VARIANTS))
@pytest.mark.usefixtures("interpreter")
def test_explain_variants(cfg, expected, why):
    cfg = dict(cfg)
    mixer = _mixer(heads=cfg.pop("heads", 2), **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reg.BackendWarning)
        expl = mixer.explain(_tokens(BIG_GRID), BIG_GRID)
    assert _backends(expl) == expected
    branch, backend, text = why
    assert text in _reason(expl, branch, backend)


@pytest.mark.usefixtures("interpreter")
def test_traced_and_compiled_calls_plan_traceable_ops():
    mixer = _mixer()
    args = (
        (mixer.cfg.loss, 1, 1, "fixed"),
        "auto",
        mixer.plan_branches,
        CPU,
        torch.float64,
        "N>=32",
        True,
    )
    assert reg.plan(*args, "trace").backends == ("generic", "generic")
    assert reg.plan(*args, "compile").backends == ("generic", "generic")
    assert reg.plan(*args, "").backends == ("cpu", "cpu")
    named = ((mixer.cfg.loss, 1, 1, "fixed"), "triton", *args[2:])
    assert reg.plan(*named, "compile").backends == ("triton", "triton")  # the custom op compiles
    with pytest.warns(reg.BackendWarning, match="jit tracing / ONNX export"):
        assert reg.plan(*named, "trace").backends == ("generic", "generic")


def test_compiled_mixer_has_no_graph_break_and_matches_eager():
    """The plan is a constant of the compiled graph (fullgraph fails on any break)."""
    mixer = _mixer()
    x, dout = _tokens(BIG_GRID), _tokens(BIG_GRID)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: mixer(t, BIG_GRID), fullgraph=True, backend="eager")
    x_ = x.detach().requires_grad_()
    out = compiled(x_)
    got = [out, *torch.autograd.grad((out * dout).sum(), [x_, *mixer.parameters()])]
    _assert_same(got, _run(mixer, x, BIG_GRID, dout), _names(mixer))


# ------------------------------------------------------------------------------------ forcing a backend


FORCED = {
    "triton": {"swiglu": "triton", "dwconv": "triton"},
    "cpu": {"swiglu": "cpu", "dwconv": "cpu"},
    "eager": {"swiglu": "eager", "dwconv": "eager"},
    "generic": {"swiglu": "generic", "dwconv": "generic"},
}


@pytest.mark.triton
@pytest.mark.parametrize("how", ["env", "cfg"])
@pytest.mark.parametrize("name", list(FORCED))
@pytest.mark.parametrize(
    "cfg",
    [{}, {"rope": True}, {"branches": ("swiglu:1", "linear:1", "dwconv:1")}],
    ids=["official", "rope", "with-linear"],
)
def test_forced_backend_gives_generic_output_and_gradients(request, monkeypatch, name, how, cfg):
    """The Triton kernels where Triton runs (``triton_device``: the GPU, else the interpreter), the others on
    CPU tensors."""
    device = request.getfixturevalue("triton_device") if name == "triton" else CPU
    if how == "env":
        monkeypatch.setenv(reg.BACKEND_ENV, name)
        mixer = _mixer(**cfg).to(device)
    else:
        monkeypatch.setenv(reg.BACKEND_ENV, "generic")  # the config wins over the variable
        mixer = _mixer(backend=name, **cfg).to(device)
    reference = _generic_twin(mixer)
    monkeypatch.delenv(reg.BACKEND_ENV)
    if how == "env":
        monkeypatch.setenv(reg.BACKEND_ENV, name)
    x, dout = _tokens(GRID).to(device), _tokens(GRID).to(device)
    expl = mixer.explain(x, GRID)
    assert {b.name: b.backend for b in expl.branches if b.name != "linear"} == FORCED[name]
    kernel = count_calls(monkeypatch, fast, "_kernel_forward")
    got = _run(mixer, x, GRID, dout)
    assert kernel["n"] == int(name == "cpu")  # the C++ kernel ran exactly when named
    monkeypatch.delenv(reg.BACKEND_ENV, raising=False)
    _assert_same(got, _run(reference, x, GRID, dout), _names(mixer))


def test_named_backend_that_cannot_serve_warns_once_or_raises_when_strict(monkeypatch):
    mixer = _mixer(loss="mse")
    monkeypatch.setenv(reg.BACKEND_ENV, "cpu")
    x = _tokens(GRID)
    with pytest.warns(
        reg.BackendWarning, match=r"backend 'cpu' .* cannot serve the 'swiglu' branch: loss 'mse'"
    ):
        out = mixer(x, GRID)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(mixer(x, GRID), out, rtol=0, atol=0)
    torch.testing.assert_close(out, _generic_twin(mixer)(x, GRID), rtol=0, atol=0)
    monkeypatch.setenv(reg.STRICT_ENV, "1")
    with pytest.raises(ValueError, match="cannot serve the 'swiglu' branch"):
        mixer(x, GRID)


def test_named_backend_implementing_no_branch_warns():
    mixer = _mixer(branches=("mlp", "linear"), backend="eager")
    with pytest.warns(
        reg.BackendWarning, match=r"cannot serve the mixer: no 'mlp', 'linear' in the fused eager"
    ):
        mixer(_tokens(GRID), GRID)


def test_bad_backend_values_are_rejected_by_name(monkeypatch):
    monkeypatch.setenv(reg.BACKEND_ENV, "cuda-please")
    with pytest.raises(ValueError, match="VIT3_TTT_BACKEND must be one of auto, triton, cpu, eager, generic"):
        _mixer()(_tokens(GRID), GRID)
    with pytest.raises(ValueError, match="backend must be one of"):
        TTTConfig(backend="torch")
    monkeypatch.delenv(reg.BACKEND_ENV)
    monkeypatch.setenv(reg.STRICT_ENV, "maybe")
    with pytest.raises(ValueError, match="VIT3_TTT_STRICT must be 0 or 1"):
        _mixer(backend="cpu", loss="mse")(_tokens(GRID), GRID)


# --------------------------------------------------------------------------------------------- caching


def test_plans_are_resolved_once_per_key(monkeypatch):
    resolved = count_calls(monkeypatch, importlib.import_module("vit3.layers.backends.plan"), "_resolve")
    first, second = _mixer(), _mixer()
    x = _tokens(GRID)
    for _ in range(3):
        first(x, GRID)
        second(x, GRID)
    assert resolved["n"] == 1  # one key: both mixers, three calls each
    with torch.no_grad():
        first(x, GRID)  # no gradients: another key
    first(_tokens(BIG_GRID), BIG_GRID)  # the token-count class
    first(_tokens((6, 7)), (6, 7))  # same class as GRID: cached
    assert resolved["n"] == 3
    monkeypatch.setenv(reg.BACKEND_ENV, "generic")
    first(x, GRID)
    first(x, GRID)
    assert resolved["n"] == 4


def test_a_key_runs_guarded_until_one_forward_and_backward_succeeded(monkeypatch):
    guards = count_calls(monkeypatch, guard._GuardFn, "apply")
    mixer, x = _mixer(), _tokens(GRID, b=1)
    out = mixer(x, GRID)
    assert guards["n"] == 1
    mixer(x, GRID)
    assert guards["n"] == 2  # no backward yet
    out.sum().backward()
    mixer(x, GRID).sum().backward()
    assert guards["n"] == 2
    with torch.no_grad():  # the inference key: no guard Function, and verified by one forward
        mixer(x, GRID)
    assert guards["n"] == 2


# ---------------------------------------------------------------------------------- failures demote
# Where Triton runs (``triton_device``: the GPU, or the interpreter on CPU), failures injected at the launch
# layer (``triton_op.Launch``, which runs compiled and interpreted kernels alike).

# The backend auto takes for the SwiGLU branch once Triton is demoted (24 tokens: below the C++ kernel's 32).
FALLBACK = {"cpu": "eager", "cuda": "generic"}


def _on(device: torch.device, mixer: TTTMixer, *tensors: torch.Tensor):
    return mixer.to(device), *(t.to(device) for t in tensors)


def _failing_launch(monkeypatch, kernels: set[str], swiglu_only: bool = True, error=None) -> dict[str, int]:
    """Makes Triton launches of ``kernels`` (of the SwiGLU model when ``swiglu_only``) raise ``error()``
    (default ``OutOfResources``, as a GPU with too little shared memory per block does); counts the raises."""
    real = triton_op.Launch.__call__
    raised = {"n": 0}

    def launch(self):
        if self.kernel.fn.__name__ in kernels and (self.kwargs.get("SWIGLU") or not swiglu_only):
            raised["n"] += 1
            raise error() if error else OutOfResources(188416, 101376, "shared memory")
        return real(self)

    monkeypatch.setattr(triton_op.Launch, "__call__", launch)
    return raised


BACKWARD_KERNELS = {"readout_bwd_kernel", "grad_bwd_kernel"}
FORWARD_KERNELS = {"readout_kernel", "forward_kernel"}  # N split or not


def _two_blocks(mixer: TTTMixer, x: torch.Tensor) -> torch.Tensor:
    """Two mixer calls of one key in one graph, as two blocks of a model make."""
    return mixer(mixer(x, GRID), GRID)


@pytest.mark.triton
def test_backward_out_of_resources_demotes_with_one_warning_and_correct_gradients(monkeypatch, triton_device):
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    fallback = FALLBACK[triton_device.type]
    mixer, x, dout = _on(triton_device, _mixer(), _tokens(GRID), _tokens(GRID))
    reference = _generic_twin(mixer)
    raised = _failing_launch(monkeypatch, BACKWARD_KERNELS)
    x_ = x.detach().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _two_blocks(mixer, x_)
        got = [out, *torch.autograd.grad((out * dout).sum(), [x_, *mixer.parameters()])]
    demoted = [w for w in caught if issubclass(w.category, reg.BackendWarning)]
    assert len(demoted) == 1, [str(w.message) for w in caught]
    message = str(demoted[0].message)
    for part in (
        "'triton' failed in the backward on",
        str(triton_device),
        "swiglu branch, head dim 16",
        "OutOfResources",
        "shared memory",
        f"{fallback!r} computes the result",
    ):
        assert part in message, message
    assert raised["n"] == 2  # each block's first backward launch, then never again
    x_ref = x.detach().requires_grad_()
    ref = _two_blocks(reference, x_ref)
    want = [ref, *torch.autograd.grad((ref * dout).sum(), [x_ref, *reference.parameters()])]
    _assert_same(got, want, _names(mixer))
    # The demotion holds for training calls of this key only: the forward kernels still serve inference.
    train = mixer.explain(x.requires_grad_(), GRID)
    assert _backends(train) == [fallback, "triton"]
    assert "demoted after it failed here: OutOfResources" in _reason(train, 0, "triton")
    assert _backends(mixer.explain(x, GRID, grad=False)) == ["triton", "triton"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(mixer, x, GRID, dout)  # no second warning, no failing launch
    assert raised["n"] == 2


@pytest.mark.triton
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_forward_out_of_resources_demotes_with_one_warning(monkeypatch, grad, triton_device):
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer, x = _on(triton_device, _mixer(), _tokens(GRID))
    reference = _generic_twin(mixer)
    raised = _failing_launch(monkeypatch, FORWARD_KERNELS)
    with pytest.warns(reg.BackendWarning, match="'triton' failed in the forward on") as caught:
        with torch.set_grad_enabled(grad):
            out = _two_blocks(mixer, x.requires_grad_(grad))
    assert len([w for w in caught if issubclass(w.category, reg.BackendWarning)]) == 1
    assert raised["n"] == 1  # the second block already took the demoted plan
    torch.testing.assert_close(out, _two_blocks(reference, x), rtol=1e-10, atol=1e-12)
    if grad:
        dout = _tokens(GRID).to(triton_device)
        _assert_same(_run(mixer, x, GRID, dout), _run(reference, x, GRID, dout), _names(mixer))
    # A forward that fails fails in both modes: the other mode's key is demoted too, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backends(mixer.explain(x, GRID, grad=not grad)) == [FALLBACK[triton_device.type], "triton"]
        with torch.set_grad_enabled(not grad):
            mixer(x, GRID)
    assert raised["n"] == 1


@pytest.mark.triton
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_failure_raises_when_strict(monkeypatch, phase, triton_device):
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    monkeypatch.setenv(reg.STRICT_ENV, "1")
    _failing_launch(monkeypatch, FORWARD_KERNELS if phase == "forward" else BACKWARD_KERNELS)
    mixer, x = _on(triton_device, _mixer(), _tokens(GRID))
    with pytest.raises(OutOfResources):
        mixer(x.requires_grad_(), GRID).sum().backward()


@pytest.mark.triton
def test_backward_failure_under_activation_checkpointing(monkeypatch, triton_device):
    """The recomputation of the second checkpointed block keeps the plan of its forward (the demotion applies
    once the backward pass is over), so checkpointing sees the tensors it saved."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer, x = _on(triton_device, _mixer(), _tokens(GRID))
    reference = _generic_twin(mixer)
    _failing_launch(monkeypatch, BACKWARD_KERNELS)

    def blocks(m, t):
        for _ in range(2):
            t = checkpoint(lambda u, m=m: m(u, GRID), t, use_reentrant=False)
        return t

    x_ = x.detach().requires_grad_()
    with pytest.warns(reg.BackendWarning, match="failed in the backward"):
        got = torch.autograd.grad(blocks(mixer, x_).square().sum(), [x_, *mixer.parameters()])
    x_ref = x.detach().requires_grad_()
    want = torch.autograd.grad(blocks(reference, x_ref).square().sum(), [x_ref, *reference.parameters()])
    _assert_same(list(got), list(want), _names(mixer)[1:])


# ------------------------------------------------------------------------- new specialisations, GPU faults


def _skipped_launch(monkeypatch, kernels: set[str], batch: int) -> None:
    """Leaves the output of ``kernels`` unwritten (NaN: ``triton_op.DEBUG_FILL``) on inputs of ``batch``
    samples, as a kernel that is wrong for one specialisation only would."""
    real = triton_op.Launch.__call__
    monkeypatch.setattr(triton_op, "DEBUG_FILL", float("nan"))

    def launch(self):
        if (
            self.kernel.fn.__name__ in kernels
            and self.args[0].shape[0] == batch
            and self.kwargs.get("SWIGLU")
        ):
            return None
        return real(self)

    monkeypatch.setattr(triton_op.Launch, "__call__", launch)


@pytest.mark.triton
def test_each_new_input_specialisation_runs_guarded_and_verified_once(monkeypatch, triton_device):
    """The plan key holds no batch size nor exact N; Triton specialises on both (and on strides). Both branches
    run on Triton: two guarded units per guarded call."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer, x, dout = _on(triton_device, _mixer(), _tokens(GRID, b=3), _tokens(GRID, b=3))
    guarded = count_calls(monkeypatch, guard._Guard, "forward")
    checked = count_calls(monkeypatch, guard._Guard, "check_backward")
    for b in (2, 2, 3, 3):
        _run(mixer, x[:b], GRID, dout[:b])
    assert guarded["n"] == checked["n"] == 4  # one guarded, verified call per batch size
    _run(mixer, x[:, :20], (4, 5), dout[:, :20])  # another N of the same token class: a new specialisation
    assert guarded["n"] == 6
    with torch.no_grad():  # inference (another key): verified by its forward alone
        for _ in range(2):
            mixer(x, GRID)
    assert guarded["n"] == 8 and checked["n"] == 6


@pytest.mark.triton
@pytest.mark.parametrize(
    ("kernels", "phase"),
    [(FORWARD_KERNELS, "forward"), ({"readout_bwd_kernel"}, "backward")],
    ids=["fwd", "bwd"],
)
def test_a_specialisation_that_computes_wrong_is_caught_and_demoted(
    monkeypatch, triton_device, kernels, phase
):
    """A verified key meets a batch size whose kernel leaves its output unwritten: the verification catches it
    (the unguarded path would return NaN), demotes with a warning and the fallback computes the result."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer, x, dout = _on(triton_device, _mixer(), _tokens(GRID, b=3), _tokens(GRID, b=3))
    reference = _generic_twin(mixer)
    _run(mixer, x[:2], GRID, dout[:2])  # verified at batch 2
    _skipped_launch(monkeypatch, kernels, batch=3)
    with pytest.warns(
        reg.BackendWarning, match=rf"'triton' failed in the {phase}.*VerificationError.*batch 3"
    ):
        got = _run(mixer, x, GRID, dout)
    for g in got:
        assert torch.isfinite(g).all()
    _assert_same(got, _run(reference, x, GRID, dout), _names(mixer))
    assert _backends(mixer.explain(x, GRID))[0] == FALLBACK[triton_device.type]


@pytest.mark.triton
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_sticky_gpu_fault_is_reported_as_the_kernels_not_the_fallbacks(monkeypatch, triton_device, phase):
    """An illegal memory access loses the CUDA context (simulated: ``_context_lost``): no fallback can run,
    so the error names the Triton backend and the switch that keeps it out, and nothing is demoted."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    fault = "CUDA error: an illegal memory access was encountered"
    accelerator_error = getattr(torch, "AcceleratorError", RuntimeError)
    kernels = FORWARD_KERNELS if phase == "forward" else BACKWARD_KERNELS
    _failing_launch(monkeypatch, kernels, error=lambda: accelerator_error(fault))
    monkeypatch.setattr(guard, "_context_lost", lambda device: True)
    mixer, x = _on(triton_device, _mixer(), _tokens(GRID))
    with warnings.catch_warnings():
        warnings.simplefilter("error", reg.BackendWarning)  # no demotion warning
        with pytest.raises(reg.KernelFault) as caught:
            mixer(x.requires_grad_(), GRID).sum().backward()
    message = str(caught.value)
    for part in (
        "'triton' faulted on",
        f"in the {phase}",
        "illegal memory access",
        "VIT3_TTT_BACKEND=generic",
    ):
        assert part in message, message
    assert not _demoted and not _pending


def test_context_lost_probes_the_device(monkeypatch):
    def sync(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    assert guard._context_lost(gpu) and not guard._context_lost(CPU)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert not guard._context_lost(gpu)


# ------------------------------------------------------------------------------------- double backward


@pytest.mark.triton
def test_triton_double_backward_matches_the_generic_path(monkeypatch, triton_device):
    """A gradient penalty: the input gradient (create_graph=True), squared, differentiated again, on a key's
    first (guarded) call and on a verified one."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer, x, dout = _on(triton_device, _mixer(), _tokens(GRID), _tokens(GRID))
    reference = _generic_twin(mixer)

    def second_order(m):
        x_ = x.detach().requires_grad_()
        (gx,) = torch.autograd.grad((m(x_, GRID) * dout).sum(), [x_], create_graph=True)
        return torch.autograd.grad(gx.square().sum(), [x_, *m.parameters()], materialize_grads=True)

    want = second_order(reference)
    for _ in range(2):
        got = second_order(mixer)
        _assert_same(list(got), list(want), _names(mixer)[1:], rtol=1e-8)


def test_cpu_kernel_that_cannot_be_built_demotes_to_the_tiled_path(monkeypatch):
    monkeypatch.setattr(cpu_ext, "load", lambda: (None, "CalledProcessError: no C++ compiler"))
    mixer, x = _mixer(), _tokens(BIG_GRID)
    tiled = TTTMixer(32, 2, mixer.cfg, backend="eager").double()
    tiled.load_state_dict(mixer.state_dict())
    dout = _tokens(BIG_GRID)
    with pytest.warns(reg.BackendWarning, match="'cpu' failed in the forward.*could not be built.*no C"):
        got = _run(mixer, x, BIG_GRID, dout)
    _assert_same(got, _run(tiled, x, BIG_GRID, dout), _names(mixer), rtol=0)
    assert _backends(mixer.explain(x, BIG_GRID)) == ["eager", "eager"]


# ------------------------------------------------------------------------------------------ old names


@pytest.mark.parametrize("name", list(reg.REMOVED_ENV))
def test_removed_environment_variables_warn_once_naming_the_replacement(monkeypatch, name):
    monkeypatch.setenv(name, "0")
    mixer = _mixer()
    with pytest.warns(reg.BackendWarning, match=rf"\${name} is no longer read.*use VIT3_TTT_BACKEND"):
        mixer(_tokens(GRID), GRID)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixer(_tokens(BIG_GRID), BIG_GRID)  # a new key: still no second warning


def test_old_impl_key_reads_as_backend():
    with pytest.warns(DeprecationWarning, match="impl='auto' is dropped"):
        assert TTTConfig.create({"impl": "auto"}).backend == "auto"
    with pytest.warns(FutureWarning, match="impl='torch' reads as backend='eager'"):
        assert TTTConfig.create({"impl": "torch"}).backend == "eager"
    with pytest.warns(FutureWarning):
        assert TTTMixer(16, 2, impl="triton").cfg.backend == "triton"
    with pytest.raises(ValueError, match="'impl' was renamed 'backend'"):
        TTTConfig.create({"impl": "cuda"})
    with pytest.raises(ValueError, match="both impl='torch' and backend='generic'"):
        TTTConfig.create({"impl": "torch", "backend": "generic"})
    with pytest.warns(FutureWarning):  # an old checkpoint's model kwargs
        model = timm.create_model("test_vit3_ttt", ttt_cfg={"impl": "torch"})
    assert model.blocks[0].attn.cfg.backend == "eager"


# --------------------------------------------------------------------------------- model-level explain


def test_model_explain_groups_mixers_with_one_plan():
    model = timm.create_model("test_vit3_ttt")
    report = vit3.explain(model, 64)
    ((names, expl),) = report.groups
    assert names == ("blocks.0.attn", "blocks.1.attn", "blocks.2.attn")
    assert expl.tokens == 16 and not expl.grad and _backends(expl) == ["eager", "cpu"]
    assert "blocks.0.attn ... blocks.2.attn (3 mixers)" in str(report)
    assert _backends(vit3.explain(model, torch.randn(1, 3, 176, 176), grad=True).groups[0][1]) == [
        "cpu",
        "cpu",
    ]


def test_model_explain_of_a_hierarchical_model_lists_each_stage():
    model = timm.create_model("test_h_vit3")
    report = vit3.explain(model, (64, 96))
    assert len(report.groups) > 1
    assert sum(len(names) for names, _ in report.groups) == sum(
        isinstance(m, TTTMixer) for m in model.modules()
    )
    assert len({expl.tokens for _, expl in report.groups}) == len(report.groups)


def test_cli_prints_the_explanation(capsys):
    cli_main(["test_vit3_ttt", "--img-size", "64", "--batch", "2"])
    out = capsys.readouterr().out
    assert "test_vit3_ttt" in out and "blocks.0.attn ... blocks.2.attn (3 mixers)" in out
    cli_main(["test_vit3_ttt", "--img-size", "64", "--dtype", "bf16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert (
        data["mixers"][0]["dtype"] == "torch.bfloat16" and data["mixers"][0]["mixers"][0] == "blocks.0.attn"
    )


def test_cli_runs_as_a_module_and_rejects_bad_arguments():
    proc = subprocess.run(
        [sys.executable, "-m", "vit3.scripts.explain", "test_vit3_ttt", "--img-size", "32", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RuntimeWarning" not in proc.stderr
    assert json.loads(proc.stdout)["model"] == "test_vit3_ttt"
    with pytest.raises(SystemExit):
        cli_main(["test_vit3_ttt", "--dtype", "fp8"])


def test_backends_implement_exactly_the_ops_that_declare_their_path():
    """Each op under ``kernels/`` declares its fast paths; the registry's inner-model lists follow them, and the
    Triton op serves exactly those ops."""
    import vit3.kernels as kernels
    from vit3.kernels import triton_op

    assert reg.BACKENDS["triton"].models == kernels.ops_with("triton") == tuple(triton_op.TRITON_LOSSES)
    assert reg.BACKENDS["cpu"].models == kernels.ops_with("cpu") == ("swiglu", "dwconv")
    assert reg.BACKENDS["eager"].models == kernels.ops_with("eager") == ("swiglu", "dwconv")
    assert reg.BACKENDS["generic"].models is None


def test_the_backends_a_config_may_name_are_the_registrys():
    """TTTConfig checks backend names against vit3.layers.config (below the registry, which it must not
    import): the same names, in the registry's order."""
    from vit3.layers.config import BACKEND_NAMES

    assert BACKEND_NAMES == ("auto", *reg.BACKENDS)
