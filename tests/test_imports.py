"""The package's imports keep its layout (docs/layout.md, "Imports"): every import of one of its modules goes
to the importer's floor or below (``FLOORS``), no module imports another module's ``_private`` names, and the
module-level imports form no circle. Read from the sources (``ast``), ``kernels/`` as ``vit3.kernels``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers.train import REPO

# The floors, lowest first, by the first name under ``vit3`` (``vit3`` alone: the package's __init__).
FLOORS = (
    {"errors", "_diffusers_names", "_diffusers", "kernels"},
    {"outputs"},
    {"data"},
    {"layers"},
    {"models", "vit3"},
    {"tasks", "convert"},
    {"engine"},
    {"export", "ablate"},
    {"scripts"},
)


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the package by its dotted name: ``vit3/`` and ``kernels/`` (``vit3.kernels``)."""
    found = {}
    for base, package in ((root / "vit3", "vit3"), (root / "kernels", "vit3.kernels")):
        for path in base.rglob("*.py"):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, top_level: bool) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` of each import of ``name``'s source (relative ones resolved); ``names``: what
    a ``from`` import takes. ``top_level``: only those that run with the module (not inside a function)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if not top_level else _module_level(tree.body)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of ``body`` that run with the module: into ``if`` / ``try`` blocks, not functions or
    classes (an ``if TYPE_CHECKING:`` block never runs, and is left out)."""
    found = []
    for node in body:
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                found += _module_level(node.body) + _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _module_level(block)
        else:
            found.append(node)
    return found


def floor(name: str) -> int | None:
    """The floor of a module of the package (``FLOORS``); ``None`` where none names it."""
    key = name.split(".")[1] if "." in name else name
    return next((i for i, names in enumerate(FLOORS) if key in names), None)


def ours(module: str, known: dict[str, Path]) -> str | None:
    """The package's module ``module`` names, or the one it lies in; ``None`` outside the package."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``edges`` (the strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def known() -> dict[str, Path]:
    return modules()


def test_every_module_lies_on_a_floor(known):
    assert [name for name in known if floor(name) is None] == []


def test_no_import_runs_back_up_a_floor(known):
    upward = []
    for name, path in known.items():
        for module, _, line in imports(name, path, top_level=False):
            target = ours(module, known)
            if target is not None and floor(target) > floor(name):
                upward.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not upward, upward


def test_no_module_imports_another_modules_private_names(known):
    private = []
    for name, path in known.items():
        for module, names, line in imports(name, path, top_level=False):
            target = ours(module, known)
            taken = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if target is not None and target != name and taken:
                private.append(f"{path.relative_to(REPO)}:{line} takes {taken} from {target}")
    assert not private, private


def test_the_module_level_imports_form_no_circle(known):
    """An import of an ancestor package (which Python has begun importing already) is no circle."""
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for module, names, _ in imports(name, path, top_level=True):
            for target in (module, *(f"{module}.{n}" for n in names)):
                found = ours(target, known)
                if found is not None and found != name and not name.startswith(found + "."):
                    edges[name].add(found)
    assert not circles(edges)


def test_the_checks_see_what_they_forbid(tmp_path):
    """The rules' parts on made-up cases: floors in order, a circle and none, the imports of a source
    (relative ones resolved, a ``TYPE_CHECKING`` block left out)."""
    assert floor("vit3.kernels.ops") < floor("vit3.layers.ttt") < floor("vit3.engine.loop")
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not circles({"a": {"b"}, "b": set()})
    source = (
        "from ..engine import loop\nfrom .ops import _private\nif TYPE_CHECKING:\n    import vit3.models\n"
    )
    path = tmp_path / "made_up.py"
    path.write_text(source)
    assert floor("vit3.nowhere") is None
    assert imports("vit3.kernels.made_up", path, top_level=True) == [
        ("vit3.engine", ["loop"], 1),
        ("vit3.kernels.ops", ["_private"], 2),
    ]
