"""``import vit3`` is all ``diffusers.DiffusionPipeline.from_pretrained(folder)`` needs to load a saved vit3
pipeline, and it imports no diffusers (the ``generation`` extra stays optional, and free when unused).

diffusers looks a saved pipeline's class (``model_index.json``'s ``_class_name``) up in its own namespace
only; a class from elsewhere needs a code file in the folder and ``trust_remote_code=True``. So when diffusers
is imported, before vit3 or after it, its namespace gets a lookup of the vit3 pipeline names (a module
``__getattr__``, PEP 562, asked before diffusers' own lazy lookup) that imports their vit3 module on first
use; that module then registers the class itself (``vit3._diffusers.register_pipeline``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["PIPELINES", "expose_pipelines"]

# The vit3 pipeline classes by name, and the module that defines (and registers) each.
PIPELINES = {"DiT3Pipeline": "vit3.tasks.pipeline"}


def _name_lookup(previous: Callable[[str], Any] | None) -> Callable[[str], Any]:
    """diffusers' module ``__getattr__``: a vit3 pipeline by name, else ``previous``'s answer (or none)."""

    def lookup(name: str) -> Any:
        if name in PIPELINES:
            return getattr(importlib.import_module(PIPELINES[name]), name)
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module 'diffusers' has no attribute {name!r}")

    return lookup


def _add_names(diffusers: ModuleType) -> None:
    previous = diffusers.__dict__.get("__getattr__")
    if getattr(previous, "__module__", None) != __name__:  # added once
        diffusers.__dict__["__getattr__"] = _name_lookup(previous)


class _WhenDiffusersLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first import of diffusers it steps aside, lets the other finders find it
    and has its loader add the names once diffusers' ``__init__`` ran."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "diffusers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                _add_names(sys.modules[fullname])  # diffusers' __init__ puts its lazy module there

            loader.exec_module = exec_module  # type: ignore[method-assign]  (this spec's loader only)
        return spec


def expose_pipelines() -> None:
    """Makes diffusers find the vit3 pipelines (:data:`PIPELINES`) by name, now if it is imported, else when
    it is (nothing where diffusers is not installed)."""
    diffusers = sys.modules.get("diffusers")
    if diffusers is not None:
        _add_names(diffusers)
    elif not any(isinstance(f, _WhenDiffusersLoads) for f in sys.meta_path):
        if importlib.util.find_spec("diffusers") is not None:
            sys.meta_path.insert(0, _WhenDiffusersLoads())
