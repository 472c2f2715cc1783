"""The mixer's guard (``vit3.layers.backends.guard``): a backend failing in the forward or in the backward
steps aside with one warning (or raises under ``VIT3_TTT_STRICT=1``), the first call of each new input
specialisation of the Triton kernels is verified, a sticky GPU fault is reported as the kernels', a double
backward works, and a C++ kernel that cannot be built steps aside.

The tests run where Triton runs (``triton_device``: the GPU, or the interpreter on CPU), failures injected at
the launch layer (``triton.plan.Launch``), which runs compiled and interpreted kernels alike;
``TRITON_INTERPRET=0 pytest tests/layers/test_backends_guard.py`` imports Triton as a GPU host does: the
launching tests skip (no GPU to run them), the others pass."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.backends import (
    BIG_GRID,
    CPU,
    GRID,
    assert_same,
    backends_of,
    generic_twin,
    make_mixer,
    param_names,
    reason_of,
    run_grads,
    tokens,
)
from helpers.common import count_calls, count_cpp_swiglu
from helpers.ops import intercept_launches
from torch.utils.checkpoint import checkpoint
from triton.runtime.errors import OutOfResources

from vit3.kernels import cpp as cpu_ext
from vit3.kernels.dwconv import eager as dwconv_eager
from vit3.kernels.mix import cpp as mix_cpp
from vit3.kernels.triton import fuse
from vit3.kernels.triton import plan as tplan
from vit3.layers import TTTMixer
from vit3.layers import backends as reg
from vit3.layers.backends import guard, verify
from vit3.layers.backends.routes import demotions

pytestmark = pytest.mark.usefixtures("no_backend_env")


# ---------------------------------------------------------------------------------- failures demote
# Where Triton runs (``triton_device``: the GPU, or the interpreter on CPU), failures injected at the launch
# layer (``helpers.backends.intercept_launches``: every launch, compiled or interpreted, per branch or in a
# whole-node program).

# The backend auto takes for the SwiGLU branch once Triton is demoted (24 tokens: below the C++ kernel's 32).
FALLBACK = {"cpu": "eager", "cuda": "generic"}


def _on(device: torch.device, mixer: TTTMixer, *tensors: torch.Tensor):
    return mixer.to(device), *(t.to(device) for t in tensors)


def _runs(kernels: set[str], name: str, kwargs: dict, swiglu_only: bool = True) -> bool:
    """Whether a launch (``name``, its constexprs) runs one of ``kernels`` (of the SwiGLU model where
    ``swiglu_only``), alone or as a part of a fused launch (``fuse``: ``k<i>_`` constexprs)."""
    parts = fuse.kernel_names(name)
    if len(parts) > 1:
        own = [
            {k.split("_", 1)[1]: v for k, v in kwargs.items() if k.startswith(f"k{i}_")}
            for i in range(len(parts))
        ]
        return any(_runs(kernels, part, kw, swiglu_only) for part, kw in zip(parts, own))
    return name in kernels and bool(kwargs.get("SWIGLU") or not swiglu_only)


def _failing_launch(monkeypatch, kernels: set[str], swiglu_only: bool = True, error=None) -> dict[str, int]:
    """Makes Triton launches of ``kernels`` (of the SwiGLU model when ``swiglu_only``) raise ``error()``
    (default ``OutOfResources``, as a GPU with too little shared memory per block does); counts the raises."""
    raised = {"n": 0}

    def launch(name, args, kwargs, run):
        if _runs(kernels, name, kwargs, swiglu_only):
            raised["n"] += len(fuse.kernel_names(name)) == 1  # counted where a part fails on its own
            raise error() if error else OutOfResources(188416, 101376, "shared memory")
        return run()

    intercept_launches(monkeypatch, launch)
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
    mixer, x, dout = _on(triton_device, make_mixer(), tokens(GRID), tokens(GRID))
    reference = generic_twin(mixer)
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
    assert_same(got, want, param_names(mixer))
    # The demotion holds for training calls of this key only: the forward kernels still serve inference.
    train = mixer.explain(x.requires_grad_(), GRID)
    assert backends_of(train) == [fallback, "triton"]
    assert "demoted after it failed here: OutOfResources" in reason_of(train, 0, "triton")
    assert backends_of(mixer.explain(x, GRID, grad=False)) == ["triton", "triton"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_grads(mixer, x, GRID, dout)  # no second warning, no failing launch
    assert raised["n"] == 2


@pytest.mark.triton
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_forward_out_of_resources_demotes_with_one_warning(monkeypatch, grad, triton_device):
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer, x = _on(triton_device, make_mixer(), tokens(GRID))
    reference = generic_twin(mixer)
    raised = _failing_launch(monkeypatch, FORWARD_KERNELS)
    with pytest.warns(reg.BackendWarning, match="'triton' failed in the forward on") as caught:
        with torch.set_grad_enabled(grad):
            out = _two_blocks(mixer, x.requires_grad_(grad))
    assert len([w for w in caught if issubclass(w.category, reg.BackendWarning)]) == 1
    assert raised["n"] == 1  # the second block already took the demoted route
    torch.testing.assert_close(out, _two_blocks(reference, x), rtol=1e-10, atol=1e-12)
    if grad:
        dout = tokens(GRID).to(triton_device)
        assert_same(run_grads(mixer, x, GRID, dout), run_grads(reference, x, GRID, dout), param_names(mixer))
    # A forward that fails fails in both modes: the other mode's key is demoted too, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends_of(mixer.explain(x, GRID, grad=not grad)) == [FALLBACK[triton_device.type], "triton"]
        with torch.set_grad_enabled(not grad):
            mixer(x, GRID)
    assert raised["n"] == 1


@pytest.mark.triton
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_failure_raises_when_strict(monkeypatch, phase, triton_device):
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    monkeypatch.setenv(reg.STRICT_ENV, "1")
    _failing_launch(monkeypatch, FORWARD_KERNELS if phase == "forward" else BACKWARD_KERNELS)
    mixer, x = _on(triton_device, make_mixer(), tokens(GRID))
    with pytest.raises(OutOfResources):
        mixer(x.requires_grad_(), GRID).sum().backward()


@pytest.mark.triton
def test_backward_failure_under_activation_checkpointing(monkeypatch, triton_device):
    """The recomputation of the second checkpointed block keeps the route of its forward (the demotion applies
    once the backward pass is over), so checkpointing sees the tensors it saved."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer, x = _on(triton_device, make_mixer(), tokens(GRID))
    reference = generic_twin(mixer)
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
    assert_same(list(got), list(want), param_names(mixer)[1:])


