"""Paths and small helpers shared by the test modules: the repository, the official fixtures, error metrics,
call counting, a default-dtype switch, benchmark modules, saved-for-backward accounting, dispatched ops."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures" / "official"
LOCAL_FIXTURES = (
    REPO / "tests" / "fixtures"
)  # generated in the repository (each with the script that made it)


def load_fixture(name: str) -> dict:
    """Loads an official golden fixture, skipping the test when ``../shared`` is absent."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"official fixture {path} not found (../shared is not laid out beside the repo)")
    return torch.load(path, weights_only=True)


def save_tree(tree: object, path: Path) -> None:
    """Writes nested dicts of tensors and plain values (numbers, strings, None; keys of any JSON type) as one
    ``.npz``: the arrays, and the tree as JSON naming them. Plain data, no pickle: what the repository keeps
    of a generated fixture (:func:`load_tree` reads it)."""
    arrays: dict[str, np.ndarray] = {}

    def index(x: object) -> dict:
        if isinstance(x, dict):
            return {"dict": [[k, index(v)] for k, v in x.items()]}
        if isinstance(x, torch.Tensor):
            arrays[name := f"a{len(arrays)}"] = x.numpy()
            return {"array": name}
        return {"value": x}

    np.savez_compressed(path, __index__=np.array(json.dumps(index(tree))), **arrays)


def load_tree(path: Path) -> object:
    """The tree :func:`save_tree` wrote to ``path``, its arrays as tensors."""
    with np.load(path, allow_pickle=False) as f:

        def build(node: dict) -> object:
            if "dict" in node:
                return {k: build(v) for k, v in node["dict"]}
            if "array" in node:
                return torch.from_numpy(f[node["array"]])
            return node["value"]

        return build(json.loads(str(f["__index__"])))


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise error relative to the largest magnitude of ``b``."""
    return float(((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).detach())


def count_calls(monkeypatch, owner, name: str) -> dict[str, int]:
    """Replaces ``owner.name`` by a wrapper counting its calls (``["n"]``) for one test."""
    count = {"n": 0}
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return count


def compiled_with_ops(module: torch.nn.Module) -> tuple[torch.nn.Module, list[list[str]]]:
    """``module`` compiled whole (``fullgraph``) through AOT autograd, and the ops (``call_function``
    targets) of each graph it makes: the forward's, then the backward's, filled by the first call and its
    backward."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[list[str]] = []

    def keep(gm, _inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    return torch.compile(module, fullgraph=True, backend=backend), graphs


def compiled_model_ops(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float
) -> tuple[list[str], list[str]]:
    """A training step of ``model`` (cross-entropy on ``x``, ``y``) compiled whole against eager: the loss
    and every parameter's gradient within ``rtol`` / ``atol``; returns the forward and backward graphs'
    ops."""

    def train(net: torch.nn.Module) -> list[torch.Tensor]:
        loss = torch.nn.functional.cross_entropy(net(x), y)
        return [loss, *torch.autograd.grad(loss, list(model.parameters()))]

    exp = train(model)
    compiled, graphs = compiled_with_ops(model)
    for a, e in zip(train(compiled), exp):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
    forward, backward = graphs
    return forward, backward


def count_cpp_swiglu(monkeypatch) -> dict[str, int]:
    """Counts the forwards of the SwiGLU op that run in the C++ kernel (``["n"]``) for one test: a branch's
    own hooks (``swiglu.cpp.PASSES``) or a whole mixer call with a SwiGLU branch (``mix.cpp.forward``)."""
    from vit3.kernels.mix import cpp as mix_cpp
    from vit3.kernels.swiglu import cpp as swiglu_cpp
    from vit3.layers.fused_mix import mix_layout

    count = count_calls(monkeypatch, swiglu_cpp.PASSES, "forward")
    real = mix_cpp.forward

    def counting(cache, spec, *args, **kwargs):
        count["n"] += any(br.op == "swiglu" for br in spec.branches)
        return real(cache, spec, *args, **kwargs)

    monkeypatch.setattr(mix_cpp, "forward", counting)
    mix_layout.cache_clear()  # layouts made before hold the hooks they were made with
    return count


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype(dtype)`` for a block: models built in it hold float64 fixture weights exactly
    (no float32 round trip)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def load_module(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` imported as a module called ``name`` (not through ``sys.path``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module: the repository root is not on ``sys.path`` under plain ``pytest``
    (and must not be: its ``vit3/`` would shadow an installed package's ``vit3.kernels``)."""
    return load_module(REPO / "benchmarks" / f"{name}.py", f"benchmarks_{name}")


def saved_values(fn: Callable[[], object]) -> int:
    """Values (elements) that autograd saves for the backward while ``fn()`` builds its graph, one entry per
    storage (views of one buffer count once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


class OpNames(TorchDispatchMode):
    """Names of the ops dispatched under it (``"aten.mm.default"``, ``"vit3.mix.default"``), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
