"""Inputs, runs and error metrics shared by the op tests (``test_op_*``, ``test_kernels_*``): q, k, v as
strided views of one qkv projection, the Triton op beside the op's reference; every Triton launch
intercepted."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types

import pytest
import torch

import vit3.kernels as kernels
from helpers.common import max_rel_err as _max_rel_err
from vit3.kernels.reference import reference_ttt
from vit3.layers import TTTMixer, apply_rope_2d, fused_mix
from vit3.layers.config import GRID_MODELS

SCALE = 9**-0.5
# The compiled kernels on a GPU; the interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 there).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WEIGHTS = {"swiglu": ("w1", "w2"), "linear": ("w",), "dwconv": ("weight",)}


def interpretable() -> bool:
    """Whether Triton's interpreter can run the kernels here: they (and ``triton.language``) were decorated
    under ``TRITON_INTERPRET=1``, which ``triton.jit`` reads once, when a function is decorated."""
    from triton.runtime.interpreter import InterpretedFunction

    from vit3.kernels.triton import matrix

    return isinstance(matrix.readout_kernel, InterpretedFunction)


def needs_kernels(device: torch.device) -> None:
    """Skips a test that launches the kernels on ``device`` where nothing can run them: a CPU on which Triton
    was imported for a GPU (``TRITON_INTERPRET=0``, as a GPU host imports it; there it runs on the GPU)."""
    if device.type == "cpu" and not interpretable():
        pytest.skip(
            "Triton was decorated for a GPU (TRITON_INTERPRET=0) and there is none to run the kernels"
        )


def make_inputs(name: str, b: int, g: int, n: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """A qkv projection output ``[B, N, 3*G*d]`` and initial weights (leaves, with grads); skips where nothing
    can run the kernels (``needs_kernels``).

    Weights are ``[1, G, d, d]``, or ``[1, G*d, 3, 3]`` for the depthwise conv, float32 unless float64.
    """
    needs_kernels(DEVICE)
    qkv = torch.randn(b, n, 3 * g * d, dtype=torch.float64).to(DEVICE, dtype).requires_grad_(True)
    shape = (1, g * d, 3, 3) if name == "dwconv" else (1, g, d, d)
    params = {
        w: (0.3 * torch.randn(shape, dtype=torch.float64)).to(DEVICE, torch.float32).requires_grad_(True)
        for w in WEIGHTS[name]
    }
    if dtype == torch.float64:
        params = {w: p.detach().double().requires_grad_(True) for w, p in params.items()}
    return qkv, params


def branch_node(
    name: str, path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, torch.Tensor],
    grid: tuple[int, int], *, scale: float, lr: float = 1.0, grad_norm: bool = True, recompute: bool = True,
) -> torch.Tensor:  # fmt: skip
    """One branch of op ``name`` on its ``path`` (``"eager"``, ``"cpu"``, ``"triton"``) as a one-branch
    mixer op (``fused_mix``): q, k, v ``[B, G, N, d]`` copied into one qkv ``[B, N, 3*G*d]`` -> ``[B, G, N,
    d]``."""
    b, g, n, d = q.shape
    qkv = torch.cat([t.transpose(1, 2).reshape(b, n, g * d) for t in (q, k, v)], dim=-1)
    branch = fused_mix.MixBranch(name, 0, g, d, False, path)
    spec = fused_mix.MixSpec((branch,), grid, scale, lr, grad_norm, 10000.0, recompute)
    weights = [params[w] for w in kernels.OPS[name].weights]
    return fused_mix.fused_mix(qkv, spec, weights).unflatten(-1, (g, d)).transpose(1, 2)


def split_heads(qkv: torch.Tensor, g: int) -> list[torch.Tensor]:
    """``[B, N, 3*G*d]`` -> q, k, v ``[B, G, N, d]``: strided views, as the mixer passes them."""
    return [t.unflatten(-1, (g, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1)]


def run_both(name, shape, dtype, *, loss="dot", lr=1.0, grad_norm=True, chunk=None, backend="triton"):
    """Output and gradients (qkv, then each weight) of the Triton op and of the op's reference.

    ``shape`` is ``(B, G, N, d)`` (a 1 x N grid) or ``(B, G, (h, w), d)``.
    """
    b, g, n, d = shape
    grid = n if isinstance(n, tuple) else (1, n)
    qkv, params = make_inputs(name, b, g, grid[0] * grid[1], d, dtype)
    kw = {"grid": grid, "scale": SCALE, "lr": lr, "grad_norm": grad_norm, "loss": loss}
    out = kernels.triton_ttt(name, *split_heads(qkv, g), params, backend=backend, chunk=chunk, **kw)
    ref = reference_ttt(name, *split_heads(qkv, g), params, **kw)
    dout = torch.randn(ref.shape, dtype=torch.float64).to(ref.device, ref.dtype)
    inputs = [qkv, *params.values()]
    got = torch.autograd.grad(out, inputs, dout.to(out.dtype))
    exp = torch.autograd.grad(ref, inputs, dout)
    return out, ref, got, exp, list(params)


def grad_names(weights: list[str]) -> list[str]:
    return ["q", "k", "v", *weights]


def per_tensor(got, exp, weights):
    """Splits the qkv gradient into q, k, v so each gradient is compared (and named) on its own."""
    return zip(grad_names(weights), [*got[0].chunk(3, -1), *got[1:]], [*exp[0].chunk(3, -1), *exp[1:]])


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return _max_rel_err(a.detach(), b.detach())


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def reference_mixer(mixer: TTTMixer, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``mixer`` (one full-batch step, fixed lr, bare inner models of the ops) recomputed with the op
    references (``vit3.kernels.reference.reference_ttt``) between its own qkv and output projections: ``[B, N,
    C]``."""
    b, n, _ = x.shape
    cfg = mixer.cfg
    pieces = mixer.qkv(x).split([w for w in mixer.widths for _ in range(3)], dim=-1)
    outs = []
    for i, ((name, heads), model) in enumerate(zip(mixer.branch_specs, mixer.inner)):
        q, k, v = pieces[3 * i : 3 * i + 3]
        if cfg.rope and name not in GRID_MODELS:
            q, k = (apply_rope_2d(t, grid, cfg.rope_base) for t in (q, k))
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))  # [B, G, N, c]
        y = reference_ttt(
            name, q, k, v, model.initial_params(), grid=grid, scale=mixer.scale, lr=cfg.inner_lr,
            grad_norm=cfg.grad_norm, loss=cfg.loss,
        )  # fmt: skip
        outs.append(y.transpose(1, 2).reshape(b, n, -1))
    return mixer.proj(torch.cat(outs, dim=-1))


