"""``torch.compile`` of a vit3 model: graph breaks counted (``torch._dynamo.explain``), compile time,
speed-up.

Per model: the number of graphs and graph breaks Dynamo finds in the forward (and each break's reason),
then ``torch.compile`` (``--backend``, Inductor by default) of the forward under ``--mode`` (``infer``:
``inference_mode``, the model in ``eval()``; ``train``: forward + backward, the model in ``train()``), the
first call's time (the compile) and the median time of the compiled and the eager model side by side; with
``--generic-too`` also the model with every mixer on the generic inner loop (``ttt_cfg`` backend ``generic``,
the same weights), compiled: what the mixer op's kernels save under compile. Writes
``compile_model<--tag>.csv`` to ``--out-dir``, a row as each model finishes.

    python benchmarks/compile_model.py --device cuda --models vit3_tiny h_vit3_tiny --img-size 224
    python benchmarks/compile_model.py --device cpu --models test_vit3_ttt --img-size 64 --backend aot_eager
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vit3  # noqa: F401  - registers the vit3 models in timm
from benchmarks.common import RESULTS, CsvRows, paired_ratio, print_table, sync, time_samples


def graph_breaks(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int, list[str]]:
    """(graphs, graph breaks, one line per break reason) of ``model(x)`` under Dynamo."""
    torch._dynamo.reset()
    report = torch._dynamo.explain(model)(x)
    reasons = [str(getattr(b, "reason", b)).splitlines()[0] for b in report.break_reasons]
    return report.graph_count, report.graph_break_count, reasons


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", default=["vit3_tiny"])
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--amp", choices=["none", "bf16"], default=None, help="autocast (default bf16 on CUDA)")
    p.add_argument("--mode", choices=["infer", "train"], default="infer")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="appended to the CSV name: compile_model<tag>.csv")
    p.add_argument("--generic-too", action="store_true", help="also TTT models compiled on the generic path")
    args = p.parse_args()
    device = torch.device(args.device)
    amp = (args.amp or ("bf16" if device.type == "cuda" else "none")) == "bf16"
    rows = CsvRows(args.out_dir / f"compile_model{args.tag}.csv")
    for name in args.models:
        torch.manual_seed(0)
        model = timm.create_model(name, img_size=args.img_size, num_classes=1000).to(device)
        model.train(args.mode == "train")
        x = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device)
        graphs, breaks, reasons = graph_breaks(model, x)
        for reason in reasons:
            print(f"{name}: graph break: {reason}")
        compiled = torch.compile(model, backend=args.backend)

        def call(m: torch.nn.Module) -> None:
            grad = torch.inference_mode() if args.mode == "infer" else contextlib.nullcontext()
            with grad, torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                out = m(x)
            if args.mode == "train":
                out.float().sum().backward()
                m.zero_grad(set_to_none=True)

        start = time.perf_counter()
        call(compiled)
        sync(device)
        first = time.perf_counter() - start
        fns = {"compiled": lambda: call(compiled), "eager": lambda: call(model)}
        if args.generic_too and name.startswith(("vit3", "h_vit3")):
            kwargs = {"img_size": args.img_size, "num_classes": 1000, "ttt_cfg": {"backend": "generic"}}
            generic = timm.create_model(name, **kwargs)
            generic.load_state_dict(model.state_dict())
            generic = torch.compile(generic.to(device).train(args.mode == "train"), backend=args.backend)
            fns["compiled_generic"] = lambda: call(generic)
        samples = time_samples(fns, device, repeats=args.repeats)
        times = {key: statistics.median(ts) for key, ts in samples.items()}
        generic_ms = 1e3 * times["compiled_generic"] if "compiled_generic" in times else float("nan")
        over_generic = (
            paired_ratio(samples["compiled_generic"], samples["compiled"]) if "compiled_generic" in times
            else float("nan")
        )  # fmt: skip
        rows.add({"model": name, "img": args.img_size, "batch": args.batch, "mode": args.mode,
                  "amp": "bf16" if amp else "none", "backend": args.backend, "graphs": graphs,
                  "graph_breaks": breaks, "first_call_s": first, "compiled_ms": 1e3 * times["compiled"],
                  "eager_ms": 1e3 * times["eager"],
                  "speedup": paired_ratio(samples["eager"], samples["compiled"]),
                  "compiled_generic_ms": generic_ms, "speedup_over_generic": over_generic})  # fmt: skip
    print_table(rows.rows)
    print(f"wrote {rows.path}")


if __name__ == "__main__":
    main()
