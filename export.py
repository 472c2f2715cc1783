"""Export multi-scale backbone features (safetensors + manifest) or the feature extractor (ONNX).

    python export.py features --model h_vit3_tiny --checkpoint h_vittt_t.pth --images photos/ --out feats/
    python export.py onnx --model h_vit3_tiny --checkpoint h_vittt_t.pth --out h_vit3_tiny_features.onnx

``features`` writes ``<out>/<image>.safetensors`` ({name: [C, h, w]}) and ``<out>/manifest.json`` (model,
preprocessing, feature names, channels, strides, shapes). ``onnx`` writes a graph taking RGB in [0, 1]
``[B, 3, H, W]`` (normalisation included) with a dynamic batch (and size where the model allows), checks
it against PyTorch with onnxruntime and prints the largest difference.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import vit3  # noqa: F401  (registers the vit3 models in timm)
from vit3.export import FeatureExtractor, check_onnx, export_features, export_onnx

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", required=True, help="timm model name, e.g. h_vit3_tiny or vit3_small")
    common.add_argument("--checkpoint", default=None, help="vit3 checkpoint or official weights file")
    common.add_argument("--pretrained", action="store_true", help="timm pretrained weights instead")
    common.add_argument(
        "--out-indices", type=int, nargs="+", default=None, help="timm features_only out_indices"
    )
    common.add_argument("--img-size", type=int, default=None, help="square input size (default: the model's)")
    f = sub.add_parser("features", parents=[common], help="features of a folder of images -> safetensors")
    f.add_argument("--images", required=True, help="folder of images")
    f.add_argument("--out", required=True, help="output folder")
    f.add_argument("--crop-pct", type=float, default=None, help="timm crop fraction (1.0: no crop margin)")
    f.add_argument("--batch-size", type=int, default=8)
    f.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    f.add_argument("--device", default="cpu")
    o = sub.add_parser("onnx", parents=[common], help="multi-scale feature extractor -> ONNX")
    o.add_argument("--out", required=True, help="output .onnx file")
    o.add_argument("--exporter", choices=("auto", "dynamo", "torchscript"), default="auto")
    o.add_argument("--opset", type=int, default=18)
    o.add_argument("--static-size", action="store_true", help="fix the image size (dynamic batch only)")
    o.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    args = parser.parse_args(argv)
    try:
        extractor = FeatureExtractor(args.model, args.checkpoint, args.pretrained, args.out_indices)
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
            )
            print(f"wrote {manifest}")
            return 0
        size = args.img_size or extractor.backbone.data_config["input_size"][-1]
        info = export_onnx(
            extractor,
            args.out,
            size,
            dynamic_size=not args.static_size,
            opset=args.opset,
            exporter=args.exporter,
        )
        if not args.no_check:
            # A batch of 1 at the export size, and a batch of 3 at another size when the size is dynamic.
            h2, w2 = (size, size) if args.static_size else (size + 32, size + 64)
            inputs = [torch.rand(1, 3, size, size), torch.rand(3, 3, h2, w2)]
            info["max_abs_err"] = check_onnx(args.out, extractor, inputs)
        print(json.dumps(info, indent=1))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
