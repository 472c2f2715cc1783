"""Building blocks of the ViT³ backbones, shared by the plain and the hierarchical family.

Every block works on channels-last maps ``[B, H, W, C]`` so the token grid travels with the tensor: any
``H`` and ``W`` (non-square included) work, and the grid handed to the TTT mixer is read from the shape at
run time. The image checks and the H-ViT³ stem and downsampling (``[B, C, H, W]`` convolutions) are
``vit3.layers.embed``. A block built under timm's ``set_scriptable(True)`` (``backends.scriptable_build``)
takes the plain PyTorch layers (timm's ``Mlp``, no C++ kernel), which ``torch.jit.script`` compiles.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, drop_path, register_notrace_module
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from vit3.kernels.common import autocast_backward, autocast_forward

from . import backends
from .config import TTTConfig, check_backend, check_recompute
from .inner_math import shape_text, tracing_kind
from .lean import hooked, lean_eligible
from .ttt import TTTMixer

__all__ = ["ConvFFN", "ConvPosEnc", "LeanMlp", "TTTBlock"]

LayerType = Callable[..., nn.Module]


def _nchw(x: Tensor) -> Tensor:
    return x.permute(0, 3, 1, 2)  # [B, H, W, C] -> [B, C, H, W]


def _nhwc(x: Tensor) -> Tensor:
    return x.permute(0, 2, 3, 1)  # [B, C, H, W] -> [B, H, W, C]


class ConvPosEnc(nn.Conv2d):
    """Residual depthwise 3x3 convolution on a channels-last map: ``x + dwconv(x)``.

    It is the conditional position encoding (CPE) in front of every ViT³ block and the depthwise step inside
    the H-ViT³ ConvFFN; both are the same operation. Parameters ``weight [C, 1, k, k]`` and ``bias [C]`` keep
    the official names (``cpe.*``, ``mlp.dwc.*``).

    Args:
        dim: channels C.
        kernel_size: odd kernel size (zero padding keeps the map size).
        backend: the backend asked for (the block's ``TTTConfig.backend``; ``auto`` reads
            ``$VIT3_TTT_BACKEND``): the C++ kernel serves under ``auto`` and ``cpu`` only.
    """

    def __init__(self, dim: int, kernel_size: int = 3, backend: str = "auto") -> None:
        super().__init__(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)
        self.backend = check_backend(backend)

    def on_kernel(self, x: Tensor) -> bool:
        """Whether a call on ``x`` takes the C++ kernel's depthwise op (3x3, the backend registry's rule)."""
        return self.kernel_size == (3, 3) and backends.conv_pos_kernel(x, self.weight, self.backend)

    def residual(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``x + dwconv(x)`` with the given ``weight [C, 1, k, k]`` and ``bias [C]``: ``[B, H, W, C]``."""
        if not torch.jit.is_scripting():  # TorchScript compiles the convolution only
            if self.on_kernel(
                x
            ):  # one C++ op: its node with gradients (saving x's token rows), else the forward
                return torch.ops.vit3_cpu.cpe(x, weight, bias)
        # On CPUs an NCHW-contiguous copy first (PyTorch's CPU depthwise kernels are far slower on
        # channels-last strides); elsewhere the channels-last view as it is (cuDNN's NHWC kernels), no copy.
        m = _nchw(x)
        return x + _nhwc(self._conv_forward(m.contiguous() if x.is_cpu else m, weight, bias))

    def forward(self, x: Tensor) -> Tensor:
        """``[B, H, W, C] -> [B, H, W, C]``."""
        return self.residual(x, self.weight, self.bias)


# FX keeps the module as one call, so a traced model runs the same convolution as the eager one (its choice of
# implementation is Python control flow).
register_notrace_module(ConvPosEnc)


