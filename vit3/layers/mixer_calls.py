"""The calls a TTT mixer keeps: the route of each key and, in front of them, the short paths of a settled call
(``TTTMixer._mixed``): on the whole-mixer C++ op, with the op's constant arguments, or on the fused node."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from . import backends
from .fused_mix import MixLayout, MixSpec

# Keys a mixer keeps routes for before it starts over (grids and batch sizes of one model run are few).
MAX_CALLS = 16


class CppShort(NamedTuple):
    """A call settled on the whole-mixer C++ op (``Calls.short``): qkv's dtype, the grid, the op and its
    constant arguments after qkv and the weights."""

    dtype: torch.dtype
    grid: tuple[int, int]
    op: Callable[..., Tensor]
    args: tuple


class NodeShort(NamedTuple):
    """A call that ran unguarded on the fused node (``Calls.node``): its device, qkv's dtype, the grid, the
    weights' dtype and, per grad mode, its ``MixLayout`` with the input specialisation verified (``()``: a
    settled call; ``None``: no call of that grad mode kept)."""

    device: torch.device
    dtype: torch.dtype
    grid: tuple[int, int]
    wdtype: torch.dtype
    by_grad: list[tuple[MixLayout, tuple] | None]


class Call:
    """A mixer call's route as the mixer keeps it: the backends' ``Route``, the fused node's ``MixSpec``
    (``None`` unless ``route.fused``), whether it runs unguarded from now on (``backends.settled``), and the
    constant arguments of the whole-mixer C++ op after qkv and the weights (``None``: the Python node)."""

    __slots__ = ("cpp", "mix_spec", "route", "settled")

    def __init__(self, route: backends.Route, mix_spec: MixSpec | None, cpp: tuple | None) -> None:
        self.route, self.mix_spec, self.cpp, self.settled = route, mix_spec, cpp, bool(route.tracing)


class Calls:
    """A mixer's routes by key (``routes``, ``TTTMixer._call``) and, in front of them for
    ``TTTMixer._mixed``'s short path, per grad mode the last call settled on the whole-mixer C++ op
    (``short[grad]``, a ``CppShort``), with where the weights are read from (``sources``,
    ``TTTMixer._param_sources``) and the weights it took (``flat``: a later call takes the short path only
    while each ``sources`` entry still holds that same tensor, in that dtype), and where the weights are,
    looked up once (``weight_places``, ``TTTMixer._param_sources``; ``False``: not yet); and the last call
    unguarded on the fused node, taken as it is (``node``, a ``NodeShort``; ``TTTMixer._keep_node``).
    ``clear`` drops them all; so does every change the backends' routes depend on (a demotion, a new
    environment, ``backends.reset``): the cache is kept with them (``backends.keep_with_routes``).

    Why one object (in the mixer's ``__dict__``, a single leaf ``torch.export`` writes back as is) and why the
    short path: ``docs/design/dispatch.md``.
    """

    __slots__ = ("__weakref__", "flat", "node", "routes", "short", "sources", "weight_places")

    def __init__(self) -> None:
        self.routes: dict[tuple, Call] = {}
        self.clear()
        backends.keep_with_routes(self)

    def clear(self) -> None:
        self.routes.clear()
        self.short: list[CppShort | None] = [None, None]
        self.sources: list[tuple[dict[str, Tensor], str]] | None = None
        self.flat: list[Tensor] | None = None
        self.weight_places: list[tuple[dict[str, Tensor], str]] | bool | None = False
        self.node: NodeShort | None = None


def call_key(device: torch.device, dtype: torch.dtype, n: int, grad: bool, grid: tuple[int, int]) -> tuple:
    """A mixer's key for the route of a call on qkv of ``device``, ``dtype`` and ``n`` tokens
    (``TTTMixer._call``)."""
    return (device, dtype, n, grad, grid)
