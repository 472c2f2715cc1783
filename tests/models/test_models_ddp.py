"""Gradients in the layout DDP buckets them: after a backward every parameter's gradient has the parameter's
own strides (what DDP checks, warning "Grad strides do not match bucket view strides" otherwise), H-ViT³'s
convolutions on channels-last maps included, with the convolutions' values; and a real 2-process DDP step of
the H-ViT³ downsampling raises no warning."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers.dist import ddp_step_worker

import vit3  # noqa: F401 - registers the models
from vit3.layers.embed import ConvNormAct


@pytest.mark.parametrize("name", ["h_vit3_tiny", "vit3_tiny"])
def test_every_gradient_has_its_parameters_strides(name):
    kwargs = {"depths": (1, 1, 1, 1)} if name.startswith("h_") else {"depth": 2}
    model = timm.create_model(name, img_size=64, **kwargs)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    grads = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters()))
    assert [n for n, p in grads if p.grad.stride() != p.stride()] == []


@pytest.mark.parametrize(("kernel", "groups"), [(1, 1), (3, 8)], ids=["1x1", "depthwise"])
def test_a_channels_last_convolution_keeps_its_gradients(kernel, groups):
    """The weight gradient of a convolution on a channels-last map, in the weight's strides, is the
    convolution's own, bit for bit, as are the input's and the bias's."""
    torch.manual_seed(1)
    layer = ConvNormAct(8, 8, kernel, stride=2, groups=groups, norm=False, act=False)
    x = torch.randn(2, 5, 5, 8).permute(0, 3, 1, 2).requires_grad_()
    dy = torch.randn(2, 8, 3, 3)
    conv = layer.conv
    expected = torch.autograd.grad(
        F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, groups=groups),
        (x, conv.weight, conv.bias),
        dy,
    )
    out = layer(x)
    got = torch.autograd.grad(out, (x, conv.weight, conv.bias), dy)
    assert got[1].stride() == conv.weight.stride()
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.slow
def test_a_ddp_step_raises_no_stride_warning(tmp_path):
    """Two gloo processes (spawned: ~20 s of imports): DDP's backward of the downsampling warns of nothing."""
    mp.spawn(ddp_step_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        text = (tmp_path / f"{rank}.txt").read_text()
        assert not text.startswith("crash"), text
        assert "Grad strides do not match" not in text, text
