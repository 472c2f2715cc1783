"""Pretrained ViT³ weights: reading the files, choosing the weights, checking them, building the models.

The official training scripts save whole training states (``model``, ``state_dict_ema`` for H-ViT³, optimizer,
scheduler and a yacs ``config`` object). ``load_checkpoint_file`` reads such a file without executing pickled
code (unknown classes come back as inert ``OrderedDict`` s) and returns one weight dict: the ``model`` entry,
or the EMA entry (``state_dict_ema`` / ``model_ema``) when asked for with ``pretrained_ema=True``. A vit3
training checkpoint as the file builds the model its record describes (:func:`apply_checkpoint_record`);
timm's ``hf-hub:`` and ``local-dir:`` sources (``save_for_hf`` folders) are loaded by timm.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from timm.models import PretrainedCfg, build_model_with_cfg, resolve_pretrained_cfg
from torch import Tensor, nn

from ..errors import CheckpointError, CheckpointMismatchError, MissingWeightsError, WeightsUnavailableError
from .record import model_record, peek_vit3_checkpoint

__all__ = [
    "EMA_KEYS",
    "HUB_SOURCES",
    "apply_checkpoint_record",
    "check_state_dict",
    "create_model_with_official_weights",
    "load_checkpoint_file",
    "rename_official_keys",
    "select_weights",
    "strip_wrapper_prefixes",
]

EMA_KEYS = ("state_dict_ema", "model_ema")
MODEL_KEYS = ("model", "state_dict")
HUB_SOURCES = ("hf-hub", "local-dir")  # pretrained cfg sources whose weights timm itself loads


class _Inert:
    """Stand-in for classes pickled in a checkpoint besides tensors: rebuilt as an empty ``OrderedDict``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> collections.OrderedDict:
        return collections.OrderedDict()


def safe_torch_load(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True)``; unknown pickled classes (training metadata) load as empty dicts."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (
        Exception
    ) as exc:  # weights_only refused a class: map each one to an inert stand-in, never import it
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # not a zip checkpoint: report the original problem
            raise exc from None
        if not names:
            raise
        with torch.serialization.safe_globals([(_Inert, name) for name in names]):
            return torch.load(path, map_location="cpu", weights_only=True)


def select_weights(checkpoint: Mapping[str, Any], use_ema: bool = False) -> dict[str, Tensor]:
    """Picks the weight dict of a checkpoint.

    Args:
        checkpoint: a training checkpoint (``model``, ``state_dict_ema``, ...) or a bare state dict.
        use_ema: take the EMA weights (``state_dict_ema`` or ``model_ema``); otherwise ``model`` (or
            ``state_dict``), or the dict itself when it holds tensors only.

    Raises:
        KeyError: EMA weights asked for but absent.
    """
    keys = EMA_KEYS if use_ema else MODEL_KEYS
    for key in keys:
        entry = checkpoint.get(key)
        if isinstance(entry, Mapping):
            return dict(entry)
    if use_ema:
        raise MissingWeightsError(
            f"checkpoint has no EMA weights (looked for {EMA_KEYS}; "
            f"top-level keys: {sorted(checkpoint)[:20]})"
        )
    return dict(checkpoint)


def load_checkpoint_file(path: str | os.PathLike, use_ema: bool = False) -> dict[str, Tensor]:
    """Reads a checkpoint file (official ``.pth`` or ``.safetensors``) and returns its weights (module doc).

    ``module.`` / ``_orig_mod.`` prefixes (DDP, torch.compile) are removed.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path!r} not found")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        checkpoint: Mapping[str, Any] = load_file(path)
    else:
        checkpoint = safe_torch_load(path)
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"{path!r} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    return strip_wrapper_prefixes(select_weights(checkpoint, use_ema))


def strip_wrapper_prefixes(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Removes the ``_orig_mod.`` / ``module.`` key prefixes that torch.compile and DDP wrappers add."""
    out = {}
    for key, value in state_dict.items():
        for prefix in ("_orig_mod.", "module."):
            key = key.removeprefix(prefix)
        out[key] = value
    return out


