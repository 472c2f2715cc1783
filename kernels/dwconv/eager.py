"""The depthwise-conv op's eager path: the closed-form TTT step, one native convolution call per stage.

Per-sample 3x3 depthwise convolutions over maps ``[B, C, h, w]`` run as one grouped convolution with the
batch folded into the groups (``groups = B*C``), on channels-last maps made without a copy (``to_map``). With
``E = -s v / N`` the step is ``G = Σ_p E[p] k[p + δ]`` (a conv weight gradient),
``W' = W - lr G / (||G|| + 1)`` (norm over each channel's 9 taps), ``out = dwconv(q; W')``; its backward
``dk = dwconv_input_grad(E; dG)``, ``dv = -s/N dwconv(k; dG)`` (``ttt_forward`` / ``ttt_backward``; the
mixer's fused node ``vit3.layers.fused_mix`` calls them through this path's ``NODE`` hooks, on token rows).
The reference they are tested against is ``vit3.kernels.dwconv.reference``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import step, step_backward
from ..ops import Hyper, Node, NodeCall

__all__ = [
    "NODE",
    "conv",
    "dwconv_backward",
    "fold_batch",
    "to_map",
    "token_map",
    "ttt_backward",
    "ttt_forward",
    "write_tokens",
]


def to_map(x: Tensor, grid: tuple[int, int]) -> Tensor:
    """``[B, G, n, c]`` tokens -> ``[B, G*c, h, w]`` maps, views of one batch-folded channels-last map.

    The memory is ``[h, w, B*G*c]``, so ``conv`` and ``dwconv_backward`` fold the batch into the channels
    (``[1, B*C, h, w]``, channels-last) without a copy: oneDNN's channels-last depthwise kernels then run
    far faster on a CPU (``docs/design/kernels.md``) than on contiguous NCHW maps, or on a folded
    per-sample channels-last map, whose strides no longer match any layout.
    """
    b, g, _, c = x.shape
    h, w = grid  # unpacked here: TorchScript (which compiles this) takes no starred arguments
    folded = x.permute(2, 0, 1, 3).reshape(h, w, b * g * c)  # [h, w, B*C]
    return folded.view(h, w, b, g * c).permute(2, 3, 0, 1)


def token_map(t: Tensor, grid: tuple[int, int]) -> Tensor:
    """Tokens ``[B, N, C]`` (any strides) -> maps ``[B, C, h, w]``, views of one batch-folded channels-last
    map (:func:`to_map`), so every depthwise stage is one convolution call for the whole batch."""
    return to_map(t.unsqueeze(1), grid)


def write_tokens(m: Tensor, dest: Tensor) -> None:
    """Writes maps ``[B, C, h, w]`` into tokens ``dest`` ``[B, N, C]`` (any strides)."""
    dest.copy_(m.flatten(2).transpose(1, 2))


def fold_batch(t: Tensor) -> Tensor:
    """Maps ``[B, C, h, w]`` -> ``[1, B*C, h, w]`` (a view where the layout allows), channels-last kept.

    A plain reshape of a map whose channels are innermost gives the merged dim the right strides but the new
    batch dim an arbitrary one; the convolution ops then no longer see channels-last and copy both inputs to
    NCHW (``docs/design/kernels.md``). Going through ``[h, w, B*C]`` gives a proper channels-last map.
    """
    b, ch, h, w = t.shape
    if b == 1:
        return t
    if t.stride(1) == 1:  # channels innermost
        return t.permute(2, 3, 0, 1).reshape(1, h, w, b * ch).permute(0, 3, 1, 2)
    return t.reshape(1, b * ch, h, w)


def dwconv_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor | None, *, need_input: bool = True, need_weight: bool = True
) -> tuple[Tensor | None, Tensor | None]:
    """Backward of the per-sample depthwise 3x3 conv ``conv`` (zero padding 1), in one native call.

    Args:
        grad_out: gradient of the conv output ``[B, C, h, w]``.
        x: the conv input ``[B, C, h, w]``.
        weight: the kernels ``[B|1, C, 3, 3]`` (only needed for the input gradient).
        need_input: return dL/dx ``[B, C, h, w]`` (else ``None``).
        need_weight: return the per-sample dL/dweight ``[B, C, 3, 3]`` (else ``None``).
    """
    b, ch, h, w = x.shape
    # The batch folded into groups: every sample has its own kernels, and one call serves them all.
    kernels = (
        x.new_empty(b * ch, 1, 3, 3) if weight is None else weight.expand(b, ch, 3, 3).reshape(-1, 1, 3, 3)
    )
    gx, gw, _ = torch.ops.aten.convolution_backward(
        fold_batch(grad_out),
        fold_batch(x),
        kernels,
        None,
        [1, 1],
        [1, 1],
        [1, 1],
        False,
        [0, 0],
        b * ch,
        [need_input, need_weight, False],
    )
    return (gx.view(b, ch, h, w) if need_input else None, gw.view(b, ch, 3, 3) if need_weight else None)


def conv(x: Tensor, weight: Tensor) -> Tensor:
    """Per-sample depthwise 3x3 conv (zero padding): maps ``[B, C, h, w]`` with weights ``[B|1, C, 3, 3]``."""
    b, ch, h, w = x.shape
    if b == 1:
        return F.conv2d(x, weight.reshape(ch, 1, 3, 3), padding=1, groups=ch)
    # Fold the batch into groups so every sample gets its own kernels in one call (on ``to_map``'s maps
    # the fold is a view of a channels-last map).
    kernels = weight.expand(b, ch, 3, 3).reshape(b * ch, 1, 3, 3)
    out = F.conv2d(fold_batch(x), kernels, padding=1, groups=b * ch)
    return out.view(b, ch, h, w)


def ttt_forward(
    qm: Tensor, km: Tensor, vm: Tensor, weight: Tensor, *, c: float, lr: float, grad_norm: bool
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """One dot-loss step on maps ``[B, C, h, w]`` (``c = s / N``), read out on ``qm``.

    Returns:
        The read-out maps ``[B, C, h, w]`` and what :func:`ttt_backward` needs.
    """
    g = dwconv_backward(vm, km, None, need_input=False)[1].mul_(-c)  # [B, C, 3, 3]
    w_new, norm = step(g, weight, lr, grad_norm, dims=(-2, -1))
    return conv(qm, w_new), (qm, km, vm, g, norm, w_new)


def ttt_backward(
    dout: Tensor, saved: tuple[Tensor, ...], *, c: float, lr: float, grad_norm: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`ttt_forward` from the read-out's ``dout`` ``[B, C, h, w]``.

    Returns:
        ``dq, dk, dv`` maps ``[B, C, h, w]`` and the per-sample weight gradient ``[B, C, 3, 3]``.
    """
    qm, km, vm, g, norm, w_new = saved
    dqm, dw_new = dwconv_backward(dout, qm, w_new)
    dg = step_backward(dw_new, g, norm, lr, grad_norm, dims=(-2, -1))
    dkm = dwconv_backward(vm, km, dg, need_weight=False)[0].mul_(-c)
    return dqm, dkm, conv(km, dg).mul_(-c), dw_new


