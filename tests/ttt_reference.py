"""An independent float64 reference of the TTT mixer: inner models written as plain forward functions and
inner gradients taken with ``torch.autograd.grad(create_graph=True)`` instead of closed forms.

Nothing here calls the closed-form gradients of ``vit3.layers.inner``; the tests compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vit3.layers import TTTMixer, apply_rope_2d, loss_value


def _per_sample_dwconv(x: Tensor, weight: Tensor) -> Tensor:
    """Depthwise 3x3 conv of maps ``[B, C, h, w]`` with per-sample kernels ``[B|1, C, 3, 3]``, one sample at a time."""
    weight = weight.expand(x.shape[0], *weight.shape[1:])
    return torch.stack(
        [F.conv2d(xb[None], wb[:, None], padding=1, groups=xb.shape[0])[0] for xb, wb in zip(x, weight)]
    )


def reference_forward(name: str, p: dict[str, Tensor], x: Tensor, grid: tuple[int, int], cfg) -> Tensor:
    """Inner model ``name`` on tokens ``[B, G, n, c]`` written directly from its definition."""
    if name == "linear":
        return x @ p["w"]
    if name == "silu":
        return F.silu(x @ p["w"])
    if name == "swiglu":
        return (x @ p["w1"]) * F.silu(x @ p["w2"])
    if name == "mlp":
        act = F.silu if cfg.mlp_act == "silu" else F.gelu
        a = act(x @ p["w1"])
        w2 = p["w2"]
        if cfg.mlp_residual == "identity":
            w2 = w2 + torch.eye(w2.shape[-1], dtype=w2.dtype)
        y = a @ w2
        return y + x if cfg.mlp_residual == "add" else y
    if name == "dwconv":
        b, g, n, c = x.shape
        maps = x.permute(0, 1, 3, 2).reshape(b, g * c, *grid)  # [B, G*c, h, w]
        out = _per_sample_dwconv(maps, p["weight"])
        return out.reshape(b, g, c, n).transpose(-2, -1)
    raise ValueError(name)


def reference_inner_loop(
    name: str, p0: dict[str, Tensor], k: Tensor, v: Tensor, grid, cfg, scale: float, gate: Tensor | None
) -> dict[str, Tensor]:
    """Inner training by autograd: per-sample weights, loss ``(s/n) sum_n gate_n l_n`` per mini-batch."""
    b, _, n, _ = k.shape
    params = {key: val.expand(b, *val.shape[1:]) + 0.0 for key, val in p0.items()}  # per-sample copies
    chunks = torch.arange(n).tensor_split(cfg.mini_batches)
    for _ in range(cfg.steps):
        for idx in chunks:
            vhat = reference_forward(name, params, k, grid, cfg)[..., idx, :]
            per_tok = loss_value(cfg.loss, vhat, v[..., idx, :])  # [B, G, n_c]
            if gate is not None:
                per_tok = per_tok * gate[..., idx]
            total = per_tok.sum() * (scale / len(idx))
            grads = torch.autograd.grad(total, list(params.values()), create_graph=True)
            new = {}
            for (key, w), g in zip(params.items(), grads):
                if cfg.grad_norm:
                    dims = (-2, -1) if name == "dwconv" else (-2,)
                    g = g / (g.pow(2).sum(dims, keepdim=True).sqrt() + 1.0)
                new[key] = w - cfg.inner_lr * g
            params = new
    return params


def reference_mixer(mixer: TTTMixer, x: Tensor, grid: tuple[int, int]) -> Tensor:
    """The whole mixer recomputed with autograd inner gradients (float64, PyTorch ops only)."""
    b, n, _ = x.shape
    cfg = mixer.cfg
    qkv = mixer.qkv(x)
    gates = torch.sigmoid(mixer.lr_gate(x)).transpose(1, 2) if mixer.lr_gate is not None else None
    outs, off, goff = [], 0, 0
    for (name, heads), width, model in zip(mixer.branch_specs, mixer.widths, mixer.inner):
        q, k, v = (
            qkv[..., off : off + width],
            qkv[..., off + width : off + 2 * width],
            qkv[..., off + 2 * width : off + 3 * width],
        )
        off += 3 * width
        gate = None
        if gates is not None:
            gate = gates[:, goff : goff + heads]
            goff += heads
        if cfg.rope and name != "dwconv":
            q, k = apply_rope_2d(q, grid, cfg.rope_base), apply_rope_2d(k, grid, cfg.rope_base)
        q, k, v = (t.reshape(b, n, heads, -1).transpose(1, 2) for t in (q, k, v))
        p0 = dict(model.named_parameters())
        if name == "dwconv":
            p0 = {"weight": p0["weight"].reshape(1, -1, 3, 3)}
        params = reference_inner_loop(name, p0, k, v, grid, cfg, mixer.scale, gate)
        y = reference_forward(name, params, q, grid, cfg)
        outs.append(y.transpose(1, 2).reshape(b, n, width))
    return mixer.proj(torch.cat(outs, dim=-1))


def assert_mixer_matches_reference(mixer: TTTMixer, x: Tensor, grid: tuple[int, int]) -> Tensor:
    """Checks ``mixer``'s output and the gradients of the input and every parameter against
    ``reference_mixer`` (float64: rtol 1e-10 on the output, 1e-9 on gradients); returns the output."""
    dout = torch.randn_like(x)
    out = mixer(x, grid)
    params = [x, *mixer.parameters()]
    grads = torch.autograd.grad((out * dout).sum(), params)
    ref = reference_mixer(mixer, x, grid)
    ref_grads = torch.autograd.grad((ref * dout).sum(), params)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    names = ["input", *(n for n, _ in mixer.named_parameters())]
    for name, g, g_ref in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12, msg=f"gradient of {name}")
    return out
