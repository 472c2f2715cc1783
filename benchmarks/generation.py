"""DiT³ against DiT (timm Attention, SDPA) of the same size: training-step speed, and the demo's scores.

Speed (default): paired training-step timing and peak memory per latent size. Quality (``--quality``): the
generation demo trained per mixer and seed, scored by the held-out-digit classifier beside the real floor;
``key=value`` arguments override the demo config. Method: benchmarks/README.md.

    python benchmarks/generation.py                                 # DiT³-S/2 vs DiT-S/2, latents 32-128
    python benchmarks/generation.py --model dit3_b_2 --sizes 32 64 --batch 8 --dtype bf16   # GPU
    python benchmarks/generation.py --quality --seeds 0 1 2         # the demo, DiT³ vs DiT over 3 seeds (CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from vit3.models.dit3 import create_dit3, num_params

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(name: str, mixer: str, size: int, device: torch.device) -> torch.nn.Module:
    model = create_dit3(name, input_size=size, mixer=mixer)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.to(device).train()


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    rows = []
    for size in args.sizes:
        models = {mixer: build(args.model, mixer, size, device) for mixer in ("ttt", "attention")}
        x = torch.randn(args.batch, 4, size, size, device=device)
        t = torch.randint(0, 1000, (args.batch,), device=device)
        y = torch.randint(0, 1000, (args.batch,), device=device)

        def step(m: torch.nn.Module) -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                out = m(x, t, y)
            out.float().square().mean().backward()
            for p in m.parameters():
                p.grad = None

        fns = {mixer: (lambda m=m: step(m)) for mixer, m in models.items()}
        samples = common.time_samples(fns, device, repeats=args.repeats, warmup=1)
        ratio = common.paired_ratio(samples["attention"], samples["ttt"])
        for mixer, m in models.items():
            ms = 1e3 * sorted(samples[mixer])[len(samples[mixer]) // 2]
            rows.append(
                {
                    "model": f"{args.model}/{mixer}",
                    "latent": size,
                    "tokens": (size // m.patch_size) ** 2,
                    "batch": args.batch,
                    "dtype": args.dtype,
                    "threads": torch.get_num_threads(),
                    "params_m": num_params(m) / 1e6,
                    "fwd+bwd_ms": ms,
                    "peak_mib": common.peak_memory(fns[mixer], device),
                    "attention_over_ttt": ratio,
                }
            )
        print(f"latent {size}² done: DiT³ step {ratio:.2f}x the speed of DiT (paired)", flush=True)
        del models
    return rows


# --------------------------------------------------------------------------------------------- quality
DEMO = Path(__file__).resolve().parents[1] / "configs" / "generation" / "demo_mnist.yaml"
SCORES = ("class_accuracy", "frechet_distance")  # the generated images' scores
FLOORS = {"class_accuracy": "real_accuracy", "frechet_distance": "frechet_real_floor"}  # real data at N


_HOW_STARTED = ("resume", "overwrite", "force_resume")


def _settings(cfg) -> dict:
    """What makes two demo runs the same run: not the file the config came from, nor how the run was started
    (resumed, allowed to overwrite: keys a config saved before they existed lacks)."""
    settings = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}
    settings["train"] = {k: v for k, v in settings["train"].items() if k not in _HOW_STARTED}
    return settings


def train_demo(mixer: str, seed: int, out: Path, overrides: Sequence[str]) -> dict:
    """One demo run (training, then sampling and scoring): its row of the quality table. A run folder that
    already holds a scored run of the same config is read back instead (delete it to train again); a killed
    run of the same config continues from its ``last.pt``; a folder of another run is refused by the
    engine."""
    from vit3.engine import load_config, run

    run_dir = out / f"{mixer}_seed{seed}"
    fixed = [f"model.mixer={mixer}", f"seed={seed}", f"output={run_dir}", "train.progress=false"]
    cfg = load_config(DEMO, [*fixed, *overrides])
    done = run_dir / "summary.json"
    saved = run_dir / "config.yaml"
    same = saved.is_file() and _settings(load_config(saved)) == _settings(cfg)
    if same and done.is_file():
        summary = json.loads(done.read_text(encoding="utf-8"))
    else:
        if same:
            cfg.set_path("train.resume", "auto")
        summary = run(cfg, "train")
    if "eval" not in summary:
        raise SystemExit(f"error: {done} holds no scores (the demo config needs train.final_eval=true)")
    report = summary["eval"]
    row = {"mixer": mixer, "seed": seed, "samples": report["num_samples"]}
    for key in SCORES:
        row[key] = report[key]
        row[FLOORS[key]] = report[FLOORS[key]]
        row[FLOORS[key] + "_std"] = report[FLOORS[key] + "_std"]
    history = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    row["train_s"] = round(sum(r["epoch_time_s"] for r in history), 1)  # every epoch, resumed or not
    return row


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per mixer, each score's mean and standard deviation over the seeds, and the real rows: the floor
    (FD) and ceiling (accuracy) of real images at the same count, averaged over the runs."""
    out = []
    for mixer in dict.fromkeys(r["mixer"] for r in rows):
        mine = [r for r in rows if r["mixer"] == mixer]
        row = {"rows": f"{mixer} (seeds {' '.join(str(r['seed']) for r in mine)})"}
        for key in SCORES:
            row[key], row[key + "_std"] = _mean_std([r[key] for r in mine])
        out.append(row)
    real = {"rows": f"real images at N = {rows[0]['samples']} (mean of the runs' draws)"}
    for key in SCORES:
        real[key], _ = _mean_std([r[FLOORS[key]] for r in rows])
        real[key + "_std"], _ = _mean_std([r[FLOORS[key] + "_std"] for r in rows])
    return [*out, real]


def quality(args: argparse.Namespace) -> None:
    out = args.out or common.RESULTS / "generation_demo_quality.csv"
    rows = [
        train_demo(mixer, seed, args.runs, args.overrides) for mixer in args.mixers for seed in args.seeds
    ]
    common.print_table(rows, "{:.4g}")
    summary = summarize(rows)
    print()
    common.print_table(summary, "{:.4g}")
    common.write_csv([*rows, *summary], out)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_runtime_args(p)
    p.add_argument(
        "--quality", action="store_true", help="the generation demo's scores over seeds (see above)"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--quality: training seeds")
    p.add_argument("--mixers", nargs="+", default=["ttt", "attention"], help="--quality: mixers")
    p.add_argument("--runs", type=Path, default=Path("output/gen_quality"), help="--quality: run folders")
    p.add_argument("overrides", nargs="*", help="--quality: key=value overrides of the demo config")
    p.add_argument("--model", default="dit3_s_2", help="a create_dit3 name (default: %(default)s)")
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128], help="latent sizes (4 channels)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="autocast dtype of the forward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--out", type=Path, default=None, help="CSV path (default: results/generation_<device>.csv)"
    )
    args = p.parse_args()
    if args.quality:
        quality(args)
        return
    common.apply_runtime(args)
    out = args.out or common.RESULTS / f"generation_{torch.device(args.device).type}.csv"
    rows = run(args)
    common.print_table(rows)
    common.write_csv(rows, out)
    series = {}
    for r in rows:
        xs, ys = series.setdefault(r["model"], ([], []))
        xs.append(r["tokens"])
        ys.append(r["fwd+bwd_ms"])
    png = out.with_suffix(".png")
    common.plot_loglog(
        series,
        "tokens (latent² / patch²)",
        "ms per training step",
        f"{args.model}: DiT³ vs DiT (batch {args.batch})",
        png,
    )
    print(f"wrote {out}\nwrote {png}")


if __name__ == "__main__":
    main()
