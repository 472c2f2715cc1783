"""Train / evaluate loops for detection (torchvision Mask / Faster R-CNN) and segmentation (UperNet, FPN).

``train(cfg)`` and ``evaluate(cfg)`` are what ``train.py`` / ``eval.py`` call for ``task: detection`` and
``task: segmentation``. They read the shared keys of ``configs/default.yaml`` (``model.*``, ``data.*``,
``train.*``, ``eval.*``) plus a ``dense:`` section (see ``configs/dense/*.yaml``):

- data: COCO layout ``<data.path>/<split>/`` + ``<data.path>/annotations/instances_<split>.json``
  (``dense.ann_train`` / ``dense.ann_val`` override the files); ADE20K layout ``<data.path>/images/<split>``
  + ``<data.path>/annotations/<split>``.
- backbone fine-tuning (what the official recipes use): ``model.drop_path_rate``, ``model.grad_checkpointing``,
  ``train.amp`` (auto: bf16 on CUDA; fp16 uses a GradScaler), ``dense.backbone_lr_mult`` (per-group lr) and
  ``train.layer_decay`` (layer-wise lr decay over the backbone blocks), no weight decay on parameters whose
  name holds one of ``dense.no_decay_keys`` (official: ``norm``).
- schedule: linear warmup over ``dense.warmup_iters`` from ``dense.warmup_factor``, then ``step``
  (``dense.milestones`` in epochs, or iterations when ``dense.iters`` > 0, times ``dense.gamma``) or ``poly``
  (``dense.poly_power``, to 0). Training runs ``train.epochs`` epochs, or ``dense.iters`` iterations if set.
- metrics: COCO box / mask AP through pycocotools; mIoU, per-class IoU, pixel accuracy (aAcc) and mAcc.

Outputs in ``cfg.output``: ``config.yaml``, ``last.pt`` / ``best.pt`` (vit3 checkpoints with the config, so
``eval.py --checkpoint`` needs nothing else) and ``metrics.json`` (history). ``last.pt`` is written at each
evaluation and every ``train.save_every_steps`` steps; ``train.resume`` continues at its epoch, batch and
step with its RNG states, on the seeded data stream of ``vit3.data.build``, so a killed run resumed ends with
the weights of an uninterrupted one (the plumbing: :mod:`vit3.engine.common`). An optimizer step accumulates
``train.accum_steps`` batches of one epoch.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..data.ade import IGNORE_INDEX, ADESegmentation
from ..data.build import build_train_loader
from ..data.coco import CocoDetection, collate_detection
from ..errors import DataError
from ..models._pretrained import load_checkpoint_file
from ..tasks.backbone import FeatureBackbone, block_layer_ids
from ..tasks.detection import build_detector
from ..tasks.segmentation import SegmentationModel, build_segmenter
from .checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    load_checkpoint,
    make_model_record,
    peek_vit3_checkpoint,
)
from .common import (
    Progress,
    amp_dtype,
    autocast,
    check_resume,
    claim_output,
    in_process_group,
    log,
    open_output,
    optimizer_step,
    restore_rng,
    save_state,
    start_run,
    wrap_ddp,
)
from .config import Config, ConfigError, check_config, run_metadata
from .distributed import DistInfo, barrier, distributed
from .optim import scaled_lrs
from .validation import model_arguments

__all__ = [
    "build_dense_model",
    "coco_results",
    "evaluate",
    "evaluate_detection",
    "evaluate_segmentation",
    "load_backbone_weights",
    "param_groups",
    "segmentation_metrics",
    "train",
]

COCO_STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def _dense(cfg: Config) -> Config:
    if "dense" not in cfg:
        raise ConfigError(f"task '{cfg.task}' needs a 'dense:' config section (see configs/dense/*.yaml)")
    return cfg.dense


# ----------------------------------------------------------------------------------------------- data


def _ann_file(cfg: Config, split: str, override: str | None) -> Path:
    return Path(override) if override else Path(cfg.data.path) / "annotations" / f"instances_{split}.json"


def ensure_synthetic(cfg: Config) -> Path:
    """Writes the synthetic digit data of ``dense.synthetic`` to ``data.path`` unless it is already there."""
    from ..data.synthetic_dense import make_synthetic_ade, make_synthetic_coco

    root, syn = Path(cfg.data.path), cfg.dense.synthetic
    if root.exists():
        return root
    splits = dict(syn.splits or {cfg.data.train_split: 64, cfg.data.val_split: 16})
    kw = dict(
        image_size=syn.image_size,
        max_per_image=syn.max_per_image,
        digit_size=tuple(syn.digit_size),
        seed=cfg.seed,
    )
    tmp = root.with_name(root.name + ".tmp")  # write aside, then move: a killed run leaves no half dataset
    make = make_synthetic_coco if cfg.task == "detection" else make_synthetic_ade
    make(tmp, splits, digits=tuple(syn.digits), **kw)
    tmp.replace(root)
    return root


def build_dataset(
    cfg: Config,
    train: bool,
    mean: tuple[float, ...] = (0.485, 0.456, 0.406),
    std: tuple[float, ...] = (0.229, 0.224, 0.225),
) -> CocoDetection | ADESegmentation:
    """The training or validation dataset of a dense config (COCO or ADE20K layout; ``mean`` / ``std``:
    the segmentation normalisation, detectors normalise inside the model)."""
    d = _dense(cfg)
    expected = ("coco", "digits") if cfg.task == "detection" else ("ade20k", "digits")
    if cfg.data.dataset not in expected:
        raise ConfigError(
            f"data.dataset '{cfg.data.dataset}' does not fit task {cfg.task}: expected one of {expected}"
        )
    if cfg.data.dataset == "digits":
        ensure_synthetic(cfg)
    split = cfg.data.train_split if train else cfg.data.val_split
    if cfg.task == "detection":
        ann = _ann_file(cfg, split, d.ann_train if train else d.ann_val)
        return CocoDetection(Path(cfg.data.path) / split, ann, train=train, with_masks=d.arch == "mask_rcnn")
    return ADESegmentation(
        cfg.data.path,
        split,
        d.num_classes,
        train=train,
        mean=mean,
        std=std,
        scale=tuple(d.scale),
        crop_size=tuple(d.crop_size),
        ratio_range=tuple(d.ratio_range),
        reduce_zero_label=d.reduce_zero_label,
        cat_max_ratio=d.cat_max_ratio,
    )


# ---------------------------------------------------------------------------------------------- model


def _backbone_kwargs(cfg: Config) -> dict[str, Any]:
    d = cfg.dense
    kw = dict(cfg.model.kwargs or {})
    kw["drop_path_rate"] = cfg.model.drop_path_rate
    if d.out_indices is not None:
        kw["out_indices"], kw["indices_from"] = tuple(d.out_indices), "dense.out_indices"
    return kw


def build_dense_model(cfg: Config, num_classes: int) -> nn.Module:
    """Detector or segmenter of ``cfg`` (backbone weights from ``model.pretrained`` when set)."""
    d = _dense(cfg)
    with (
        model_arguments(cfg.model.name, cfg.model.kwargs or {}),
        model_arguments(d.arch, d.get("detector_kwargs") or {}, "dense.detector_kwargs"),
    ):
        model = _build_dense_model(cfg, d, num_classes)
    if cfg.model.pretrained:
        load_backbone_weights(_dense_backbone(model), cfg.model.pretrained, use_ema=cfg.model.pretrained_ema)
    if cfg.model.grad_checkpointing:
        _dense_backbone(model).set_grad_checkpointing(True)
    return model


def _build_dense_model(cfg: Config, d: Config, num_classes: int) -> nn.Module:
    if cfg.task == "detection":
        min_size = d.min_size if isinstance(d.min_size, int) else tuple(d.min_size)
        return build_detector(
            cfg.model.name,
            num_classes,
            arch=d.arch,
            out_channels=d.out_channels,
            min_size=min_size,
            max_size=d.max_size,
            anchor_sizes=tuple(d.anchor_sizes),
            box_head_dim=d.box_head_dim,
            mask_head_dim=d.mask_head_dim,
            backbone_kwargs=_backbone_kwargs(cfg),
            box_detections_per_img=d.detections_per_img,
            **(d.detector_kwargs or {}),
        )
    return build_segmenter(
        cfg.model.name, num_classes, d.arch, d.aux_weight, d.head_channels, _backbone_kwargs(cfg)
    )


def _dense_backbone(model: nn.Module) -> FeatureBackbone:
    return model.backbone.backbone


def load_backbone_weights(backbone: FeatureBackbone, path: str, use_ema: bool = False) -> list[str]:
    """Loads ImageNet weights (a vit3 checkpoint or an official file) into a ``features_only`` backbone.

    timm's feature wrappers rename modules (``stages.0`` -> ``stages_0``, or add a ``model.`` prefix), so each
    backbone key is matched against the file's keys with those spellings undone; the classifier is ignored.

    Returns:
        Backbone keys that got no weight (the added output norms, normally).

    Raises:
        CheckpointMismatchError: no key matched, or a matched key has another shape.
    """
    obj = peek_vit3_checkpoint(path)
    if obj is not None:
        state = obj["ema" if use_ema else "model"]
        if state is None:
            raise CheckpointError(f"checkpoint {path} holds no EMA weights (trained with train.ema=false)")
    else:
        state = load_checkpoint_file(path, use_ema=use_ema)  # official layouts (converted keys)
    body = backbone.body.state_dict()
    loaded, missing = {}, []
    for key, value in body.items():
        head, _, rest = key.partition(".")
        candidates = (key, key.removeprefix("model."), f"{head.replace('_', '.')}.{rest}" if rest else key)
        src = next((c for c in candidates if c in state), None)
        if src is None:
            missing.append(key)
            continue
        if state[src].shape != value.shape:
            raise CheckpointMismatchError(
                f"{path}: weight {src} has shape {tuple(state[src].shape)}, backbone expects {tuple(value.shape)}"
            )
        loaded[key] = state[src]
    if not loaded:
        raise CheckpointMismatchError(
            f"{path}: none of its {len(state)} weights fit backbone {backbone.model_name}"
        )
    backbone.body.load_state_dict(loaded, strict=False)
    return missing


def param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    backbone_lr_mult: float = 1.0,
    layer_decay: float | None = None,
    no_decay_keys: tuple[str, ...] = ("norm",),
) -> list[dict[str, Any]]:
    """AdamW parameter groups with per-group lr for the backbone and layer-wise lr decay.

    Backbone parameters (``model.backbone.backbone.body``) get ``lr * backbone_lr_mult``, times
    ``layer_decay ** (num_layers - 1 - layer_id)`` when ``layer_decay`` is set (stem deepest decay, last
    blocks least; see :func:`~vit3.tasks.backbone.block_layer_ids`). Parameters whose name contains one of
    ``no_decay_keys`` get no weight decay. Each group records its ``lr_scale`` for the scheduler.
    """
    body = _dense_backbone(model).body
    layer_of, n_layers = block_layer_ids(body)
    body_ids = {id(p): layer_of[n] for n, p in body.named_parameters()}
    groups: dict[tuple[float, float], list[Tensor]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        scale = 1.0
        if id(p) in body_ids:
            scale = backbone_lr_mult * (
                layer_decay ** (n_layers - 1 - body_ids[id(p)]) if layer_decay else 1.0
            )
        wd = 0.0 if any(k in name for k in no_decay_keys) else weight_decay
        groups.setdefault((scale, wd), []).append(p)
    return [{"params": ps, "lr": lr * s, "lr_scale": s, "weight_decay": wd} for (s, wd), ps in groups.items()]


def lr_factor(step: int, total: int, d: Config, iters_per_epoch: int) -> float:
    """Schedule factor at optimizer step ``step`` of ``total`` (warmup, then step or poly decay)."""
    if d.lr_schedule == "poly":
        factor = (1 - min(step, total) / max(total, 1)) ** d.poly_power
    elif d.lr_schedule == "step":
        unit = 1 if d.iters else iters_per_epoch  # milestones are epochs unless training by iterations
        factor = d.gamma ** sum(step >= m * unit for m in d.milestones)
    else:
        raise ConfigError(f"unknown dense.lr_schedule '{d.lr_schedule}': expected step or poly")
    if step < d.warmup_iters:
        factor *= d.warmup_factor + (1 - d.warmup_factor) * step / d.warmup_iters
    return factor


# ---------------------------------------------------------------------------------------------- train


def _to(batch, device: torch.device, task: str):
    if task == "detection":
        images, targets = batch
        return [i.to(device) for i in images], [{k: v.to(device) for k, v in t.items()} for t in targets]
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train(cfg: Config) -> dict[str, Any]:
    """Trains a detector or segmenter as ``cfg`` says; evaluates every ``train.eval_every`` epochs and at the end.

    Returns:
        ``{"history": [...], "final": metrics of the last evaluation, "losses": per-step total losses}``.
    """
    d = _dense(cfg)
    return in_process_group(cfg, _train, d)


@dataclass
class _Progress(Progress):
    """The counters of :class:`~vit3.engine.common.Progress` plus the history, the losses and the best score."""

    history: list[dict[str, Any]] = field(default_factory=list)  # one row per evaluation
    losses: list[float] = field(default_factory=list)  # one total loss per optimizer step
    best: float = -math.inf


def _train(cfg: Config, d: Any, info: DistInfo) -> dict[str, Any]:
    check_config(cfg, "train")  # the config may have been changed in code since it was loaded
    device = info.device
    amp = amp_dtype(cfg.train.amp, device)
    if cfg.task == "segmentation" and cfg.data.batch_size < 2:
        raise ConfigError(
            "segmentation needs data.batch_size >= 2 per process (BatchNorm in the decode heads)"
        )
    resume, ckpt = start_run(cfg, info, cfg.task)
    out = Path(cfg.output)
    if ckpt is not None:
        for change in check_resume(cfg, ckpt, info.world, resume):
            log(info, f"warning: train.force_resume=true: {change}")
    folder = claim_output(cfg, resume, ckpt)
    model, train_set, val_set = _model_and_data(cfg, with_train=True)
    open_output(folder, cfg, info)  # nothing written before the model and the data are known to be right
    model.to(device)
    num_classes = val_set.num_classes
    # The per-sample seeded, resumable stream of the classification engine (vit3.data.build); BatchNorm in
    # the segmentation heads needs full batches.
    loader, wrapped, sampler = build_train_loader(
        train_set, None, cfg, info.rank, info.world, drop_last=cfg.task == "segmentation",
        collate_fn=collate_detection if cfg.task == "detection" else None,
    )  # fmt: skip
    accum, bs = int(cfg.train.accum_steps), int(cfg.data.batch_size)
    batches_per_epoch = len(loader) // accum * accum  # every optimizer step accumulates within one epoch
    if batches_per_epoch == 0:
        raise ConfigError(f"train.accum_steps={accum} exceeds the {len(loader)} batches per epoch")
    iters_per_epoch = batches_per_epoch // accum
    total = d.iters or cfg.train.epochs * iters_per_epoch
    lr = scaled_lrs(cfg.train, bs * info.world * accum)["base_lr"]
    groups = param_groups(
        model, lr, cfg.train.weight_decay, d.backbone_lr_mult, cfg.train.layer_decay, tuple(d.no_decay_keys)
    )
    opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    net = wrap_ddp(model, cfg, info)
    p = _Progress()
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        p.restore(ckpt, bs, info.world, accum)
        p.roll_over(batches_per_epoch)
        p.history, p.losses, p.best = list(ckpt["history"]), list(ckpt["losses"]), float(ckpt["best"])
        restore_rng(ckpt, info)
        log(
            info,
            f"resumed from {resume}: epoch {p.epoch + 1}, batch {p.batch_in_epoch}, step {p.global_step}",
        )
    class_names = getattr(val_set, "class_names", d.class_names)

    def state() -> dict[str, Any]:
        return {
            "task": cfg.task,
            "record": make_model_record(cfg, num_classes, class_names, cfg.data.mean, cfg.data.std),
            "model_name": cfg.model.name,
            "num_classes": num_classes,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(),
            **p.counters(),
            "history": p.history,
            "losses": p.losses,
            "best": p.best,
            "config": cfg.to_dict(),
            "meta": run_metadata(),
        }

    eval_every = d.eval_interval or (cfg.train.eval_every or 1) * iters_per_epoch
    save_every = int(cfg.train.save_every_steps or 0)
    key = "bbox_AP" if cfg.task == "detection" else "mIoU"
    net.train()
    t0 = time.time()
    while p.global_step < total:
        wrapped.set_epoch(p.epoch)
        sampler.set_epoch(p.epoch, start=p.batch_in_epoch * bs)
        step_loss = 0.0
        for b, batch in enumerate(loader, start=p.batch_in_epoch):
            if b >= batches_per_epoch or p.global_step >= total:
                break
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_scale"] * lr_factor(p.global_step, total, d, iters_per_epoch)
            update = (b + 1) % accum == 0
            sync = net.no_sync() if info.distributed and not update else contextlib.nullcontext()
            with sync:
                with autocast(device, amp):
                    parts = net(*_to(batch, device, cfg.task))  # detector(images, targets) / segmenter(x, y)
                    loss = sum(parts.values())
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"non-finite loss at step {p.global_step}: { {k: float(v) for k, v in parts.items()} }"
                    )
                scaler.scale(loss / accum).backward()
            step_loss += float(loss.detach()) / accum
            p.batch_in_epoch = b + 1
            if not update:
                continue
            optimizer_step(model, opt, scaler, cfg.train.clip_grad)
            p.global_step += 1
            p.losses.append(step_loss)
            step, step_loss = p.global_step, 0.0
            if info.is_main and cfg.train.log_every and step % cfg.train.log_every == 0:
                print(
                    f"step {step}/{total} loss {p.losses[-1]:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                    f"({time.time() - t0:.0f}s)",
                    flush=True,
                )
            if step % eval_every == 0 or step == total:
                metrics = _evaluate_model(cfg, model, val_set, device) if info.is_main else {}
                improved = info.is_main and metrics[key] > p.best
                if info.is_main:
                    p.history.append({"step": step, "loss": p.losses[-1], **_scalars(metrics)})
                    p.best = max(p.best, metrics[key])
                save_state(state, out / "last.pt", info, [out / "best.pt"] if improved else [])
                if info.is_main:
                    (out / "metrics.json").write_text(_json(p.history))
                    print(
                        f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in _scalars(metrics).items()),
                        flush=True,
                    )
                barrier()
                net.train()
            elif save_every and step % save_every == 0:
                save_state(state, out / "last.pt", info)
        p.roll_over(batches_per_epoch)
    return {"history": p.history, "final": p.history[-1] if p.history else {}, "losses": p.losses}


def _model_and_data(cfg: Config, with_train: bool) -> tuple[nn.Module, Any, Any]:
    """Model, training set (None unless ``with_train``) and validation set of a dense config.

    Detection takes its classes from the COCO files (train and val must agree); segmentation from
    ``dense.num_classes`` and normalises with the backbone's mean / std (``data.mean`` / ``data.std`` override).
    """
    d = cfg.dense
    if cfg.task == "detection":
        val_set = build_dataset(cfg, train=False)
        train_set = build_dataset(cfg, train=True) if with_train else None
        if train_set is not None and train_set.label_to_cat_id != val_set.label_to_cat_id:
            raise DataError(
                f"train and val annotation files have different categories: {sorted(train_set.label_to_cat_id.values())} "
                f"vs {sorted(val_set.label_to_cat_id.values())}"
            )
        return build_dense_model(cfg, val_set.num_classes), train_set, val_set
    if not d.num_classes:
        raise ConfigError("segmentation needs dense.num_classes (150 for ADE20K)")
    model = build_dense_model(cfg, d.num_classes)
    dc = _dense_backbone(model).data_config
    mean, std = tuple(cfg.data.mean or dc["mean"]), tuple(cfg.data.std or dc["std"])
    for key, values in (("mean", mean), ("std", std)):
        if len(values) != 3:
            raise ConfigError(f"data.{key} must hold one value per RGB channel (3), got {list(values)}")
    train_set = build_dataset(cfg, True, mean, std) if with_train else None
    return model, train_set, build_dataset(cfg, False, mean, std)


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def _json(obj: Any) -> str:
    """JSON text with NaN (a COCO size range without objects, a class never seen) written as null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), indent=1)


