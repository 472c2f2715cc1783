"""The fused TTT inner-loop op: custom ``torch.library`` ops around the Triton kernels, autograd, dispatch.

``fused_ttt`` runs one full-batch inner step of an inner model (``"swiglu"``: the official ViT³ branch,
dot loss; ``"linear"``: dot or MSE loss; ``"dwconv"``: the official 3x3 depthwise-conv branch, dot loss)
per (sample, head) and applies the result to the
queries, forward and backward in Triton. It is registered as the custom ops ``vit3::ttt_fused_fwd`` /
``vit3::ttt_fused_bwd`` (``torch.library.triton_op``) so ``torch.compile`` sees the kernels without a
graph break. ``backend="reference"`` runs the pure-PyTorch reference formulation instead
(``swiglu_ttt_ref``/``linear_ttt_ref``). Which implementation a mixer runs is decided by
``vit3.layers.backends``: this op reads no environment variable.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.library import triton_op, wrap_triton

from . import ttt_fused_kernels as K
from .dwconv_ttt_ref import dwconv_ttt_ref
from .linear_ttt_ref import linear_ttt_ref
from .swiglu_ttt_ref import swiglu_ttt_ref

__all__ = [
    "FUSED_LOSSES",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_DWCONV",
    "MIN_HEAD_DIM",
    "fits_device",
    "fused_ttt",
    "gpu_tiles",
    "head_dim_supported",
    "max_head_dim",
    "resolve_backend",
    "small_tile",
    "triton_runs_on",
]

FUSED_LOSSES = {"swiglu": ("dot",), "linear": ("dot", "mse"), "dwconv": ("dot",)}
WEIGHT_NAMES = {"swiglu": ("w1", "w2"), "linear": ("w",), "dwconv": ("weight",)}
# Head dims the kernels take. The matrix models' kernels keep [BLOCK_D, BLOCK_C] column blocks of the d x d
# weights and gradients on chip (``gpu_tiles``: the whole matrix up to d = 64, 16 columns beyond): whole
# 128 x 128 matrices would need 311-606 KB of shared memory in the backward kernels on sm_90, more than the
# 227 KB an H100/H200 block may use; in 16-column blocks they need at most 120 KB (184 KB in float64).
# Beyond 128 the full-width k/q tiles and the dq/dk accumulators outgrow it; the depthwise conv keeps only
# 9 x d weights and full-width tiles, up to 128 as well.
MIN_HEAD_DIM, MAX_HEAD_DIM, MAX_HEAD_DIM_DWCONV = 16, 128, 128


def max_head_dim(name: str, dtype: torch.dtype | None = None) -> int:
    """The largest head dim the kernels of inner model ``name`` take for inputs of ``dtype``.

    The same for every dtype: float64 (a checking mode) takes narrower column blocks where needed.
    """
    return MAX_HEAD_DIM_DWCONV if name == "dwconv" else MAX_HEAD_DIM


def head_dim_supported(name: str, head_dim: int, dtype: torch.dtype | None = None) -> bool:
    """Whether the kernels of inner model ``name`` take heads of ``head_dim`` channels (``dtype`` inputs)."""
    return MIN_HEAD_DIM <= head_dim <= max_head_dim(name, dtype)


IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Test hook: when set (e.g. to NaN), every buffer the op allocates is filled with it, so any element a kernel
# fails to write shows up in the result.
DEBUG_FILL: float | None = None


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(DEBUG_FILL) if DEBUG_FILL is not None else out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA, or any device under ``TRITON_INTERPRET=1``."""
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


