"""The Python time of one mixer call: ``TTTMixer.mix`` against the bare ops it calls, on the same inputs.

One ``mix`` call (inference; training: forward + backward) is recorded as the ops it dispatches, replayed
bare, and timed against it in interleaved pairs over ``--repeats`` rounds; the paired median difference is the
Python around the ops. ``--python-node`` adds the Python fused node beside the C++ op. Writes
``results/mixer_overhead_cpu.csv``. Method and columns: benchmarks/README.md.

    python benchmarks/mixer_overhead.py --threads 1                 # ViT³-T's mixer at 224 px: 192, 3, 196
    python benchmarks/mixer_overhead.py --threads 1 --python-node   # the C++ op and the Python node
    python benchmarks/mixer_overhead.py --threads 1 --dim 384 --heads 6 --batch 4
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_runtime_args, run_script, time_samples
from benchmarks.mixer import grid_for
from vit3.layers import TTTMixer, ttt


class _Record(TorchDispatchMode):
    """Records every op dispatched under it, with its arguments (``(func, args, kwargs)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((func, args, kwargs))
        return func(*args, **kwargs)


def record(fn) -> list[tuple]:
    """The ops one call of ``fn`` dispatches."""
    with _Record() as rec:
        fn()
    return rec.ops


def replay(ops: list[tuple]) -> None:
    """The recorded ops again, on the same tensors: the bare ops of the recorded call."""
    for func, args, kwargs in ops:
        func(*args, **kwargs)


def with_bare_ops(infer, train) -> tuple[dict, dict[str, list[tuple]]]:
    """``infer`` (run under ``torch.no_grad`` here) and ``train`` warmed up (kernels built, routes resolved
    and verified), their ops recorded: the four calls ``infer``, ``bare infer``, ``train``, ``bare train``,
    and the records by mode."""

    def infer_() -> None:
        with torch.no_grad():
            infer()

    for _ in range(3):
        infer_()
        train()
    ops = {"infer": record(infer_), "train": record(train)}

    def bare_infer() -> None:
        with torch.no_grad():  # as ``infer``: the same grad-mode switch on both sides
            replay(ops["infer"])

    fns = {
        "infer": infer_,
        "bare infer": bare_infer,
        "train": train,
        "bare train": lambda: replay(ops["train"]),
    }
    return fns, ops


def _mixer_fns(mixer: TTTMixer, qkv: torch.Tensor, grid: tuple[int, int], upstream: torch.Tensor) -> dict:
    """The mixer's calls (``mix infer``, ``mix train``) and their bare ops (``bare infer``, ``bare train``),
    warmed up: the routes resolved and verified (``ttt.CPP_NODE`` is read then)."""
    leaves = [qkv, *mixer.parameters()]

    def train() -> None:
        for t in leaves:  # as a training step (optimizer.zero_grad): nothing accumulates into .grad
            t.grad = None
        mixer.mix(qkv, grid).backward(upstream)

    calls, bare = with_bare_ops(lambda: mixer.mix(qkv, grid), train)
    fns = {name if name.startswith("bare") else f"mix {name}": fn for name, fn in calls.items()}
    if ttt.CPP_NODE:
        fns |= _op_fns(mixer, qkv, leaves, upstream)
    return {"fns": fns, "ops": {mode: len(ops) for mode, ops in bare.items()}}


def _op_fns(mixer: TTTMixer, qkv: torch.Tensor, leaves: list, upstream: torch.Tensor) -> dict:
    """The whole-mixer C++ op called directly (``op infer``, ``op train``) with the arguments the mixer's
    settled routes hand it: the same op and autograd node as ``mix``, without the mixer's Python in front."""
    flat = [d[name] for d, name in mixer._param_sources()]
    # by grad mode (the key's fourth field)
    args = {key[3]: call.cpp for key, call in mixer._calls.routes.items()}
    op = torch.ops.vit3_cpu.mix

    def infer() -> None:
        with torch.no_grad():
            op(qkv, flat, *args[False])

    def train() -> None:
        for t in leaves:
            t.grad = None
        op(qkv, flat, *args[True]).backward(upstream)

    return {"op infer": infer, "op train": train}


def _floor_fns(qkv: torch.Tensor) -> dict:
    """What any training call of one op pays over its bare ops (the autograd engine's start, one node, one
    ``AccumulateGrad``): ``qkv * 1`` forward + backward (``floor``) and its bare ops (``bare floor``)."""
    upstream = torch.ones_like(qkv)

    def floor() -> None:
        qkv.grad = None
        torch.mul(qkv, 1.0).backward(upstream)

    ops = record(floor)
    return {"floor": floor, "bare floor": lambda: replay(ops)}


def _pairs(fns: dict, pairs: list[tuple[str, str]], device: torch.device, repeats: int) -> dict[str, list]:
    """Each pair ``(a, b)`` timed on its own, the two calls swapping places every round (``time_samples`` with
    ``alternate``): ``"a|b"`` -> ``a`` minus ``b`` per round, and each name's samples from the first pair that
    times it. Why pairs: with three calls interleaved the middle one never runs first, after the other work,
    and the difference to it carries that position's cost (tens of µs at a few hundred µs a call)."""
    out: dict[str, list] = {}
    for a, b in pairs:
        got = time_samples({a: fns[a], f"{b} ": fns[b]}, device, repeats=repeats, warmup=20, alternate=True)
        first, second = got[a], got[f"{b} "]
        out[f"{a}|{b}"] = [x - y for x, y in zip(first, second)]
        out.setdefault(a, first)
        out.setdefault(b, second)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    n, grid = args.tokens, grid_for(args.tokens)
    mixer = TTTMixer(args.dim, args.heads).to(device)
    qkv = torch.randn(args.batch, n, mixer.qkv.out_features, device=device, requires_grad=True)
    upstream = torch.randn(args.batch, n, sum(mixer.widths), device=device)
    nodes = ["cpp", "python"] if args.python_node else ["cpp"]
    fns, n_ops = {}, {}
    for node in nodes:  # each mixer routes its calls with its node
        ttt.CPP_NODE = node == "cpp"
        # a shallow copy: the same parameters and inputs (both nodes then read the same, cache-warm, memory),
        # its own routes (pickling state drops them)
        got = _mixer_fns(copy.copy(mixer), qkv, grid, upstream)
        fns |= {f"{node} {name}": fn for name, fn in got["fns"].items()}
        n_ops[node] = got["ops"]
    ttt.CPP_NODE = True
    fns |= _floor_fns(qkv) | {"torch.empty": lambda: torch.empty(16)}
    pairs = [("floor", "bare floor")]
    for node in nodes:
        for mode in ("infer", "train"):
            pairs.append((f"{node} mix {mode}", f"{node} bare {mode}"))
            if f"{node} op {mode}" in fns:
                # the mixer's own Python (against the op called directly), and the estimator's zero: the op
                # against itself
                pairs += [
                    (f"{node} mix {mode}", f"{node} op {mode}"),
                    (f"{node} op {mode}", f"{node} op {mode}"),
                ]
    samples = _pairs(fns, pairs, device, args.repeats)
    samples |= time_samples({"torch.empty": fns["torch.empty"]}, device, repeats=args.repeats, warmup=20)
    med = {name: 1e6 * statistics.median(ts) for name, ts in samples.items()}
    rows = []
    for node in nodes:
        for mode in ("infer", "train"):
            mix, op = f"{node} mix {mode}", f"{node} op {mode}"
            rows.append(
                {
                    "node": node,
                    "mode": mode,
                    "dim": args.dim,
                    "heads": args.heads,
                    "batch": args.batch,
                    "N": n,
                    "threads": torch.get_num_threads(),
                    "ops": n_ops[node][mode],
                    "mix_us": med[mix],
                    "bare_ops_us": med[f"{node} bare {mode}"],
                    # paired within each round (the two run back to back), then the median over rounds
                    "overhead_us": med[f"{mix}|{node} bare {mode}"],
                    # the mixer's Python in front of the op: mix against the op called directly (C++ node
                    # only)
                    "mixer_python_us": med.get(f"{mix}|{op}", float("nan")),
                    # the same estimate for two identical calls: what it reads where there is nothing to find
                    "same_call_us": med.get(f"{op}|{op}", float("nan")),
                    "one_op_autograd_us": med["floor|bare floor"] if mode == "train" else 0.0,
                    "torch_empty_us": med["torch.empty"],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=196)
    p.add_argument("--repeats", type=int, default=3000)
    p.add_argument(
        "--python-node",
        action="store_true",
        help="time the Python fused node (ttt.CPP_NODE off) beside the C++ op, one row pair each",
    )
    return run_script(p, argv, run, "mixer_overhead", floatfmt="{:.1f}")


if __name__ == "__main__":
    sys.exit(main())