# ----------------------------------------------------------------------------------------------- eval


def coco_results(
    outputs: dict[str, Tensor], image_id: int, label_to_cat_id: dict[int, int]
) -> tuple[list, list]:
    """torchvision detector outputs of one image -> COCO ``bbox`` and ``segm`` result entries."""
    from pycocotools import mask as mask_utils

    boxes = outputs["boxes"].float().cpu()
    boxes[:, 2:] -= boxes[:, :2]  # xyxy -> xywh
    scores, labels = outputs["scores"].float().cpu().tolist(), outputs["labels"].cpu().tolist()
    bbox = [
        {
            "image_id": image_id,
            "category_id": label_to_cat_id[lab],
            "bbox": [round(v, 2) for v in box],
            "score": s,
        }
        for box, lab, s in zip(boxes.tolist(), labels, scores)
    ]
    segm = []
    if "masks" in outputs:
        masks = (outputs["masks"][:, 0] > 0.5).cpu().numpy().astype(np.uint8)  # [n, H, W]
        for m, lab, s in zip(masks, labels, scores):
            rle = mask_utils.encode(np.asfortranarray(m))
            rle["counts"] = rle["counts"].decode("ascii")
            segm.append(
                {"image_id": image_id, "category_id": label_to_cat_id[lab], "segmentation": rle, "score": s}
            )
    return bbox, segm


