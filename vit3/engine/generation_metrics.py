"""Metrics of generated images: FID / Inception Score, and class accuracy + Fréchet distance under a
classifier.

* :func:`inception_metrics`: FID and Inception Score (torchmetrics) on a local Inception-v3 weights file
  (``metrics.inception_weights``); nothing is downloaded.
* :func:`classifier_metrics`: a vit3 classifier's accuracy on the generated images and the Fréchet distance
  of its features, with real images scored at the same count (the floor and ceiling real data reaches).
* :func:`resolve_classifier`: ``"auto"`` is the generation demo's scorer, trained once when absent.
Details: ``docs/design/engine.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from ..models.record import load_checkpoint
from .checkpoint import load_model_weights
from .config import CONFIG_DIR, ConfigError, config_from_dict, load_config

__all__ = [
    "DEMO_CLASSIFIER_CONFIG",
    "classifier_metrics",
    "inception_metrics",
    "resolve_classifier",
]

DEMO_CLASSIFIER_CONFIG = CONFIG_DIR / "generation" / "demo_mnist_scorer.yaml"
INCEPTION_FILE = "pt_inception-2015-12-05-6726825d.pth"


def _batches(images: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for i in range(0, len(images), size):
        yield images[i : i + size]


def _nchw_rgb(batch: np.ndarray) -> Tensor:
    """uint8 ``[B, H, W, C]`` (C = 1 or 3) -> uint8 ``[B, 3, H, W]``."""
    x = torch.from_numpy(np.ascontiguousarray(batch)).permute(0, 3, 1, 2)
    return x.expand(-1, 3, -1, -1).contiguous() if x.shape[1] == 1 else x


# --------------------------------------------------------------------------------------- Inception (FID, IS)
def inception_metrics(
    images: np.ndarray,
    reference: Iterable[np.ndarray],
    weights: str,
    batch_size: int = 100,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """FID against ``reference`` and Inception Score of ``images`` (uint8 ``[N, H, W, C]``).

    Args:
        images: generated images.
        reference: batches of real uint8 images ``[n, H, W, C]``.
        weights: local Inception-v3 weights file of torch-fidelity ("" or missing: no numbers, a note).
        batch_size: images per Inception forward.
        device: where Inception runs.

    Returns:
        ``fid``, ``is_mean``, ``is_std`` (``None`` with a ``fid_note`` when the weights are not available).
    """
    if not weights or not Path(weights).is_file():
        why = "metrics.inception_weights is empty" if not weights else f"{weights} does not exist"
        return {
            "fid": None,
            "is_mean": None,
            "is_std": None,
            "fid_note": f"FID/IS skipped: {why}. They need torch-fidelity's Inception-v3 weights as a local "
            "file "
            f"({INCEPTION_FILE}); nothing is downloaded.",
        }
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance, NoTrainInceptionV3
        from torchmetrics.image.inception import InceptionScore
    except ImportError as exc:  # the generation extra is not installed
        raise ImportError(
            f"FID needs torchmetrics and torch-fidelity (pip install -e '.[generation]'): {exc}"
        ) from exc
    fid = FrechetInceptionDistance(feature=2048, feature_extractor_weights_path=str(weights)).to(device)
    logits = NoTrainInceptionV3(
        name="inception-v3-compat",
        features_list=["logits_unbiased"],
        feature_extractor_weights_path=str(weights),
    )
    score = InceptionScore(feature=logits).to(device)
    n_real = 0
    for batch in reference:
        fid.update(_nchw_rgb(batch).to(device), real=True)
        n_real += len(batch)
    for batch in _batches(images, batch_size):
        x = _nchw_rgb(batch).to(device)
        fid.update(x, real=False)
        score.update(x)
    is_mean, is_std = score.compute()
    return {
        "fid": float(fid.compute()),
        "is_mean": float(is_mean),
        "is_std": float(is_std),
        "fid_reference_images": n_real,
    }


# ------------------------------------------------------------------------------- classifier-based metrics
def resolve_classifier(spec: str) -> Path:
    """The classifier checkpoint that ``metrics.classifier`` names (``"auto"``: the generation demo's scorer).

    ``"auto"`` uses ``<scorer output>/best.pt`` (``output/gen_demo_scorer/best.pt`` with the shipped config)
    when it exists and otherwise trains it with ``configs/generation/demo_mnist_scorer.yaml`` (single process
    only).

    Raises:
        FileNotFoundError: a named file does not exist.
        ConfigError: ``"auto"`` needs training but this run is one of several processes.
    """
    if spec != "auto":
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"metrics.classifier checkpoint not found: {path}")
        return path
    demo = load_config(DEMO_CLASSIFIER_CONFIG)
    path = Path(demo.output) / "best.pt"
    if path.is_file():
        return path
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise ConfigError(
            f"metrics.classifier=auto: {path} does not exist; train it first with `python train.py --config "
            f"configs/generation/{DEMO_CLASSIFIER_CONFIG.name}` or name a checkpoint with "
            "metrics.classifier=FILE"
        )
    from .classification import train as train_classifier

    print(
        f"metrics.classifier=auto: {path} not found, training the demo's scorer on the held-out digits "
        f"({DEMO_CLASSIFIER_CONFIG.name})"
    )
    summary = train_classifier(load_config(DEMO_CLASSIFIER_CONFIG, ["train.progress=false"]))
    return Path(summary["best"] or summary["last"])


def _load_classifier(path: Path) -> tuple[nn.Module, Any, Any, int]:
    """The classifier (eval mode), its config, its eval transform and its input channels."""
    import timm

    import vit3.models  # noqa: F401  (registers the vit3 models in timm)

    from ..data import build_transform
    from .classification import data_stats, input_channels, resolve_data_cfg

    ckpt = load_checkpoint(path)
    if ckpt.get("config", {}).get("task", "classification") != "classification":
        raise ConfigError(
            f"metrics.classifier {path} is a {ckpt['config'].get('task')} checkpoint, not a classifier"
        )
    cfg = config_from_dict(ckpt["config"])
    model = timm.create_model(
        ckpt["model_name"], num_classes=int(ckpt["num_classes"]), **ckpt["model_kwargs"]
    )
    load_model_weights(model, ckpt, source=str(path))
    in_chans = input_channels(cfg)
    resolve_data_cfg(cfg, model, in_chans)
    mean, std = data_stats(cfg)
    return model.eval(), cfg, build_transform(cfg, False, mean, std), in_chans


def _classify(
    model: nn.Module, transform, images: Iterable[Image.Image], batch_size: int, device
) -> tuple[Tensor, Tensor]:
    """Logits ``[N, K]`` and pooled features ``[N, D]`` of PIL images."""
    feats, logits, batch = [], [], []

    def flush() -> None:
        x = model.forward_features(torch.stack(batch).to(device))
        feats.append(model.forward_head(x, pre_logits=True).float().cpu())
        logits.append(model.forward_head(x).float().cpu())
        batch.clear()

    with torch.no_grad():
        for img in images:
            batch.append(transform(img))
            if len(batch) == batch_size:
                flush()
        if batch:
            flush()
    return torch.cat(logits), torch.cat(feats)


def _frechet(a: Tensor, b: Tensor) -> float:
    """Fréchet distance between two feature sets ``[N, D]`` (torchmetrics' computation, double precision)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    class _Identity(nn.Module):  # the features are precomputed: the metric's extractor passes them on
        num_features = a.shape[1]

        def forward(self, x: Tensor) -> Tensor:
            return x

    metric = FrechetInceptionDistance(feature=_Identity())
    metric.update(a.double(), real=True)
    metric.update(b.double(), real=False)
    return float(metric.compute())


def _spread(values: list[float]) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max())}  # fmt: skip