def assert_matches_reference(
    out: torch.Tensor, ref: torch.Tensor, qkv: torch.Tensor, weights: dict[str, torch.Tensor]
) -> None:
    """A fast path's read-out ``out`` against the reference's ``ref`` (float64: rtol 1e-12), and the gradients
    of q, k, v (the three thirds of the ``qkv`` gradient) and of each weight (rtol 1e-10), each named."""
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(ref)
    leaves = [qkv, *weights.values()]
    got = torch.autograd.grad((out * dout).sum(), leaves)
    want = torch.autograd.grad((ref * dout).sum(), leaves)
    names = ["q", "k", "v", *weights]
    pairs = zip(names, [*got[0].chunk(3, -1), *got[1:]], [*want[0].chunk(3, -1), *want[1:]])
    for name, g, g_ref in pairs:
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


# AMD Instinct GPUs as a ROCm build of PyTorch describes them (``torch.cuda.get_device_properties``).
AMD_GPUS = {
    arch: types.SimpleNamespace(
        gcnArchName=f"{arch}:sramecc+:xnack-",
        major=9,
        minor=minor,
        name=name,
        multi_processor_count=sms,
        shared_memory_per_block_optin=64 * 1024,
    )
    for arch, minor, name, sms in (
        ("gfx90a", 0, "AMD Instinct MI250X/MI250", 110),
        ("gfx942", 4, "AMD Instinct MI300X", 304),
    )
}


# The modules of the Triton kernels in import order (each copy in ``gpu_kernels`` imports the copies before
# it).
KERNEL_MODULES = (
    "vit3.kernels.triton.jit",
    "vit3.kernels.triton.step",
    "vit3.kernels.triton.matrix",
    "vit3.kernels.dwconv.triton",
)


@functools.cache
def gpu_kernels() -> dict[str, types.ModuleType]:
    """Copies of the kernel modules (``KERNEL_MODULES``) as a GPU host imports them: decorated without the
    interpreter (``triton.jit`` reads ``TRITON_INTERPRET`` when a function is decorated), whatever this
    process has set, each calling the other copies' helpers."""
    modules = {name: importlib.import_module(name) for name in KERNEL_MODULES}
    copies = {}
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        for name in KERNEL_MODULES:
            spec = importlib.util.find_spec(name)
            copies[name] = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(copies[name])
    finally:
        sys.modules.update(modules)
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return copies


def use_gpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Puts the kernels of ``gpu_kernels`` in place of this process's (for the test), where the launcher
    reads them."""
    for name, copy in gpu_kernels().items():
        for attr in copy.__all__:
            monkeypatch.setattr(sys.modules[name], attr, getattr(copy, attr))


def intercept_launches(monkeypatch, hook) -> None:
    """Runs every Triton launch, of the per-branch plans (``triton.plan.Launch``) and of the whole-node launch
    programs (``triton.program``) alike, through ``hook(name, args, kwargs, launch)``: the kernel's name, its
    arguments (tensors, or ``Address`` es with their shape on a GPU) and constexprs, and ``launch()``, the
    real launch. Both take their launcher from ``triton.plan.launcher``, which this replaces (a program's key
    holds the launcher, so programs built before are not reused)."""
    from vit3.kernels.triton import plan as tplan

    real = tplan.launcher

    class Launcher:
        def __init__(self, kernel) -> None:
            self.kernel, self.name = kernel, kernel.fn.__name__

        def __getitem__(self, grid):
            run = real(self.kernel)[grid]
            return lambda *args, **kwargs: hook(self.name, args, kwargs, lambda: run(*args, **kwargs))

    monkeypatch.setattr(tplan, "launcher", Launcher)
