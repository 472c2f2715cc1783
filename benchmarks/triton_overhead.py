"""The Python (CPU) time of the Triton path per call, with the kernel launches stubbed out.

What a GPU host's CPU spends around the kernels (argument checks, the cached launch plan, the autograd node),
measured on CPU tensors with Triton's launcher a no-op and the CPU taken for a GPU. Reported per call, median
of interleaved repeats, in microseconds: ``triton_ttt`` of each branch, the Triton path of one mixer call
as one launch program and branch by branch (and over the floor: an empty autograd node), H-ViT³'s mixer, and
for scale a whole ``TTTMixer`` and one ``torch.empty``. Triton's own launch cost is not included. Method:
benchmarks/README.md.

    python benchmarks/triton_overhead.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if os.environ.pop("TRITON_INTERPRET", None) == "1":  # before Triton is imported: the GPU host's custom ops
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
from triton.runtime import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, FloorNode, GpuDriver, print_table, time_samples, write_csv
from vit3.kernels.triton import checks, device, op, tiles
from vit3.layers import TTTMixer, fused_mix
from vit3.layers.backends import verify


def stub_launches() -> list[str]:
    """Makes the CPU look like a GPU to the Triton path and Triton's launchers no-ops that record their
    kernel: ``JITFunction.run`` (called by ``kernel[grid](...)``) and the compiled kernels a launch program
    calls itself (``JITFunction.warmup`` compiles nothing, the compiled kernel's ``[grid]`` launches nothing);
    the registry still guards each new input specialisation, as on a GPU, but takes it as verified
    (``verify.COMPARE`` off; stubbed launches compute nothing: a comparison would demote them). A compiled
    kernel's launch calls each pointer argument's ``data_ptr`` as Triton's launcher does."""
    launched: list[str] = []

    class Compiled:
        def __init__(self, name: str) -> None:
            self.name = name
            self.pointers: list[int] | None = None  # the positions of arguments with a ``data_ptr``

        def __getitem__(self, grid: tuple[int, int, int]) -> Callable[..., None]:
            def launch(*args: Any, stream: int | None = None) -> None:
                # Triton's launcher takes an integer pointer as it is and calls ``data_ptr()`` of anything
                # else (then asks the driver about the address: not emulated)
                if self.pointers is None:
                    self.pointers = [i for i, a in enumerate(args) if hasattr(a, "data_ptr")]
                for i in self.pointers:
                    args[i].data_ptr()
                launched.append(self.name)

            return launch

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Compiled:
        if not warmup:
            launched.append(self.fn.__name__)
        return Compiled(self.fn.__name__)

    JITFunction.run = run
    driver.set_active(GpuDriver())  # the stream a launch program asks for once per launch list
    for module in (device, checks):
        module.triton_runs_on = lambda where: True
    sys.modules["vit3.kernels"].triton_runs_on = device.triton_runs_on
    tiles.fits_device = lambda *args: (True, "")
    verify.COMPARE = False  # a new specialisation is taken as verified
    return launched


NODE = "triton path per mixer call: fused node"


def _train_backward(outs: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
    """``backward()`` on ``outs`` as a training step runs it, after ``zero_grad()`` (every ``.grad`` ``None``,
    PyTorch's default): autograd keeps a node's gradient as its ``.grad``, or copies it where its layout is
    not its weight's (accumulating into a kept ``.grad`` instead would hide that copy)."""
    for t in leaves:
        t.grad = None
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _node_calls(qkv: torch.Tensor, weights: list[torch.Tensor], grid: tuple[int, int], heads: int,
                scale: float) -> dict[str, Callable[[], None]]:  # fmt: skip
    """The fused node of both branches on Triton: inference, and forward + backward end to end; as one launch
    program (``triton.program``, where the tree has it) and branch by branch (the ``Node`` hooks), and both
    with RoPE on the SwiGLU branch (H-ViT³'s mixer: q, k rotated by the program's kernels or around the
    hooks); the program through the mixer op ``vit3::mix``, called eagerly (the dispatcher's cost) and
    compiled (``aot_eager``), and through a settled mixer's ``TTTMixer.mix`` (its short path, what a model's
    call runs between the projections); and the floor of any Python autograd node with its inputs
    (``common.FloorNode``). ``{}`` on a tree without the Triton node."""
    if "path" not in fused_mix.MixBranch._fields:
        return {}
    c, d = weights[0].shape[1] * weights[0].shape[2], weights[0].shape[2]
    branches = (fused_mix.MixBranch("swiglu", 0, heads, d, False, "triton"),
                fused_mix.MixBranch("dwconv", 3 * c, 1, d, False, "triton"))  # fmt: skip
    layout = fused_mix.mix_layout(fused_mix.MixSpec(branches, grid, scale, 1.0, True, 10000.0))
    layouts = {"branch hooks": layout._replace(whole=None) if hasattr(layout, "whole") else layout}
    if getattr(layout, "whole", None) is not None:
        layouts = {"program": layout} | layouts
    # H-ViT³'s mixer: RoPE on the SwiGLU branch's q, k (rotated by the program's kernels, around the hooks)
    rope = (branches[0]._replace(rope=True), branches[1])
    rope_layout = fused_mix.mix_layout(fused_mix.MixSpec(rope, grid, scale, 1.0, True, 10000.0))
    if getattr(rope_layout, "whole", None) is not None:
        layouts["rope, program"] = rope_layout
    layouts["rope, branch hooks"] = (
        rope_layout._replace(whole=None) if hasattr(rope_layout, "whole") else rope_layout
    )

    def infer(layout: Any) -> Callable[[], None]:
        plain = qkv.detach()
        return lambda: fused_mix._forward(plain, layout, False, tuple(weights))

    def both(layout: Any) -> Callable[[], None]:
        def run() -> None:
            _train_backward([fused_mix._FusedMix.apply(qkv, layout, None, *weights)], [qkv, *weights])

        return run

    def floor() -> None:
        _train_backward([FloorNode.apply(qkv, c + d, *weights)], [qkv, *weights])

    def through(call: Callable[..., Any]) -> Callable[[], None]:
        args = fused_mix.op_args(layout.spec)

        def run() -> None:
            _train_backward([call(qkv, *weights, args=args)], [qkv, *weights])

        return run

    def op_call(qkv: torch.Tensor, *weights: torch.Tensor, args: tuple) -> torch.Tensor:
        return fused_mix.mix_op(qkv, list(weights), *args, True)[0]

    fns = {}
    for how, lay in layouts.items():
        fns[f"{NODE} infer ({how})"] = infer(lay)
        fns[f"{NODE} fwd+bwd ({how})"] = both(lay)
    if "program" in layouts:  # the mixer op: called eagerly (the dispatcher's cost), compiled (the graph's)
        fns[f"{NODE} fwd+bwd (program, through the op)"] = through(op_call)
        compiled = torch.compile(op_call, backend="aot_eager", fullgraph=True)
        fns[f"{NODE} fwd+bwd (program, the op compiled)"] = through(compiled)
        mixer = TTTMixer(c, heads, backend="triton")
        inner = list(mixer.inner.parameters())

        def mix() -> None:
            _train_backward([mixer.mix(qkv, grid)], [qkv, *inner])

        fns[f"{NODE} fwd+bwd (program, TTTMixer.mix)"] = mix
    fns["floor: an empty autograd node, fwd+bwd"] = floor
    return fns


BACK_TO_BACK = 20


def _repeated(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` ``BACK_TO_BACK`` times in a row."""

    def run() -> None:
        for _ in range(BACK_TO_BACK):
            fn()

    return run


# Whether the node timers (``_timed``) record, and the suffix of the rows they record into: only inside the
# calls ``_recorded`` marks (not the whole mixer's).
_RECORDING: dict[str, str | None] = {"on": None}


def _recorded(fn: Callable[[], None], suffix: str = "") -> Callable[[], None]:
    def run() -> None:
        _RECORDING["on"] = suffix
        try:
            fn()
        finally:
            _RECORDING["on"] = None

    return run


def _timed(cls: Any, name: str, into: Callable[[Any], list[float] | None]) -> None:
    """Wraps ``cls.name`` (an autograd node's staticmethod) to append its seconds per call to ``into(ctx)``
    while ``_RECORDING`` is on (``None``: not recorded)."""
    real = getattr(cls, name)

    def timed(ctx: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(ctx, *args)
        finally:
            found = into(ctx) if _RECORDING["on"] is not None else None
            if found is not None:
                found.append(time.perf_counter() - start)

    setattr(cls, name, staticmethod(timed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--side", type=int, default=4, help="tokens: side x side")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "triton_overhead.csv")
    p.add_argument("--tree", default="", help="a label for the tree measured (a column of the CSV)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    launched = stub_launches()
    b, c, h, n = args.batch, args.dim, args.heads, args.side**2
    d = c // h
    grid = (args.side, args.side)
    qkv = torch.randn(b, n, 3 * (c + d), requires_grad=True)
    weights = [torch.randn(1, h, d, d, requires_grad=True) for _ in range(2)]
    weights.append(torch.randn(1, d, 3, 3, requires_grad=True))
    q1, k1, v1, q2, k2, v2 = qkv.split([c, c, c, d, d, d], dim=-1)
    heads = {"swiglu": h, "dwconv": 1}
    views = {
        "swiglu": [t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q1, k1, v1)],
        "dwconv": [t.unflatten(-1, (1, -1)).transpose(1, 2) for t in (q2, k2, v2)],
    }
    params = {"swiglu": dict(zip(("w1", "w2"), weights[:2])), "dwconv": {"weight": weights[2]}}

    def call(name: str) -> torch.Tensor:
        return op.triton_ttt(name, *views[name], params[name], grid=grid, scale=9**-0.5, backend="triton")

    def infer(name: str):
        def run() -> None:
            with torch.no_grad():
                call(name)

        return run

    def forward(name: str):
        return lambda: call(name)

    def both(name: str):
        def run() -> None:
            _train_backward([call(name)], [qkv, *weights])

        return run

    def path() -> None:
        _train_backward([call(name) for name in heads], [qkv, *weights])

    mixer = TTTMixer(c, h, backend="triton")
    x = torch.randn(b, n, c, requires_grad=True)

    def mixer_both() -> None:
        _train_backward([mixer(x, grid).sum()], [x, *mixer.parameters()])

    fns = {f"{name} {kind}": make(name) for name in heads for kind, make in
           (("infer", infer), ("fwd", forward), ("fwd+bwd", both))}  # fmt: skip
    fns["triton path per mixer call: triton_ttt per branch fwd+bwd"] = path
    nodes = _node_calls(qkv, weights, grid, h, 9**-0.5)
    fns |= nodes
    # The same calls BACK_TO_BACK times in a row (warm caches), per call: the interleaved harness starts every
    # call with cold caches (one ``torch.empty`` reads several times its warm cost there).
    warm = {f"{label} (back to back)": fn for label, fn in (("triton path per mixer call: triton_ttt per "
        "branch "
            "fwd+bwd", path), *nodes.items())}  # fmt: skip
    fns |= {label: _repeated(fn) for label, fn in warm.items()}
    fns["TTTMixer fwd+bwd (backend=triton)"] = mixer_both
    fns["torch.empty (for scale)"] = lambda: torch.empty(16)
    for fn in fns.values():  # warm-up: plans built, before the node timers start
        fn()
    # The backward inside each branch's ``triton_ttt`` node, the fused node's forward and backward: timed in
    # the interleaved calls only.
    times: dict[str, list[float]] = {f"{name} bwd node": [] for name in heads}
    _timed(op._TritonTTT, "backward", lambda ctx: times[f"{ctx.call.cfg[0]} bwd node"])
    for label in [f"{name} fwd+bwd" for name in heads] + [
        "triton path per mixer call: triton_ttt per branch fwd+bwd"
    ]:
        fns[label] = _recorded(fns[label])
    if nodes:  # the node's own forward and backward, of the first fwd+bwd row (the program, where it is)
        first = next(label for label in nodes if "fwd+bwd" in label)
        parts = [f"{NODE} fwd (in the node)", f"{NODE} bwd (in the node)"]
        b2b = " (back to back)"  # the node's parts in its back-to-back rounds too (warm caches)
        times |= {part + suffix: [] for part in parts for suffix in ("", b2b)}
        _timed(fused_mix._FusedMix, "forward", lambda ctx: times[parts[0] + _RECORDING["on"]])
        _timed(fused_mix._FusedMix, "backward", lambda ctx: times[parts[1] + _RECORDING["on"]])
        fns[first] = _recorded(fns[first])
        # its own rounds: the timers' cost stays out of the back-to-back row the floor is taken from
        warm[f"{first}{b2b}, parts timed"] = nodes[first]
        fns[f"{first}{b2b}, parts timed"] = _recorded(_repeated(nodes[first]), b2b)
    samples = time_samples(fns, torch.device("cpu"), repeats=args.repeats, warmup=20)
    samples |= {label: [t / BACK_TO_BACK for t in samples[label]] for label in warm}
    samples |= {label: ts for label, ts in times.items() if ts}
    launched.clear()
    (nodes[first] if nodes else path)()

    def stats(ts: list[float]) -> dict[str, float]:
        ts = sorted(ts)
        return {"median_us": ts[len(ts) // 2] * 1e6, "p10_us": ts[len(ts) // 10] * 1e6}

    rows = [{"call": label} | stats(ts) for label, ts in samples.items()]
    by = {r["call"]: r for r in rows}
    own = {k: sum(by[f"{n} {part}"][k] for n in heads for part in ("fwd", "bwd node")) for k in stats([0.0])}
    rows.append({"call": "triton path per mixer call: triton_ttt per branch, fwd + bwd node, summed"} | own)
    if nodes:
        for suffix in ("", b2b):
            rows.append(
                {"call": f"{NODE}: fwd + bwd in the node, summed{suffix}"}
                | {k: sum(by[p + suffix][k] for p in parts) for k in own}
            )
        # Over the floor, round by round (back to back): what the node costs beyond any Python autograd node.
        floor = samples["floor: an empty autograd node, fwd+bwd (back to back)"]
        for label in nodes:
            if "fwd+bwd (" in label:
                diffs = [a - f for a, f in zip(samples[f"{label} (back to back)"], floor)]
                rows.append({"call": f"{label} over the floor (back to back)"} | stats(diffs))
    print_table(rows, floatfmt="{:.1f}")
    print(f"launches stubbed per mixer call (fwd+bwd): {len(launched)}; shape B={b} N={n} C={c} heads={h}")
    write_csv([({"tree": args.tree} if args.tree else {}) | r for r in rows], args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
