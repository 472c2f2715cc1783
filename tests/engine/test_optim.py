"""vit3.engine.optim: AdamW's parameter groups, the lrs scaled to the total batch, the warmup + cosine
schedule (against its formula, timm's scheduler and whole classification and generation runs: accumulation
across epochs, a resume, the recipe's fitting), optimizer state across regroupings, and the dense recipes'
groups and schedule."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import timm
import torch
from helpers.generation import tiny_gen_cfg
from helpers.train import bare_resume, run_until_crash, tiny_cfg

import vit3.models  # noqa: F401  (registers the models)
from vit3.engine import ConfigError, load_config, optim, run
from vit3.engine.config import CONFIG_DIR, WRITTEN_KEY, Config, config_from_dict
from vit3.engine.config.value_checks import dense_warmup_advice
from vit3.tasks.backbone import block_layer_ids
from vit3.tasks.segmentation import build_segmenter

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ lrs scaled to the batch
@pytest.mark.parametrize(
    ("rule", "total_batch", "factor"),
    [
        pytest.param("linear", 128, 0.25, id="linear-quarter-batch"),
        pytest.param("sqrt", 128, 0.5, id="sqrt-quarter-batch"),
        pytest.param("sqrt", 8, 0.125, id="sqrt-batch-of-8"),
        pytest.param("sqrt", 2048, 2.0, id="sqrt-4x-batch"),
    ],
)
def test_lrs_follow_the_total_batch_by_the_recipes_rule(rule, total_batch, factor):
    cfg = load_config(None, [f"train.lr_batch_rule={rule}", "train.lr_batch=512"])
    lrs = optim.scaled_lrs(cfg.train, total_batch)
    for key in ("base_lr", "warmup_lr", "min_lr"):
        assert lrs[key] == pytest.approx(cfg.train[key] * factor, rel=1e-12), key


def test_an_unknown_lr_rule_is_refused():
    with pytest.raises(ConfigError, match=r"train.lr_batch_rule must be one of linear, sqrt, got 'cubic'"):
        optim.scaled_lrs(load_config(None, ["train.lr_batch_rule=cubic"]).train, 64)


# ------------------------------------------------------------------------------ AdamW's groups
def _groups_by_param(opt):
    return {id(p): g for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("name", ["test_vit3_ttt", "test_h_vit3"])
def test_weight_decay_skips_1d_params_biases_and_no_weight_decay(name):
    model = timm.create_model(name, num_classes=5)
    cfg = load_config()
    opt = optim.build_optimizer(model, cfg.train, 1e-3)
    groups = _groups_by_param(opt)
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    for n, p in model.named_parameters():
        expected = 0.0 if (p.ndim <= 1 or n.endswith(".bias") or n in skip) else 0.05
        assert groups[id(p)]["weight_decay"] == expected, n
    assert len(groups) == sum(1 for _ in model.parameters())  # every parameter optimised once


def test_layer_decay_scales_earlier_blocks_down():
    model = timm.create_model("test_vit3_ttt", num_classes=5)
    cfg = load_config(None, ["train.layer_decay=0.5"])
    opt = optim.build_optimizer(model, cfg.train, 1e-3)
    sched = optim.build_scheduler(opt, cfg.train, {"base_lr": 1e-3, "warmup_lr": 1e-3, "min_lr": 1e-3}, 1)
    sched.step_update(0)
    groups = _groups_by_param(opt)
    lr = {n: groups[id(p)]["lr"] for n, p in model.named_parameters()}
    assert lr["head.weight"] == pytest.approx(1e-3)
    assert lr["blocks.0.attn.qkv.weight"] < lr["blocks.2.attn.qkv.weight"] < lr["head.weight"]
    assert lr["blocks.1.attn.qkv.weight"] == pytest.approx(0.5 * lr["blocks.2.attn.qkv.weight"])


# ------------------------------------------------------------------------------ warmup + cosine
def test_lr_scales_with_total_batch_and_follows_warmup_then_cosine():
    cfg = load_config()
    lrs = optim.scaled_lrs(cfg.train, 1024)  # the official 8 x 128
    assert lrs == pytest.approx({"base_lr": 1e-3, "warmup_lr": 1e-6, "min_lr": 1e-5})
    model = torch.nn.Linear(4, 2)
    opt = optim.build_optimizer(model, cfg.train, lrs["base_lr"])
    updates_per_epoch = 10
    sched = optim.build_scheduler(opt, cfg.train, lrs, updates_per_epoch)
    total, warm = 300 * updates_per_epoch, 20 * updates_per_epoch

    def reference(t):
        if t < warm:
            return lrs["warmup_lr"] + t * (lrs["base_lr"] - lrs["warmup_lr"]) / warm
        return lrs["min_lr"] + 0.5 * (lrs["base_lr"] - lrs["min_lr"]) * (1 + math.cos(math.pi * t / total))

    for t in (0, 1, warm - 1, warm, 1234, total - 1):
        sched.step_update(t)
        assert opt.param_groups[0]["lr"] == pytest.approx(reference(t), rel=1e-9), t


@pytest.mark.parametrize("warmup_epochs", [0, 2, 20], ids=["no-warmup", "warmup", "warmup-past-the-end"])
def test_the_schedule_is_timms_cosine_bit_for_bit(warmup_epochs):
    """``WarmupCosine`` sets every layer-decay group's lr to what timm's ``CosineLRScheduler`` of the same
    settings (one cycle, warmup inside it, per update) sets, exactly: at construction and at every update,
    past the schedule's end too; its state keeps the names earlier checkpoints hold."""
    from timm.scheduler import CosineLRScheduler

    cfg = load_config(
        None, ["train.layer_decay=0.7", "train.epochs=10", f"train.warmup_epochs={warmup_epochs}"]
    )
    lrs = optim.scaled_lrs(cfg.train, 300)
    updates_per_epoch = 7
    ours, theirs = (
        optim.build_optimizer(timm.create_model("test_vit3_ttt", num_classes=3), cfg.train, lrs["base_lr"])
        for _ in range(2)
    )
    sched = optim.build_scheduler(ours, cfg.train, lrs, updates_per_epoch)
    ref = CosineLRScheduler(theirs, t_initial=10 * updates_per_epoch, lr_min=lrs["min_lr"],
                            warmup_lr_init=lrs["warmup_lr"], warmup_t=warmup_epochs * updates_per_epoch,
                            cycle_limit=1, t_in_epochs=False)  # fmt: skip
    assert len({g["lr_scale"] for g in ours.param_groups}) > 2
    for t in [None, *range(0, 10 * updates_per_epoch + 3)]:
        if t is not None:
            sched.step_update(t)
            ref.step_update(t)
        assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in theirs.param_groups], t
    state, timms = sched.state_dict(), ref.state_dict()
    for key in ("t_initial", "warmup_t", "base_values", "lr_min", "warmup_lr_init", "warmup_steps"):
        assert state[key] == timms[key], key


