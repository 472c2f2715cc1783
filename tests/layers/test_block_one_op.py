"""The plain ViT³ block as one C++ op (``vit3_cpu::ttt_block``, ``TTTBlock.one_op``): where it serves it gives
the bits of the block run layer by layer, forward and every gradient, drop path included; it steps aside, and
``explain`` says why, wherever the layers would do more than the op computes."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
from helpers.common import count_calls
from timm.layers import Mlp
from torch import nn

import vit3
from vit3.layers.blocks import TTTBlock
from vit3.layers.ttt import TTTMixer

DIM, GRID = 32, (5, 8)


def _block(drop_path: float = 0.0, mlp_layer: type[nn.Module] | None = None, **cfg) -> TTTBlock:
    torch.manual_seed(4)
    kwargs = {"mlp_layer": mlp_layer} if mlp_layer is not None else {}
    block = TTTBlock(DIM, 4, ttt_cfg=cfg, drop_path=drop_path, **kwargs).double()
    with torch.no_grad():  # non-trivial CPE, norms and inner weights
        for p in (block.cpe.weight, block.cpe.bias, block.norm1.weight, block.norm2.bias):
            p.normal_()
    return block


def _x(requires_grad: bool = False) -> torch.Tensor:
    torch.manual_seed(5)
    return torch.randn(2, *GRID, DIM, dtype=torch.float64, requires_grad=requires_grad)


def _settle(block: TTTBlock, x: torch.Tensor) -> None:
    """The first calls of the mixer's route run layer by layer, guarded (with gradients, up to the backward
    that verifies them); afterwards the call is settled."""
    for _ in range(2):
        out = block(x)
        if out.requires_grad:
            out.sum().backward()


def _run(
    block: TTTBlock, x: torch.Tensor, seed: int = 7
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Output, the gradients of x and every parameter (where gradients flow) and the RNG state after the
    call."""
    torch.manual_seed(seed)
    out = block(x)
    rng = torch.get_rng_state()
    if not torch.is_grad_enabled():
        return out, [], rng
    leaves = [x, *block.parameters()]
    grads = torch.autograd.grad(
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum(), leaves
    )
    return out, list(grads), rng


