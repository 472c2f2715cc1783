"""Forward + backward of the TTT mixer on every backend against the float64 reference, at training shapes.

Per model's mixer and precision (fp32; bf16 autocast), one child process per backend; prints the relative
RMS error of the output and the worst gradient against the float64 ``generic`` reference, with a verdict and
the registry's fallback warnings. Writes ``backend_check<--tag>.csv`` to ``--out-dir``. Method and
tolerances: benchmarks/README.md.

    python benchmarks/backend_check.py --out-dir /tmp/check            # CUDA
    python benchmarks/backend_check.py --device cpu --batch 1 --quick  # CPU dry run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, print_table, write_csv

BACKENDS = ("triton", "cpu", "eager", "generic")
# model -> (img size, the first TTT block's token grid is img / stride)
MODELS = {"vit3_tiny": (224, 16), "vit3_small": (224, 16), "h_vit3_tiny": (224, 4)}
TOLERANCE = {"fp32": 1e-2, "bf16": 5e-2}


def first_mixer(name: str, img: int) -> torch.nn.Module:
    """The first ``TTTMixer`` of timm model ``name`` (its configuration: branches, RoPE, head dim)."""
    import timm

    import vit3  # noqa: F401  - registers the models
    from vit3.layers import TTTMixer

    model = timm.create_model(name, img_size=img, num_classes=10)
    return next(m for m in model.modules() if isinstance(m, TTTMixer))


def inputs(name: str, batch: int, quick: bool) -> tuple[torch.nn.Module, torch.Tensor, tuple[int, int]]:
    """The mixer (seeded weights), its input tokens ``[B, N, C]`` and grid, on CPU in float32."""
    img, stride = MODELS[name]
    if quick:
        img = 4 * stride  # a 4 x 4 grid
    torch.manual_seed(0)
    mixer = first_mixer(name, img)
    grid = (img // stride, img // stride)
    x = torch.randn(batch, grid[0] * grid[1], mixer.dim)
    return mixer, x, grid


def run_one(
    mixer: torch.nn.Module, x: torch.Tensor, grid: tuple[int, int], prec: str
) -> dict[str, torch.Tensor]:
    """Output and gradients (input, every parameter) of one forward + backward, on CPU in float64."""
    x = x.clone().requires_grad_(True)
    amp = torch.autocast(x.device.type, dtype=torch.bfloat16) if prec == "bf16" else contextlib.nullcontext()
    with amp:
        out = mixer(x, grid)
    torch.manual_seed(1)
    dout = torch.randn(out.shape, dtype=torch.float64).to(out.device, out.dtype)
    names = ["x", *(n for n, _ in mixer.named_parameters())]
    grads = torch.autograd.grad(out, [x, *mixer.parameters()], dout, allow_unused=True)
    res = {"out": out.detach()} | {f"d{n}": g for n, g in zip(names, grads) if g is not None}
    return {k: v.double().cpu() for k, v in res.items()}


def child(args: argparse.Namespace) -> None:
    """Runs every (model, precision) on the backend of ``$VIT3_TTT_BACKEND``; saves to ``--save``.

    ``--reference``: once per model in float64 instead (the parent sets the ``generic`` backend).
    """
    device = torch.device(args.device)
    results = {}
    for name in args.models:
        mixer, x, grid = inputs(name, args.batch, args.quick)
        if args.reference:
            results[name] = run_one(mixer.to(device).double(), x.to(device).double(), grid, "fp32")
            continue
        for prec in args.precisions:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results[(name, prec)] = run_one(mixer.to(device), x.to(device), grid, prec)
            # The registry's fallbacks and demotions: the named backend did not compute (all of) this.
            notes = sorted({str(w.message) for w in caught if "Backend" in w.category.__name__})
            results[(name, prec, "fallback")] = notes
    torch.save(results, args.save)


def spawn(args: argparse.Namespace, backend: str, save: Path, reference: bool = False) -> subprocess.Popen:
    """Starts ``child`` in a fresh process with ``VIT3_TTT_BACKEND=backend`` (``collect`` waits for it)."""
    cmd = [sys.executable, sys.argv[0], "--device", args.device, "--batch", str(args.batch)]
    cmd += ["--models", *args.models, "--precisions", *args.precisions, "--save", str(save)]
    cmd += ["--quick"] * args.quick + ["--reference"] * reference
    env = dict(os.environ, VIT3_TTT_BACKEND=backend)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen, backend: str, save: Path, timeout: float) -> dict | None:
    """The results of a child started by ``spawn``, or None (and why) where it failed or timed out."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        print(f"[{backend}] timed out after {timeout:.0f}s", flush=True)
        return None
    for line in sorted({ln.strip() for ln in err.splitlines() if "Warning" in ln}):
        print(f"[{backend}] {line}")
    if proc.returncode:
        print(f"[{backend}] failed (rc {proc.returncode}):\n{err[-2000:]}", flush=True)
        return None
    return torch.load(save, weights_only=True)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(TOLERANCE))
    p.add_argument("--batch", type=int, default=16, help="images per batch (training-size default)")
    p.add_argument("--quick", action="store_true", help="4 x 4 token grids (a CPU dry run)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for all child processes")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="appended to the CSV name: backend_check<tag>.csv")
    p.add_argument("--save", type=Path, default=None, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.save is not None:
        return child(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # All children at once (the reference and one per backend): the check must fit a short device lease.
        saves = {b: Path(tmp) / f"{b}.pt" for b in ("reference", *args.backends)}
        procs = {b: spawn(args, "generic" if b == "reference" else b, save, b == "reference")
                 for b, save in saves.items()}  # fmt: skip
        deadline = time.monotonic() + args.timeout
        runs = {}
        for b, proc in procs.items():
            res = collect(proc, b, saves[b], max(1.0, deadline - time.monotonic()))
            if res is not None:
                runs[b] = res
    refs = runs.pop("reference", None)
    if refs is None:
        raise SystemExit("the float64 reference did not run")
    for name in args.models:
        ref = refs[name]
        head_dim = first_mixer(name, MODELS[name][0]).head_dim
        for prec in args.precisions:
            for backend, res in runs.items():
                got, notes = res[(name, prec)], res.get((name, prec, "fallback"), [])
                out_err = rel_rms(got["out"], ref["out"])
                grads = {k: rel_rms(got[k], ref[k]) for k in ref if k != "out"}
                worst = max(grads, key=grads.get)
                rows.append({"model": name, "batch": args.batch, "tokens": ref["out"].shape[1],
                             "head_dim": head_dim, "precision": prec, "backend": backend,
                             "out_rel_rms": out_err,
                             "worst_grad": worst, "worst_grad_rel_rms": grads[worst],
                             "verdict": "ok" if max(out_err, grads[worst]) <= TOLERANCE[prec] else "FAIL",
                             "fallback": " | ".join(notes)[:160]})  # fmt: skip
    if not rows:
        raise SystemExit("no backend ran")
    print_table(rows)
    path = args.out_dir / f"backend_check{args.tag}.csv"
    write_csv(rows, path)
    print(f"wrote {path}")
    if any(r["verdict"] != "ok" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
