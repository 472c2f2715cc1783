"""What one training step asks of the host, counted: ATen ops, casts, host syncs, Triton launches, saved MiB.

A settled bf16-autocast training step (forward + backward) of each model on CPU tensors, the Triton path
emulated with its launches stubbed (``triton_overhead.stub_launches``: the plans are built and bound as on a
GPU host, the kernels not run) unless ``--cpu-paths``. Counts are exact, not timings: ATen compute ops
(views, allocations and type queries apart), ``_to_copy`` casts, host syncs (``_local_scalar_dense``...),
Triton launches (per TTT block), and the activations saved per image (the slope between ``--batch`` and
twice it). Method: benchmarks/README.md.

    python benchmarks/step_counts.py --res 224 --batch 2
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

if os.environ.pop("TRITON_INTERPRET", None) == "1":  # before Triton is imported: the GPU host's custom ops
    os.execv(sys.executable, [sys.executable, *sys.argv])

import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vit3  # noqa: F401  (registers the models)
from benchmarks.common import report
from benchmarks.saved_activations import saved_bytes
from benchmarks.triton_overhead import stub_launches
from vit3.layers.blocks import TTTBlock

MODELS = ("vit3_tiny", "h_vit3_tiny", "deit_tiny_patch16_224")
# Ops that read a device value on the host: each one is a synchronisation on a GPU.
SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal", "allclose")


# Ops that allocate without computing (a caching allocator's work on a GPU, no kernel).
ALLOCATIONS = ("empty", "new_empty", "empty_strided", "new_empty_strided")


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched: views apart, allocations apart, the rest (compute ops) by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = self.allocations = self.syncs = self.queries = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in SYNC_OPS:
            self.syncs += 1
        elif func.is_view or name == "_unsafe_view":
            self.views += 1
        elif name in ALLOCATIONS:
            self.allocations += 1
        elif all("Tensor" not in str(r.type) for r in func._schema.returns):
            self.queries += 1  # a type or size query (``promote_types``): no kernel
        else:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_step(name: str, res: int, batch: int, launched: list[str], top: int = 0) -> dict[str, float]:
    """The counts of one settled training step of ``name`` at ``res`` px and ``batch`` images."""
    model = timm.create_model(name, img_size=res, num_classes=1000).train()
    x = torch.randn(batch, 3, res, res)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):  # routes made, caches warm
        step()
    launched.clear()
    counter = OpCounter()
    with counter:
        step()
    launches = len(launched)
    if top:
        print(name, Counter(launched), flush=True)
    blocks = sum(isinstance(m, TTTBlock) for m in model.modules()) or len(getattr(model, "blocks", ())) or 1
    small, large = saved_bytes(model, res, batch), saved_bytes(model, res, 2 * batch)
    ops = counter.ops
    if top:
        print(name, ops.most_common(top), flush=True)
    return {
        "model": name,
        "res": res,
        "batch": batch,
        "aten_ops": sum(ops.values()),
        "to_copy": ops["_to_copy"] + ops["copy_"],
        "allocations": counter.allocations,
        "views": counter.views,
        "queries": counter.queries,
        "host_syncs": counter.syncs,
        "triton_launches": launches,
        "blocks": blocks,
        "launches_per_block": launches / blocks,
        "saved_mib_per_image": (large["total"] - small["total"]) / batch / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--cpu-paths", action="store_true", help="the CPU paths, not the Triton path emulated")
    p.add_argument("--top", type=int, default=0, help="print each model's most frequent ATen ops")
    p.add_argument("--out", type=Path, default=None, help="CSV path (default: benchmarks/results/)")
    args = p.parse_args()
    torch.manual_seed(0)
    launched: list[str] = []
    if not args.cpu_paths:
        launched = stub_launches()
        os.environ["VIT3_TTT_BACKEND"] = "triton"
    rows = []
    for name in args.models:
        row = count_step(name, args.res, args.batch, launched, args.top)
        row["paths"] = "cpu" if args.cpu_paths else "triton (emulated)"
        rows.append(row)
        print(row, flush=True)
    tag = "cpu" if args.cpu_paths else "emulated_gpu"
    report(rows, args.out, f"step_counts_{tag}", "cpu")


if __name__ == "__main__":
    main()
