"""Time of the ONNX export (``vit3.export.export_onnx``) of every registered vit3 model, dynamic batch and
size.

For each model: the wall-clock and process CPU seconds of the export (torch.export, decompositions, the
translation to ONNX and the graph folding, or with ``--optimize`` onnxscript's whole optimiser), the node
count of the saved graph, and the largest difference to PyTorch that onnxruntime gives on a batch of 1 at
the export size and a batch of 3 at another size. CPU seconds are reported beside wall seconds because a
shared machine stretches the wall clock.

    python benchmarks/export_onnx.py                                  # every vit3 model, 224 px
    python benchmarks/export_onnx.py --models h_vit3_tiny --optimize  # with onnxscript's optimiser
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vit3  # noqa: F401  - registers the vit3 models in timm
from benchmarks.common import RESULTS, add_runtime_args, apply_runtime, print_table, write_csv
from vit3.export import FeatureExtractor, check_onnx, export_onnx

MODELS = ("vit3_tiny", "vit3_small", "vit3_base", "h_vit3_tiny", "h_vit3_small", "h_vit3_base")


def measure(name: str, size: int, optimize: bool, folder: Path) -> dict:
    """Exports ``name`` once and checks it; returns one result row."""
    extractor = FeatureExtractor(name)
    wall, cpu = time.perf_counter(), time.process_time()
    info = export_onnx(extractor, folder / f"{name}.onnx", size, exporter="dynamo", optimize=optimize)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    c = extractor.in_chans
    err = check_onnx(
        info["path"], extractor, [torch.rand(1, c, size, size), torch.rand(3, c, size + 32, size + 64)]
    )
    return {
        "model": name,
        "img_size": size,
        "graph": info["optimized"],
        "nodes": info["nodes"],
        "export_wall_s": round(wall, 1),
        "export_cpu_s": round(cpu, 1),
        "max_abs_err": err,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), help="timm model names")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--optimize", action="store_true", help="onnxscript's whole optimiser (slow)")
    p.add_argument("--out", default=None, help="CSV path (default: results/export_onnx_<device>.csv)")
    add_runtime_args(p)
    args = p.parse_args(argv)
    apply_runtime(args)
    unknown = [m for m in args.models if m not in timm.list_models()]
    if unknown:
        p.error(f"unknown models: {unknown}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows.append(measure(name, args.img_size, args.optimize, Path(tmp)))
            print_table(rows[-1:])
    print_table(rows)
    out = Path(args.out) if args.out else RESULTS / f"export_onnx_{args.device}.csv"
    write_csv(rows, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