def rename_official_keys(
    module: nn.Module,
    state_dict: dict[str, Tensor],
    prefix: str,
    *_: Any,
    convert: Callable[[dict[str, Tensor]], dict[str, Tensor]],
) -> None:
    """A ViT³ family's ``load_state_dict`` pre-hook: the official ViTTT names under ``prefix`` renamed to
    ours by ``convert`` (the family's ``official_to_ours``), in place. So ``load_state_dict``,
    ``timm.models.load_checkpoint`` and ``create_model(..., checkpoint_path=...)`` take an official file's
    weights as ``pretrained_cfg_overlay=dict(file=...)`` does; weights in our names pass as they are."""
    keys = [k for k in state_dict if k.startswith(prefix)]
    theirs = {k[len(prefix) :]: state_dict[k] for k in keys}
    ours = convert(theirs)
    if ours.keys() == theirs.keys():
        return
    for k in keys:
        del state_dict[k]
    state_dict.update({prefix + k: v for k, v in ours.items()})


def check_state_dict(
    state_dict: Mapping[str, Tensor],
    model: nn.Module,
    ignore_prefixes: Iterable[str] = (),
    in_chans_keys: Iterable[str] = (),
    what: str = "checkpoint",
    strict: bool = True,
) -> None:
    """Raises one ``ValueError`` listing every missing, unexpected and mis-shaped key, if there is any.

    Args:
        state_dict: converted weights, in the model's names.
        model: the target model.
        ignore_prefixes: key prefixes not compared (the classifier, which timm drops or keeps itself).
        in_chans_keys: first-conv weights whose input-channel dim timm adapts after the filter.
        what: the checkpoint's name in the message.
        strict: False (timm's ``pretrained_strict=False``): missing and unexpected keys pass, as
            ``load_state_dict(strict=False)`` takes them; mis-shaped keys, or none that fits, still raise.
    """
    ignore = tuple(ignore_prefixes)
    adapt = set(in_chans_keys)
    ours = {k: v.shape for k, v in model.state_dict().items() if not k.startswith(ignore)}
    theirs = {k: v.shape for k, v in state_dict.items() if not k.startswith(ignore)}
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    misshaped = []
    for key in sorted(set(ours) & set(theirs)):
        a, b = tuple(theirs[key]), tuple(ours[key])
        if a == b or (key in adapt and len(a) == len(b) == 4 and a[0] == b[0] and a[2:] == b[2:]):
            continue
        misshaped.append(f"{key}: checkpoint {a} vs model {b}")
    name = type(model).__name__
    if ours and theirs and not set(ours) & set(theirs):
        raise CheckpointMismatchError(
            f"{what} does not fit this {name}: none of its {len(theirs)} key(s) (e.g. "
            f"{', '.join(sorted(theirs)[:3])}) names one of the model's weights"
        )
    if not strict:
        missing, unexpected = [], []
    if missing or unexpected or misshaped:
        raise CheckpointMismatchError(
            f"{what} does not fit this {name} (another model or size?):\n"
            f"  missing keys ({len(missing)}): {missing}\n"
            f"  unexpected keys ({len(unexpected)}): {unexpected}\n"
            f"  mis-shaped keys ({len(misshaped)}): {misshaped}"
        )


