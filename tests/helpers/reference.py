"""An independent float64 reference of the TTT mixer: inner models written as plain forward functions and
inner gradients taken with ``torch.autograd.grad(create_graph=True)`` instead of closed forms.

Nothing here calls the closed-form gradients of ``vit3.layers.inner_models``; the tests compare the two.
The inner models with an op of their own (``swiglu``, ``linear``, ``dwconv``) are that op's reference model
(``vit3.kernels.<op>.reference``), and the normalisation is the shared ``normalize_grad``: no formula twice.
A registered model not written out here (not in ``WRITTEN_HERE``) is its own definition: the model under
test hands its ``forward_train``, ``initial_params`` and ``norm_dims`` in (``own``), while the loop, the
gradients and the mixer around it stay this file's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from vit3.kernels.common import normalize_grad
from vit3.kernels.dwconv.reference import dwconv
from vit3.kernels.linear.reference import linear
from vit3.kernels.swiglu.reference import swiglu
from vit3.layers import TTTMixer, apply_rope_2d, loss_value
from vit3.layers.config import GRID_MODELS
from vit3.layers.inner_models import InnerModel, ResidualNormInner

REFERENCE_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}


def _bias(p: dict[str, Tensor], name: str) -> Tensor | float:
    return p[name] if name in p else 0.0


def _per_sample_conv(x: Tensor, weight: Tensor, groups: int) -> Tensor:
    """3x3 conv (zero padding) of maps ``[B, C, h, w]`` with per-sample weights ``[B|1, C, C/groups, 3,
    3]``."""
    weight = weight.expand(x.shape[0], *weight.shape[1:])
    return torch.stack([F.conv2d(xb[None], wb, padding=1, groups=groups)[0] for xb, wb in zip(x, weight)])


def _mlp(p: dict[str, Tensor], x: Tensor, cfg, layers: int) -> Tensor:
    act = REFERENCE_ACTIVATIONS[cfg.mlp_act]
    a = x
    for i in range(1, layers + 1):
        w = p[f"w{i}"]
        if cfg.mlp_residual == "identity" and i > 1:
            w = w + torch.eye(w.shape[-1], dtype=w.dtype)
        a = a @ w + _bias(p, f"b{i}")
        if i < layers:
            a = act(a)
    return a + x if cfg.mlp_residual == "add" else a


def reference_forward(
    name: str,
    p: dict[str, Tensor],
    x: Tensor,
    grid: tuple[int, int],
    cfg,
    norm: tuple[Tensor, Tensor] | None = None,
    own: InnerModel | None = None,
) -> Tensor:
    """Inner model ``name`` on tokens ``[B, G, n, c]``: written out here from its definition, or ``own``'s
    ``forward_train`` where it stands in (:func:`stand_in`).

    ``p`` holds per-sample weights in the written-out models' layouts (leading dim B or 1): FC weights
    ``[B, G, in, out]``, FC biases ``[B, G, 1, out]``, ``conv`` ``[B, G, 9c, c]`` (row ``i * 9 + 3 * kh + kw``
    for input channel i), ``dwconv`` ``[B, G*c, 3, 3]``; a stand-in's own. ``norm = (weight, bias)``
    (``[G, c]`` each) makes it ``x + LayerNorm(g(x))``.
    """
    y = _reference_g(name, p, x, grid, cfg, own)
    if norm is None:
        return y
    weight, bias = norm
    return x + F.layer_norm(y, y.shape[-1:], eps=1e-6) * weight[:, None] + bias[:, None]


def _conv(p: dict[str, Tensor], x: Tensor, grid: tuple[int, int], cfg) -> Tensor:
    b, g, n, c = x.shape
    maps = x.permute(0, 1, 3, 2).reshape(b, g * c, *grid)  # [B, G*c, h, w]
    w = p["weight"]  # [B|1, G, 9c, c] -> conv weights [B|1, G*c_out, c_in, 3, 3]
    w = w.transpose(-2, -1).reshape(w.shape[0], g * c, c, 3, 3)
    return _per_sample_conv(maps, w, groups=g).reshape(b, g, c, n).transpose(-2, -1)


# The inner models written out here, name -> forward(p, x, grid, cfg): each from its definition.
WRITTEN_HERE: dict[str, Callable[..., Tensor]] = {
    "linear": lambda p, x, grid, cfg: linear(x, p["w"]) + _bias(p, "b"),
    "silu": lambda p, x, grid, cfg: F.silu(linear(x, p["w"]) + _bias(p, "b")),
    "swiglu": lambda p, x, grid, cfg: swiglu(x, p["w1"], p["w2"]),
    "swiglu_out": lambda p, x, grid, cfg: swiglu(x, p["w1"], p["w2"]) @ p["w3"],
    "dwconv": lambda p, x, grid, cfg: dwconv(x, p["weight"], grid),
    "mlp": lambda p, x, grid, cfg: _mlp(p, x, cfg, 2),
    "mlp3": lambda p, x, grid, cfg: _mlp(p, x, cfg, 3),
    "conv": _conv,
}


def _reference_g(
    name: str, p: dict[str, Tensor], x: Tensor, grid: tuple[int, int], cfg, own: InnerModel | None
) -> Tensor:
    if name in WRITTEN_HERE:
        return WRITTEN_HERE[name](p, x, grid, cfg)
    if own is None:
        raise ValueError(f"{name!r} is not written out here: pass the model under test as own (stand_in)")
    return own.forward_train(p, x, grid, need_output=True)[0]


def stand_in(name: str, model: InnerModel) -> InnerModel | None:
    """The model under test, without its ``x + LN(g(x))`` wrapper, where it is its own definition (``name``
    not in ``WRITTEN_HERE``); else ``None``: the reference asks it nothing."""
    if name in WRITTEN_HERE:
        return None
    return model.model if isinstance(model, ResidualNormInner) else model


def reference_params(name: str, model) -> tuple[dict[str, Tensor], tuple[Tensor, Tensor] | None]:
    """The initial inner weights of ``model`` in :func:`reference_forward`'s layouts, and its ``(weight,
    bias)`` LayerNorm (``[G, c]``) when it is wrapped as ``x + LN(g(x))``, read from its named parameters."""
    heads, c = model.heads, model.head_dim
    named = dict(model.named_parameters())
    norm = None
    if "ln_weight" in named:
        norm = (named.pop("ln_weight").view(heads, c), named.pop("ln_bias").view(heads, c))
        named = {key.removeprefix("model."): val for key, val in named.items()}
    own = stand_in(name, model)
    if own is not None:
        return dict(own.initial_params()), norm
    p = {}
    for key, val in named.items():
        if name == "dwconv":
            val = val.reshape(1, -1, 3, 3)  # [G*c, 1, 3, 3] -> [1, G*c, 3, 3]
        elif name == "conv":
            val = val.flatten(2).transpose(-2, -1)[None]  # [G, c_out, c_in, 3, 3] -> [1, G, 9c, c_out]
        elif key.startswith("b"):
            val = val.view(1, heads, 1, -1)  # flat [G*out] -> [1, G, 1, out]
        p[key] = val
    return p, norm


def reference_inner_loop(
    name: str,
    p0: dict[str, Tensor],
    k: Tensor,
    v: Tensor,
    grid,
    cfg,
    scale: float,
    gate: Tensor | None,
    norm: tuple[Tensor, Tensor] | None = None,
    own: InnerModel | None = None,
) -> dict[str, Tensor]:
    """Inner training by autograd: per-sample weights, loss ``(s/n) sum_n gate_n l_n`` per mini-batch; the
    gradient normalised over the dims ``own`` names where it stands in."""
    b, _, n, _ = k.shape
    if name in WRITTEN_HERE:
        dims = {key: (-2, -1) if name == "dwconv" else (-2,) for key in p0}
    else:
        dims = {key: tuple(own.norm_dims(key)) for key in p0}
    params = {key: val.expand(b, *val.shape[1:]) + 0.0 for key, val in p0.items()}  # per-sample copies
    chunks = torch.arange(n).tensor_split(cfg.mini_batches)
    for _ in range(cfg.steps):
        for idx in chunks:
            vhat = reference_forward(name, params, k, grid, cfg, norm, own)[..., idx, :]
            per_tok = loss_value(cfg.loss, vhat, v[..., idx, :])  # [B, G, n_c]
            if gate is not None:
                per_tok = per_tok * gate[..., idx]
            total = per_tok.sum() * (scale / len(idx))
            grads = torch.autograd.grad(total, list(params.values()), create_graph=True)
            new = {}
            for (key, w), g in zip(params.items(), grads):
                if cfg.grad_norm:
                    g = normalize_grad(g, dims[key])
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
        if cfg.rope and name not in GRID_MODELS:
            q, k = apply_rope_2d(q, grid, cfg.rope_base), apply_rope_2d(k, grid, cfg.rope_base)
        q, k, v = (t.reshape(b, n, heads, -1).transpose(1, 2) for t in (q, k, v))
        p0, norm = reference_params(name, model)
        own = stand_in(name, model)
        params = reference_inner_loop(name, p0, k, v, grid, cfg, mixer.scale, gate, norm, own)
        y = reference_forward(name, params, q, grid, cfg, norm, own)
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


def check_mixer(mixer: TTTMixer, grid: tuple[int, int]) -> None:
    """``mixer`` in float64, its inner weights enlarged (so the step is not negligible) and its biases and
    LayerNorm affine moved off 0 / 1, held to the reference on a random input
    (:func:`assert_mixer_matches_reference`)."""
    torch.manual_seed(2)
    mixer = mixer.double()
    with torch.no_grad():
        for model in mixer.inner:
            for p in model.parameters():
                p.mul_(20)
                if p.ndim == 1:
                    p.add_(0.5 * torch.randn_like(p))
    x = torch.randn(2, grid[0] * grid[1], mixer.qkv.in_features, dtype=torch.float64, requires_grad=True)
    assert_mixer_matches_reference(mixer, x, grid)
