"""The Python time of whole models, and the speed ratio their ops alone allow: ViT³-T beside DeiT-T.

Each model's inference forward and training step are recorded as the ops they dispatch and replayed bare;
all are timed interleaved over ``--repeats`` rounds. Per row: ``python_ms``, ``speed_vs_base`` and
``bare_vs_base``. Writes ``results/model_overhead_<device>.csv``. Method: benchmarks/README.md.

    python benchmarks/model_overhead.py --threads 1                  # vit3_tiny vs deit_tiny, 224 px, batch 1
    python benchmarks/model_overhead.py --threads 1 --pair vit3_small:deit_small_patch16_224 --batch 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vit3  # noqa: F401  (registers the vit3 models in timm)
from benchmarks.common import add_runtime_args, paired_diff, paired_ratio, run_script, time_samples
from benchmarks.mixer_overhead import with_bare_ops


def _calls(name: str, res: int, batch: int, device: torch.device) -> dict[str, object]:
    """The inference and training calls of model ``name`` and their bare ops (recorded after a warm-up)."""
    model = timm.create_model(name).to(device)
    x = torch.randn(batch, 3, res, res, device=device)
    params = list(model.parameters())

    def infer() -> None:
        model.eval()
        model(x)

    def train() -> None:
        model.train()
        for p in params:  # as a training step (optimizer.zero_grad): nothing accumulates into .grad
            p.grad = None
        model(x).sum().backward()

    fns, ops = with_bare_ops(infer, train)
    return fns | {"ops": ops}


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    names = args.pair.split(":")
    calls = {name: _calls(name, args.res, args.batch, device) for name in names}
    kinds = ("infer", "bare infer", "train", "bare train")
    fns = {f"{name} {kind}": c[kind] for name, c in calls.items() for kind in kinds}
    samples = time_samples(fns, device, repeats=args.repeats, warmup=2, alternate=True)
    base = names[-1]

    rows = []
    for name in names:
        for mode in ("infer", "train"):
            mine, bare = samples[f"{name} {mode}"], samples[f"{name} bare {mode}"]
            rows.append(
                {
                    "model": name,
                    "mode": mode,
                    "res": args.res,
                    "batch": args.batch,
                    "threads": torch.get_num_threads(),
                    "ops": len(calls[name]["ops"][mode]),
                    "model_ms": 1e3 * statistics.median(mine),
                    "bare_ms": 1e3 * statistics.median(bare),
                    "python_ms": 1e3 * paired_diff(mine, bare),
                    "speed_vs_base": paired_ratio(samples[f"{base} {mode}"], mine),
                    "bare_vs_base": paired_ratio(samples[f"{base} bare {mode}"], bare),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    p.add_argument("--pair", default="vit3_tiny:deit_tiny_patch16_224", help="models a:b (b: the baseline)")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    return run_script(p, argv, run, "model_overhead", floatfmt="{:.3f}")


if __name__ == "__main__":
    sys.exit(main())
