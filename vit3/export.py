"""Export multi-scale backbone features: safetensors files for a folder of images, and ONNX.

:class:`FeatureExtractor` (a timm ``features_only`` backbone with its normalisation, from a checkpoint's
record or a model name), :func:`export_features` (one ``<image stem>.safetensors`` per image and a
``manifest.json``) and :func:`export_onnx` / :func:`check_onnx` (the extractor as ONNX, normalisation inside).
How each is built, written and checked: ``docs/design/export.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import timm
import torch
from torch import Tensor, nn

from .data.image import apply_transform, open_image, warn_if_tiny, warn_skipped
from .engine.config import ConfigError
from .engine.run_folder import move_aside
from .errors import DataError, OutputError
from .outputs import atomic_path, write_bytes, write_text
from .tasks.backbone import FeatureBackbone

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
MANIFEST = "manifest.json"
DYNAMO_MIN_OPSET = 18  # torch.export's ONNX exporter writes this opset and up


class FeatureExtractor(nn.Module):
    """Normalisation + timm ``features_only`` backbone.

    Args:
        model_name: timm model name; ``None`` for a vit3 checkpoint's own model (required otherwise).
        checkpoint: weights (a vit3 checkpoint or an official file), loaded into the backbone.
        pretrained: timm pretrained weights instead.
        out_indices: timm ``out_indices`` (None: the model's default).
        use_ema: a vit3 checkpoint's EMA weights.
        indices_from: the flag or key ``out_indices`` came from (named when they do not fit the model).
        **kwargs: more ``timm.create_model`` kwargs (over a vit3 checkpoint's own).

    ``weights`` says where the weights came from (the checkpoint, ``"timm pretrained"`` or
    ``"random init"``); the manifest and the ONNX report record it.

    Forward: ``[B, C_in, H, W]`` images in [0, 1] -> tuple of ``[B, C_i, H / s_i, W / s_i]``.
    """

    def __init__(
        self,
        model_name: str | None = None,
        checkpoint: str | None = None,
        pretrained: bool = False,
        out_indices: Sequence[int] | None = None,
        use_ema: bool = False,
        indices_from: str = "out_indices",
        **kwargs,
    ) -> None:
        super().__init__()
        record = None
        if checkpoint:
            from .engine.checkpoint import merge_model_spec
            from .models.record import model_record, peek_vit3_checkpoint, require_classifier

            ckpt = peek_vit3_checkpoint(checkpoint)
            if ckpt is not None:
                require_classifier(ckpt, checkpoint, "exporting a backbone")
                record = model_record(ckpt)
                model_name, kwargs = merge_model_spec(record, model_name, kwargs, checkpoint)
        if not model_name:
            raise ConfigError(
                f"{checkpoint} is not a vit3 checkpoint (it carries no model record): name its model with "
                "--model"
                if checkpoint
                else "no model: give --model NAME or a vit3 --checkpoint"
            )
        self.backbone = FeatureBackbone(
            model_name,
            out_indices,
            pretrained=pretrained,
            out_norm=False,
            indices_from=indices_from,
            **kwargs,
        )
        self.weights = str(checkpoint) if checkpoint else ("timm pretrained" if pretrained else "random init")
        if checkpoint:
            from .engine.dense import load_backbone_weights

            missing = load_backbone_weights(self.backbone, checkpoint, use_ema=use_ema)
            if missing:
                log.warning(
                    "%s: %d backbone weights not in %s: %s", model_name, len(missing), checkpoint, missing[:5]
                )
        self.in_chans = int(kwargs.get("in_chans", self.backbone.data_config["input_size"][0]))
        self.preprocessing = _preprocessing(self.backbone.data_config, record, self.in_chans)
        c = self.in_chans
        self.register_buffer(
            "mean", torch.tensor(self.preprocessing["mean"]).view(1, c, 1, 1), persistent=False
        )
        self.register_buffer(
            "std", torch.tensor(self.preprocessing["std"]).view(1, c, 1, 1), persistent=False
        )
        info = self.backbone.body.feature_info
        # by the model's feature index: a map keeps its name whichever out_indices were asked
        self.names = [f"feat{i}_s{s}" for i, s in zip(info.out_indices, info.reduction())]
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


def _preprocessing(model_cfg: dict[str, Any], record: dict[str, Any] | None, in_chans: int) -> dict[str, Any]:
    """Eval preprocessing: the record's settings where it has them, else the model's ``pretrained_cfg``."""
    record = record or {}
    size = record.get("img_size") or model_cfg["input_size"][-1]
    mean = list(record.get("mean") or model_cfg["mean"])
    std = list(record.get("std") or model_cfg["std"])
    if len(mean) != in_chans and len(mean) == 3:  # RGB statistics for a one-channel model: their average
        mean, std = [sum(mean) / 3] * in_chans, [sum(std) / 3] * in_chans
    return {
        "input_size": [in_chans, int(size), int(size)],
        "interpolation": record.get("interpolation") or model_cfg["interpolation"],
        "crop_pct": float(record.get("crop_pct") or model_cfg["crop_pct"]),
        "crop_mode": model_cfg.get("crop_mode", "center"),
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
    }


def eval_transform(extractor: FeatureExtractor, img_size: int | None = None, crop_pct: float | None = None):
    """timm eval transform of the extractor (resize, center crop, to tensor) *without* normalisation.

    Returns:
        ``(transform, config)``: the callable (PIL -> ``[C_in, H, W]`` in [0, 1]) and its settings.
    """
    cfg = dict(extractor.preprocessing)
    if img_size:
        cfg["input_size"] = [extractor.in_chans, img_size, img_size]
    if crop_pct:
        cfg["crop_pct"] = crop_pct
    transform = timm.data.create_transform(
        input_size=tuple(cfg["input_size"]),
        interpolation=cfg["interpolation"],
        crop_pct=cfg["crop_pct"],
        crop_mode=cfg["crop_mode"],
        mean=(0.0,) * extractor.in_chans,
        std=(1.0,) * extractor.in_chans,
        is_training=False,
    )
    return transform, cfg


def list_images(folder: str | Path) -> list[Path]:
    """Image files of ``folder`` and its subfolders (e.g. ``val/<class>/``), sorted; raises if there is none.
    Other files are skipped with a warning that names them (hidden files, e.g. ``.DS_Store``, silently)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder not found: {folder}")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if not images:
        raise DataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
    warn_skipped(folder, [p for p in files if p.suffix.lower() not in IMAGE_SUFFIXES], IMAGE_SUFFIXES)
    return images


def check_export_output(kind: str, out: str | Path, overwrite: bool = False) -> list[str]:
    """Checks that an export of ``kind`` (``"features"`` into the folder ``out``, ``"onnx"`` to the file
    ``out``) replaces no earlier export and mixes with no other files (no stale file beside a new manifest).

    Returns:
        The entries of the folder that hold an earlier export, which ``overwrite`` moves into
        ``replaced-<UTC time>/`` there (empty where there is none).

    Raises:
        ConfigError: ``out`` holds an earlier export and ``overwrite`` is not set; for features, also a folder
            that holds other files than a feature export (``manifest.json``, ``*.safetensors``), even with
            ``overwrite`` (those files are not an export's to move).
    """
    out = Path(out)
    aside = (
        f"--overwrite to move it into {(out.parent if kind == 'onnx' else out) / 'replaced-<time>'}/ first"
    )
    if kind == "onnx":
        if out.exists() and not overwrite:
            raise ConfigError(
                f"--out {out} exists, and this export would replace it: give another --out, or {aside}"
            )
        return [out.name] if out.exists() else []
    if not out.is_dir():
        return []
    earlier = [
        e
        for e in sorted(out.iterdir())
        if not e.name.startswith(".") and not (e.is_dir() and e.name.startswith("replaced-"))
    ]
    files = [
        f
        for e in earlier
        for f in ([e] if e.is_file() else sorted(e.rglob("*")))
        if f.is_file() and not f.name.startswith(".")
    ]
    other = [f for f in files if f.suffix != ".safetensors" and f != out / MANIFEST]
    if other:
        raise ConfigError(
            f"--out {out} holds files that are no feature export (e.g. {other[0].relative_to(out)}), which "
            "the "
            f"export would mix with: give an empty or new folder"
        )
    if earlier and not overwrite:
        what = MANIFEST if (out / MANIFEST).is_file() else f"feature files without a {MANIFEST}"
        raise ConfigError(
            f"--out {out} holds an earlier feature export ({what}), whose files would sit beside the new "
            f"manifest: give another --out, or {aside}"
        )
    return [e.name for e in earlier]


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
    overwrite: bool = False,
) -> Path:
    """Writes the features of every image of ``image_dir`` as safetensors, plus a manifest.

    Args:
        extractor: the model.
        image_dir: folder of images (subfolders included: ``<out>/<subfolder>/<stem>.safetensors``).
        out_dir: output folder (created).
        img_size: square input size (None: the model's default).
        crop_pct: timm crop fraction (None: the model's; 1.0 resizes the shorter side to ``img_size``).
        batch_size: images per forward pass.
        dtype: stored dtype (float32, float16 or bfloat16).
        device: where to run the model.
        overwrite: move an earlier export in ``out_dir`` aside first (:func:`check_export_output`).

    Returns:
        The manifest path (written last, once every feature file is). Each ``<stem>.safetensors`` holds
        ``{name: [C, h, w]}``.

    Raises:
        ConfigError: ``out_dir`` holds an earlier export (without ``overwrite``) or other files.
        OutputError: the system refused a write (a full disk): no manifest is written.
    """
    from safetensors.torch import save as safetensors_bytes

    images = list_images(image_dir)
    image_dir = Path(image_dir)
    stems = [p.relative_to(image_dir).with_suffix("").as_posix() for p in images]
    dup = sorted({s for s in stems if stems.count(s) > 1})
    if dup:
        raise DataError(f"images in {image_dir} share file stems (outputs would collide): {dup[:5]}")
    out_dir = Path(out_dir)
    earlier = check_export_output("features", out_dir, overwrite)
    if earlier:
        target, moved = move_aside(out_dir, earlier, ())
        log.warning("--overwrite: moved the earlier export's %s to %s", ", ".join(moved), target)
    out_dir.mkdir(parents=True, exist_ok=True)
    transform, pre = eval_transform(extractor, img_size, crop_pct)
    mode = "L" if extractor.in_chans == 1 else "RGB"
    extractor = extractor.to(device).eval()
    files, shapes = [], None
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size]
        pictures = [open_image(p, mode) for p in chunk]
        for path, picture in zip(chunk, pictures):
            warn_if_tiny(picture, path)
        x = torch.stack([apply_transform(transform, im, str(p)) for p, im in zip(chunk, pictures)]).to(device)
        feats = extractor(x)  # x: [b, C_in, H, W]
        shapes = [list(f.shape[1:]) for f in feats]
        for i, path in enumerate(chunk):
            tensors = {n: f[i].to(dtype).contiguous().cpu() for n, f in zip(extractor.names, feats)}
            image = path.relative_to(image_dir).as_posix()  # a subfolder's images keep their subfolder
            name = f"{image.rpartition('.')[0]}.safetensors"
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            metadata = {"image": image, "model": extractor.backbone.model_name}
            # Written like the manifest (mode 0666 & ~umask); safetensors' save_file creates files 0600.
            data = safetensors_bytes(tensors, metadata=metadata)
            write_bytes(out_dir / name, data, "feature file", durable=False, clean=False)
            files.append({"image": image, "file": name})
    manifest = {
        "model": extractor.backbone.model_name,
        "weights": extractor.weights,
        "preprocessing": {**pre, "image_mode": mode, "input_range": "pixels / 255, then (x - mean) / std"},
        "dtype": str(dtype).removeprefix("torch."),
        "features": [{**d, "shape": s} for d, s in zip(extractor.describe(), shapes)],
        "files": files,
    }
    return write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1), "manifest")


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """torch.fx records the Python stack of every traced op (ONNX debug metadata): a cost an export skips."""
    import torch.fx.config as fx_config

    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def fold_onnx(model: Any) -> None:
    """The cheap part of onnxscript's optimiser, in place on an ``onnx_ir`` model: constant folding (the
    static parts of the shape computations), dead-node removal, common-subexpression elimination and
    initializer clean-up, without its pattern-rewrite rules, whose matcher takes minutes on graphs of
    several thousand nodes (``export_onnx(optimize=True)`` runs the whole optimiser)."""
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript.optimizer import fold_constants

    ir.passes.Sequential(common.InlinePass(), common.RemoveUnusedNodesPass())(model)
    for _ in range(2):  # folding exposes more constants once dead nodes are gone
        fold_constants(model)
        common.RemoveUnusedNodesPass()(model)
    ir.passes.Sequential(
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.NameFixPass(),
    )(model)