class ConvFFN(nn.Module):
    """The H-ViT³ feed-forward: ``fc2(act(ConvPosEnc(drop(act(fc1(x))))))`` on a channels-last map.

    In training (gradients on, eager, no dropout in force, no hooks on its layers, ``recompute`` other than
    ``"never"``) it saves per token only x and ``h = fc1(x)``: the backward recomputes ``act -> dwconv ->
    act`` from ``h`` (``_LeanConvFfnFn``), where autograd through the layers keeps the hidden map about five
    times (the activations, the convolution's input and output).

    Args:
        in_features: input and output width C.
        hidden_features: hidden width.
        act_layer: activation (GELU).
        drop: dropout after the activation and after ``fc2``.
        backend: the block's ``TTTConfig.backend``, which the depthwise step follows (:class:`ConvPosEnc`).
        recompute: the block's ``TTTConfig.recompute``: ``"never"`` keeps autograd's saving.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int | None = None,
        act_layer: LayerType = nn.GELU,
        drop: float = 0.0,
        backend: str = "auto",
        recompute: str = "auto",
        **_: Any,
    ) -> None:
        super().__init__()
        hidden = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.dwc = ConvPosEnc(hidden, backend=backend)
        self.fc2 = nn.Linear(hidden, in_features)
        self.drop2 = nn.Dropout(drop)
        self.recompute = check_recompute(recompute)

    def middle(self, h: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
        """``act(dwconv(drop(act(h))))``: ``[B, H, W, hidden]``; the depthwise step is the module ``dwc`` (a
        call FX keeps whole), or its convolution with ``weight`` and ``bias`` (``ConvPosEnc.residual``)."""
        a = self.drop1(self.act(h))
        if weight is None:
            a = self.dwc(a)
        else:
            a = self.dwc.residual(a, weight, bias)
        return self.act(a)

    def _lean(self, x: Tensor) -> bool:
        return (
            lean_eligible(x)
            and not (self.training and (self.drop1.p > 0 or self.drop2.p > 0))
            and not hooked(self, self.fc1, self.act, self.dwc, self.fc2)
            and backends.recompute_mode(self.recompute)[0] != "never"
        )

    def forward(self, x: Tensor) -> Tensor:
        """``[B, H, W, C] -> [B, H, W, C]``."""
        if not torch.jit.is_scripting():  # TorchScript compiles the layers as they are
            if self._lean(x):
                f1, dw, f2 = self.fc1, self.dwc, self.fc2
                return _LeanConvFfnFn.apply(
                    x, f1.weight, f1.bias, dw.weight, dw.bias, f2.weight, f2.bias, self
                )
        return self.drop2(self.fc2(self.middle(self.fc1(x))))


class _LeanConvFfnFn(torch.autograd.Function):
    """``ConvFFN`` saving x and ``h = fc1(x)`` only; the backward recomputes ``a = ffn.middle(h)`` with
    autograd (the activation and the depthwise step as the forward ran them) for fc2's weight gradient and the
    gradients of ``h`` and the depthwise weights. Under autocast it computes what autograd through the layers
    would."""

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any,
        x: Tensor,
        w1: Tensor,
        b1: Tensor | None,
        dw: Tensor,
        db: Tensor | None,
        w2: Tensor,
        b2: Tensor | None,
        ffn: ConvFFN,
    ) -> Tensor:
        h = F.linear(x, w1, b1)  # [B, H, W, hidden]
        ctx.save_for_backward(x, h, w1, dw, db, w2)
        ctx.ffn, ctx.biases = ffn, (b1 is not None, b2 is not None)
        return F.linear(ffn.middle(h, dw, db), w2, b2)

    @staticmethod
    @autocast_backward
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, h, w1, dw, db, w2 = ctx.saved_tensors
        has_b1, has_b2 = ctx.biases
        leaves = [t.detach().requires_grad_() for t in (h, dw, db) if t is not None]
        hl, dwl, dbl = (*leaves, None)[:3]
        with torch.enable_grad():
            a = ctx.ffn.middle(hl, dwl, dbl)  # recomputed
        rows = dy.numel() // dy.shape[-1]
        dy2 = dy.reshape(rows, -1)  # [T, C]
        dw2, db2 = dy2.t() @ a.detach().reshape(rows, -1), dy2.sum(0) if has_b2 else None
        da = (dy2 @ w2).view(a.shape).to(a.dtype)
        grads = torch.autograd.grad(a, leaves, da)
        del a
        dh = grads[0].reshape(rows, -1)
        dw1, db1 = dh.t() @ x.reshape(rows, -1), dh.sum(0) if has_b1 else None
        dx = (dh @ w1).view(x.shape).to(x.dtype)
        ddb = grads[2] if db is not None else None
        return dx, dw1, db1, grads[1], ddb, dw2, db2, None


def _as_autocast_reads(t: Tensor, state: tuple) -> Tensor:
    """``t`` as autocast hands it to a matmul under ``state`` (``autocast_forward``'s ``ctx.autocast``): cast
    to its dtype where on and ``t`` is floating, neither float64 nor of that dtype already."""
    _, enabled, dtype = state
    if not enabled or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
        return t
    return t.to(dtype)


class _LeanMlpFn(torch.autograd.Function):
    """``fc2(GELU(fc1(LN(x))))`` (the LayerNorm optional) saving x, the norm's statistics, its output and
    the weights as the layers read them and ``h = fc1(LN(x))`` only: the backward recomputes ``GELU(h)`` for
    fc2's weight gradient (an elementwise pass), where autograd keeps it (4C values per token at a 4C hidden
    width). What the layers read is kept, not recomputed or cast again: each op of a step costs host time on
    a GPU (the norm and two or three casts per block).

    Under autocast it computes what autograd through the layers would: the matmuls in the autocast dtype (the
    fp32 weights cast by autocast, in the backward too: it runs under the forward's autocast state) and each
    gradient in the dtype of the tensor it belongs to."""

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any,
        x: Tensor,
        ln_w: Tensor | None,
        ln_b: Tensor | None,
        eps: float | None,
        w1: Tensor,
        b1: Tensor | None,
        w2: Tensor,
        b2: Tensor | None,
        approx: str,
    ) -> Tensor:
        n = mean = rstd = None
        ctx.norm_dtype = x.dtype
        if eps is not None:
            n, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], ln_w, ln_b, eps)
            ctx.norm_dtype = n.dtype
            n = _as_autocast_reads(n, ctx.autocast)  # as fc1 reads it: the cast made once, kept
        w1, w2 = (_as_autocast_reads(w, ctx.autocast) for w in (w1, w2))  # kept as read: no casts again
        h = F.linear(x if n is None else n, w1, b1)  # [..., hidden]
        ctx.save_for_backward(x, n, h, w1, w2, mean, rstd, ln_w, ln_b)  # None where absent
        ctx.eps, ctx.approx, ctx.biases = eps, approx, (b1 is not None, b2 is not None)
        return F.linear(F.gelu(h, approximate=approx), w2, b2)

    @staticmethod
    @autocast_backward
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, n, h, w1, w2, mean, rstd, ln_w, ln_b = ctx.saved_tensors
        has_b1, has_b2 = ctx.biases
        rows = dy.numel() // dy.shape[-1]
        dy2 = dy.reshape(rows, -1)  # [T, C]
        a = F.gelu(h, approximate=ctx.approx).reshape(rows, -1)  # [T, hidden], recomputed
        dw2, db2 = dy2.t() @ a, dy2.sum(0) if has_b2 else None
        del a
        dh = torch.ops.aten.gelu_backward(dy2 @ w2, h.reshape(rows, -1), approximate=ctx.approx)
        dw1, db1 = dh.t() @ (x if n is None else n).reshape(rows, -1), dh.sum(0) if has_b1 else None
        dn = (dh @ w1).view(x.shape).to(ctx.norm_dtype)  # the norm output's gradient, as the norm computed it
        if n is None:
            return dn, None, None, None, dw1, db1, dw2, db2, None
        # the norm's input as it ran: autocast may run the norm in float32 (CUDA does), x cast to it
        mask = [True, ln_w is not None, ln_b is not None]
        dx, d_lw, d_lb = torch.ops.aten.native_layer_norm_backward(
            dn, x.to(ctx.norm_dtype), x.shape[-1:], mean, rstd, ln_w, ln_b, mask
        )
        return dx, d_lw, d_lb, None, dw1, db1, dw2, db2, None


_WEIGHT_BIAS = operator.itemgetter("weight", "bias")
_DROP_PATHS = (nn.Identity, DropPath)


def _drop_scale(module: nn.Module, x: Tensor) -> Tensor | None:
    """The scale ``[B, 1, 1, 1]`` a drop path in force multiplies its branch by (timm's ``drop_path`` of ones:
    its draw and its values), ``None`` for an ``Identity`` or a drop path not in force."""
    if type(module) is not DropPath or not module.training or module.drop_prob == 0.0:
        return None
    return drop_path(x.new_ones(x.shape[0], 1, 1, 1), module.drop_prob, True, module.scale_by_keep)


def _active(module: nn.Module) -> bool:
    """Whether calling ``module`` can change its input: not an ``Identity``, nor dropout outside training or
    of p = 0 (such calls are skipped on the hot path)."""
    if type(module) is nn.Identity:
        return False
    return not (isinstance(module, nn.Dropout) and (module.p == 0 or not module.training))


class LeanMlp(Mlp):
    """timm's ``Mlp`` (same parameters and names: ``fc1``, ``fc2``) with a memory-lean training backward that
    recomputes the GELU output instead of saving it (an elementwise pass): per token it keeps x, the output of
    the LayerNorm in front (``forward(x, norm=...)``) and ``fc1``'s, 4C values fewer than autograd through
    ``LayerNorm`` + ``Mlp``.

    The saving variant (plain ``norm`` then ``Mlp.forward``) runs with ``recompute="never"``
    (``TTTConfig.recompute`` or ``$VIT3_TTT_RECOMPUTE``), and wherever the lean path does not apply: tracing,
    another activation, dropout in training, a norm between the layers; without gradients the plain layers run
    (one op on CPU tensors, below).

    On CPU tensors (``backends.cpu_block_kernel``'s rule) the lean path is one C++ node
    (``torch.ops.vit3_cpu.lean_mlp``, the same ATen calls as ``_LeanMlpFn`` without its Python), elsewhere the
    Python node; without gradients the same op runs the whole MLP as one call (its forward alone).

    Args:
        recompute: the block's ``TTTConfig.recompute``.
        backend: the block's ``TTTConfig.backend`` (the C++ node serves under ``auto`` and ``cpu`` only); the
            other arguments are ``Mlp``'s.
    """

    def __init__(self, *args: Any, recompute: str = "auto", backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recompute, self.backend = check_recompute(recompute), check_backend(backend)

    def _fusable(self) -> bool:
        """What the lean nodes compute: GELU between the layers, no norm between them, no dropout in force."""
        m = self._modules  # not Module.__getattr__ (a lookup per attribute): this runs on every call
        act, norm, drop1, drop2 = m["act"], m["norm"], m["drop1"], m["drop2"]
        return (
            type(act) is nn.GELU
            and isinstance(norm, nn.Identity)
            and not (self.training and (drop1.p > 0 or drop2.p > 0))
        )

    def _lean(self, x: Tensor) -> bool:
        return lean_eligible(x) and self._fusable() and backends.recompute_mode(self.recompute)[0] != "never"

    def _plain(self, x: Tensor) -> Tensor:
        """``Mlp.forward`` without calling its no-op modules (``Identity``, dropout outside training or of p =
        0): each module call costs a noticeable share of this MLP on a CPU (``docs/design/dispatch.md``)."""
        x = self.act(self.fc1(x))
        for module in (self.drop1, self.norm):
            if _active(module):
                x = module(x)
        x = self.fc2(x)
        return self.drop2(x) if _active(self.drop2) else x

    def forward(self, x: Tensor, norm: nn.Module | None = None) -> Tensor:
        """``[..., C] -> [..., C]``: ``Mlp(norm(x))`` (``norm``: an optional LayerNorm over the last dim)."""
        lean = self._lean(x)
        one_op = (
            not lean
            and not torch.is_grad_enabled()
            and self._fusable()
            and backends.cpu_block_kernel(x, self.backend)
        )
        if not (lean or one_op):
            return self._plain(x if norm is None else norm(x))
        ln: dict[str, Any] = {"ln_w": None, "ln_b": None, "eps": None}
        if type(norm) is nn.LayerNorm and norm.normalized_shape == x.shape[-1:]:
            ln = {"ln_w": norm.weight, "ln_b": norm.bias, "eps": norm.eps}
        elif norm is not None:
            x = norm(x)
        f1, f2 = self.fc1, self.fc2
        args = (x, *ln.values(), f1.weight, f1.bias, f2.weight, f2.bias, self.act.approximate)
        if one_op or backends.cpu_block_kernel(x, self.backend):
            return torch.ops.vit3_cpu.lean_mlp(*args)
        return _LeanMlpFn.apply(*args)


class TTTBlock(nn.Module):
    """A ViT³ block on a channels-last map: CPE, then TTT mixer and feed-forward, each pre-norm and residual.

    ``x = x + dwconv(x); x = x + DropPath(TTT(LN x)); x = x + DropPath(FFN(LN x))``. The plain ViT³ block uses
    ``mlp_layer=LeanMlp`` (timm's ``Mlp``, names ``fc1``/``fc2``, with a memory-lean backward) and LayerNorm
    eps 1e-6; the H-ViT³ block uses ``mlp_layer=ConvFFN``, eps 1e-5 and a mixer with RoPE. Parameter names
    follow the official code (``cpe``, ``norm1``, ``attn``, ``norm2``, ``mlp``).

    On CPU a settled call of the plain block runs as one C++ op, ``torch.ops.vit3_cpu.ttt_block`` (the same
    ops and bits without the Python between them; ``one_op`` says when, ``explain_one_op`` why not).

    Args:
        dim: width C.
        num_heads: mixer heads.
        mlp_ratio: feed-forward hidden width / C.
        ttt_cfg: mixer configuration (``TTTConfig`` or dict), passed to ``TTTMixer``.
        proj_drop: dropout inside the feed-forward.
        drop_path: stochastic depth rate.
        mlp_layer: feed-forward class (``LeanMlp``, timm ``Mlp`` or ``ConvFFN``); a ``LeanMlp`` follows the
            mixer config's ``recompute``, and is timm's ``Mlp`` in a block built scriptable.
        norm_layer: normalisation over the last dim.
        act_layer: feed-forward activation.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        ttt_cfg: TTTConfig | dict[str, Any] | None = None,
        proj_drop: float = 0.0,
        drop_path: float = 0.0,
        mlp_layer: LayerType = LeanMlp,
        norm_layer: LayerType = nn.LayerNorm,
        act_layer: LayerType = nn.GELU,
    ) -> None:
        super().__init__()
        ttt_cfg = TTTConfig.create(ttt_cfg)
        scriptable = backends.scriptable_build(ttt_cfg.backend)
        # the block's backend, as its mixer's; built scriptable, the plain paths ("generic": no kernel)
        backend = "generic" if scriptable else ttt_cfg.backend
        if scriptable and mlp_layer is LeanMlp:
            mlp_layer = Mlp  # the same layers and names, without the lean nodes TorchScript cannot compile
        self.cpe = ConvPosEnc(dim, backend=backend)
        self.norm1 = norm_layer(dim)
        # The model validates its image once (check_image); per-block finiteness checks would re-read every
        # activation on the hot path.
        self.attn = TTTMixer(dim, num_heads, ttt_cfg, check_finite=False)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        # what the block's config says to the feed-forwards that read it
        follows = {
            LeanMlp: {"recompute": ttt_cfg.recompute, "backend": backend},
            ConvFFN: {"recompute": ttt_cfg.recompute, "backend": backend},
        }
        own = next(
            (kw for cls, kw in follows.items() if isinstance(mlp_layer, type) and issubclass(mlp_layer, cls)),
            {},
        )
        self.mlp = mlp_layer(
            in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop, **own
        )
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def _cpe_norm(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(t, n)``: the CPE's output ``t`` and the first norm's ``n = norm1(t)``.

        One C++ op (``torch.ops.vit3_cpu.cpe_norm``) where the CPE takes the C++ kernel and the norm is a
        LayerNorm over C, without gradients (its forward alone) or in memory-lean training (its node saves x
        and the norm's statistics and recomputes t); else ``recompute="always"`` checkpoints the two, and
        ``auto``, the saving variant (and TorchScript) run them as they are."""
        if torch.jit.is_scripting():
            return self._plain_cpe_norm(x)
        cpe, norm = self.cpe, self.norm1
        mode, source = backends.recompute_mode(self.attn.cfg.recompute)
        lean = mode != "never" and lean_eligible(x)  # memory-lean training: the CPE output is not saved
        if (
            (lean or not torch.is_grad_enabled())
            and type(cpe) is ConvPosEnc
            and type(norm) is nn.LayerNorm
            and cpe.on_kernel(x)  # before reading x's shape: False for traced (FX) values
            and norm.normalized_shape == x.shape[-1:]
        ):
            return torch.ops.vit3_cpu.cpe_norm(x, cpe.weight, cpe.bias, norm.weight, norm.bias, norm.eps)
        # Elsewhere cpe(x) is recomputed from x (saved by the CPE anyway) by a checkpoint only where asked
        # for (``always``): under ``auto`` its rerun costs more host work than the CPE output's memory.
        if lean and source != backends.LEAN_DEFAULT:
            return checkpoint(self._plain_cpe_norm, x, use_reentrant=False, preserve_rng_state=False)
        return self._plain_cpe_norm(x)

    def _plain_cpe_norm(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = self.cpe(x)
        return x, self.norm1(x)

    def _one_op_layers(self, x: Tensor, grad: bool, hooks: bool = True) -> tuple[tuple | None, str]:
        """The layers of a call on ``x`` (with gradients: ``grad``) that can run as one op, or ``None`` and
        why not (``one_op``); ``hooks=False`` leaves hooks aside (``explain_one_op``)."""
        if tracing_kind():  # before anything a tracer would have to follow
            return None, "traced or compiled: the layers' own paths serve"
        # The layers and parameters are read from the modules' dicts, not through ``Module.__getattr__``
        # (``docs/design/dispatch.md``): this runs on every call.
        m = self._modules
        attn, mlp, cpe, n1, n2 = m["attn"], m["mlp"], m["cpe"], m["norm1"], m["norm2"]
        dp1, dp2 = m["drop_path1"], m["drop_path2"]
        if type(attn) is not TTTMixer or attn.cfg.check_finite or attn.cfg.lr_mode == "token":
            return None, "the mixer has token lr gates or checks finiteness"
        if attn.scriptable:
            return None, f"built scriptable: the plain layers serve ({backends.SCRIPTABLE_PATH})"
        backend = attn.cfg.backend
        why = backends.cpu_block_reason(x, backend)
        if why:
            return None, why
        not_lean_mlp = (
            f"the feed-forward is {type(mlp).__name__}, not the lean MLP the op computes (fc1, GELU, fc2 "
            "without dropout in force)"
        )
        if type(mlp) is not LeanMlp:
            return None, not_lean_mlp
        fc1, act, fc2 = mlp._modules["fc1"], mlp._modules["act"], mlp._modules["fc2"]
        if not (
            type(fc1) is nn.Linear and type(fc2) is nn.Linear and mlp._fusable() and mlp.backend == backend
        ):
            return None, not_lean_mlp
        qkv, proj = attn._modules["qkv"], attn._modules["proj"]
        if not (
            type(cpe) is ConvPosEnc
            and cpe.kernel_size == (3, 3)
            and type(n1) is nn.LayerNorm
            and type(n2) is nn.LayerNorm
            and n1.normalized_shape == n2.normalized_shape == (x.shape[-1],) == (attn.dim,)
            and type(qkv) is nn.Linear
            and type(proj) is nn.Linear
            and cpe.backend == backend
            and type(dp1) in _DROP_PATHS
            and type(dp2) in _DROP_PATHS
        ):
            return None, "a layer is not one the op computes (3x3 CPE, LayerNorms over C, Linear, DropPath)"
        if hooks and hooked(attn, qkv, proj, mlp, dp1, dp2):
            return None, "a layer has hooks or is compiled"
        lean = True  # without gradients: the lean ops' forwards
        if grad:
            modes = (
                backends.recompute_mode(attn.cfg.recompute)[0],
                backends.recompute_mode(mlp.recompute)[0],
            )
            if modes not in (("always", "always"), ("never", "never")):
                return None, "training recomputes qkv (the mixer's own node) or its layers' settings differ"
            lean = modes[0] == "always"
        return (lean, attn, cpe, n1, n2, qkv, proj, fc1, act, fc2), ""

    def one_op(self, x: Tensor) -> tuple | None:
        """The arguments of ``torch.ops.vit3_cpu.ttt_block`` but the drop-path scales for a call on ``x``
        ``[B, H, W, C]``, or ``None`` where the block runs layer by layer (``explain_one_op`` says why).

        The op runs the block's layers in their order, each through its own op, without the Python between
        them (the same bits, and with gradients the same nodes). It serves where every layer is one it
        computes and calls nothing else (no hooks, no compiled submodule): the C++ kernel's CPE and lean MLP
        on ``x`` (``backends.cpu_block_kernel``, the block's backend), LayerNorms, a mixer without token gates
        or finiteness checks whose call on these tokens is settled on the whole-mixer C++ op
        (``TTTMixer.settled_cpp_args``: the first calls of a route run layer by layer, guarded), and with
        gradients the memory-lean block (recompute ``always``, the lean nodes) or the saving one (``never``:
        the CPE's node, then the norms and the MLP's layers as ATen ops); ``qkv`` keeps the mixer's own node.
        """
        layers, _ = self._one_op_layers(x, torch.is_grad_enabled())
        if layers is None:
            return None
        lean, attn, cpe, n1, n2, qkv, proj, fc1, act, fc2 = layers
        cpe_w, cpe_b = _WEIGHT_BIAS(cpe._parameters)
        n1_w, n1_b = _WEIGHT_BIAS(n1._parameters)
        qkv_w, qkv_b = _WEIGHT_BIAS(qkv._parameters)
        h, w = x.shape[1:3]
        mixer = attn.settled_cpp_args(
            x.device, x.dtype, h * w, (h, w), x, cpe_w, cpe_b, n1_w, n1_b, qkv_w, qkv_b
        )
        if mixer is None:
            return None
        proj_w, proj_b = _WEIGHT_BIAS(proj._parameters)
        n2_w, n2_b = _WEIGHT_BIAS(n2._parameters)
        fc1_w, fc1_b = _WEIGHT_BIAS(fc1._parameters)
        fc2_w, fc2_b = _WEIGHT_BIAS(fc2._parameters)
        return (
            *(x, lean, cpe_w, cpe_b, n1_w, n1_b, n1.eps, qkv_w, qkv_b, *mixer, proj_w, proj_b),
            *(n2_w, n2_b, n2.eps, fc1_w, fc1_b, fc2_w, fc2_b, act.approximate),
        )

    def explain_one_op(self, x: Tensor, grad: bool) -> str:
        """Why a call on ``x`` ``[B, H, W, C]`` (with gradients: ``grad``) runs layer by layer, or ``""``
        where it runs as one op once its mixer's call is settled (``one_op``); hooks are left aside
        (``explain`` adds its own)."""
        layers, why = self._one_op_layers(x, grad, hooks=False)
        if layers is None:
            return why
        b, h, w, c = x.shape
        if not self.attn.explain(x.reshape(b, h * w, c), (h, w), grad=grad).cpp_op:
            return "the mixer's call does not take the whole-mixer C++ op (vit3_cpu::mix)"
        return ""

    def forward(self, x: Tensor) -> Tensor:
        """``[B, H, W, C] -> [B, H, W, C]``; the mixer sees the ``H x W`` raster of tokens."""
        if not torch.jit.is_scripting():  # TorchScript compiles the layers one by one
            args = self.one_op(x)
            if args is not None:
                dp1, dp2 = self._modules["drop_path1"], self._modules["drop_path2"]
                return torch.ops.vit3_cpu.ttt_block(*args, _drop_scale(dp1, x), _drop_scale(dp2, x))
            dim = self._modules["attn"].dim
            traced = isinstance(x, torch.fx.Proxy) or tracing_kind() == "trace"  # sizes a tracer records
            if not traced and (x.ndim != 4 or x.shape[3] != dim):
                raise ValueError(
                    f"TTTBlock built for C={dim} expects a channels-last map [B, H, W, C], got "
                    f"{shape_text(x)}"
                )
        b, h, w, c = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
        x, n = self._cpe_norm(x)
        y = self.attn(n.reshape(b, h * w, c), grid=(h, w)).reshape(b, h, w, c)  # [B, H*W, C] -> [B, H, W, C]
        if torch.jit.is_scripting():  # a block built scriptable: every layer called (timm's Mlp or ConvFFN)
            x = x + self.drop_path1(y)
            return x + self.drop_path2(self.mlp(self.norm2(x)))
        x = x + (self.drop_path1(y) if _active(self.drop_path1) else y)
        ffn = self.mlp(x, norm=self.norm2) if isinstance(self.mlp, LeanMlp) else self.mlp(self.norm2(x))
        return x + (self.drop_path2(ffn) if _active(self.drop_path2) else ffn)
