"""What a training step saves for its backward, per image: MiB of activations and where they are kept.

Counts every storage autograd saves while the forward builds its graph (``saved_tensors_hooks``), once per
storage, in bf16 autocast (``--amp none``: float32, a CPU run's default, where the C++ kernels run), and
attributes each storage to the top-level child module (stem, stages, head)
whose forward saved it first. Per image is the slope between two batch sizes, so what a step keeps once
(the parameters, autocast's bf16 copies of them) drops out. CPU tensors stand in for a
GPU's: the layers and their saving are the same.

    python benchmarks/saved_activations.py --res 224 --batch 2
    python benchmarks/saved_activations.py --res 224 --batch 2 --amp none
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vit3  # noqa: F401  (registers the models)
from benchmarks.common import report

MODELS = ("vit3_tiny", "h_vit3_tiny", "deit_tiny_patch16_224")


def saved_bytes(model: torch.nn.Module, res: int, batch: int, amp: bool = True) -> dict[str, float]:
    """``{"total": bytes, <child>: bytes, ...}`` saved by one settled training forward, in bf16 autocast
    where ``amp``, else in float32."""
    storages: dict[int, tuple[int, str]] = {}
    where = ["other"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in storages:
            storages[ptr] = (t.untyped_storage().nbytes(), where[-1])
        return t

    def enter(name: str):
        return lambda *_: where.append(name)

    def leave(*_) -> None:
        where.pop()

    hooks = []
    for child_name, child in model.named_children():
        hooks.append(child.register_forward_pre_hook(enter(child_name)))
        hooks.append(child.register_forward_hook(leave))
    x = torch.randn(batch, 3, res, res)
    for _ in range(3):  # the third forward is a settled one (in float32 too: the C++ op from the third)
        storages.clear()
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = model(x)
        out.float().sum().backward()
    for h in hooks:
        h.remove()
    out = {"total": float(sum(n for n, _ in storages.values()))}
    for n, child in storages.values():
        out[child] = out.get(child, 0.0) + n
    return out


def saved_per_image(name: str, res: int, batch: int, amp: bool = True) -> dict[str, float]:
    """``{"total": MiB, <child>: MiB, ...}`` saved per image by a training forward of ``name``: the slope
    between ``batch`` and ``2 * batch`` images."""
    model = timm.create_model(name, img_size=res, num_classes=1000).train()
    small, large = saved_bytes(model, res, batch, amp), saved_bytes(model, res, 2 * batch, amp)
    return {k: (large.get(k, 0.0) - small.get(k, 0.0)) / batch / 2**20 for k in large}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--amp", choices=("bf16", "none"), default="bf16", help="none: float32")
    p.add_argument("--out", type=Path, default=None, help="CSV path (default: benchmarks/results/)")
    args = p.parse_args()
    rows = []
    for name in args.models:
        mib = saved_per_image(name, args.res, args.batch, args.amp == "bf16")
        parts = ", ".join(
            f"{k} {v:.1f}" for k, v in sorted(mib.items(), key=lambda kv: -kv[1]) if k != "total"
        )
        rows.append(
            {"model": name, "res": args.res, "saved_mib_per_image": round(mib["total"], 2), "by_part": parts}
        )
    report(rows, args.out, "saved_activations" if args.amp == "bf16" else "saved_activations_fp32", "cpu")


if __name__ == "__main__":
    main()