@pytest.mark.parametrize("settled", [False, True], ids=["first-call", "settled"])
@pytest.mark.parametrize(
    "shape", [(2, GRID[0] * GRID[1], DIM), (2, *GRID, DIM // 2)], ids=["tokens", "other-width"]
)
def test_a_block_names_the_map_it_takes(settled, shape):
    """Tokens ``[B, N, C]`` or a map of another width are refused in one line naming the map a block takes,
    before and after its calls settle on the one op (before: an ``IndexError``, or the C++ CPE's message)."""
    block = _block()
    with torch.no_grad():
        if settled:
            _settle(block, _x())
            assert block.one_op(_x()) is not None
        with pytest.raises(
            ValueError, match=r"^TTTBlock built for C=32 expects a channels-last map \[B, H, W, C\], got \("
        ):
            block(torch.randn(*shape, dtype=torch.float64))


def test_a_traced_block_records_no_check_of_its_map():
    """Under ``torch.jit.trace`` (fvcore's FLOP count, the legacy ONNX export) the map check reads traced
    sizes: it stays out of the trace, which would warn of a tensor turned into a Python bool."""
    block = _block().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.trace(block, (_x(),), check_trace=False)
    assert not [w for w in caught if w.filename.endswith("blocks.py")], [str(w.message) for w in caught]


@pytest.mark.parametrize("recompute", ["always", "never"], ids=["lean", "saving"])
@pytest.mark.parametrize("drop_path", [0.0, 0.3], ids=["no-drop-path", "drop-path"])
@pytest.mark.parametrize("mode", ["train", "eval", "no_grad", "inference_mode"])
def test_the_one_op_block_gives_the_layer_by_layer_bits(monkeypatch, mode, drop_path, recompute):
    """Same output, same gradient of x and of every parameter, same draws of the drop path (the RNG state
    after the call), for the memory-lean block and the saving one; the layer-by-layer call is the same block
    with a (no-op) hook on its mixer."""
    block = _block(drop_path, recompute=recompute).train(mode == "train")
    grad = mode in ("train", "eval")
    x = _x(requires_grad=grad)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with context():
        _settle(block, x)
        assert block.one_op(x) is not None
        calls = count_calls(monkeypatch, torch.ops.vit3_cpu, "ttt_block")
        mixer = count_calls(monkeypatch, TTTMixer, "forward")
        got = _run(block, x)
        assert (calls["n"], mixer["n"]) == (1, 0)
        handle = block.attn.register_forward_hook(lambda *args: None)
        try:
            want = _run(block, x)
        finally:
            handle.remove()
        assert (calls["n"], mixer["n"]) == (1, 1)
    assert torch.equal(got[0], want[0])
    names = ["x", *(name for name, _ in block.named_parameters())]
    for name, g, g_ref in zip(names, got[1], want[1]):
        assert torch.equal(g, g_ref), f"gradient of {name}"
    assert torch.equal(got[2], want[2]), "the drop path's draws"
    if drop_path and mode == "train":  # the drop path did draw: another seed changes the output
        assert not torch.equal(_run(block, x, seed=8)[0], got[0])


def test_a_vit3_model_runs_every_block_as_one_op_with_the_same_logits(monkeypatch):
    """A whole model (``test_vit3_ttt``): every block one op once settled, logits as with hooks on the
    mixers."""
    model = timm.create_model("test_vit3_ttt").eval()
    img = torch.randn(2, 3, 128, 96)  # 48 tokens: the C++ kernel (from 32 per head)
    with torch.no_grad():
        _settle(model, img)
        calls = count_calls(monkeypatch, torch.ops.vit3_cpu, "ttt_block")
        got = model(img)
        assert calls["n"] == len(model.blocks)
        handles = [
            m.register_forward_pre_hook(lambda *args: None)
            for m in model.modules()
            if isinstance(m, TTTMixer)
        ]
        want = model(img)
        for handle in handles:
            handle.remove()
    assert calls["n"] == len(model.blocks)
    assert torch.equal(got, want)


def _hook_on_mixer(block: TTTBlock) -> None:
    block.attn.register_forward_hook(lambda *args: None)


def _global_hook(block: TTTBlock) -> None:
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    block._global_hook_handle = handle


def _compiled_projection(block: TTTBlock) -> None:
    block.attn.proj.compile()  # compiled on its first call, which the test never makes


# name, block kwargs, what is done to the settled block, whether gradients flow, the reason explain gives
# (None: explain leaves hooks and settledness aside: the block would run as one op)
STEPS_ASIDE = [
    pytest.param({}, _hook_on_mixer, False, None, id="hook-on-the-mixer"),
    pytest.param({}, _global_hook, False, None, id="global-module-hook"),
    pytest.param({}, _compiled_projection, False, None, id="compiled-projection"),
    pytest.param(
        {"backend": "eager"}, None, False, "the C++ kernel serves backend auto or cpu", id="backend-eager"
    ),
    pytest.param({"recompute": "qkv"}, None, True, "recomputes qkv", id="training-recompute-qkv"),
    pytest.param({"lr_mode": "token"}, None, False, "token lr gates", id="token-lr-gates"),
    pytest.param({"mlp_layer": Mlp}, None, False, "not the lean MLP", id="timm-mlp"),
]


@pytest.mark.parametrize(("kwargs", "change", "grad", "why"), STEPS_ASIDE)
def test_the_block_runs_layer_by_layer_where_the_op_would_skip_something(kwargs, change, grad, why):
    kwargs = dict(kwargs)
    block = _block(mlp_layer=kwargs.pop("mlp_layer", None), **kwargs).train(grad)
    x = _x(requires_grad=grad)
    with torch.set_grad_enabled(grad):
        _settle(block, x)
        if change is not None:
            change(block)
        try:
            assert block.one_op(x) is None
            explained = block.explain_one_op(x, grad)
        finally:
            handle = block.__dict__.pop("_global_hook_handle", None)
            if handle is not None:
                handle.remove()
    assert (explained == "") if why is None else (why in explained), explained


def test_under_autocast_and_before_the_mixer_settles_the_block_runs_layer_by_layer():
    block = _block().float().eval()
    x = _x().float()
    with torch.no_grad():
        assert block.one_op(x) is None  # the first call: the mixer's route is verified layer by layer
        _settle(block, x)
        assert block.one_op(x) is not None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert block.one_op(x) is None
            assert "autocast: the C++ kernel takes float32 and float64" in block.explain_one_op(x, False)


def test_the_one_op_block_is_once_differentiable():
    """A second backward through the op meets its C++ nodes' once-differentiable error, as the layers'
    does."""
    block = _block()
    x = _x(requires_grad=True)
    _settle(block, x)
    assert block.one_op(x) is not None
    (g,) = torch.autograd.grad(block(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once differentiable"):
        g.sum().backward()


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        pytest.param("test_vit3_ttt", "blocks.0 ... blocks.2 (3 blocks): one C++ op each", id="vit3"),
        pytest.param(
            "test_h_vit3", "layer by layer: the feed-forward is ConvFFN, not the lean MLP", id="h-vit3"
        ),
    ],
)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_explain_says_whether_the_blocks_run_as_one_op(model, expected, grad):
    report = vit3.explain(timm.create_model(model), 128, grad=grad)
    assert expected in str(report), str(report)
    (entry,) = report.blocks_to_dict()
    assert entry["one_op"] == (model == "test_vit3_ttt")


def test_explain_names_the_reason_a_block_is_no_cpp_op():
    """bf16, under autocast or as the model's dtype: the blocks' reason names the dtype rule they meet (it
    cited a function's name)."""
    model = timm.create_model("test_vit3_ttt")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = str(vit3.explain(model, 128))
    for report in (under_autocast, str(vit3.explain(model.to(torch.bfloat16), 128))):
        assert "layer by layer: torch.bfloat16 tensors: the C++ kernel takes float32 and float64" in report
        assert "cpu_block_kernel" not in report


@pytest.mark.parametrize(("recompute", "expected"), [("never", "one C++ op each"), ("qkv", "layer by layer: "
    "training recomputes qkv")])  # fmt: skip
def test_explain_follows_the_recompute_mode_for_training_blocks(monkeypatch, recompute, expected):
    monkeypatch.setenv("VIT3_TTT_RECOMPUTE", recompute)
    model = timm.create_model("test_vit3_ttt")
    assert expected in str(vit3.explain(model, 128, grad=True))
    assert "one C++ op each" in str(vit3.explain(model, 128, grad=False))
