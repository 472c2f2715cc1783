"""Export multi-scale backbone features (safetensors + manifest) or the feature extractor (ONNX).

    python export.py features --checkpoint output/finetune/best.pt --images photos/ --out feats/
    python export.py onnx --checkpoint output/finetune/best.pt --out features.onnx
    python export.py features --model h_vit3_tiny --checkpoint h_vittt_t.pth --images photos/ --out feats/

A vit3 checkpoint carries its model; ``--model`` is for official files. Weights: ``--checkpoint``,
``--pretrained`` or ``--random-init``. An ``--out`` holding an earlier export is refused unless
``--overwrite``. A mistake in the input ends with one ``error:`` line and exit code 2 (``--debug``).
Outputs and options: docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch

import vit3  # noqa: F401  (registers the vit3 models in timm)
from vit3.engine.cli import ArgumentParser, add_debug_flag, run_cli
from vit3.engine.config.schema import EXPORT_FLAGS, check_flags, check_input_size
from vit3.errors import ConfigError
from vit3.export import FeatureExtractor, check_onnx, export_features, export_onnx

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _export(args: argparse.Namespace) -> int:
    check_flags(args, EXPORT_FLAGS[args.command])
    if not (args.checkpoint or args.pretrained or args.random_init):
        raise ConfigError(
            f"export.py {args.command} needs the weights to export: pass --checkpoint FILE (a vit3 "
            "checkpoint or "
            "an official file) or --pretrained (timm's weights); --random-init exports a randomly "
            "initialised "
            f"backbone"
        )
    if args.ema and not args.checkpoint:
        raise ConfigError("--ema takes the EMA weights of a vit3 --checkpoint: pass one, or leave --ema out")
    extractor = FeatureExtractor(
        args.model, args.checkpoint, args.pretrained, args.out_indices, args.ema, indices_from="--out-indices"
    )
    if args.random_init:
        warnings.warn(
            f"--random-init: exporting a randomly initialised {extractor.backbone.model_name}, whose "
            "features "
            f"carry no learned information",
            stacklevel=1,
        )
    if args.img_size:
        check_input_size(
            extractor, extractor.in_chans, args.img_size, "--img-size", extractor.backbone.model_name
        )
    if args.command == "features":
        manifest = export_features(
            extractor,
            args.images,
            args.out,
            args.img_size,
            args.crop_pct,
            args.batch_size,
            DTYPES[args.dtype],
            args.device,
            args.overwrite,
        )
        print(f"wrote {manifest}")
        return 0
    size = args.img_size or extractor.preprocessing["input_size"][-1]
    legacy = args.exporter == "torchscript"  # the legacy exporter writes static graphs only
    info = export_onnx(
        extractor,
        args.out,
        size,
        dynamic_batch=not legacy,
        dynamic_size=not (args.static_size or legacy),
        opset=args.opset,
        exporter=args.exporter,
        optimize=args.optimize,
        overwrite=args.overwrite,
    )
    if not args.no_check:
        # A batch of 1 at the export size; a dynamic batch: one of 3 too, at another size if that is dynamic
        h2, w2 = (size, size) if args.static_size else (size + 32, size + 64)
        c = extractor.in_chans
        inputs = [torch.rand(1, c, size, size), *([] if legacy else [torch.rand(3, c, h2, w2)])]
        info["max_abs_err"] = check_onnx(args.out, extractor, inputs)
    print(json.dumps(info, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = ArgumentParser(add_help=False)
    common.add_argument(
        "--model", default=None, help="timm model name, e.g. h_vit3_tiny (default: the vit3 checkpoint's)"
    )
    weights = common.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", default=None, help="vit3 checkpoint or official weights file")
    weights.add_argument("--pretrained", action="store_true", help="timm pretrained weights instead")
    weights.add_argument(
        "--random-init",
        action="store_true",
        help="no weights: a randomly initialised backbone (needs --model)",
    )
    common.add_argument("--ema", action="store_true", help="the EMA weights of a vit3 checkpoint")
    common.add_argument(
        "--out-indices", type=int, nargs="+", default=None, help="timm features_only out_indices"
    )
    common.add_argument(
        "--img-size", type=int, default=None, help="square input size (default: the checkpoint's / model's)"
    )
    common.add_argument(
        "--overwrite",
        action="store_true",
        help="move an earlier export at --out into a replaced-<time>/ folder beside it first",
    )
    add_debug_flag(common)
    f = sub.add_parser("features", parents=[common], help="features of a folder of images -> safetensors")
    f.add_argument("--images", required=True, help="folder of images (subfolders included)")
    f.add_argument(
        "--out",
        required=True,
        help="output folder (created; one that holds an earlier export: see --overwrite)",
    )
    f.add_argument("--crop-pct", type=float, default=None, help="timm crop fraction (1.0: no crop margin)")
    f.add_argument("--batch-size", type=int, default=8)
    f.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    f.add_argument("--device", default="cpu")
    o = sub.add_parser("onnx", parents=[common], help="multi-scale feature extractor -> ONNX")
    o.add_argument("--out", required=True, help="output .onnx file (an earlier one: see --overwrite)")
    o.add_argument(
        "--exporter",
        choices=("auto", "dynamo", "torchscript"),
        default="auto",
        help="dynamo (torch.export); torchscript: a static graph (batch 1, --img-size); auto: dynamo",
    )
    o.add_argument("--opset", type=int, default=18)
    o.add_argument("--static-size", action="store_true", help="fix the image size (dynamic batch only)")
    o.add_argument(
        "--optimize", action="store_true", help="run the ONNX graph optimiser (slow for large graphs)"
    )
    o.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    return run_cli(parser, _export, argv, intermixed=False)


if __name__ == "__main__":
    sys.exit(main())