def _official_file(variant: str, cfg: PretrainedCfg) -> str:
    """The local file of the official weights: ``cfg.file``, or the official URL downloaded once (hub)."""
    if cfg.file:
        return os.fspath(cfg.file)
    pass_file = (
        f"timm.create_model({variant!r}, pretrained=True, "
        "pretrained_cfg_overlay=dict(file='/path/to/weights.pth'))"
    )
    if not cfg.url:
        raise WeightsUnavailableError(
            f"no official weights are published for {variant}; load weights of your own with {pass_file}"
        )
    how = f"download the file yourself and pass it with {pass_file}"
    cache = os.path.join(torch.hub.get_dir(), "checkpoints", "vit3", f"{variant}.pth")
    if not os.path.isfile(cache):
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        try:
            torch.hub.download_url_to_file(cfg.url, cache, progress=False)
        except Exception as exc:  # offline, proxy, HTTP errors: say how to load a local copy
            raise WeightsUnavailableError(
                f"could not download the official {variant} weights from {cfg.url} "
                f"({type(exc).__name__}: {exc}); {how}"
            ) from exc
    return cache


def apply_checkpoint_record(
    variant: str, kwargs: dict[str, Any], architecture: Mapping[str, Any], stride: int
) -> dict[str, Any]:
    """The ``timm.create_model(variant, pretrained=True, **kwargs)`` kwargs for a vit3 training checkpoint as
    the weights file (``pretrained_cfg_overlay=dict(file=...)``): the model its record describes.

    The record's model kwargs come under the caller's (a caller's value that differs wins, with a warning),
    and the pretrained cfg takes the record's class count, input channels and size, normalisation,
    interpolation, crop and class names under the caller's overlay, so ``timm.data.resolve_model_data_config``
    gives the preprocessing the weights were trained with. The weights (EMA with ``pretrained_ema=True``) go
    in as the cfg's ``state_dict``. Any other file, or no file, returns ``kwargs`` as they are.

    Args:
        variant: the timm name being built.
        kwargs: the caller's kwargs of ``timm.create_model`` (not changed).
        architecture: the variant's own kwargs (under the record's and the caller's).
        stride: the stride of ``forward_features``' grid, for the cfg's ``pool_size`` (a ``patch_size`` kwarg,
            the plain family's stride, replaces it).

    Raises:
        CheckpointMismatchError: the checkpoint holds another model than ``variant``.
        MissingWeightsError: ``pretrained_ema=True`` and the run kept no EMA weights.
    """
    overlay = dict(kwargs.get("pretrained_cfg_overlay") or {})
    cfg = resolve_pretrained_cfg(variant, kwargs.get("pretrained_cfg"), overlay)
    path = os.fspath(cfg.file) if cfg.file else ""
    if cfg.state_dict is not None or cfg.source in HUB_SOURCES or not os.path.isfile(path):
        return kwargs
    if path.endswith(".safetensors"):  # weights only, no record
        return kwargs
    ckpt = peek_vit3_checkpoint(path)
    if ckpt is None:  # an official file: create_model_with_official_weights reads it
        return kwargs
    record = model_record(ckpt)
    if record["name"] != variant:
        raise CheckpointMismatchError(
            f"{path} holds a {record['name']!r} ({record['kwargs'] or {}}), not a {variant!r}: build it with "
            f"timm.create_model({record['name']!r}, pretrained=True, pretrained_cfg_overlay=dict(file=...))"
        )
    out = dict(kwargs)
    use_ema = bool(out.pop("pretrained_ema", False))
    weights = ckpt.get("ema") if use_ema else ckpt["model"]
    if weights is None:
        raise MissingWeightsError(
            f"{path} holds no EMA weights (its run had train.ema=false): leave out pretrained_ema"
        )
    for key, value in (record["kwargs"] or {}).items():
        if key in out and out[key] != value:
            warnings.warn(
                f"{key}={out[key]!r} differs from {path}'s {value!r}: using {out[key]!r}", stacklevel=3
            )
        out.setdefault(key, value)
    size = record["img_size"]
    if size is None:
        spatial = tuple(cfg.input_size[1:])
    else:
        spatial = (int(size), int(size)) if isinstance(size, int) else tuple(int(s) for s in size)
    from_record: dict[str, Any] = {"state_dict": weights, "input_size": (int(record["in_chans"]), *spatial)}
    if size is not None:
        grid_stride = int({**architecture, **out}.get("patch_size", stride))
        from_record["pool_size"] = tuple(math.ceil(s / grid_stride) for s in spatial)
    for key, value in (
        ("num_classes", record["num_classes"]),
        ("mean", record["mean"]),
        ("std", record["std"]),
        ("interpolation", record["interpolation"]),
        ("crop_pct", record["crop_pct"]),
        ("label_names", record["classes"]),
    ):
        if value is not None:
            from_record[key] = tuple(value) if isinstance(value, list) else value
    out["pretrained_cfg_overlay"] = {**from_record, **overlay}
    return out