@pytest.mark.parametrize(
    ("loader_batches", "accum", "batches", "updates"),
    [(10, 1, 10, 10), (10, 3, 9, 3), (10, 4, 8, 2), (3, 3, 3, 1)],
)
def test_an_epoch_is_whole_updates_of_accumulated_batches(loader_batches, accum, batches, updates):
    assert optim.epoch_steps(loader_batches, accum) == (batches, updates)


def test_an_epoch_without_one_whole_update_is_refused():
    with pytest.raises(ConfigError, match=r"^train.accum_steps=4 exceeds the 3 batches per epoch$"):
        optim.epoch_steps(3, 4)


# ------------------------------------------------------------------------------ a whole run's lr
# A classification run on 80 images: 20 batches of 4 an epoch, an update every 2 (10 updates an epoch).
_ACCUM_RUN = ("data.batch_size=4", "train.accum_steps=2", "train.warmup_lr=1e-5", "train.min_lr=1e-4")
_UPDATES_PER_EPOCH = 10


def _spy_on_updates(monkeypatch, engine: str = "classification") -> list[tuple[int, list[float]]]:
    """Records, in order, ``(k, every group's lr)`` at each optimizer update of the runs of ``engine`` (a
    module of ``vit3.engine``) this test starts (the step ``loop.optimizer_step`` is given, which it
    counts, and the lrs the update ran at)."""
    module = importlib.import_module(f"vit3.engine.{engine}")
    seen, real = [], module.optimizer_step

    def spy(model, optimizer, scaler, clip, scheduler, progress, *rest):
        step = progress.global_step
        real(model, optimizer, scaler, clip, scheduler, progress, *rest)
        assert progress.global_step == step + 1, "optimizer_step counts its update"
        seen.append((step, [g["lr"] for g in optimizer.param_groups]))

    monkeypatch.setattr(module, "optimizer_step", spy)
    return seen


