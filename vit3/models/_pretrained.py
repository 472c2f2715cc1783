"""Official ViT³ checkpoints: reading the files, choosing the weights, checking them, building the models.

The official training scripts save whole training states (``model``, ``state_dict_ema`` for H-ViT³, optimizer,
scheduler and a yacs ``config`` object). ``load_checkpoint_file`` reads such a file without executing pickled
code (unknown classes come back as inert ``OrderedDict`` s) and returns one weight dict: the ``model`` entry,
or the EMA entry (``state_dict_ema`` / ``model_ema``) when asked for with ``pretrained_ema=True``.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from timm.models import PretrainedCfg, build_model_with_cfg, resolve_pretrained_cfg
from torch import Tensor, nn

from ..errors import CheckpointError, CheckpointMismatchError, MissingWeightsError, WeightsUnavailableError

__all__ = [
    "EMA_KEYS",
    "check_state_dict",
    "create_model_with_official_weights",
    "load_checkpoint_file",
    "select_weights",
    "strip_wrapper_prefixes",
]

EMA_KEYS = ("state_dict_ema", "model_ema")
MODEL_KEYS = ("model", "state_dict")


class _Inert:
    """Stand-in for classes pickled in a checkpoint besides tensors: rebuilt as an empty ``OrderedDict``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> collections.OrderedDict:
        return collections.OrderedDict()


def _torch_load(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True)``, reading unknown pickled classes (training metadata) as inert dicts."""
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
            f"checkpoint has no EMA weights (looked for {EMA_KEYS}; top-level keys: {sorted(checkpoint)[:20]})"
        )
    return dict(checkpoint)


def load_checkpoint_file(path: str | os.PathLike, use_ema: bool = False) -> dict[str, Tensor]:
    """Reads a checkpoint file (official ``.pth`` or ``.safetensors``) and returns its weights (see module doc).

    ``module.`` / ``_orig_mod.`` prefixes (DDP, torch.compile) are removed.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path!r} not found")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        checkpoint: Mapping[str, Any] = load_file(path)
    else:
        checkpoint = _torch_load(path)
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


def check_state_dict(
    state_dict: Mapping[str, Tensor],
    model: nn.Module,
    ignore_prefixes: Iterable[str] = (),
    in_chans_keys: Iterable[str] = (),
    what: str = "checkpoint",
) -> None:
    """Raises one ``ValueError`` listing every missing, unexpected and mis-shaped key, if there is any.

    Args:
        state_dict: converted weights, in the model's names.
        model: the target model.
        ignore_prefixes: key prefixes not compared (the classifier, which timm drops or keeps itself).
        in_chans_keys: first-conv weights whose input-channel dim timm adapts after the filter.
        what: the checkpoint's name in the message.
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
    if missing or unexpected or misshaped:
        name = type(model).__name__
        raise CheckpointMismatchError(
            f"{what} does not fit this {name} (another model or size?):\n"
            f"  missing keys ({len(missing)}): {missing}\n"
            f"  unexpected keys ({len(unexpected)}): {unexpected}\n"
            f"  mis-shaped keys ({len(misshaped)}): {misshaped}"
        )


def _official_file(variant: str, cfg: PretrainedCfg) -> str:
    """The local file of the official weights: ``cfg.file``, or the official URL downloaded once into the hub cache."""
    if cfg.file:
        return os.fspath(cfg.file)
    how = (
        f"download it yourself and pass it with timm.create_model({variant!r}, pretrained=True, "
        f"pretrained_cfg_overlay=dict(file='/path/to/checkpoint.pth'))"
    )
    if not cfg.url:
        raise WeightsUnavailableError(f"no official weights are published for {variant}; {how}")
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


def create_model_with_official_weights(
    model_cls: type[nn.Module],
    variant: str,
    pretrained: bool,
    filter_fn: Callable[[dict[str, Tensor], nn.Module], dict[str, Tensor]],
    feature_cfg: dict[str, Any],
    **kwargs: Any,
) -> nn.Module:
    """``timm.build_model_with_cfg`` with the official checkpoint files read by ``load_checkpoint_file``.

    With ``pretrained=True`` the weights come from ``pretrained_cfg_overlay=dict(file=...)`` or, without a file,
    from the official URL (downloaded once); ``pretrained_ema=True`` takes the EMA weights of the file.
    timm then converts them with ``filter_fn`` (the model's ``checkpoint_filter_fn``), adapts the classifier
    and the input channels, and loads them strictly.
    """
    use_ema = bool(kwargs.pop("pretrained_ema", False))
    if pretrained:
        overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
        merged = resolve_pretrained_cfg(variant, kwargs.get("pretrained_cfg"), overlay)
        if not merged.state_dict:
            path = _official_file(variant, merged)
            overlay.update(file=path, state_dict=load_checkpoint_file(path, use_ema=use_ema))
        kwargs["pretrained_cfg_overlay"] = overlay
    try:
        model = build_model_with_cfg(
            model_cls,
            variant,
            pretrained,
            pretrained_filter_fn=filter_fn,
            feature_cfg=dict(feature_cfg),
            **kwargs,
        )
    except RuntimeError as exc:
        if pretrained and "size mismatch for head." in str(exc):
            raise CheckpointMismatchError(
                "the checkpoint's classifier has another class count than the pretrained config: declare it, "
                "e.g. pretrained_cfg_overlay=dict(file=..., num_classes=<checkpoint classes>) (timm then keeps "
                "the head, or replaces it when num_classes differs)\n" + str(exc)
            ) from exc
        raise
    # the weights were only passed through the config: do not keep a second copy on the model
    for module in (model, getattr(model, "model", None)):
        cfg_dict = getattr(module, "pretrained_cfg", None)
        if isinstance(cfg_dict, dict):
            cfg_dict.pop("state_dict", None)
    return model