def create_model_with_official_weights(
    model_cls: type[nn.Module],
    variant: str,
    pretrained: bool,
    filter_fn: Callable[[dict[str, Tensor], nn.Module], dict[str, Tensor]],
    feature_cfg: dict[str, Any],
    **kwargs: Any,
) -> nn.Module:
    """``timm.build_model_with_cfg`` with the official checkpoint files read by ``load_checkpoint_file``.

    With ``pretrained=True`` the weights come from ``pretrained_cfg_overlay=dict(file=...)`` or, without a
    file, from the official URL (downloaded once); ``pretrained_ema=True`` takes the EMA weights of the file.
    A cfg of timm's ``hf-hub:`` / ``local-dir:`` sources (or with an ``hf_hub_id`` and no file) is timm's to
    load. timm then converts them with ``filter_fn`` (the model's ``checkpoint_filter_fn``, told timm's
    ``pretrained_strict``), adapts the classifier and the input channels, and loads them.

    Raises:
        ValueError: ``pretrained_ema=True`` with weights from timm's hub sources (they hold one set).
    """
    use_ema = bool(kwargs.pop("pretrained_ema", False))
    if pretrained:
        overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
        merged = resolve_pretrained_cfg(variant, kwargs.get("pretrained_cfg"), overlay)
        from_hub = merged.source in HUB_SOURCES or (
            merged.hf_hub_id and not merged.file and not merged.state_dict
        )
        if from_hub and use_ema:
            raise ValueError(
                "pretrained_ema=True takes the EMA weights of a checkpoint file; "
                f"the {merged.source or 'hf-hub'} weights of {merged.hf_hub_id or merged.file} are one set: "
                "leave out pretrained_ema"
            )
        if not from_hub and not merged.state_dict:
            path = _official_file(variant, merged)
            overlay.update(file=path, state_dict=load_checkpoint_file(path, use_ema=use_ema))
        kwargs["pretrained_cfg_overlay"] = overlay
    try:
        model = build_model_with_cfg(
            model_cls,
            variant,
            pretrained,
            pretrained_filter_fn=functools.partial(filter_fn, strict=kwargs.get("pretrained_strict", True)),
            feature_cfg=dict(feature_cfg),
            **kwargs,
        )
    except CheckpointMismatchError as exc:  # the filter's check (check_state_dict): name the file
        file = kwargs["pretrained_cfg_overlay"].get("file") if pretrained else None
        if not file:
            raise
        raise CheckpointMismatchError(f"{file}: {exc}") from exc
    except RuntimeError as exc:
        if pretrained and "size mismatch for head." in str(exc):
            raise CheckpointMismatchError(
                "the checkpoint's classifier has another class count than the pretrained config: declare it, "
                "e.g. pretrained_cfg_overlay=dict(file=..., num_classes=<checkpoint classes>) "
                "(timm then keeps the head, or replaces it when num_classes differs)\n" + str(exc)
            ) from exc
        raise
    # the weights were only passed through the config: do not keep a second copy on the model
    for module in (model, getattr(model, "model", None)):
        cfg_dict = getattr(module, "pretrained_cfg", None)
        if isinstance(cfg_dict, dict):
            cfg_dict.pop("state_dict", None)
    return model