def _assert_the_formula_at_every_update(
    seen, out, train_cfg, epochs: int, warmup_epochs: float, base_lr: float = 2e-3
) -> None:
    """The updates ``seen`` are exactly 0..T-1 (T = ``epochs`` x 10) and update k runs every group at
    ``build_scheduler``'s formula, written out here (W = ``warmup_epochs`` x 10), on the lrs scaled to the
    total batch of 8 (``base_lr`` at ``lr_batch`` 20: x 8 / 20); ``out/metrics.json`` logs each epoch's
    last update's lr."""
    total, warm = epochs * _UPDATES_PER_EPOCH, int(warmup_epochs * _UPDATES_PER_EPOCH)
    lrs = optim.scaled_lrs(train_cfg, 4 * 2)
    assert lrs["base_lr"] == pytest.approx(base_lr * 8 / 20)

    def formula(k):
        if k < warm:
            return lrs["warmup_lr"] + k * (lrs["base_lr"] - lrs["warmup_lr"]) / warm
        return lrs["min_lr"] + (lrs["base_lr"] - lrs["min_lr"]) * (1 + math.cos(math.pi * k / total)) / 2

    assert [k for k, _ in seen] == list(range(total))
    for k, group_lrs in seen:
        assert group_lrs == pytest.approx([formula(k)] * len(group_lrs), rel=1e-12), (
            f"update {k}: lr {group_lrs[0]:.6g}, the formula's {formula(k):.6g} over T = {total} updates, "
            f"W = {warm} of warmup ({_UPDATES_PER_EPOCH} updates an epoch of 2 micro-batches each)"
        )
    history = json.loads((out / "metrics.json").read_text())
    assert [h["lr"] for h in history] == pytest.approx(
        [formula(_UPDATES_PER_EPOCH * e - 1) for e in range(1, epochs + 1)], rel=1e-6
    )


def test_a_run_applies_the_formulas_lr_at_every_update(four_digits, tmp_path, monkeypatch):
    """A classification run with gradient accumulation: update k (counted per optimizer update, not per
    batch) runs at ``build_scheduler``'s formula on the lrs scaled to the total batch, k passing from one
    epoch into the next; the logged lr is the last update's."""
    seen = _spy_on_updates(monkeypatch)
    cfg = tiny_cfg(four_digits, tmp_path / "run", *_ACCUM_RUN, "train.epochs=3", "train.warmup_epochs=1")
    run(cfg, "train")
    _assert_the_formula_at_every_update(seen, tmp_path / "run", cfg.train, epochs=3, warmup_epochs=1)


def test_a_generation_run_applies_the_formulas_lr_at_every_update(four_digits, tmp_path, monkeypatch):
    """The same schedule through the generation engine (DiT³ on the same digits, batches and accumulation):
    it builds it with ``build_optimization`` and steps it from its own loop."""
    seen = _spy_on_updates(monkeypatch, "generation")
    cfg = tiny_gen_cfg(four_digits, tmp_path / "gen", *_ACCUM_RUN, "train.epochs=3", "train.warmup_epochs=1")
    run(cfg, "train")
    _assert_the_formula_at_every_update(
        seen, tmp_path / "gen", cfg.train, epochs=3, warmup_epochs=1, base_lr=3e-3
    )


@pytest.mark.parametrize("stop", [_UPDATES_PER_EPOCH, _UPDATES_PER_EPOCH + 5], ids=["epoch-end", "mid-epoch"])
def test_a_resumed_run_goes_on_at_the_same_update_and_lr(four_digits, tmp_path, monkeypatch, stop):
    """The same run stopped right after the checkpoint of update ``stop`` (an epoch's end, or inside the
    second epoch: ``train.save_every_steps``), then a bare ``train.py --resume last.pt`` (the schedule
    rebuilt from the checkpoint's config, the step restored): the two processes' updates together are
    exactly 0..29, each at the formula's lr."""
    seen = _spy_on_updates(monkeypatch)
    out = tmp_path / "run"
    every = ("train.save_every_steps=5",)
    cfg = tiny_cfg(four_digits, out, *_ACCUM_RUN, *every, "train.epochs=3", "train.warmup_epochs=1")
    run_until_crash(monkeypatch, cfg, global_step=stop)
    assert [k for k, _ in seen] == list(range(stop))
    bare_resume(out / "last.pt")
    _assert_the_formula_at_every_update(seen, out, cfg.train, epochs=3, warmup_epochs=1)


def test_a_fitted_run_follows_the_fitted_epochs_and_warmup(four_digits, tmp_path, monkeypatch):
    """``train.min_steps=20`` over the recipe's 1 epoch of 10 updates (epochs and warmup not written, so
    ``recipe.fit_epochs`` may fit them): 2 epochs and a warmup of 1, and the schedule is the formula with
    those totals (T = 20, W = 10), not the unfitted ones (T = 10, W = 5)."""
    seen = _spy_on_updates(monkeypatch)
    fit = ("train.epochs=1", "train.warmup_epochs=0.5", "train.min_steps=20")
    data = tiny_cfg(four_digits, tmp_path / "run", *_ACCUM_RUN, *fit).to_dict()
    data[WRITTEN_KEY] = [k for k in data[WRITTEN_KEY] if k not in ("train.epochs", "train.warmup_epochs")]
    cfg = config_from_dict(data)
    run(cfg, "train")
    _assert_the_formula_at_every_update(seen, tmp_path / "run", cfg.train, epochs=2, warmup_epochs=1)


