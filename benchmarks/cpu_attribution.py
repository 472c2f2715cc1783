"""Where a CPU step's time goes, by the code that spends it: ViT³-T beside DeiT-T, sampled with ``perf``.

Each (model, mode) steps in a child process for ``--seconds`` (``infer`` / ``train``) while ``perf record``
samples it; the samples are sorted by shared object and symbol into parts (gemm, aten, vit3 kernels, jit code,
python, bindings, c10, libc, os, other), each priced in ms per step, with ``vs_base_ms`` against the last
model of ``--pair``. Writes ``results/cpu_attribution_cpu.csv``. Needs ``perf`` allowed to attach to a child
(``perf_event_paranoid`` at most 1). Method and the parts: benchmarks/README.md.

    python benchmarks/cpu_attribution.py --threads 1                 # vit3_tiny vs deit_tiny, 224 px, batch 1
    python benchmarks/cpu_attribution.py --threads 1 --modes train --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_runtime_args, apply_runtime, run_script

PARTS = ("gemm", "aten", "vit3 kernels", "jit code", "python", "bindings", "c10", "libc", "os", "other")
_GEMM_PREFIXES = ("mkl_", "cblas_", "gemm", "sgemm", "dgemm")


def part_of(dso: str, symbol: str) -> str:
    """The part (one of ``PARTS``) that a sample in shared object ``dso`` at ``symbol`` belongs to."""
    name = symbol.removeprefix("[.] ").removeprefix("[k] ").strip()
    if dso.startswith("libtorch_cpu"):
        return "gemm" if name.startswith(_GEMM_PREFIXES) else "aten"
    for prefix, part in (
        ("vit3_cpu", "vit3 kernels"),
        ("[JIT]", "jit code"),
        ("libpython", "python"),
        ("libtorch_python", "bindings"),
        ("libc10", "c10"),
        ("libc.so", "libc"),
        ("[kernel", "os"),
    ):
        if dso.startswith(prefix):
            return part
    return "other"


def parse_report(text: str) -> dict[str, int]:
    """Samples per part from ``perf report --stdio -n --sort dso,sym -g none -t <TAB>`` output."""
    samples = dict.fromkeys(PARTS, 0)
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("\t")]
        if line.startswith("#") or len(fields) != 4 or not fields[1].isdigit():
            continue
        samples[part_of(fields[2], fields[3])] += int(fields[1])
    return samples


def _worker(args: argparse.Namespace) -> int:
    """The child: builds the model, warms it up, signals ``--ready`` and steps for ``--seconds``; prints
    ``{"ms": <ms per step>}``."""
    import timm
    import torch

    import vit3  # noqa: F401  (registers the vit3 models in timm)

    apply_runtime(args)
    torch.manual_seed(0)
    model = timm.create_model(args.model, img_size=args.res).train(args.mode == "train")
    x = torch.randn(args.batch, 3, args.res, args.res)
    params = list(model.parameters())

    def step() -> None:
        if args.mode == "infer":
            with torch.inference_mode():
                model(x)
            return
        for p in params:  # as a training step (optimizer.zero_grad): nothing accumulates into .grad
            p.grad = None
        model(x).sum().backward()

    for _ in range(args.warmup):
        step()
    Path(args.ready).write_text(str(os.getpid()))
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        step()
        steps += 1
    print(json.dumps({"ms": 1e3 * (time.perf_counter() - start) / steps}))
    return 0


def _sample(model: str, mode: str, args: argparse.Namespace) -> tuple[float, dict[str, int]]:
    """ms per step of ``model`` in ``mode`` and its samples per part, from a child process sampled by perf."""
    with tempfile.TemporaryDirectory() as tmp:
        ready, data = Path(tmp) / "ready", Path(tmp) / "perf.data"
        worker = [sys.executable, __file__, "--worker", "--model", model, "--mode", mode, "--device", "cpu"]
        worker += ["--res", str(args.res), "--batch", str(args.batch), "--seconds", str(args.seconds)]
        worker += ["--warmup", str(args.warmup), "--ready", str(ready)]
        worker += ["--threads", str(args.threads)] if args.threads else []
        worker += [] if args.tune_malloc else ["--no-tune-malloc"]
        child = subprocess.Popen(
            worker,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while not ready.exists():
            if child.poll() is not None:
                raise RuntimeError(
                    f"{model} {mode}: the child process failed:\n{child.stderr.read()[-2000:]}"
                )
            time.sleep(0.05)
        # sample all but the last half second, so perf stops before the child does
        record = ["perf", "record", "-q", "-F", str(args.freq), "-p", str(child.pid), "-o", str(data)]
        rec = subprocess.run(
            [*record, "--", "sleep", str(max(args.seconds - 0.5, 0.5))], capture_output=True, text=True
        )
        out, err = child.communicate()
        if rec.returncode != 0:
            raise RuntimeError(f"perf record failed (permissions? see --help):\n{rec.stderr[-2000:]}")
        if child.returncode != 0:
            raise RuntimeError(f"{model} {mode}: the child process failed:\n{err[-2000:]}")
        sort = ["--stdio", "--no-children", "-n", "--sort", "dso,sym", "-g", "none", "-t", "\t"]
        report = subprocess.run(
            ["perf", "report", "-i", str(data), *sort],
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(out.strip().splitlines()[-1])["ms"], parse_report(report.stdout)


def run(args: argparse.Namespace) -> list[dict]:
    if shutil.which("perf") is None:
        raise SystemExit("cpu_attribution.py needs Linux perf (linux-tools) on PATH")
    names = args.pair.split(":")
    rows = []
    for mode in args.modes:
        by_model = {}
        for name in names:
            ms, samples = _sample(name, mode, args)
            total = sum(samples.values()) or 1
            by_model[name] = {part: ms * n / total for part, n in samples.items()}
            by_model[name]["step"] = ms
            print(f"{name} {mode}: {ms:.2f} ms per step, {total} samples", flush=True)
        base = by_model[names[-1]]
        for name in names:
            for part in (*PARTS, "step"):
                ms = by_model[name][part]
                rows.append(
                    {
                        "model": name,
                        "mode": mode,
                        "res": args.res,
                        "batch": args.batch,
                        "threads": args.threads or "",
                        "part": part,
                        "ms": ms,
                        "share": ms / by_model[name]["step"],
                        "vs_base_ms": ms - base[part],
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    p.set_defaults(device="cpu")  # a CPU benchmark on any host
    p.add_argument("--pair", default="vit3_tiny:deit_tiny_patch16_224", help="models a:b (b: the baseline)")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--modes", nargs="+", choices=("infer", "train"), default=["infer", "train"])
    p.add_argument("--seconds", type=float, default=15.0, help="sampled steady state per (model, mode)")
    p.add_argument("--warmup", type=int, default=10, help="steps before sampling starts")
    p.add_argument("--freq", type=int, default=1999, help="perf samples per second")
    # the child process's own options (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--ready", help=argparse.SUPPRESS)
    if "--worker" in (sys.argv[1:] if argv is None else argv):
        return _worker(p.parse_args(argv))
    return run_script(p, argv, run, "cpu_attribution", floatfmt="{:.3f}")


if __name__ == "__main__":
    sys.exit(main())
