"""Helpers for the model tests: tiny model names, FX feature extraction the way timm's own tests trace
models."""

from __future__ import annotations

import torch
from timm.models import get_notrace_functions, get_notrace_modules
from torch import nn

TINY_MODELS = ("test_vit3_ttt", "test_h_vit3")
FULL_MODELS = ("vit3_tiny", "vit3_small", "vit3_base", "h_vit3_tiny", "h_vit3_small", "h_vit3_base")


def fx_model(model: nn.Module) -> nn.Module:
    """Symbolically traces ``model`` (timm's leaf modules and functions kept opaque) into a graph module.

    The graph returns the model output under the name of the last traced node, in both train and eval mode,
    through torchvision's ``create_feature_extractor`` as timm's tests do.
    """
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    kwargs = dict(
        leaf_modules=get_notrace_modules(),
        autowrap_functions=get_notrace_functions(),
        param_shapes_constant=True,
    )
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=kwargs)
    return create_feature_extractor(
        model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=kwargs
    )


def fx_output(graph_model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The single output of a graph module built by ``fx_model``."""
    (out,) = graph_model(x).values()
    return out