def classifier_metrics(
    images: np.ndarray,
    labels: np.ndarray,
    classifier: str | Path,
    batch_size: int = 100,
    device: torch.device | str = "cpu",
    draws: int = 10,
    seed: int = 0,
) -> dict[str, Any]:
    """Accuracy of a classifier on generated images and their Fréchet distance to real images, each beside
    what real images reach at the same count.

    The real images are the classifier's val split (images it never trained on). Each of ``draws`` draws
    picks ``N = len(images)`` of them at random (without replacement, seeded by ``seed``); the generated
    images and the drawn real images are both compared with the remaining real images, and both are
    classified. The distances and accuracies are reported as mean and spread over the draws.

    Args:
        images: generated uint8 ``[N, H, W, C]``.
        labels: requested classes ``[N]``.
        classifier: a vit3 classification checkpoint (its config gives the preprocessing and real data).
        batch_size: images per classifier forward.
        device: where the classifier runs.
        draws: draws of N real images.
        seed: seed of the draws.

    Returns:
        ``class_accuracy`` (%) and ``per_class_accuracy`` {class: %} of the generated images;
        ``frechet_distance`` (generated vs the rest of the real images: mean over the draws, ``_std`` beside);
        ``frechet_real_floor`` (the drawn real images vs the rest: mean, ``_std``, ``_min``, ``_max``);
        ``real_accuracy`` (% of the drawn real images, mean and ``_std``); ``real_val_accuracy`` (% of all the
        real images); ``floor_draws``, ``feature_dim``, ``generated_images``, ``real_images`` (split sizes).

    Raises:
        ValueError: the classifier has too few classes, or there are not more real images than generated.
    """
    from ..data import build_datasets

    path = Path(classifier)
    model, cfg, transform, in_chans = _load_classifier(path)
    model.to(device)
    target = "L" if in_chans == 1 else "RGB"
    gen = (Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img).convert(target) for img in images)
    logits, feats = _classify(model, transform, gen, batch_size, device)
    if logits.shape[1] <= int(labels.max()):
        raise ValueError(
            f"classifier {path} has {logits.shape[1]} classes; the samples request class {int(labels.max())}"
        )
    pred = logits.argmax(-1).numpy()
    per_class = {int(c): float(100.0 * (pred[labels == c] == c).mean()) for c in np.unique(labels)}
    data = build_datasets(cfg, in_chans, splits=("train", "val"))
    val = data["val"]
    n, n_real = len(images), len(val)
    if n_real <= n or draws < 1:
        raise ValueError(
            "the real floor needs more real images than generated ones and at least one draw: classifier "
            f"{path} "
            f"has {n_real} val images for {n} samples, draws={draws}"
        )
    real_logits, real_feats = _classify(
        model, transform, (val[i][0] for i in range(n_real)), batch_size, device
    )
    real_labels = np.asarray([val[i][1] for i in range(n_real)])
    real_correct = real_logits.argmax(-1).numpy() == real_labels
    rng = np.random.default_rng(seed)
    fd_gen, fd_real, acc_real = [], [], []
    for _ in range(int(draws)):
        order = rng.permutation(n_real)
        drawn, rest = order[:n], order[n:]
        fd_gen.append(_frechet(real_feats[rest], feats))
        fd_real.append(_frechet(real_feats[rest], real_feats[drawn]))
        acc_real.append(100.0 * float(real_correct[drawn].mean()))
    gen_fd, floor, acc = _spread(fd_gen), _spread(fd_real), _spread(acc_real)
    return {
        "classifier": str(path),
        "class_accuracy": float(100.0 * (pred == labels).mean()),
        "per_class_accuracy": per_class,
        "frechet_distance": gen_fd["mean"],
        "frechet_distance_std": gen_fd["std"],
        "frechet_real_floor": floor["mean"],
        "frechet_real_floor_std": floor["std"],
        "frechet_real_floor_min": floor["min"],
        "frechet_real_floor_max": floor["max"],
        "real_accuracy": acc["mean"],
        "real_accuracy_std": acc["std"],
        "real_val_accuracy": float(100.0 * real_correct.mean()),
        "floor_draws": int(draws),
        "feature_dim": int(feats.shape[1]),
        "generated_images": n,
        "real_images": {"train": len(data["train"]), "val": n_real},
    }
