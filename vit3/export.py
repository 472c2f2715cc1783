"""Export multi-scale backbone features: safetensors files for a folder of images, and ONNX.

- :func:`export_features`: runs a timm ``features_only`` backbone (raw maps: no added norms, no pyramid) over
  every image of a folder with the model's eval preprocessing (timm ``resolve_data_config`` +
  ``create_transform``) and writes ``<out>/<image stem>.safetensors`` (one ``[C, h, w]`` tensor per feature
  map) and ``<out>/manifest.json`` (model, preprocessing, feature names / channels / strides / shapes, files).
- :func:`export_onnx`: the same extractor as ONNX, with the normalisation inside the graph (input: RGB in
  [0, 1], ``[B, 3, H, W]``), a dynamic batch and, where the model allows it, a dynamic image size.
  :func:`check_onnx` runs it with onnxruntime and returns the largest difference to PyTorch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import timm
import torch
from PIL import Image
from torch import Tensor, nn

from .tasks.backbone import FeatureBackbone

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
MANIFEST = "manifest.json"


class FeatureExtractor(nn.Module):
    """Normalisation + timm ``features_only`` backbone.

    Args:
        model_name: timm model name.
        checkpoint: weights (a vit3 checkpoint or an official file), loaded into the backbone.
        pretrained: timm pretrained weights instead.
        out_indices: timm ``out_indices`` (None: the model's default).
        **kwargs: more ``timm.create_model`` kwargs.

    Forward: ``[B, 3, H, W]`` RGB in [0, 1] -> tuple of ``[B, C_i, H / s_i, W / s_i]``.
    """

    def __init__(
        self,
        model_name: str,
        checkpoint: str | None = None,
        pretrained: bool = False,
        out_indices: Sequence[int] | None = None,
        **kwargs,
    ) -> None:
        super().__init__()
        self.backbone = FeatureBackbone(
            model_name, out_indices, pretrained=pretrained, out_norm=False, **kwargs
        )
        if checkpoint:
            from .engine.dense import load_backbone_weights

            missing = load_backbone_weights(self.backbone, checkpoint)
            if missing:
                log.warning(
                    "%s: %d backbone weights not in %s: %s", model_name, len(missing), checkpoint, missing[:5]
                )
        dc = self.backbone.data_config
        self.register_buffer("mean", torch.tensor(dc["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(dc["std"]).view(1, 3, 1, 1), persistent=False)
        info = self.backbone.body.feature_info
        self.names = [f"feat{i}_s{s}" for i, s in enumerate(info.reduction())]
        self.eval()

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.backbone((x - self.mean) / self.std))

    def describe(self) -> list[dict[str, Any]]:
        """Name, timm module, channels and stride of every output."""
        info = self.backbone.body.feature_info
        return [
            {"name": n, "module": m, "channels": c, "stride": s}
            for n, m, c, s in zip(self.names, info.module_name(), info.channels(), info.reduction())
        ]


def eval_transform(extractor: FeatureExtractor, img_size: int | None = None, crop_pct: float | None = None):
    """timm eval transform of the model (resize, center crop, to tensor) *without* normalisation.

    Returns:
        ``(transform, config)``: the callable (PIL -> ``[3, H, W]`` in [0, 1]) and its resolved settings.
    """
    args: dict[str, Any] = {}
    if img_size:
        args["input_size"] = (3, img_size, img_size)
    if crop_pct:
        args["crop_pct"] = crop_pct
    cfg = timm.data.resolve_data_config(args, model=extractor.backbone.body)
    transform = timm.data.create_transform(
        **{**cfg, "mean": (0.0,) * 3, "std": (1.0,) * 3}, is_training=False
    )
    return transform, {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}


def list_images(folder: str | Path) -> list[Path]:
    """Image files of ``folder`` (not recursive), sorted; raises if there is none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder not found: {folder}")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
    return images


@torch.no_grad()
def export_features(
    extractor: FeatureExtractor,
    image_dir: str | Path,
    out_dir: str | Path,
    img_size: int | None = None,
    crop_pct: float | None = None,
    batch_size: int = 8,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Path:
    """Writes the features of every image of ``image_dir`` as safetensors, plus a manifest.

    Args:
        extractor: the model.
        image_dir: folder of images.
        out_dir: output folder (created).
        img_size: square input size (None: the model's default).
        crop_pct: timm crop fraction (None: the model's; 1.0 resizes the shorter side to ``img_size``).
        batch_size: images per forward pass.
        dtype: stored dtype (float32, float16 or bfloat16).
        device: where to run the model.

    Returns:
        The manifest path. Each ``<stem>.safetensors`` holds ``{name: [C, h, w]}``.
    """
    from safetensors.torch import save_file

    images = list_images(image_dir)
    stems = [p.stem for p in images]
    dup = sorted({s for s in stems if stems.count(s) > 1})
    if dup:
        raise ValueError(f"images in {image_dir} share file stems (outputs would collide): {dup[:5]}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    transform, pre = eval_transform(extractor, img_size, crop_pct)
    extractor = extractor.to(device).eval()
    files, shapes = [], None
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size]
        x = torch.stack([transform(Image.open(p).convert("RGB")) for p in chunk]).to(device)  # [b, 3, H, W]
        feats = extractor(x)
        shapes = [list(f.shape[1:]) for f in feats]
        for i, path in enumerate(chunk):
            tensors = {n: f[i].to(dtype).contiguous().cpu() for n, f in zip(extractor.names, feats)}
            name = f"{path.stem}.safetensors"
            save_file(
                tensors, out_dir / name, metadata={"image": path.name, "model": extractor.backbone.model_name}
            )
            files.append({"image": path.name, "file": name})
    manifest = {
        "model": extractor.backbone.model_name,
        "preprocessing": {**pre, "input_range": "RGB / 255, then (x - mean) / std"},
        "dtype": str(dtype).removeprefix("torch."),
        "features": [{**d, "shape": s} for d, s in zip(extractor.describe(), shapes)],
        "files": files,
    }
    path = out_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    return path


def export_onnx(
    extractor: FeatureExtractor,
    path: str | Path,
    img_size: int | tuple[int, int] = 224,
    dynamic_batch: bool = True,
    dynamic_size: bool = True,
    opset: int = 18,
    exporter: str = "auto",
) -> dict[str, Any]:
    """Exports the extractor to ONNX (input ``images`` ``[B, 3, H, W]`` in [0, 1]; outputs named as features).

    Args:
        extractor: the model.
        path: output ``.onnx`` file.
        img_size: example input size.
        dynamic_batch: symbolic batch dimension.
        dynamic_size: symbolic height / width.
        opset: ONNX opset.
        exporter: ``dynamo`` (torch.export), ``torchscript`` (``dynamo=False``) or ``auto`` (dynamo, then
            TorchScript if dynamo fails).

    Returns:
        ``{"path", "exporter", "dynamic_batch", "dynamic_size", "errors"}`` (errors of exporters that failed).
    """
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise ValueError(f"unknown exporter {exporter!r}: expected auto, dynamo or torchscript")
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extractor = extractor.cpu().eval()
    x = torch.rand(2 if dynamic_batch else 1, 3, h, w)
    axes = {**({0: "batch"} if dynamic_batch else {}), **({2: "height", 3: "width"} if dynamic_size else {})}
    errors: dict[str, str] = {}
    for kind in ("dynamo", "torchscript") if exporter == "auto" else (exporter,):
        try:
            kwargs: dict[str, Any] = {
                "input_names": ["images"],
                "output_names": list(extractor.names),
                "opset_version": opset,
            }
            if kind == "dynamo":
                dims = {}
                if dynamic_batch:
                    dims[0] = torch.export.Dim("batch", min=1, max=1024)
                if dynamic_size:
                    dims[2], dims[3] = torch.export.Dim.AUTO, torch.export.Dim.AUTO
                torch.onnx.export(extractor, (x,), path, dynamo=True, dynamic_shapes={"x": dims}, **kwargs)
            else:
                dyn = {"images": axes, **{n: {0: "batch"} if dynamic_batch else {} for n in extractor.names}}
                torch.onnx.export(extractor, (x,), path, dynamo=False, dynamic_axes=dyn, **kwargs)
            return {
                "path": str(path),
                "exporter": kind,
                "dynamic_batch": dynamic_batch,
                "dynamic_size": dynamic_size,
                "errors": errors,
            }
        except Exception as e:  # try the next exporter; the caller sees why this one failed
            errors[kind] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("ONNX export with %s failed: %s", kind, errors[kind])
    raise RuntimeError(f"ONNX export of {extractor.backbone.model_name} failed: {errors}")


def check_onnx(path: str | Path, extractor: FeatureExtractor, inputs: Sequence[Tensor]) -> float:
    """Runs the ONNX file with onnxruntime on each ``[B, 3, H, W]`` input and compares with PyTorch.

    Returns:
        The largest absolute difference over all inputs and outputs.

    Raises:
        ValueError: an output has another shape than PyTorch's.
    """
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for x in inputs:
        with torch.no_grad():
            ref = extractor.cpu().eval()(x)
        got = session.run(None, {"images": x.numpy()})
        for name, r, g in zip(extractor.names, ref, got):
            if tuple(g.shape) != tuple(r.shape):
                raise ValueError(
                    f"ONNX output {name} has shape {tuple(g.shape)}, PyTorch {tuple(r.shape)} (input {tuple(x.shape)})"
                )
            worst = max(worst, float((torch.from_numpy(g) - r).abs().max()))
    return worst