def _coco_eval(coco_gt, results: list[dict], iou_type: str, image_ids: list[int]) -> dict[str, float]:
    from pycocotools.cocoeval import COCOeval

    if not results:  # pycocotools cannot index an empty result list: nothing detected scores 0
        return {f"{iou_type}_{k}": 0.0 for k in COCO_STATS}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress and the summary table
        dt = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, dt, iou_type)
        ev.params.imgIds = image_ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    # A stat of -1 means no ground truth of that size: report it as NaN, not as a score.
    return {
        f"{iou_type}_{k}": (float(v) if v >= 0 else float("nan")) for k, v in zip(COCO_STATS, ev.stats[:6])
    }


@torch.no_grad()
def evaluate_detection(
    model: nn.Module, dataset: CocoDetection, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """COCO box (and mask, for Mask R-CNN) AP of ``model`` on ``dataset`` through pycocotools.

    Returns:
        ``bbox_AP``, ``bbox_AP50``, ... ``segm_APl`` (0..1), and ``num_detections``.
    """
    model.eval()
    bbox, segm = [], []
    for i in range(len(dataset)):
        image, target = dataset[i]
        out = model([image.to(device)])[0]
        b, s = coco_results(out, int(target["image_id"]), dataset.label_to_cat_id)
        bbox += b
        segm += s
    metrics = _coco_eval(dataset.coco, bbox, "bbox", dataset.ids)
    if dataset.with_masks:
        metrics.update(_coco_eval(dataset.coco, segm, "segm", dataset.ids))
    metrics["num_detections"] = float(len(bbox))
    return metrics


def segmentation_metrics(confusion: Tensor, class_names: list[str] | None = None) -> dict[str, Any]:
    """mIoU, mAcc, aAcc and per-class IoU / accuracy from a ``[K, K]`` confusion matrix (rows: truth).

    Classes absent from both the labels and the predictions have NaN IoU and are left out of the means
    (as mmseg's ``nanmean``).
    """
    conf = confusion.double()
    tp = conf.diag()
    iou = tp / (conf.sum(0) + conf.sum(1) - tp)
    acc = tp / conf.sum(1)
    names = class_names or [str(i) for i in range(len(tp))]
    return {
        "mIoU": float(iou.nanmean()),
        "mAcc": float(acc.nanmean()),
        "aAcc": float(tp.sum() / conf.sum().clamp_min(1)),
        "per_class_IoU": {n: float(v) for n, v in zip(names, iou)},
        "per_class_Acc": {n: float(v) for n, v in zip(names, acc)},
    }


def confusion_matrix(
    pred: Tensor, target: Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """``[K, K]`` counts of (truth, prediction) pairs over pixels whose label is not ``ignore_index``."""
    keep = target != ignore_index
    idx = target[keep] * num_classes + pred[keep]
    return torch.bincount(idx, minlength=num_classes**2).view(num_classes, num_classes)


@torch.no_grad()
def evaluate_segmentation(
    model: SegmentationModel,
    dataset: ADESegmentation,
    device: torch.device | str = "cpu",
    mode: str = "whole",
    crop_size: tuple[int, int] = (512, 512),
    stride: tuple[int, int] = (341, 341),
    class_names: list[str] | None = None,
) -> dict[str, Any]:
    """mIoU / per-class IoU / pixel accuracy of ``model`` on ``dataset`` (whole or sliding-window inference)."""
    model.eval()
    k = dataset.num_classes
    conf = torch.zeros(k, k, dtype=torch.int64)
    for i in range(len(dataset)):
        x, y = dataset[i]
        prob = model.predict(
            x[None].to(device), out_size=y.shape, mode=mode, crop_size=crop_size, stride=stride
        )
        conf += confusion_matrix(prob.argmax(1)[0].cpu(), y, k)
    return segmentation_metrics(conf, class_names)


def _evaluate_model(cfg: Config, model: nn.Module, dataset, device: torch.device) -> dict[str, Any]:
    d = cfg.dense
    if cfg.task == "detection":
        return evaluate_detection(model, dataset, device)
    return evaluate_segmentation(
        model, dataset, device, d.inference, tuple(d.slide_crop), tuple(d.slide_stride), d.class_names or None
    )


def evaluate(cfg: Config) -> dict[str, Any]:
    """Evaluates ``eval.checkpoint`` (a dense vit3 checkpoint) on the validation split; writes a JSON.

    Returns:
        The metrics (COCO AP for detection; mIoU, mAcc, aAcc and per-class IoU for segmentation).
    """
    _dense(cfg)
    with distributed(cfg.device, cfg.dist.backend) as dist_info:
        return _evaluate(cfg, dist_info.device)


def _evaluate(cfg: Config, device: torch.device) -> dict[str, Any]:
    check_config(cfg, "eval")  # the config may have been changed in code since it was loaded
    if cfg.eval.img_sizes:
        raise ConfigError(
            f"--img-size / eval.img_sizes={list(cfg.eval.img_sizes)} sets classification resolutions; a {cfg.task} "
            "model's test scale is "
            + (
                "dense.min_size / dense.max_size (e.g. dense.min_size=640)"
                if cfg.task == "detection"
                else "dense.scale (long, short), e.g. dense.scale=[2048,640], and dense.slide_crop"
            )
        )
    path = cfg.eval.checkpoint
    ckpt = load_checkpoint(path) if path else None
    model, _, dataset = _model_and_data(cfg, with_train=False)
    if ckpt:
        if ckpt.get("num_classes") != dataset.num_classes:
            raise CheckpointMismatchError(
                f"checkpoint {path} has {ckpt.get('num_classes')} classes, the validation data {dataset.num_classes}"
            )
        model.load_state_dict(ckpt["model"])
    model.to(device)
    metrics = _evaluate_model(cfg, model, dataset, device)
    out = (
        Path(cfg.eval.json)
        if cfg.eval.json
        else (Path(path).with_suffix(".eval.json") if path else Path(cfg.output) / "eval.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_json({"checkpoint": path, "task": cfg.task, "metrics": metrics}))
    print(_json(_scalars(metrics)))
    return metrics
