"""The mixer's backend registry (``vit3.layers.backends``): every backend it can be forced onto (by the config
or by ``VIT3_TTT_BACKEND``) computes the generic path's output and gradients, a named backend that cannot
serve warns once (or raises under ``VIT3_TTT_STRICT=1``), routes are resolved once per key, and an unknown
config key is refused by name.

The tests that launch kernels run where Triton runs (``triton_device``: the GPU, else the interpreter)."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest
import timm
import torch
from helpers import backends as hb
from helpers.backends import (
    BIG_GRID,
    CPU,
    GRID,
    assert_same,
    generic_twin,
    make_mixer,
    param_names,
    run_grads,
    tokens,
)
from helpers.common import count_calls, count_cpp_swiglu

import vit3.kernels.swiglu.eager as swiglu_eager
from vit3.layers import TTTConfig, TTTMixer
from vit3.layers import backends as reg
from vit3.layers.backends import guard
from vit3.layers.blocks import ConvFFN, ConvPosEnc, LeanMlp
from vit3.layers.lean import RecomputedStack

pytestmark = pytest.mark.usefixtures("no_backend_env")


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
    CPU tensors. Beside a linear branch, which only Triton implements, the C++ and eager backends leave the
    mixer op to the generic path (with a warning)."""
    device = request.getfixturevalue("triton_device") if name == "triton" else CPU
    if how == "env":
        monkeypatch.setenv(reg.BACKEND_ENV, name)
        mixer = make_mixer(**cfg).to(device)
    else:
        monkeypatch.setenv(reg.BACKEND_ENV, "generic")  # the config wins over the variable
        mixer = make_mixer(backend=name, **cfg).to(device)
    reference = generic_twin(mixer)
    monkeypatch.delenv(reg.BACKEND_ENV)
    if how == "env":
        monkeypatch.setenv(reg.BACKEND_ENV, name)
    x, dout = tokens(GRID).to(device), tokens(GRID).to(device)
    expl = mixer.explain(x, GRID)
    linear = any(b.startswith("linear") for b in cfg.get("branches", ()))
    served = "generic" if linear and name != "triton" else name
    assert {b.name: b.backend for b in expl.branches if b.name != "linear"} == FORCED[served]
    kernel = count_cpp_swiglu(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", reg.BackendWarning)
        got = run_grads(mixer, x, GRID, dout)
    said = [str(w.message) for w in caught if issubclass(w.category, reg.BackendWarning)]
    assert len(said) == (served != name) and all("cannot serve the mixer op" in s for s in said)
    assert kernel["n"] == int(served == "cpu")  # the C++ kernel ran exactly when it served
    monkeypatch.delenv(reg.BACKEND_ENV, raising=False)
    assert_same(got, run_grads(reference, x, GRID, dout), param_names(mixer))


def test_named_backend_that_cannot_serve_warns_once_or_raises_when_strict(monkeypatch):
    mixer = make_mixer(loss="mse")
    monkeypatch.setenv(reg.BACKEND_ENV, "cpu")
    x = tokens(GRID)
    with pytest.warns(
        reg.BackendWarning, match=r"backend 'cpu' .* cannot serve the 'swiglu' branch: loss 'mse'"
    ):
        out = mixer(x, GRID)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(mixer(x, GRID), out, rtol=0, atol=0)
    torch.testing.assert_close(out, generic_twin(mixer)(x, GRID), rtol=0, atol=0)
    monkeypatch.setenv(reg.STRICT_ENV, "1")
    with pytest.raises(ValueError, match="cannot serve the 'swiglu' branch"):
        mixer(x, GRID)


def test_a_call_runs_the_mixer_op_or_the_generic_path_never_branch_by_branch(monkeypatch):
    """A fast path runs only inside the mixer op: beside a branch without one (an MLP), the SwiGLU branch
    takes the generic inner loop too, named or not, and the named backend's warning says why (raises under
    ``VIT3_TTT_STRICT=1``)."""
    mixer, x, dout = make_mixer(branches=("swiglu", "mlp:1")), tokens(BIG_GRID), tokens(BIG_GRID)
    expl = mixer.explain(x, BIG_GRID)
    assert not expl.fused and hb.backends_of(expl) == ["generic", "generic"]
    why = "branch 1 ('mlp') has no fast path here, and the mixer op runs every branch or none"
    assert hb.reason_of(expl, 0, "cpu") == hb.reason_of(expl, 0, "eager") == why
    kernel = count_cpp_swiglu(monkeypatch)
    tiled = count_calls(monkeypatch, swiglu_eager.PASSES, "forward")
    got = run_grads(mixer, x, BIG_GRID, dout)
    assert kernel["n"] == tiled["n"] == 0
    assert_same(got, run_grads(generic_twin(mixer), x, BIG_GRID, dout), param_names(mixer), rtol=0)
    named = make_mixer(branches=("swiglu", "mlp:1"), backend="cpu")
    with pytest.warns(
        reg.BackendWarning,
        match=r"backend 'cpu' .* cannot serve the mixer op: branch 1 \('mlp'\) has no fast path",
    ):
        named(x, BIG_GRID)
    assert kernel["n"] == 0
    monkeypatch.setenv(reg.STRICT_ENV, "1")
    with pytest.raises(ValueError, match=r"backend 'eager' .* cannot serve the mixer op"):
        make_mixer(branches=("swiglu", "mlp:1"), backend="eager")(x, BIG_GRID)


def test_named_backend_implementing_no_branch_warns():
    mixer = make_mixer(branches=("mlp", "linear"), backend="eager")
    with pytest.warns(
        reg.BackendWarning, match=r"cannot serve the mixer: no 'mlp', 'linear' in the fused eager"
    ):
        mixer(tokens(GRID), GRID)


def test_bad_backend_values_are_rejected_by_name(monkeypatch):
    monkeypatch.setenv(reg.BACKEND_ENV, "cuda-please")
    with pytest.raises(ValueError, match="VIT3_TTT_BACKEND must be one of auto, triton, cpu, eager, generic"):
        make_mixer()(tokens(GRID), GRID)
    with pytest.raises(ValueError, match="backend must be one of"):
        TTTConfig(backend="torch")
    monkeypatch.delenv(reg.BACKEND_ENV)
    monkeypatch.setenv(reg.STRICT_ENV, "maybe")
    with pytest.raises(ValueError, match="VIT3_TTT_STRICT must be 0 or 1"):
        make_mixer(backend="cpu", loss="mse")(tokens(GRID), GRID)


# --------------------------------------------------------------------------------------------- caching


def test_routes_are_resolved_once_per_key(monkeypatch):
    resolved = count_calls(monkeypatch, importlib.import_module("vit3.layers.backends.routes"), "resolve")
    first, second = make_mixer(), make_mixer()
    x = tokens(GRID)
    for _ in range(3):
        first(x, GRID)
        second(x, GRID)
    assert resolved["n"] == 1  # one key: both mixers, three calls each
    with torch.no_grad():
        first(x, GRID)  # no gradients: another key
    first(tokens(BIG_GRID), BIG_GRID)  # the token-count class
    first(tokens((6, 7)), (6, 7))  # same class as GRID: cached
    assert resolved["n"] == 3
    monkeypatch.setenv(reg.BACKEND_ENV, "generic")
    first(x, GRID)
    first(x, GRID)
    assert resolved["n"] == 4


class _CountedEnviron(dict):
    """``os.environ`` that counts its reads."""

    def __init__(self, env) -> None:
        super().__init__(env)
        self.reads = 0

    def get(self, *args):
        self.reads += 1
        return super().get(*args)

    def __getitem__(self, name):
        self.reads += 1
        return super().__getitem__(name)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_a_mixer_keeps_its_route_and_reads_no_environment_after_the_first_call(monkeypatch, grad):
    """The route of a (mixer, key) is decided once and kept on the mixer: a later call of that key asks the
    backends' cache nothing and reads no environment variable."""
    mixer, x = make_mixer(), tokens(BIG_GRID, b=1)
    with torch.set_grad_enabled(grad):
        for _ in range(2):  # the guarded first calls of the key, then a verified one
            out = mixer(x, BIG_GRID)
            if grad:
                out.sum().backward()
        routed = count_calls(monkeypatch, reg, "route")
        environ = _CountedEnviron(os.environ)
        monkeypatch.setattr("os.environ", environ)
        out = mixer(x, BIG_GRID)
        if grad:
            out.sum().backward()
    assert routed["n"] == 0 and environ.reads == 0
    assert not mixer(tokens(GRID, b=1), GRID).isnan().any() and routed["n"] == 1  # a new key is routed


def test_a_key_runs_guarded_until_one_forward_and_backward_succeeded(monkeypatch):
    guards = count_calls(monkeypatch, guard._GuardFn, "apply")
    mixer, x = make_mixer(), tokens(GRID, b=1)
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


# ------------------------------------------------------------------------------------------ old names


def test_an_unknown_config_key_is_refused_naming_it():
    """Keys the config does not have (``impl``, the name ``backend`` had before 0.1.0) are refused by name,
    in a config, in a mixer's keyword arguments and in a timm model's ``ttt_cfg``."""
    for make in (
        lambda: TTTConfig.create({"impl": "torch"}),
        lambda: TTTMixer(16, 2, impl="triton"),
        lambda: timm.create_model("test_vit3_ttt", ttt_cfg={"impl": "torch"}),
    ):
        with pytest.raises(ValueError, match=r"unknown TTT config keys \['impl'\]"):
            make()


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: ConvPosEnc(8, backend="torch"), "backend"),
        (lambda: ConvFFN(8, 16, backend="torch"), "backend"),
        (lambda: ConvFFN(8, 16, recompute="yes"), "recompute"),
        (lambda: LeanMlp(8, 16, backend="torch"), "backend"),
        (lambda: LeanMlp(8, 16, recompute="yes"), "recompute"),
        (lambda: RecomputedStack(torch.nn.Identity(), recompute="yes"), "recompute"),
    ],
)
def test_a_block_layer_refuses_a_bad_backend_or_recompute_when_built(make, key):
    """The layers outside the mixer that take the block's backend or recompute check it as ``TTTConfig``
    does (one check, ``config.check_backend`` / ``check_recompute``), when built: the dispatcher takes it as
    checked."""
    with pytest.raises(ValueError, match=f"{key} must be one of"):
        make()
