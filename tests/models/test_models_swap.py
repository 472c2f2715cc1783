"""TTT swapped into timm's own ViT/DeiT and Swin: still timm models, initialised from the attention,
trainable."""

from __future__ import annotations

import copy
import io

import pytest
import timm
import torch
from timm.models.swin_transformer import SwinTransformerBlock

from vit3.layers import TTTConfig, TTTMixer
from vit3.models import swap_attention_for_ttt
from vit3.models.swap import SwinStageTTTBlock, TokenTTT, WindowTTT, copy_attention_weights

VIT_CASES = [
    pytest.param("test_vit", dict(img_size=64), 1, id="vit"),
    pytest.param(
        "deit_tiny_distilled_patch16_224",
        dict(img_size=64, embed_dim=32, depth=2, num_heads=2),
        2,
        id="deit-distilled",
    ),
]
SWIN_KW = dict(img_size=64, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4)


def _swin(**kwargs) -> torch.nn.Module:
    return timm.create_model("swin_tiny_patch4_window7_224", **SWIN_KW, **kwargs)


def _mixers(model: torch.nn.Module) -> list[TTTMixer]:
    return [m for m in model.modules() if isinstance(m, TTTMixer)]


def _train_step_grads(model: torch.nn.Module, x: torch.Tensor) -> None:
    out = model(x)
    out = torch.cat(out) if isinstance(out, tuple) else out
    out.float().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing


@pytest.mark.parametrize(("name", "kwargs", "prefix"), VIT_CASES)
def test_vit_attention_becomes_ttt_initialised_from_its_weights(name, kwargs, prefix):
    model = timm.create_model(name, num_classes=5, **kwargs)
    attn = [
        (b.attn.qkv.weight.clone(), b.attn.qkv.bias.clone(), b.attn.proj.weight.clone()) for b in model.blocks
    ]
    heads = [b.attn.num_heads for b in model.blocks]
    assert swap_attention_for_ttt(model) is model
    assert model.num_prefix_tokens == prefix
    assert all(isinstance(b.attn, TokenTTT) for b in model.blocks)
    for block, h, (qkv_w, qkv_b, proj_w) in zip(model.blocks, heads, attn):
        mixer = block.attn.mixer
        c = mixer.dim
        assert mixer.num_heads == h and mixer.widths[0] == c == model.embed_dim
        assert torch.equal(mixer.qkv.weight[: 3 * c], qkv_w) and torch.equal(mixer.qkv.bias[: 3 * c], qkv_b)
        assert torch.equal(mixer.proj.weight[:, :c], proj_w)
    model.train()
    _train_step_grads(model, torch.randn(2, 3, 64, 64))
    assert model.eval()(torch.randn(1, 3, 64, 64)).shape == (1, 5)


def test_vit_prefix_tokens_get_the_mean_patch_output():
    model = swap_attention_for_ttt(timm.create_model("test_vit", img_size=64)).eval()
    layer = model.blocks[0].attn
    model.patch_embed(torch.randn(1, 3, 64, 64))  # records the 4x4 grid
    x = torch.randn(2, 1 + 16, model.embed_dim)
    y = layer(x)
    patches = layer.mixer(x[:, 1:], grid=(4, 4))
    torch.testing.assert_close(y[:, 1:], patches)
    torch.testing.assert_close(y[:, 0], patches.mean(1))
    with pytest.raises(ValueError, match="attention mask"):
        layer(x, attn_mask=torch.ones(17, 17, dtype=torch.bool))


def test_vit_dynamic_image_size_and_features_only_keep_working():
    model = swap_attention_for_ttt(timm.create_model("test_vit", img_size=64, dynamic_img_size=True)).eval()
    assert model(torch.randn(1, 3, 48, 80)).shape == (1, 1000)
    _, inter = model.forward_intermediates(torch.randn(1, 3, 48, 80), indices=2)
    assert [t.shape[-2:] for t in inter] == [(3, 5), (3, 5)]
    feats = swap_attention_for_ttt(timm.create_model("test_vit", img_size=64, features_only=True)).eval()
    outs = feats(torch.randn(1, 3, 64, 64))
    assert len(outs) == len(feats.feature_info.channels()) and outs[0].shape == (1, 64, 4, 4)
    assert _mixers(feats)


@pytest.mark.parametrize("scope", ["stage", "window"])
def test_swin_attention_becomes_ttt_and_model_still_works(scope):
    model = _swin(num_classes=5)
    n_blocks = sum(1 for m in model.modules() if isinstance(m, SwinTransformerBlock))
    first = model.layers[0].blocks[0].attn
    qkv_w, proj_w = first.qkv.weight.clone(), first.proj.weight.clone()
    swap_attention_for_ttt(model, scope=scope)
    assert len(_mixers(model)) == n_blocks
    wrapper = SwinStageTTTBlock if scope == "stage" else WindowTTT
    assert sum(isinstance(m, wrapper) for m in model.modules()) == n_blocks
    mixer = _mixers(model)[0]
    c = mixer.dim
    assert torch.equal(mixer.qkv.weight[: 3 * c], qkv_w) and torch.equal(mixer.proj.weight[:, :c], proj_w)
    model.train()
    _train_step_grads(model, torch.randn(2, 3, 64, 64))
    feats = swap_attention_for_ttt(_swin(features_only=True), scope=scope).eval()
    outs = feats(torch.randn(1, 3, 64, 64))
    assert [o.shape for o in outs] == [(1, 16, 16, 16), (1, 8, 8, 32)]  # timm Swin features are NHWC