# ------------------------------------------------------------------------------ optimizer state
def test_optimizer_moments_follow_their_parameters_into_other_groups():
    """A resume whose config groups the parameters otherwise (weight decay 0: one group, not decay and
    no-decay) carries each parameter's AdamW moments to its new place; other trained parameters (a freeze)
    are refused naming the settings."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))

    def train_cfg(wd: float):
        return load_config(None, [f"train.weight_decay={wd}"]).train

    saved = optim.build_optimizer(model, train_cfg(0.05), 1e-3)
    model(torch.randn(5, 4)).sum().backward()
    saved.step()
    order = [p for g in saved.param_groups for p in g["params"]]
    fresh = optim.build_optimizer(model, train_cfg(0.0), 1e-3)
    assert len(fresh.param_groups) != len(saved.param_groups)
    optim.load_optimizer_state(fresh, saved.state_dict(), order)
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], saved.state[p]["exp_avg"])
    assert {g["weight_decay"] for g in fresh.param_groups} == {0.0}
    model[0].requires_grad_(False)
    frozen = optim.build_optimizer(model, train_cfg(0.0), 1e-3)
    with pytest.raises(ConfigError, match=r"cannot resume the optimizer of .*train.freeze"):
        optim.load_optimizer_state(frozen, saved.state_dict(), order)


# ------------------------------------------------------------------------------ dense recipes
def test_dense_param_groups_apply_layer_decay_backbone_mult_and_no_decay():
    model = build_segmenter("test_vit3_ttt", num_classes=3, head="semantic_fpn", head_channels=8)
    body = model.backbone.backbone.body
    groups = optim.dense_param_groups(
        model, body, lr=1.0, weight_decay=0.05, backbone_lr_mult=0.5, layer_decay=0.5
    )
    by_param = {id(p): g for g in groups for p in g["params"]}
    assert len(by_param) == sum(1 for p in model.parameters() if p.requires_grad)
    ids, n = block_layer_ids(model.backbone.backbone.body)
    for name, p in model.backbone.backbone.body.named_parameters():
        assert by_param[id(p)]["lr"] == pytest.approx(0.5 * 0.5 ** (n - 1 - ids[name])), name
        assert by_param[id(p)]["weight_decay"] == (0.0 if "norm" in name else 0.05), name
    head_w = model.head.classifier[1].weight
    assert by_param[id(head_w)]["lr"] == 1.0 and by_param[id(head_w)]["weight_decay"] == 0.05


def _sched(**kw) -> Config:
    base = dict(
        lr_schedule="step",
        milestones=[2, 3],
        gamma=0.1,
        poly_power=1.0,
        warmup_iters=4,
        warmup_factor=0.001,
        iters=0,
    )
    return Config({**base, **kw})


def test_lr_schedule_warmup_step_and_poly():
    d = _sched()
    assert optim.dense_lr_factor(0, 100, d, iters_per_epoch=10) == pytest.approx(0.001)
    assert optim.dense_lr_factor(2, 100, d, 10) == pytest.approx(0.001 + 0.999 * 0.5)
    assert [optim.dense_lr_factor(s, 100, d, 10) for s in (4, 19, 20, 29, 30)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01]
    )
    d = _sched(iters=50, milestones=[20])  # milestones count iterations when training by iterations
    assert [optim.dense_lr_factor(s, 50, d, 10) for s in (19, 20)] == pytest.approx([1, 0.1])
    d = _sched(lr_schedule="poly", warmup_iters=0, poly_power=0.9)
    assert [optim.dense_lr_factor(s, 100, d, 10) for s in (0, 50, 100)] == pytest.approx([1, 0.5**0.9, 0])
    with pytest.raises(ValueError, match=r"unknown dense\.lr_schedule"):
        optim.dense_lr_factor(0, 10, _sched(lr_schedule="cosine"), 10)


def test_a_run_all_warmup_is_told_what_its_lr_does():
    """The demo's schedule with ``dense.iters=5``: all warmup, and its milestone (3) counted in iterations
    decays the lr inside the warmup; the warning says both (it said the lr never decays)."""
    cfg = load_config(CONFIG_DIR / "dense" / "demo_detection.yaml", ["dense.iters=5"])
    d = cfg.dense
    factors = [optim.dense_lr_factor(s, 5, d, iters_per_epoch=100) for s in range(5)]
    assert factors[3] < factors[2] and max(factors) < 1
    advice = dense_warmup_advice(d.warmup_iters, cfg)
    assert "never decays" not in advice
    assert f"dense.milestones {list(d.milestones)}, counted in iterations" in advice
