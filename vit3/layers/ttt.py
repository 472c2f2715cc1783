"""The TTT token mixer: attention replaced by a small inner model trained at test time.

For each sample, each branch's inner model takes one (or more) gradient steps on the inner loss of all
(k, v) pairs of the image (non-causal, full sequence), then is applied to q. See ``TTTConfig`` for the
design space, the paper (Han et al., "ViT³: Unlocking Test-Time Training in Vision", CVPR 2026) for the
method, and the op references (``vit3.kernels.<op>.reference``) for the formulas of the official branches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from vit3.kernels import OPS
from vit3.kernels.common import autocast_backward, autocast_forward, autocast_off, grad_flows, normalize_grad
from vit3.kernels.mix.cpp import cpp_args

from . import backends
from .backends import MixerExplanation, ModelExplanation
from .config import GRID_MODELS, TTTConfig, check_count, is_count
from .fused_mix import MixBranch, MixSpec, fused_mix, mix_layout, node_call, takes
from .inner import assert_finite, create_inner_model, inner_loop
from .inner_math import shape_text, static_shape, static_sizes, tracing_kind
from .mixer_calls import MAX_CALLS, Call, Calls, CppShort, NodeShort, call_key
from .rope import apply_rope_2d, rope_tables

__all__ = [
    "OFFICIAL_MIXER_KEYS",
    "NonFiniteError",
    "TTTMixer",
    "explain",
    "inner_loop",
    "mixer_key_from_official",
    "normalize_grad",
]


class NonFiniteError(ValueError):
    """The mixer met non-finite tokens: bad input, or (in a finite-image training step) a diverged model."""


# Whether fused calls whose branches all run the C++ CPU kernel take the whole-mixer C++ op
# (``vit3.kernels.mix.cpp.cpp_args``); read when a call is routed. ``False`` keeps the Python node
# (``benchmarks/mixer_overhead.py --python-node``).
CPP_NODE = True


def _takes_cpp_op(route: backends.Route, mix_spec: MixSpec | None, dtype: torch.dtype) -> bool:
    """Whether an untraced call on ``route`` (its fused node's ``mix_spec``, ``None`` where not fused) with
    ``dtype`` qkv runs, once settled, as the whole-mixer C++ op ``torch.ops.vit3_cpu.mix``: every branch on
    ``cpu`` and in the op (``Node.mix``), qkv in a dtype the op computes in (float32, float64: a 16-bit qkv
    is cast first, off the op), ``CPP_NODE`` on (the call adds: no gates, the weights in qkv's dtype)."""
    return (
        CPP_NODE
        and (dtype is torch.float32 or dtype is torch.float64)
        and mix_spec is not None
        and all(b == "cpu" for b in route.backends)
        and all(OPS[br.op].paths["cpu"].node.mix is not None for br in mix_spec.branches)
    )


def _takes_as_is(mix_spec: MixSpec, dtype: torch.dtype, flat: list[Tensor]) -> bool:
    """Whether the fused node takes qkv of ``dtype`` and the initial weights ``flat`` as they are (``_fused``
    casts nothing): the weights in the inner loop's dtype (``dtype``, float32 at least), and qkv in it too or
    read as it is (``fused_mix.takes``)."""
    compute = torch.promote_types(dtype, torch.float32)
    return all(p.dtype == compute for p in flat) and (dtype == compute or takes(mix_spec, dtype))


def _fused(mix_spec: MixSpec, qkv: Tensor, flat: list[Tensor]) -> Tensor:
    """The fused node on ``qkv`` and the initial weights ``flat``. The inner loop runs in float32 at
    least (bf16/fp16 gradients of the inner loss are too coarse): a node whose branches all read 16-bit q, k,
    v as they are (Triton's, accumulating in float32; ``fused_mix.takes``) gets qkv so and float32 weights,
    the others a float32 copy of qkv, their read-out cast back to qkv's dtype."""
    dtype = qkv.dtype
    if _takes_as_is(mix_spec, dtype, flat):  # no casts to call
        return fused_mix(qkv, mix_spec, flat)
    compute = torch.promote_types(dtype, torch.float32)
    flat = [p if p.dtype == compute else p.to(compute) for p in flat]
    if _takes_as_is(mix_spec, dtype, flat):  # the weights cast; native 16-bit operands: no copy of qkv
        return fused_mix(qkv, mix_spec, flat)
    return fused_mix(qkv.to(compute), mix_spec, flat).to(dtype)


class TTTMixer(nn.Module):
    """Test-time-training token mixer (ViT³) for tokens ``[B, N, C]`` on an ``h x w`` grid.

    Branches sit side by side, each with its own heads of ``head_dim = dim // num_heads`` channels and its
    own q, k, v (laid out branch by branch in one ``qkv`` projection, as the official code does); their
    outputs are concatenated and projected back to ``dim``.

    Which implementation runs each branch (the Triton kernel, the C++ CPU kernel, the fused eager path or
    the generic inner loop) is decided by ``vit3.layers.backends``; ``explain`` says which and why. Where
    every branch takes the C++ kernel, settled calls run the whole-mixer C++ op (``_takes_cpp_op``). A mixer
    built under timm's ``set_scriptable(True)`` (``backends.scriptable_build``) runs the reference math of
    every branch (:meth:`reference_mix`), eager and under ``torch.jit.script`` alike.

    Args:
        dim: token width C.
        num_heads: heads of the main branch (branch specs without ``:k``).
        cfg: a ``TTTConfig`` (or dict); keyword overrides are applied on top.
    """

    # The routes, in the instance's ``__dict__`` once made (``_calls``); read so by ``_mixed``'s short path.
    _call_cache: Calls | None = None
    # TorchScript leaves the routes' cache alone (it would read the property, making it, and fail on its
    # type).
    __jit_ignored_attributes__ = ("_call_cache", "_calls")
    __jit_unused_properties__ = ("_calls",)

    def __init__(
        self, dim: int, num_heads: int = 8, cfg: TTTConfig | dict[str, Any] | None = None, **overrides: Any
    ) -> None:
        super().__init__()
        tokens = " (the tokens go to the call: TTTMixer(dim, num_heads)(x, grid))"
        dim = check_count("TTTMixer", "dim", dim, tokens if isinstance(dim, Tensor) else "")
        num_heads = check_count("TTTMixer", "num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads}")
        self.cfg = cfg = TTTConfig.create(cfg, **overrides)
        self.dim, self.num_heads = dim, num_heads
        self.head_dim = head_dim = dim // num_heads
        self.branch_specs = cfg.branch_specs(num_heads)
        # What the backend registry sees of each branch: (inner model, heads, head dim, bare model?).
        self.route_branches = tuple(
            (name, heads, head_dim, cfg.plain_branch(name)) for name, heads in self.branch_specs
        )
        self.widths = [heads * head_dim for _, heads in self.branch_specs]
        self.qkv_sizes = [w for w in self.widths for _ in range(3)]  # q, k, v of each branch in turn
        if cfg.rope:
            for (name, _), width in zip(self.branch_specs, self.widths):
                if name not in GRID_MODELS and width % 4:
                    raise ValueError(f"RoPE needs branch widths divisible by 4; branch {name!r} has {width}")
        self.scale = cfg.resolve_scale(head_dim)
        total = sum(self.widths)
        self.qkv = nn.Linear(dim, 3 * total, bias=cfg.qkv_bias)
        self.inner = nn.ModuleList(
            [create_inner_model(name, heads, head_dim, cfg) for name, heads in self.branch_specs]
        )
        self.lr_gate = (
            nn.Linear(dim, sum(h for _, h in self.branch_specs)) if cfg.lr_mode == "token" else None
        )
        self.proj = nn.Linear(total, dim)
        self.scriptable = backends.scriptable_build(cfg.backend)
        # What the reference path reads of the config as plain values (TorchScript reads no dataclass).
        self.loop_settings = (cfg.loss, float(cfg.inner_lr), cfg.steps, cfg.mini_batches, cfg.grad_norm)
        self.rope, self.rope_base = cfg.rope, float(cfg.rope_base)

    def check_shape(self, x: Tensor, grid: tuple[int, int]) -> None:
        """Checks tokens ``[B, N, C]`` against the mixer's width and ``grid`` (``ValueError`` naming them)."""
        if x.ndim != 3:
            raise ValueError(
                f"TTTMixer expects tokens [B, N, C], got a tensor of rank {x.ndim} {shape_text(x)}"
            )
        shape = static_shape(x)
        n, c = shape[1], shape[2]
        if c != self.dim:
            raise ValueError(f"TTTMixer built for C={self.dim} channels got C={c} (input {shape_text(x)})")
        h, w = grid
        if h < 1 or w < 1 or h * w != n:
            raise ValueError(f"grid {h}x{w} = {h * w} tokens does not fit N={n} (input {shape_text(x)})")

    def _check(self, x: Tensor, grid: tuple[int, int], kind: str) -> None:
        """Shape and (``TTTConfig.check_finite``, not under tracing: ``kind``) finiteness checks of the input;
        under a trace, the refusal of a legacy ONNX export with ``dynamic_axes``."""
        # under torch.jit.trace a grid read off a shape holds tensors: checked as ints, computed with as it is
        self.check_shape(x, tuple(static_sizes(grid)) if kind == "trace" else grid)
        if self.cfg.check_finite and not kind:
            assert_finite(x, NonFiniteError, "TTTMixer input contains non-finite values (NaN or Inf)")
        if kind == "trace" and backends.legacy_onnx_dynamic_axes():
            raise ValueError(
                "dynamic_axes: the legacy ONNX exporter (torch.onnx.export(dynamo=False)) fixes a ViT³ "
                "model's sizes (token counts, RoPE grids) at the example's, so its graph is wrong at any "
                "other; export without dynamic_axes, or with torch.onnx.export(dynamo=True, "
                "dynamic_shapes=...) or vit3's export.py onnx"
            )

    def _call(self, qkv: Tensor, grid: tuple[int, int], grad: bool, kind: str) -> Call:
        """This call's route: decided once per key (device, dtype, N, grad mode, grid) and kept on the mixer
        (``Calls``), in front of the backends' own cache (``backends.route``); traced calls ask that one.

        The config is read when a key is first routed (a mixer's config is fixed at construction).
        """
        key = call_key(qkv.device, qkv.dtype, qkv.shape[1], grad, grid)
        found = None if kind else self._calls.routes.get(key)
        if found is None:
            c = self.cfg
            route = backends.route(
                (c.loss, c.steps, c.mini_batches, c.lr_mode),
                c.backend,
                self.route_branches,
                qkv.device,
                qkv.dtype,
                backends.token_class(qkv.shape[1], kind),
                grad,
                kind,
                c.recompute,
            )
            mix_spec = self.mix_spec(route, grid) if route.fused else None
            cpp = cpp_args(mix_spec, qkv) if not kind and _takes_cpp_op(route, mix_spec, qkv.dtype) else None
            found = Call(route, mix_spec, cpp)
            if not kind:  # traced grids and sizes may be symbolic: not kept
                calls = self._calls
                if len(calls.routes) >= MAX_CALLS:
                    calls.clear()
                calls.routes[key] = found
        return found

    def explain(
        self, x: Tensor, grid: tuple[int, int], grad: bool | None = None
    ) -> backends.MixerExplanation:
        """Which backend a forward on ``x`` would run for each branch, and why each other one was passed over.

        Args:
            x: tokens ``[B, N, C]`` (only their device, dtype under the current autocast, and N matter).
            grid: ``(h, w)``.
            grad: explain the route with gradients flowing; ``None``: as a forward here would (grad mode on
                and parameters or ``x`` requiring grad).

        Returns:
            A ``MixerExplanation`` (``str()`` is a table; ``to_dict()`` for JSON).
        """
        self._check(x, grid, tracing_kind())
        if grad is None:
            grad = grad_flows(x, *self.parameters())
        with torch.no_grad():
            qkv = self.qkv(x[:, :1])  # the dtype the backends read (autocast's, under autocast)
        return backends.explain_mixer(self, qkv.device, qkv.dtype, grid, grad)

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """Mixes tokens ``[B, N, C]`` laid out on ``grid = (h, w)`` (raster order); returns ``[B, N, C]``.

        Inside a plain ViT³ block on a CPU, settled calls run the whole block as one C++ op and do not come
        here (a breakpoint goes silent after warm-up; ``vit3.explain(model, ...)`` says which blocks,
        docs/layout.md follows the call)."""
        # Compiled by TorchScript (a mixer built scriptable): the reference path, no finiteness check.
        if torch.jit.is_scripting():
            self.check_shape(x, grid)
            gates = torch.sigmoid(self.lr_gate(x)).transpose(1, 2) if self.lr_gate is not None else None
            return self.proj(self.reference_mix(self.qkv(x), grid, gates))
        return self._forward(x, grid)

    def _forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """``forward`` in Python: the checks, the token gates, ``mix`` between the projections."""
        kind = tracing_kind()
        self._check(x, grid, kind)
        gates = (
            torch.sigmoid(self.lr_gate(x)).transpose(1, 2) if self.lr_gate is not None else None
        )  # [B, G, N]
        if self._recompute_qkv(x, kind):  # the backward reruns qkv and the inner loops: only x is saved here
            params = [p for m in (self.qkv, self.inner) for p in m.parameters()]
            mixed = _RecomputedMix.apply(self, grid, x, gates, *params)
        else:
            mixed = self._mixed(self.qkv(x), grid, gates, kind)
        return self.proj(mixed)

    def _project_and_mix(self, x: Tensor, grid: tuple[int, int], gates: Tensor | None) -> Tensor:
        return self.mix(self.qkv(x), grid, gates)

    def _recompute_qkv(self, x: Tensor, kind: str) -> bool:
        """``recompute="qkv"`` (config or ``$VIT3_TTT_RECOMPUTE``) and gradients flowing, outside tracing."""
        if kind or not torch.is_grad_enabled():
            return False
        return backends.recompute_mode(self.cfg.recompute)[0] == "qkv" and (
            x.requires_grad or self.qkv.weight.requires_grad
        )

    def mix(self, qkv: Tensor, grid: tuple[int, int], gates: Tensor | None = None) -> Tensor:
        """The inner loops of every branch, between the two projections.

        Args:
            qkv: the qkv projection output ``[B, N, 3 * sum(widths)]`` (branch by branch: q, k, v).
            grid: ``(h, w)``.
            gates: token lr gates ``[B, sum(heads), N]``, required when ``lr_mode="token"`` and refused
                otherwise.

        Returns:
            The branch read-outs concatenated, ``[B, N, sum(widths)]``, in ``qkv``'s dtype.
        """
        if (gates is None) != (self.lr_gate is None):
            need = "needs" if gates is None else "takes no"
            raise ValueError(f"TTTMixer.mix: lr_mode={self.cfg.lr_mode!r} {need} token lr gates (gates=)")
        return self._mixed(qkv, grid, gates, tracing_kind())

    def _mixed(self, qkv: Tensor, grid: tuple[int, int], gates: Tensor | None, kind: str) -> Tensor:
        """``mix`` under tracing ``kind`` (``inner_math.tracing_kind()``), which ``forward`` has asked."""
        # The short path (``Calls``): the last settled call on the whole-mixer C++ op kept for this grad mode
        # (``_cpp_call``), where it had this dtype and grid, on a CPU qkv, with the same weight tensors in
        # that dtype: the conditions of ``settled_cpp_args`` without building its route key (N is the grid's,
        # which the op checks), outside tracing. Written out in this one frame (``grad_flows``'s rule too):
        # beside the op's kernels on a CPU every Python call here counts (``benchmarks/mixer_overhead.py``).
        batch = static_shape(qkv)[0] if kind == "trace" else qkv.shape[0]
        if not batch:  # no kernel path takes an empty batch
            return self._empty_mix(qkv, gates)
        if self.scriptable:  # built for TorchScript: the path it compiles, eager too (autocast off inside)
            with autocast_off(qkv.device.type):
                return self.reference_mix(qkv, grid, gates)
        if gates is None and not kind:
            calls = self._call_cache
            flat = calls.flat if calls is not None else None
            if flat is not None:
                call = calls.short[
                    torch.is_grad_enabled() and (qkv.requires_grad or any(p.requires_grad for p in flat))
                ]
                if call is not None and call.dtype is qkv.dtype and call.grid == grid and qkv.is_cpu:
                    dtype = call.dtype
                    for (params, name), p in zip(calls.sources, flat):
                        if params.get(name) is not p or p.dtype is not dtype:
                            break
                    else:
                        return call.op(qkv, flat, *call.args)
            node = calls.node if calls is not None else None
            # the short path of a settled call on the fused node (``_keep_node``): this device, dtype and
            # grid, the weights in the dtype it had, and on a backend that specialises (Triton) the input
            # specialisation it verified
            if (
                node is not None
                and node.dtype is qkv.dtype
                and node.grid == grid
                and qkv.device == node.device
            ):
                flat = [p for m in self.inner for p in m.initial_params().values()]
                grad = torch.is_grad_enabled() and (qkv.requires_grad or any(p.requires_grad for p in flat))
                kept = node.by_grad[grad]  # its layout, and the specialisation verified (``()``: settled)
                if (
                    kept is not None
                    and all(p.dtype is node.wdtype for p in flat)
                    and (not kept[1] or backends.specialisation([qkv, *flat]) == kept[1])
                ):
                    return node_call(qkv, flat, kept[0], grad)
        return self._mix_tokens(qkv, grid, gates, kind)

    def _empty_mix(self, qkv: Tensor, gates: Tensor | None) -> Tensor:
        """``mix`` of an empty batch (``qkv`` ``[0, N, 3 * sum(widths)]``): ``[0, N, sum(widths)]``, as a timm
        model returns an empty result for no images; a backward through it gives every weight a zero
        gradient."""
        out = qkv.narrow(-1, 0, sum(self.widths))
        for t in (*self.inner.parameters(), *([] if gates is None else [gates])):
            out = out + t.sum().to(out.dtype)
        return out

    def _mix_tokens(self, qkv: Tensor, grid: tuple[int, int], gates: Tensor | None, kind: str) -> Tensor:
        """``_mixed`` past its short path: the routed call."""
        if not kind and gates is None and (out := self._cpp_call(qkv, grid)) is not None:
            return out
        weights = [model.initial_params() for model in self.inner]
        flat = [p for w in weights for p in w.values()]
        grad = grad_flows(qkv, gates, *flat)
        call = self._call(qkv, grid, grad, kind)
        route = call.route
        with autocast_off(qkv.device.type):  # the inner loops compute in qkv's dtype
            if not route.fused:  # every branch on the generic inner loop, which needs no guard
                return self.reference_mix(qkv, grid, gates)
            if call.settled:  # verified: no guard, the node itself
                if gates is None and not kind:
                    self._keep_node(qkv, grid, call.mix_spec, flat, grad, ())
                return _fused(call.mix_spec, qkv, flat)
            names = [list(w) for w in weights]

            def compute(p: backends.Route, qkv: Tensor, *flat: Tensor) -> Tensor:
                if p.fused:
                    return _fused(self.mix_spec(p, grid), qkv, list(flat))
                it = iter(flat)  # a branch demoted to generic: every branch with it
                again = [{name: next(it) for name in branch} for branch in names]
                return self.reference_mix(qkv, grid, gates, again)

            tensors = [qkv, *flat]
            unguarded = backends.unguarded(route, tensors)
            if unguarded is None:  # a key's first calls, a new input specialisation
                out = backends.guarded(route, compute, tensors)
                call.settled = backends.settled(route)
                return out
            out = _fused(call.mix_spec, qkv, flat)  # the route's own spec: no demotion to reroute
            call.settled = unguarded == ()
            # a backend that specialises (Triton) never settles: its verified specialisation is kept instead
            # (a settled call is kept above, once the C++ op has passed it)
            if unguarded and gates is None and not kind:
                self._keep_node(qkv, grid, call.mix_spec, flat, grad, unguarded)
            return out

    def reference_mix(
        self,
        qkv: Tensor,
        grid: tuple[int, int],
        gates: Tensor | None = None,
        weights: list[dict[str, Tensor]] | None = None,
    ) -> Tensor:
        """``mix`` by the reference math of every branch (``InnerModel.ttt``): the generic backend, and the
        path a mixer built scriptable runs, eager and compiled by TorchScript.

        Args:
            qkv: ``[B, N, 3 * sum(widths)]``; grid: ``(h, w)``; gates: ``[B, sum(heads), N]`` or ``None``.
            weights: each branch's initial weights by name; ``None``: the inner models' own.

        Returns:
            ``[B, N, sum(widths)]`` in ``qkv``'s dtype.
        """
        loss, lr, steps, mini_batches, grad_norm = self.loop_settings
        pieces, outs, offset = self._split(qkv), [], 0
        for i, model in enumerate(self.inner):
            heads = self.branch_specs[i][1]
            q, k, v, gate = self._branch_inputs(pieces, i, heads, model.grid_model, grid, gates, offset)
            offset += heads
            if weights is None:
                params = model.initial_params()
            else:
                params = weights[i]
            y = model.ttt(q, k, v, params, grid, gate, loss, self.scale, lr, steps, mini_batches, grad_norm)
            outs.append(y.to(qkv.dtype).transpose(1, 2))  # [B, N, G, c]
        return self._joined(outs, qkv)

    def _split(self, qkv: Tensor) -> list[Tensor]:
        """q, k, v of every branch, ``[B, N, width]`` each. One split for all branches: its backward is a
        single concatenation, where slicing per branch would make autograd zero-fill and add a full-size qkv
        gradient for every slice."""
        return list(qkv.split(self.qkv_sizes, dim=-1))

    def _branch_inputs(
        self,
        pieces: list[Tensor],
        i: int,
        heads: int,
        grid_model: bool,
        grid: tuple[int, int],
        gates: Tensor | None,
        offset: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Branch ``i``'s q, k, v ``[B, G, N, c]`` (RoPE on q and k where it applies, in the io dtype) and
        its token lr gate ``[B, G, N]`` (the ``heads`` rows of ``gates`` from ``offset``, compute dtype)."""
        q, k, v = pieces[3 * i], pieces[3 * i + 1], pieces[3 * i + 2]
        io_dtype = q.dtype
        # The inner loop runs in float32 at least (bf16/fp16 gradients of the inner loss are too coarse).
        compute = torch.promote_types(io_dtype, torch.float32)
        gate = None if gates is None else gates[:, offset : offset + heads].to(compute)
        if self.rope and not grid_model:  # one angle table for q and k
            rope = rope_tables(grid, static_shape(q)[-1], self.rope_base, q.device, compute)
            # back to the io dtype, as the fused node hands them on: q, k, v share one dtype
            q = apply_rope_2d(q, grid, self.rope_base, False, rope).to(io_dtype)
            k = apply_rope_2d(k, grid, self.rope_base, False, rope).to(io_dtype)
        # [B, N, G*c] -> [B, G, N, c]: strided views of qkv, no copy
        shape = [heads, self.head_dim]
        q = q.unflatten(-1, shape).transpose(1, 2)
        k = k.unflatten(-1, shape).transpose(1, 2)
        v = v.unflatten(-1, shape).transpose(1, 2)
        return q, k, v, gate

    @staticmethod
    def _joined(outs: list[Tensor], qkv: Tensor) -> Tensor:
        """The branch read-outs ``[B, N, G, c]`` as ``[B, N, sum(G) * c]``: concatenating along the head dim
        writes them in token order in one pass."""
        b, n = qkv.shape[0], qkv.shape[1]
        return torch.cat(outs, dim=2).view(b, n, -1) if len(outs) > 1 else outs[0].reshape(b, n, -1)

    def _keep_node(
        self,
        qkv: Tensor,
        grid: tuple[int, int],
        spec: MixSpec,
        flat: list[Tensor],
        grad: bool,
        unguarded: tuple,
    ) -> None:
        """Keeps a call on the fused node that ran unguarded (``backends.unguarded``: settled, ``()``, or on a
        verified input specialisation) for ``_mixed``'s short path (``Calls.node``), where ``_fused`` hands
        the node qkv and the weights as they are (no cast), per grad mode (``grad``: ``grad_flows``)."""
        dtype, wdtype = qkv.dtype, flat[0].dtype
        if not _takes_as_is(spec, dtype, flat):
            return
        calls = self._calls
        node = calls.node
        if node is None or node[:4] != (qkv.device, dtype, grid, wdtype):
            node = calls.node = NodeShort(qkv.device, dtype, grid, wdtype, [None, None])
        node.by_grad[grad] = (mix_layout(spec), unguarded)

    def _cpp_call(self, qkv: Tensor, grid: tuple[int, int]) -> Tensor | None:
        """A settled call on the whole-mixer C++ op (no node in Python), or ``None`` where this call takes the
        general path (``settled_cpp_args``). The call is kept for ``_mixed``'s short path
        (``Calls.short``)."""
        found = self.settled_cpp_args(qkv.device, qkv.dtype, qkv.shape[1], grid, qkv)
        if found is None:
            return None
        flat, *cpp = found
        overload = torch.ops.vit3_cpu.mix.default
        # the overload's C++ callable, which its ``__call__`` (one Python frame more) calls
        op = getattr(overload, "_op", overload)
        calls = self._calls
        calls.sources, calls.flat = self._param_sources(), flat
        calls.short[grad_flows(qkv, *flat)] = CppShort(qkv.dtype, grid, op, cpp)
        return op(qkv, *found)

    def settled_cpp_args(
        self,
        device: torch.device,
        dtype: torch.dtype,
        n: int,
        grid: tuple[int, int],
        *inputs: Tensor | None,
    ) -> tuple | None:
        """The arguments of ``torch.ops.vit3_cpu.mix`` after qkv (the initial weights, then the route's
        constants) for a call on qkv of ``device``, ``dtype`` and ``n`` tokens on ``grid``, that qkv requiring
        grad as ``inputs`` say (``grad_flows``: qkv itself, or what it is computed from); ``None`` where that
        call takes the general path (not routed or not settled yet, other backends, weights not the
        parameters themselves or in another dtype). A ``TTTBlock`` asks it to run the whole block as one
        op."""
        sources = self._param_sources()
        if sources is None:
            return None
        try:
            flat = [d[name] for d, name in sources]
        except KeyError:  # a parametrization moved a parameter out of ``_parameters``: looked up again
            calls = self._calls
            calls.weight_places, calls.sources, calls.flat = False, None, None
            return None
        call = self._calls.routes.get(call_key(device, dtype, n, grad_flows(*inputs, *flat), grid))
        if call is None or call.cpp is None or not call.settled or any(p.dtype is not dtype for p in flat):
            return None
        return (flat, *call.cpp)

    def runs_cpp_op(self, route: backends.Route, grid: tuple[int, int], dtype: torch.dtype) -> bool:
        """Whether a settled call on ``route`` with ``dtype`` tokens runs as the whole-mixer C++ op (what
        ``explain`` says; the call's own rule, ``_takes_cpp_op``, with the parameters in that dtype)."""
        mix_spec = self.mix_spec(route, grid) if route.fused else None
        return all(
            p.dtype is dtype for m in self.inner for p in m.initial_params().values()
        ) and _takes_cpp_op(route, mix_spec, dtype)

    def mix_spec(self, route: backends.Route, grid: tuple[int, int]) -> MixSpec:
        """The fused node's ``MixSpec`` for ``route`` on ``grid``."""
        cfg = self.cfg
        branches, offset = [], 0
        for (name, heads), width, backend in zip(self.branch_specs, self.widths, route.backends):
            rope = cfg.rope and name not in GRID_MODELS
            branches.append(MixBranch(name, offset, heads, self.head_dim, rope, backend))
            offset += 3 * width
        return MixSpec(
            tuple(branches), grid, self.scale, cfg.inner_lr, cfg.grad_norm, cfg.rope_base, route.recompute
        )

    def _param_sources(self) -> list[tuple[dict[str, Tensor], str]] | None:
        """Where each initial weight of the whole-mixer C++ op is, branch by branch in ``initial_params``
        order: the ``(module._parameters, name)`` it is read from on every call (so a parameter replaced by
        ``.to()``, ``load_state_dict`` or assignment, or its ``requires_grad`` changed, is seen); ``None``
        where an inner model's initial weights are not its parameters themselves, nor views of them its op
        takes as stored (``Node.stored``: the depthwise conv weight's): then ``initial_params`` on every
        call)."""
        calls = self._calls
        sources = calls.weight_places
        if sources is not False:
            return sources
        sources = []
        for (op_name, _), model in zip(self.branch_specs, self.inner):
            cpu = OPS[op_name].paths.get("cpu") if op_name in OPS else None
            stored = cpu.node.stored if cpu is not None else None
            for name, t in model.initial_params().items():
                p = model._parameters.get(name)
                if p is None or (p is not t and not (stored is not None and stored(p, t))):
                    sources = None
                    break
                sources.append((model._parameters, name))
            if sources is None:
                break
        calls.weight_places = sources
        return sources

    @property
    def _calls(self) -> Calls:
        """The routes of this mixer's calls by key (``_call``); not copied by pickling (``__getstate__``)."""
        calls = self._call_cache
        if calls is None:
            calls = self.__dict__["_call_cache"] = Calls()
        return calls

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state.pop("_call_cache", None)  # routes hold this process's devices and verified kernels
        return state

    def __prepare_scriptable__(self) -> TTTMixer:
        """``torch.jit.script`` calls this on every module first: a mixer built scriptable is compiled as it
        is (its reference path); another refuses, naming what works, before TorchScript's compiler fails deep
        inside on the Python it cannot compile (the backend registry, its cached routes, the fused nodes)."""
        if self.scriptable:
            return self
        raise RuntimeError(
            "TorchScript (torch.jit.script) compiles a ViT³ model built for it: build it under "
            "timm.layers.set_scriptable(True) (timm.create_model(name, scriptable=True)), which runs the "
            "reference path; this one chose its kernels at build. Or use torch.jit.trace (a static graph), "
            "torch.export.export (dynamic sizes), torch.compile, or vit3.export.export_onnx."
        )

    def extra_repr(self) -> str:
        branches = ", ".join(f"{name}x{heads}" for name, heads in self.branch_specs)
        c = self.cfg
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, branches=[{branches}], loss={c.loss}, "
            f"lr={c.inner_lr}({c.lr_mode}), steps={c.steps}, mini_batches={c.mini_batches}, "
            f"grad_norm={c.grad_norm}, scale={self.scale:.4g}, rope={c.rope}"
        )


class _RecomputedMix(torch.autograd.Function):
    """``mixer.mix(mixer.qkv(x))`` saving only x (and the gates): the backward reruns the projection and the
    inner loops with gradients and differentiates that (``TTTConfig.recompute="qkv"``).

    Not ``torch.utils.checkpoint``: its non-reentrant form matches the saved tensors of the rerun against the
    first run's, and the mixer's first calls of a route run guarded (``backends.guarded``), later ones not.
    The rerun takes the forward's autocast state (``autocast_backward``), so it recomputes what the forward
    did.
    """

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any, mixer: TTTMixer, grid: tuple[int, int], x: Tensor, gates: Tensor | None, *params: Tensor
    ):
        ctx.mixer, ctx.grid, ctx.has_gates = mixer, grid, gates is not None
        ctx.save_for_backward(x, *([gates] if gates is not None else []))
        with torch.no_grad():
            return mixer._project_and_mix(x, grid, gates)

    @staticmethod
    @autocast_backward
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        mixer = ctx.mixer
        x, *rest = ctx.saved_tensors
        x = x.detach().requires_grad_()
        gates = rest[0].detach().requires_grad_() if ctx.has_gates else None
        params = [p for m in (mixer.qkv, mixer.inner) for p in m.parameters()]
        with torch.enable_grad():
            out = mixer._project_and_mix(x, ctx.grid, gates)
        wanted = [x, *([gates] if gates is not None else []), *(p for p in params if p.requires_grad)]
        grads = iter(torch.autograd.grad(out, wanted, d_out, allow_unused=True))
        dx, dgates = next(grads), next(grads) if gates is not None else None
        return None, None, dx, dgates, *(next(grads) if p.requires_grad else None for p in params)


def _register_fx_leaf() -> None:
    # The mixer validates shapes and values with Python control flow: FX must treat it as one leaf call.
    try:
        from timm.layers import register_notrace_module
    except ImportError:  # pragma: no cover - older timm
        return
    register_notrace_module(TTTMixer)


_register_fx_leaf()


# Official ViT³ mixer parameter names -> ours (the official mixer is branches ("swiglu", "dwconv:1")).
OFFICIAL_MIXER_KEYS = {"w1": "inner.0.w1", "w2": "inner.0.w2", "w3": "inner.1.weight"}


def mixer_key_from_official(key: str) -> str:
    """Maps an official mixer key (``attn.w3``, ``layers.0.blocks.1.attn.w1``, ``qkv.weight``...) to ours.

    Only the inner weights move (``w1``/``w2`` -> ``inner.0.*``, ``w3`` -> ``inner.1.weight``); ``qkv`` and
    ``proj`` keep their names and every official tensor keeps its shape.
    """
    prefix, _, leaf = key.rpartition(".")
    if leaf in OFFICIAL_MIXER_KEYS:
        return f"{prefix}.{OFFICIAL_MIXER_KEYS[leaf]}" if prefix else OFFICIAL_MIXER_KEYS[leaf]
    return key


def _image_size(size: Any) -> tuple[int, int]:
    """``(h, w)`` of an image size given to :func:`explain`: ``s``, or a tuple ending in ``(h, w)``."""
    sides = list(size)[-2:] if isinstance(size, list | tuple) else [size]
    if not sides or not all(is_count(s) for s in sides):
        numbers = all(isinstance(s, int) and not isinstance(s, bool) for s in sides)
        raise (ValueError if sides and numbers else TypeError)(
            "explain inputs must be an image batch (a Tensor) or an image size (a positive integer or "
            f"(height, width) of them), got {size!r}"
        )
    return int(sides[0]), int(sides[-1])


def explain(
    model: nn.Module, inputs: Tensor | int | tuple[int, ...], *, grad: bool = False, batch: int = 1
) -> ModelExplanation:
    """The backend of every branch of every TTT mixer of ``model`` for one input, and why; and whether each
    ``TTTBlock`` runs as one op (``TTTBlock.explain_one_op``).

    Runs one forward (without gradients) with hooks that capture each mixer's input and grid (and each block's
    input); mixers with the same route, and blocks with the same answer, are listed together.

    Args:
        model: any module holding ``TTTMixer`` s (vit3 models, ``swap_attention_for_ttt`` results).
        inputs: an input batch, or an image size (``224``, ``(h, w)``) for random images of ``batch`` samples
            on the model's device and dtype.
        grad: explain the training route (gradients flowing) instead of the inference one.
        batch: samples of the random batch.

    Raises:
        TypeError: ``model`` is no module (e.g. a model's name: build the model first).
        TypeError: ``inputs`` is neither a tensor nor an image size (e.g. ``"224"``); ``batch`` no integer.
        ValueError: an image side or ``batch`` below 1.
    """
    if not isinstance(model, nn.Module):
        build = (
            f": build it first, e.g. explain(timm.create_model({model!r}), ...)"
            if isinstance(model, str)
            else ""
        )
        raise TypeError(f"explain takes a model (an nn.Module), got {model!r}{build}")
    batch = check_count("explain", "batch", batch)
    if not isinstance(inputs, Tensor):
        h, w = _image_size(inputs)
        ref = next(model.parameters())
        inputs = torch.randn(batch, getattr(model, "in_chans", 3), h, w, device=ref.device, dtype=ref.dtype)
    found: dict[MixerExplanation, list[str]] = {}

    def hook(name: str) -> Callable[..., None]:
        def capture(module: TTTMixer, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["x"]
            grid = args[1] if len(args) > 1 else kwargs["grid"]
            found.setdefault(module.explain(x, grid, grad=grad), []).append(name)

        return capture

    blocks: dict[str, list[str]] = {}

    def block_hook(name: str) -> Callable[..., None]:
        def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["x"]
            blocks.setdefault(module.explain_one_op(x, grad), []).append(name)

        return capture

    handles = [
        m.register_forward_pre_hook(hook(name), with_kwargs=True)
        for name, m in model.named_modules()
        if isinstance(m, TTTMixer)
    ]
    # blocks that can run as one op say whether they do (``TTTBlock``, which imports this module)
    handles += [
        m.register_forward_pre_hook(block_hook(name), with_kwargs=True)
        for name, m in model.named_modules()
        if callable(getattr(m, "explain_one_op", None))
    ]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return ModelExplanation(
        tuple((tuple(names), expl) for expl, names in found.items()),
        tuple((tuple(names), why) for why, names in blocks.items()),
    )