def _node_forward(x: NodeCall) -> tuple[list[Tensor], str]:
    """:func:`ttt_forward` on tokens ``[B, N, C]`` (any strides): maps in, the read-out into ``dest``."""
    h = x.hyper
    maps = (token_map(t, h.grid) for t in (x.q, x.k, x.v))
    om, saved = ttt_forward(*maps, x.weights[0], c=h.scale / x.q.shape[1], lr=h.lr, grad_norm=h.grad_norm)
    write_tokens(om, x.dest)
    return list(saved) if x.save else [], ""


def _node_backward(
    d_out: Tensor, saved: tuple[Tensor, ...], tag: str, dq: Tensor, dk: Tensor, dv: Tensor, h: Hyper
) -> tuple[Tensor]:
    """:func:`ttt_backward` on tokens ``[B, N, C]``: writes dq, dk, dv, returns the weight gradient."""
    c = h.scale / d_out.shape[1]
    *maps, dw = ttt_backward(token_map(d_out, h.grid), saved, c=c, lr=h.lr, grad_norm=h.grad_norm)
    for m, grad in zip(maps, (dq, dk, dv)):
        write_tokens(m, grad)
    return (dw,)


# The eager path in the fused node: on token rows, one convolution per stage for the whole batch.
NODE = Node(heads=False, forward=_node_forward, backward=_node_backward)