@pytest.mark.parametrize(("scope", "sees_far_token"), [("stage", True), ("window", False)])
def test_swin_scope_decides_what_a_token_sees(scope, sees_far_token):
    """Stage scope mixes over the whole map; window scope only inside the (unshifted) 4x4 window."""
    model = swap_attention_for_ttt(_swin(), scope=scope).eval()
    block = model.layers[0].blocks[0]  # first block: no shift
    x = torch.randn(1, 16, 16, 16)
    far = x.clone()
    far[0, 12, 12] = 5 * torch.randn(
        16
    )  # a token in another window (not a constant shift: LayerNorm removes those)
    with torch.no_grad():
        changed = not torch.allclose(block(x)[0, 0, 0], block(far)[0, 0, 0])
    assert changed == sees_far_token


def test_swapped_vit_can_be_fine_tuned():
    torch.manual_seed(0)
    model = swap_attention_for_ttt(
        timm.create_model("test_vit", img_size=32, patch_size=8, depth=2, num_classes=3)
    ).train()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_ttt_cfg_reaches_every_mixer():
    model = swap_attention_for_ttt(
        timm.create_model("test_vit", img_size=64), ttt_cfg=dict(rope=True, qkv_bias=False)
    )
    assert all(m.cfg.rope and m.qkv.bias is None for m in _mixers(model))
    cfg = TTTConfig(branches=("linear",))
    model = swap_attention_for_ttt(_swin(), ttt_cfg=cfg, init_from_attention=False)
    assert all(m.branch_specs == [("linear", m.num_heads)] for m in _mixers(model))


def test_gradient_checkpointing_recomputes_each_mixer_on_its_own_grid():
    """Two forwards on transposed grids (the same token count) before one backward: with gradient
    checkpointing the gradients are the plain model's (timm's block checkpoint recomputed every mixer on the
    last forward's grid: wrong gradients); copies and pickles keep their own switch."""
    torch.manual_seed(0)
    kw = dict(img_size=32, patch_size=8, depth=2, num_classes=3, dynamic_img_size=True)
    model = timm.create_model("ttt_swap", base="vit_tiny_patch16_224", **kw)
    wide, tall = torch.randn(2, 3, 32, 64), torch.randn(2, 3, 64, 32)

    def grads(checkpointing: bool) -> torch.Tensor:
        m = copy.deepcopy(model)
        m.set_grad_checkpointing(checkpointing)
        ((m(wide) ** 2).sum() + (m(tall) ** 2).sum()).backward()
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    torch.testing.assert_close(grads(True), grads(False), rtol=0, atol=0)
    on = copy.deepcopy(model)
    on.set_grad_checkpointing(True)
    assert not any(m.checkpoint for m in model.modules() if isinstance(m, TokenTTT))
    buffer = io.BytesIO()
    torch.save(on, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.set_grad_checkpointing(False)
    assert all(m.checkpoint for m in on.modules() if isinstance(m, TokenTTT))


def test_copy_refuses_other_shapes_and_swap_refuses_other_models():
    mixer = TTTMixer(32, 2)
    with pytest.raises(ValueError, match=r"cannot start the TTT mixer \(width 32.*init_from_attention=False"):
        copy_attention_weights(mixer, torch.nn.Linear(16, 48), torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="no timm ViT Attention or Swin"):
        swap_attention_for_ttt(timm.create_model("test_vit3_ttt"))
    # a Swin whose heads are narrower than its width over its heads: its attention fits no mixer branch
    narrow = _swin(head_dim=8)
    with pytest.raises(ValueError, match=r"no branch has its \d+ channels"):
        swap_attention_for_ttt(narrow)
    assert _mixers(swap_attention_for_ttt(narrow, init_from_attention=False))
    with pytest.raises(ValueError, match=r"drops patch tokens in training \(patch_drop_rate\)"):
        swap_attention_for_ttt(timm.create_model("test_vit", img_size=64, patch_drop_rate=0.25))
    with pytest.raises(ValueError, match="scope"):
        swap_attention_for_ttt(_swin(), scope="global")


def test_ttt_swap_is_the_swapped_model_by_name(tmp_path):
    """``timm.create_model("ttt_swap", base=...)``: what a converted checkpoint's record rebuilds."""
    base = timm.create_model("test_vit", img_size=64, num_classes=3)
    weights = tmp_path / "vit.pth"
    torch.save(base.state_dict(), weights)
    model = timm.create_model(
        "ttt_swap", base="test_vit", img_size=64, num_classes=3, ttt={"loss": "mse"}, pretrained=True,
        pretrained_cfg_overlay={"file": str(weights), "num_classes": 3},
    )  # fmt: skip
    assert isinstance(model, type(base)) and all(isinstance(b.attn, TokenTTT) for b in model.blocks)
    assert all(m.cfg.loss == "mse" for m in _mixers(model))
    mixer, attn = model.blocks[0].attn.mixer, base.blocks[0].attn  # pretrained: initialised from the file
    assert torch.equal(mixer.qkv.weight[: 3 * mixer.dim], attn.qkv.weight)
    assert torch.equal(model.head.weight, base.head.weight)
    swin = timm.create_model("ttt_swap", base="swin_tiny_patch4_window7_224", scope="window", **SWIN_KW)
    assert sum(isinstance(m, WindowTTT) for m in swin.modules()) == 4
    with pytest.raises(ValueError, match="base='' must name a timm ViT/DeiT or Swin model"):
        timm.create_model("ttt_swap", base="")