# ------------------------------------------------------------------------- new specialisations, GPU faults


def _skipped_launch(monkeypatch, kernels: set[str], batch: int) -> None:
    """Leaves the output of ``kernels`` unwritten (NaN: ``triton.plan.DEBUG_FILL``) on inputs of ``batch``
    samples, as a kernel that is wrong for one specialisation only would."""
    monkeypatch.setattr(tplan, "DEBUG_FILL", float("nan"))

    def launch(name, args, kwargs, run):
        if _runs(kernels, name, kwargs) and args[0].shape[0] == batch:
            return None
        return run()

    intercept_launches(monkeypatch, launch)


@pytest.mark.triton
def test_each_new_input_specialisation_runs_guarded_and_verified_once(monkeypatch, triton_device):
    """The route key holds no batch size nor exact N; Triton specialises on both (and on strides). Both
    branches run on Triton in one fused node: one guarded unit per guarded call."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    mixer, x, dout = _on(triton_device, make_mixer(), tokens(GRID, b=3), tokens(GRID, b=3))
    guarded = count_calls(monkeypatch, guard._Guard, "forward")
    checked = count_calls(monkeypatch, guard._Guard, "check_backward")
    for b in (2, 2, 3, 3):
        run_grads(mixer, x[:b], GRID, dout[:b])
    assert guarded["n"] == checked["n"] == 2  # one guarded, verified call per batch size
    run_grads(
        mixer, x[:, :20], (4, 5), dout[:, :20]
    )  # another N of the same token class: a new specialisation
    assert guarded["n"] == 3
    with torch.no_grad():  # inference (another key): verified by its forward alone
        for _ in range(2):
            mixer(x, GRID)
    assert guarded["n"] == 4 and checked["n"] == 3


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
    mixer, x, dout = _on(triton_device, make_mixer(), tokens(GRID, b=3), tokens(GRID, b=3))
    reference = generic_twin(mixer)
    run_grads(mixer, x[:2], GRID, dout[:2])  # verified at batch 2
    _skipped_launch(monkeypatch, kernels, batch=3)
    with pytest.warns(
        reg.BackendWarning, match=rf"'triton' failed in the {phase}.*VerificationError.*batch 3"
    ):
        got = run_grads(mixer, x, GRID, dout)
    for g in got:
        assert torch.isfinite(g).all()
    assert_same(got, run_grads(reference, x, GRID, dout), param_names(mixer))
    assert backends_of(mixer.explain(x, GRID))[0] == FALLBACK[triton_device.type]


@pytest.mark.triton
def test_without_comparison_a_new_specialisation_is_taken_as_verified(monkeypatch, triton_device):
    """``verify.COMPARE`` off (benchmarks whose launches compute nothing): the same wrong specialisation is
    still guarded, but not compared, so it is not demoted."""
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    monkeypatch.setattr(verify, "COMPARE", False)
    mixer, x, dout = _on(triton_device, make_mixer(), tokens(GRID, b=3), tokens(GRID, b=3))
    run_grads(mixer, x[:2], GRID, dout[:2])
    _skipped_launch(monkeypatch, FORWARD_KERNELS, batch=3)
    guarded = count_calls(monkeypatch, guard._Guard, "forward")
    with warnings.catch_warnings():
        warnings.simplefilter("error", reg.BackendWarning)  # no demotion
        out = run_grads(mixer, x, GRID, dout)[0]
    assert guarded["n"] == 1 and not torch.isfinite(out).all()
    assert backends_of(mixer.explain(x, GRID))[0] == "triton"


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
    mixer, x = _on(triton_device, make_mixer(), tokens(GRID))
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
    assert not demotions()


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
    mixer, x, dout = _on(triton_device, make_mixer(), tokens(GRID), tokens(GRID))
    reference = generic_twin(mixer)

    def second_order(m):
        x_ = x.detach().requires_grad_()
        (gx,) = torch.autograd.grad((m(x_, GRID) * dout).sum(), [x_], create_graph=True)
        return torch.autograd.grad(gx.square().sum(), [x_, *m.parameters()], materialize_grads=True)

    want = second_order(reference)
    for _ in range(2):
        got = second_order(mixer)
        assert_same(list(got), list(want), param_names(mixer)[1:], rtol=1e-8)


def test_cpu_kernel_that_cannot_be_built_demotes_to_the_tiled_path(monkeypatch):
    monkeypatch.setattr(cpu_ext, "load", lambda: (None, "CalledProcessError: no C++ compiler"))
    mixer, x = make_mixer(), tokens(BIG_GRID)
    tiled = TTTMixer(32, 2, mixer.cfg, backend="eager").double()
    tiled.load_state_dict(mixer.state_dict())
    dout = tokens(BIG_GRID)
    with pytest.warns(reg.BackendWarning, match="'cpu' failed in the forward.*could not be built.*no C"):
        got = run_grads(mixer, x, BIG_GRID, dout)
    assert_same(got, run_grads(tiled, x, BIG_GRID, dout), param_names(mixer), rtol=0)
    assert backends_of(mixer.explain(x, BIG_GRID)) == ["eager", "eager"]


def test_a_branch_demoted_to_the_generic_path_takes_the_whole_call_with_it(monkeypatch):
    """The depthwise-conv branch's C++ and eager paths fail: it is demoted through both to the generic path,
    and the SwiGLU branch, which has not failed, leaves the op with it (a call runs the op or the generic
    path); both stay there. On the C++ kernel both branches run in one call, which cannot name the branch
    that failed: it demotes both (to the eager paths, where the conv branch fails in its own hooks)."""

    def broken(*args, **kwargs):
        raise RuntimeError("planted dwconv fault")

    monkeypatch.setattr(mix_cpp, "forward", broken)
    monkeypatch.setattr(dwconv_eager, "ttt_forward", broken)
    mixer, x, dout = make_mixer(), tokens(BIG_GRID), tokens(BIG_GRID)
    with pytest.warns(reg.BackendWarning, match="planted dwconv fault"):
        got = run_grads(mixer, x, BIG_GRID, dout)
    assert_same(got, run_grads(generic_twin(mixer), x, BIG_GRID, dout), param_names(mixer), rtol=0)
    assert backends_of(mixer.explain(x, BIG_GRID)) == ["generic", "generic"]
    kernel = count_cpp_swiglu(monkeypatch)
    run_grads(mixer, x, BIG_GRID, dout)
    assert kernel["n"] == 0