def export_onnx(
    extractor: FeatureExtractor,
    path: str | Path,
    img_size: int | tuple[int, int] = 224,
    dynamic_batch: bool = True,
    dynamic_size: bool = True,
    opset: int = 18,
    exporter: str = "auto",
    optimize: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Exports the extractor to ONNX (input ``images`` ``[B, C_in, H, W]`` in [0, 1]; outputs named as
    features).

    Args:
        extractor: the model.
        path: output ``.onnx`` file.
        img_size: example input size (with a dynamic size, at least twice the deepest stride: a feature
            map of one pixel in the example would be fixed at that size in the graph).
        dynamic_batch: symbolic batch dimension.
        dynamic_size: symbolic height / width.
        opset: ONNX opset.
        exporter: ``dynamo`` (torch.export), ``torchscript`` (``dynamo=False``: a static graph, which needs
            ``dynamic_batch=False`` and ``dynamic_size=False``: that exporter fixes the sizes it traces) or
            ``auto`` (dynamo, then for a static graph TorchScript if dynamo fails).
        optimize: run onnxscript's whole graph optimiser on the dynamo export (its pattern rewrites take
            minutes for the larger models; by default only :func:`fold_onnx`, and onnxruntime optimises the
            graph again when it loads it).
        overwrite: move an earlier file at ``path`` into ``replaced-<UTC time>/`` beside it first (without
            it, such a file is refused: :func:`check_export_output`). The file is written to a temporary
            name and renamed, so a failed export (a full disk) leaves no partial file.

    Returns:
        ``{"path", "exporter", "dynamic_batch", "dynamic_size", "optimized", "nodes", "errors"}`` (``errors``:
        of exporters that failed or were not tried).

    Raises:
        ValueError: an unknown ``exporter``, ``torchscript`` asked for a dynamic batch or size, or an
            ``opset`` below :data:`DYNAMO_MIN_OPSET` for a dynamic graph or from ``dynamo``.
    """
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise ValueError(f"unknown exporter {exporter!r}: expected auto, dynamo or torchscript")
    static = not (dynamic_batch or dynamic_size)
    if exporter == "torchscript" and not static:
        raise ValueError(
            "exporter='torchscript' writes a static graph (the legacy exporter fixes the sizes it traces): "
            "pass dynamic_batch=False and dynamic_size=False, or exporter='dynamo' for a dynamic batch or "
            "size"
        )
    if opset < DYNAMO_MIN_OPSET and (exporter == "dynamo" or not static):
        raise ConfigError(
            f"opset {opset}: the torch.export exporter writes opset {DYNAMO_MIN_OPSET} and up; below it only "
            "the legacy exporter writes a graph, a static one (--exporter torchscript, or "
            "exporter='torchscript': one image of the export size): ask for it, or for opset "
            f"{DYNAMO_MIN_OPSET} or more"
        )
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    path = Path(path)
    earlier = check_export_output("onnx", path, overwrite)
    if earlier:
        target, _ = move_aside(path.parent, earlier, ())
        log.warning("--overwrite: moved the earlier %s to %s", path.name, target)
    path.parent.mkdir(parents=True, exist_ok=True)
    extractor = extractor.cpu().eval()
    if dynamic_size:  # torch.export fixes any size it sees as 1: trace with at least a 2x2 deepest grid
        reach = 2 * max(extractor.backbone.strides)
        h, w = max(h, reach), max(w, reach)
    x = torch.rand(2 if dynamic_batch else 1, extractor.in_chans, h, w)
    errors: dict[str, str] = {}
    kinds = ("dynamo", "torchscript") if exporter == "auto" else (exporter,)
    if opset < DYNAMO_MIN_OPSET:  # a static graph (above): the legacy exporter's alone
        kinds = ("torchscript",)
        errors["dynamo"] = f"not tried: it writes opset {DYNAMO_MIN_OPSET} and up"
    if not static and "torchscript" in kinds:  # auto for a dynamic graph: dynamo alone
        kinds = ("dynamo",)
        errors["torchscript"] = "not tried: it writes static graphs only (dynamic_batch / dynamic_size asked)"
    for kind in kinds:
        try:
            kwargs: dict[str, Any] = {
                "input_names": ["images"],
                "output_names": list(extractor.names),
                "opset_version": opset,
            }
            nodes = None
            if kind == "dynamo":
                dims = {}
                if dynamic_batch:
                    dims[0] = torch.export.Dim("batch", min=1, max=1024)
                if dynamic_size:
                    dims[2], dims[3] = torch.export.Dim.AUTO, torch.export.Dim.AUTO
                with _without_stack_traces():
                    program = torch.onnx.export(
                        extractor,
                        (x,),
                        None,
                        dynamo=True,
                        dynamic_shapes={"x": dims},
                        optimize=optimize,
                        **kwargs,
                    )
                wrote = program.model.opset_imports.get("", opset)
                if wrote != opset:  # torch logs a failed down-conversion and keeps its own opset
                    raise ValueError(f"it wrote opset {wrote}, not the opset {opset} asked (no conversion)")
                if not optimize:
                    fold_onnx(program.model)
                nodes = len(program.model.graph)
                with atomic_path(path, "ONNX file") as tmp:
                    program.save(tmp)
            else:
                b, _, h, w = x.shape
                log.warning(
                    "the TorchScript exporter writes a static graph: batch %d, %dx%d images only", b, h, w
                )
                with atomic_path(path, "ONNX file") as tmp:
                    torch.onnx.export(extractor, (x,), tmp, dynamo=False, **kwargs)
            return {
                "path": str(path),
                "weights": extractor.weights,
                "exporter": kind,
                "dynamic_batch": dynamic_batch,
                "dynamic_size": dynamic_size,
                "optimized": ("full" if optimize else "folded") if kind == "dynamo" else None,
                "nodes": nodes,
                "errors": errors,
            }
        except OutputError:  # the system refused the file (a full disk): no exporter can write it
            raise
        except Exception as e:  # try the next exporter; the caller sees why this one failed
            errors[kind] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("ONNX export with %s failed: %s", kind, errors[kind])
    raise RuntimeError(f"ONNX export of {extractor.backbone.model_name} failed: {errors}")


def check_onnx(path: str | Path, extractor: FeatureExtractor, inputs: Sequence[Tensor]) -> float:
    """Runs the ONNX file with onnxruntime on each ``[B, C_in, H, W]`` input and compares with PyTorch.

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
                    f"ONNX output {name} has shape {tuple(g.shape)}, PyTorch {tuple(r.shape)} (input "
                    f"{tuple(x.shape)})"
                )
            worst = max(worst, float((torch.from_numpy(g) - r).abs().max()))
    return worst
