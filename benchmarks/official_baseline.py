"""The official ViT³ eager formulation of the mixer's inner loop, re-written as a benchmark baseline.

It follows the released code's sequence of eager PyTorch ops (separate matmuls, elementwise ops, the
nine shifted slices of the depthwise-conv gradient), so benchmarks can compare our paths against what
users of the official code run. Only the inner loop is here (q, k, v in, read-out out), not the
qkv/output projections. It is a transcription of the official op sequence, not the definition: the op
references (``vit3.kernels.swiglu.reference``, ``vit3.kernels.dwconv.reference``) are, and
``tests/kernels/test_op_swiglu.py`` / ``tests/kernels/test_op_dwconv.py`` check this baseline against them in
float64. The gradient normalisation is the shared one (``vit3.kernels.common.normalize_grad``, the same ops
as the official ``G / (G.norm() + 1)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vit3.kernels.common import normalize_grad

SCALE = 9**-0.5


def official_swiglu_branch(
    q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, lr: float = 1.0
) -> Tensor:
    """SwiGLU branch: q, k, v ``[B, H, N, d]``, w1, w2 ``[1, H, d, d]`` -> ``[B, H, N, d]``."""
    z1 = k @ w1
    z2 = k @ w2
    sig = torch.sigmoid(z2)
    a = z2 * sig
    e = -v / float(v.shape[2]) * SCALE
    g1 = k.transpose(-2, -1) @ (e * a)
    g2 = k.transpose(-2, -1) @ (e * z1 * (sig * (1.0 + z2 * (1.0 - sig))))
    g1, g2 = normalize_grad(g1), normalize_grad(g2)
    w1, w2 = w1 - lr * g1, w2 - lr * g2
    return (q @ w1) * F.silu(q @ w2)


def official_dwconv_branch(q: Tensor, k: Tensor, v: Tensor, w: Tensor, lr: float = 1.0) -> Tensor:
    """Depthwise-conv branch on maps ``[B, C, h, w]`` with kernels ``[C, 1, 3, 3]`` -> ``[B, C, h, w]``."""
    b, c, h, wd = k.shape
    e = -v / float(h * wd) * SCALE
    kp = F.pad(k, (1, 1, 1, 1))
    dots = [
        (kp[:, :, 1 + dy : 1 + dy + h, 1 + dx : 1 + dx + wd] * e).sum(dim=(-2, -1))
        for dy in (-1, 0, 1)
        for dx in (-1, 0, 1)
    ]
    g = torch.stack(dots, dim=-1).reshape(b * c, 1, 3, 3)
    g = normalize_grad(g, dims=(-2, -1))
    w = w.repeat(b, 1, 1, 1) - lr * g
    return F.conv2d(q.reshape(1, b * c, h, wd), w, padding=1, groups=b * c).reshape(b, c, h, wd)


def official_inner(
    qkv: Tensor, heads: int, grid: tuple[int, int], w1: Tensor, w2: Tensor, w3: Tensor
) -> Tensor:
    """Both branches from the qkv projection output ``[B, N, 3C + 3d]`` -> concatenated ``[B, N, C + d]``."""
    b, n, _ = qkv.shape
    d = w1.shape[-1]
    c = heads * d
    h, w = grid
    q1, k1, v1, q2, k2, v2 = torch.split(qkv, [c, c, c, d, d, d], dim=-1)
    q1, k1, v1 = (t.reshape(b, n, heads, d).transpose(1, 2) for t in (q1, k1, v1))
    q2, k2, v2 = (t.reshape(b, h, w, d).permute(0, 3, 1, 2) for t in (q2, k2, v2))
    x1 = official_swiglu_branch(q1, k1, v1, w1, w2).transpose(1, 2).reshape(b, n, c)
    x2 = official_dwconv_branch(q2, k2, v2, w3).reshape(b, d, n).transpose(1, 2)
    return torch.cat([x1, x2], dim=-1)