def fits_device(name: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether the kernels of inner model ``name`` at ``head_dim`` / ``dtype`` have a launch configuration that
    fits ``device`` (compute capability, opt-in shared memory per block), and the reason if not.

    Pending: the per-architecture check; today every CUDA device and the interpreter pass.
    """
    return True, ""


def resolve_backend(backend: str = "auto") -> str:
    """Checks ``backend``: ``"auto"``, ``"triton"`` or ``"reference"``."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    return backend


# --------------------------------------------------------------------------------------------- launch set-up


def _acc_dtype(dtype: torch.dtype) -> tuple[torch.dtype, Any]:
    """Accumulator dtype (torch, triton) for inputs of ``dtype``: float64 for float64, else float32."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: TF32 for half inputs (and fp32 when PyTorch allows TF32), else IEEE."""
    if _interpreting() or dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def gpu_tiles(block_d: int, dtype: torch.dtype, model: str) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_C, num_warps)`` of inner model ``model``'s kernels for ``BLOCK_D``-wide heads of ``dtype``.

    ``BLOCK_C`` (output columns per program, also on the interpreter) is the whole head up to
    ``BLOCK_D = 64`` (32 for float64): one column block, one fused launch per stage. On a GPU: 32-token
    tiles (64 make ptxas spill registers in the backward kernels, sm_90), 8 warps from d = 64, where the
    weights and gradients take most of the registers. Wider heads take 16-column blocks, which keep every
    kernel within 120 KB of shared memory (184 KB for float64) and nearly free of spills
    (``tests/test_kernels_compile.py``), with 64-token tiles for 16-bit inputs (Hopper's warp-group MMA)
    and 32 for fp32/fp64 ones. The depthwise conv keeps 9 x d weights: its kernels always take the first
    branch (``BLOCK_C`` unused).

    Args:
        block_d: the head dim padded to a power of two (16..128).
        dtype: the q/k/v dtype.
        model: ``"swiglu"``, ``"linear"`` or ``"dwconv"``.

    Returns:
        ``(BLOCK_N, BLOCK_C, num_warps)``; the matrix kernels run ``cdiv(d, BLOCK_C)`` column blocks.
    """
    if model == "dwconv" or block_d <= (32 if dtype == torch.float64 else 64):
        return 32, block_d, 4 if block_d <= 32 else 8
    return 64 if dtype.itemsize == 2 else 32, 16, 8


def small_tile(block_r: int, block_d: int, dtype: torch.dtype) -> int:
    """Columns per program of the step, step-backward and reduction kernels (``[BLOCK_R, cols]`` tiles).

    At most 2048 fp32 (1024 fp64) elements per tile: 4096 (the d = 64 matrices) make them spill registers.

    Args:
        block_r: rows of the weight tiles (``BLOCK_D``, or 16 for the 9 taps of the depthwise conv).
        block_d: the head dim padded to a power of two.
        dtype: the q/k/v dtype (float64 tiles take twice the registers).

    Returns:
        The column tile; the kernels run ``cdiv(d, tile)`` programs per (sample, head) or head.
    """
    elems = 1024 if dtype == torch.float64 else 2048
    return min(block_d, max(16, elems // block_r))


def _launch(
    n_tok: int, d: int, bg: int, device: torch.device, chunk: int | None, dtype: torch.dtype, model: str
) -> dict[str, int]:
    """Tile sizes and the split of the N tokens into ``S`` chunks of ``CHUNK`` (a multiple of ``BLOCK_N``).

    On a GPU the split gives about two programs per SM; the interpreter runs programs one after another,
    so it takes one chunk (unless ``chunk`` forces a split, as the tests do) and large tiles. The column
    blocks (``BLOCK_C``, ``C`` of them) are the same on both, so the interpreter runs the GPU's split.
    """
    block_d = max(16, triton.next_power_of_2(d))
    block_n, block_c, warps = gpu_tiles(block_d, dtype, model)
    if _interpreting() or device.type != "cuda":
        block_n, want = min(256, max(16, triton.next_power_of_2(n_tok))), n_tok
        warps = 4
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = triton.cdiv(n_tok, max(1, triton.cdiv(2 * sms, bg)))
    if chunk is not None:
        block_n = min(block_n, max(16, triton.next_power_of_2(chunk)))
        want = chunk
    size = triton.cdiv(max(want, 1), block_n) * block_n
    return {
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "BLOCK_C": block_c,
        "C": triton.cdiv(d, block_c),
        "CHUNK": size,
        "S": triton.cdiv(n_tok, size),
        "warps": warps,
    }


# ------------------------------------------------------------------------------------------- custom ops


def _kernel_op(name: str) -> Any:
    """Registers ``fn`` as custom op ``name``: a ``triton_op`` (kernels visible to ``torch.compile``).

    Under ``TRITON_INTERPRET=1`` kernels are interpreted Python functions that ``torch.compile`` cannot
    trace, so the op is an opaque ``custom_op`` instead, with ``fn`` (which launches nothing on fake
    tensors) as its fake implementation: compiled graphs still hold the op, without graph breaks.
    """

    def register(fn: Any) -> Any:
        if _interpreting():
            op = torch.library.custom_op(name, fn, mutates_args=())
            op.register_fake(fn)
            return op
        return triton_op(name, fn, mutates_args=())

    return register


def _live(t: Tensor) -> bool:
    """False for fake tensors (shape propagation only: nothing to launch)."""
    return not isinstance(t, FakeTensor)


def _setup(q: Tensor, w: Tensor, model: str, chunk: int) -> tuple[dict[str, int], dict[str, Any], Any]:
    """Launch sizes, the constexpr flags shared by the kernels, and the accumulator dtype."""
    b, g, n_tok, d = q.shape
    acc, acc_tl = _acc_dtype(q.dtype)
    cfg = _launch(n_tok, d, b * g, q.device, chunk if chunk > 0 else None, q.dtype, model)
    cfg["R"] = w.shape[3]  # rows of each weight: d, or 9 taps for the depthwise conv
    cfg["BLOCK_R"] = 16 if model == "dwconv" else cfg["BLOCK_D"]
    cfg["BLOCK_CS"] = small_tile(cfg["BLOCK_R"], cfg["BLOCK_D"], q.dtype)
    cfg["CS"] = triton.cdiv(d, cfg["BLOCK_CS"])  # column blocks of the step and reduction kernels
    tiles = {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_D": cfg["BLOCK_D"], "ACC": acc_tl, "num_warps": cfg["warps"]}
    return cfg, tiles, acc


def _matrix_flags(model: str, loss: str, nw: int, dtype: torch.dtype, block_c: int) -> dict[str, Any]:
    flags = {"SWIGLU": model == "swiglu", "MSE": loss == "mse", "NW": nw, "PREC": _precision(dtype)}
    return flags | {"BLOCK_C": block_c}


def _backward_passes(n_col: int) -> list[dict[str, bool]]:
    """The ``COLS`` / ``CROSS`` launches of a backward stage: one fused launch for a single column block,
    else the column launch (per-column outputs) and the cross launch (``dq`` / ``dk``, all columns)."""
    if n_col == 1:
        return [{"COLS": True, "CROSS": True}]
    return [{"COLS": True, "CROSS": False}, {"COLS": False, "CROSS": True}]


@_kernel_op("vit3::ttt_fused_fwd")
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, model: str, loss: str, h: int, wd: int, scale: float,
    lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Forward: ``out [B, G, N, c]`` and the saved statistics ``G``, ``W'`` ``[B*G, NW, R, c]``, ``||G||``.

    ``w`` is ``[1, G, NW, R, c]`` (``NW`` = 2 for SwiGLU; ``R`` = c, or 9 taps for the depthwise conv on
    the ``h x wd`` grid); ``chunk <= 0`` picks the split of N automatically.
    """
    b, g, n_tok, d = q.shape
    nw, r = w.shape[2], w.shape[3]
    cfg, tiles, acc = _setup(q, w, model, chunk)
    s, coef = cfg["S"], scale / n_tok
    part = _empty(b * g, s, nw, r, d, dtype=acc, device=q.device)
    gbuf = _empty(b * g, nw, r, d, dtype=acc, device=q.device)
    wpbuf = _empty(b * g, nw, r, d, dtype=acc, device=q.device)
    nbuf = _empty(b * g, nw, d, dtype=acc, device=q.device)
    out = _empty(b, n_tok, g, d, dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, G, N, c], token-major
    if not _live(q):
        return out, gbuf, wpbuf, nbuf
    grid, sizes = (s, b * g), (g, n_tok, d, cfg["CHUNK"])
    cgrid = (s, b * g, cfg["C"])  # matrix kernels: one program per chunk, (sample, head), column block
    w_strides = (w.stride(1), w.stride(3), w.stride(4), w.stride(2))
    flags = _matrix_flags(model, loss, nw, q.dtype, cfg["BLOCK_C"])
    if model == "dwconv":
        wrap_triton(K.conv_grad_partial_kernel)[grid](
            k, v, part, *sizes, h, wd, *k.stride(), *v.stride(), coef, **tiles
        )
    else:
        wrap_triton(K.grad_partial_kernel)[cgrid](
            k, v, w, part, *sizes, *k.stride(), *v.stride(), *w_strides, coef, **flags, **tiles
        )
    wrap_triton(K.step_kernel)[(b * g, cfg["CS"])](
        w, part, gbuf, wpbuf, nbuf, g, r, d, s, *w_strides, lr,
        NW=nw, GRAD_NORM=grad_norm, BLOCK_R=cfg["BLOCK_R"], BLOCK_C=cfg["BLOCK_CS"], ACC=tiles["ACC"],
    )  # fmt: skip
    if model == "dwconv":
        wrap_triton(K.conv_readout_kernel)[grid](
            q, wpbuf, out, *sizes, h, wd, *q.stride(), *out.stride(), **tiles
        )
    else:
        del flags["MSE"]
        wrap_triton(K.readout_kernel)[cgrid](
            q, wpbuf, out, *sizes, *q.stride(), *out.stride(), **flags, **tiles
        )
    return out, gbuf, wpbuf, nbuf


@_kernel_op("vit3::ttt_fused_bwd")
def _bwd_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor, gbuf: Tensor, wpbuf: Tensor, nbuf: Tensor,
    model: str, loss: str, h: int, wd: int, scale: float, lr: float, grad_norm: bool, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Backward: ``dq``, ``dk``, ``dv`` ``[B, G, N, c]`` and ``dw [1, G, NW, R, c]`` (accumulator dtype)."""
    b, g, n_tok, d = q.shape
    nw, r = w.shape[2], w.shape[3]
    cfg, tiles, acc = _setup(q, w, model, chunk)
    s, coef = cfg["S"], scale / n_tok
    # Slots 0..S-1: per-chunk partials (first of the read-out's dW', then, reused, of kᵀdZ); slot S: dW'.
    part = _empty(b * g, s + 1, nw, r, d, dtype=acc, device=q.device)
    dgbuf = _empty(b * g, nw, r, d, dtype=acc, device=q.device)
    dw = _empty(1, g, nw, r, d, dtype=acc, device=q.device)
    dq, dk, dv = (_empty(b, n_tok, g, d, dtype=t.dtype, device=q.device).transpose(1, 2) for t in (q, k, v))
    if not _live(q):
        return dq, dk, dv, dw
    grid, sizes = (s, b * g), (g, n_tok, d, cfg["CHUNK"])
    w_strides = (w.stride(1), w.stride(3), w.stride(4), w.stride(2))
    io = (*q.stride(), *dout.stride(), *dq.stride())
    flags = _matrix_flags(model, loss, nw, q.dtype, cfg["BLOCK_C"])
    passes = _backward_passes(cfg["C"])
    if model == "dwconv":
        wrap_triton(K.conv_readout_bwd_kernel)[grid](q, dout, wpbuf, dq, part, *sizes, h, wd, *io, **tiles)
    else:
        ro_flags = {key: val for key, val in flags.items() if key != "MSE"}
        for p in passes:
            wrap_triton(K.readout_bwd_kernel)[(s, b * g, cfg["C"] if p["COLS"] else 1)](
                q, dout, wpbuf, dq, part, *sizes, *io, **p, **ro_flags, **tiles
            )
    small = {"BLOCK_R": cfg["BLOCK_R"], "BLOCK_C": cfg["BLOCK_CS"], "ACC": tiles["ACC"]}
    wrap_triton(K.step_bwd_kernel)[(b * g, cfg["CS"])](
        part, gbuf, nbuf, dgbuf, r, d, s, lr, NW=nw, GRAD_NORM=grad_norm, **small
    )
    kv = (*k.stride(), *v.stride(), *dk.stride(), *dv.stride())
    if model == "dwconv":
        wrap_triton(K.conv_grad_bwd_kernel)[grid](
            k, v, dgbuf, dk, dv, part, *sizes, h, wd, *kv, coef, **tiles
        )
    else:
        for p in passes:
            wrap_triton(K.grad_bwd_kernel)[(s, b * g, cfg["C"] if p["COLS"] else 1)](
                k, v, w, dgbuf, dk, dv, part, *sizes, *kv, *w_strides, coef, **p, **flags, **tiles
            )
    wrap_triton(K.wgrad_reduce_kernel)[(g, cfg["CS"])](part, dw, b, g, r, d, s + 1, NW=nw, **small)
    return dq, dk, dv, dw


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, w, *cfg = inputs
    _, gbuf, wpbuf, nbuf = output
    ctx.save_for_backward(q, k, v, w, gbuf, wpbuf, nbuf)
    ctx.cfg = cfg
    ctx.mark_non_differentiable(gbuf, wpbuf, nbuf)


def _backward(ctx: Any, dout: Tensor, *_stats: Tensor) -> tuple:
    q, k, v, w, gbuf, wpbuf, nbuf = ctx.saved_tensors
    dq, dk, dv, dw = _bwd_op(dout, q, k, v, w, gbuf, wpbuf, nbuf, *ctx.cfg)
    return (dq, dk, dv, dw) + (None,) * len(ctx.cfg)


torch.library.register_autograd("vit3::ttt_fused_fwd", _backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------- public op


def _validate(name: str, q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor], loss: str) -> None:
    if name not in FUSED_LOSSES:
        raise ValueError(f"fused_ttt supports the inner models {tuple(FUSED_LOSSES)}, got {name!r}")
    if loss not in FUSED_LOSSES[name]:
        raise ValueError(f"fused_ttt supports the losses {FUSED_LOSSES[name]} for {name!r}, got {loss!r}")
    if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"q, k, v must all be [B, G, N, c], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] < 1:
        raise ValueError("fused_ttt needs at least one token (N >= 1)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in IO_DTYPES:
        raise ValueError(f"q, k, v must share one dtype of {IO_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    names = WEIGHT_NAMES[name]
    if set(params) != set(names):
        raise ValueError(f"inner model {name!r} takes the weights {names}, got {sorted(params)}")
    _, g, _, d = q.shape
    for key in names:
        p = params[key]
        shape = (1, g * d, 3, 3) if name == "dwconv" else (1, g, d, d)
        if tuple(p.shape) != shape:
            raise ValueError(
                f"weight {key!r} must be {list(shape)} (shared initial weights), got {list(p.shape)}"
            )
        if p.device != q.device or not p.is_floating_point():
            raise ValueError(
                f"weight {key!r} must be a floating tensor on {q.device}, got {p.dtype} on {p.device}"
            )


def fused_ttt(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: dict[str, Tensor],
    *,
    grid: tuple[int, int] | None = None,
    scale: float,
    lr: float = 1.0,
    grad_norm: bool = True,
    loss: str = "dot",
    backend: str = "auto",
    chunk: int | None = None,
) -> Tensor:
    """One full-batch inner step of inner model ``name`` on ``(k, v)``, applied to ``q``, fused.

    Equals ``vit3.layers.inner_loop`` (one step, one mini-batch, fixed lr) followed by ``apply_to``.

    Args:
        name: ``"swiglu"``, ``"linear"`` or ``"dwconv"`` (3x3 depthwise conv over the grid).
        q, k, v: ``[B, G, N, c]``, any strides (e.g. views of one qkv projection; read in place), float16,
            bfloat16, float32 or float64; accumulation in float32 (float64 for float64).
        params: initial weights ``{"w1", "w2"}`` (SwiGLU) or ``{"w"}`` (linear), each ``[1, G, c, c]``, or
            ``{"weight": [1, G*c, 3, 3]}`` (depthwise conv, channel ``g*c + i`` = head g, channel i).
        grid: the raster token grid ``(h, w)``, ``h * w == N`` (needed by ``"dwconv"``, else only checked).
        scale: loss scale s (the loss is ``(s / N) Σ_n l_n``).
        lr: inner learning rate.
        grad_norm: the official ``G / (||G||_col + 1)``.
        loss: ``"dot"`` (both models) or ``"mse"`` (linear only).
        backend: ``"triton"``, ``"reference"`` or ``"auto"`` (Triton where it runs and takes the head dim,
            16..128, else the reference).
        chunk: tokens per program (tests force a split of N with it); ``None`` chooses.

    Returns:
        ``[B, G, N, c]`` in q's dtype (token-major memory, so ``transpose(1, 2)`` to ``[B, N, G*c]`` is free).
    """
    _validate(name, q, k, v, params, loss)
    if grid is None and name == "dwconv":
        raise ValueError("the depthwise-conv inner model needs the token grid (h, w)")
    grid = grid or (1, q.shape[2])
    if grid[0] < 1 or grid[1] < 1 or grid[0] * grid[1] != q.shape[2]:
        raise ValueError(f"grid {grid[0]}x{grid[1]} does not fit N={q.shape[2]}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    d = q.shape[-1]
    which = resolve_backend(backend)
    if which == "auto":
        which = "triton" if triton_runs_on(q.device) and head_dim_supported(name, d, q.dtype) else "reference"
    if q.shape[0] * q.shape[1] == 0:  # nothing to launch
        which = "reference"
    if which == "reference":
        if name == "swiglu":
            return swiglu_ttt_ref(
                q, k, v, params["w1"], params["w2"], scale=scale, lr=lr, grad_norm=grad_norm
            )
        if name == "dwconv":
            return dwconv_ttt_ref(q, k, v, params["weight"], grid, scale=scale, lr=lr, grad_norm=grad_norm)
        return linear_ttt_ref(q, k, v, params["w"], scale=scale, lr=lr, grad_norm=grad_norm, loss=loss)
    if not triton_runs_on(q.device):
        raise ValueError(f"the Triton kernel cannot run on {q.device} (CUDA, or CPU with TRITON_INTERPRET=1)")
    if not head_dim_supported(name, d, q.dtype):
        top = max_head_dim(name, q.dtype)
        why = " (wider tiles exceed on-chip shared memory)" if d > top else ""
        raise ValueError(
            f"the Triton kernel for {name!r} with {q.dtype} supports head dims {MIN_HEAD_DIM}..{top}, got {d}{why}"
        )
    acc, _ = _acc_dtype(q.dtype)
    if name == "dwconv":  # [1, G*c, 3, 3] -> [1, G, 1, 9, c]: taps as rows, channels as columns
        w = params["weight"].reshape(1, q.shape[1], d, 9).transpose(-1, -2).unsqueeze(2)
    else:  # [1, G, NW, c, c]
        w = torch.stack([params[key][0] for key in WEIGHT_NAMES[name]], dim=1).unsqueeze(0)
    w = w.to(acc).contiguous()  # tiny copy: the kernels see one fp32 (fp64) weight buffer
    out, _, _, _ = _fwd_op(
        q, k, v, w, name, loss, grid[0], grid[1], float(scale), float(lr), bool(grad_norm), chunk or 0
    )
    return out
