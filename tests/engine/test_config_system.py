"""vit3.engine.config: inheritance, typed overrides, unknown keys, saved metadata; the shipped recipes."""

from __future__ import annotations

import re

import pytest
import yaml

from vit3.engine import TASKS, run
from vit3.engine.config import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    ConfigError,
    check_config,
    config_from_checkpoint,
    load_config,
    parse_override,
    save_config,
    schema,
    written_keys,
)


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_base_inheritance_merges_deeply_and_child_keys_are_valid(tmp_path):
    _write(tmp_path / "parent.yaml", {"train": {"epochs": 3, "base_lr": 0.1}, "output": "p"})
    child = _write(
        tmp_path / "child.yaml",
        {
            "base": "parent.yaml",
            "train": {"base_lr": 0.2},
            "dense": {"min_size": 9},
            "model": {"kwargs": {"z": 1}},
        },
    )
    cfg = load_config(child, ["dense.min_size=5"])  # a key the child introduced is overridable
    assert (
        cfg.train.epochs == 3 and cfg.train.base_lr == 0.2 and cfg.output == "p" and cfg.dense.min_size == 5
    )
    assert cfg.model.kwargs.z == 1 and "base" not in cfg


def test_a_base_is_beside_the_file_else_one_of_vit3s_configs(tmp_path):
    """``base: configs/finetune.yaml`` in a user's own file elsewhere reads vit3's (it was looked for beside
    the file only, and refused as not found); a file beside it of that name comes first."""
    mine = _write(tmp_path / "my.yaml", {"base": "configs/finetune.yaml", "train": {"epochs": 7}})
    cfg = load_config(mine)
    assert cfg.train.epochs == 7 and cfg.train.lr_batch_rule == "sqrt"  # finetune.yaml's
    (tmp_path / "configs").mkdir()
    _write(tmp_path / "configs" / "finetune.yaml", {"train": {"lr_batch_rule": "linear"}})
    assert load_config(mine).train.lr_batch_rule == "linear"
    gone = _write(tmp_path / "gone.yaml", {"base": "configs/nothing.yaml"})
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "configs" / "nothing.yaml"))):
        load_config(gone)


@pytest.mark.parametrize("where", ["child", "parent"])
def test_a_key_no_config_of_vit3_has_is_refused_naming_the_file(tmp_path, where):
    """A file's key that no config of vit3 has (``train.lr`` for ``train.base_lr``) would be kept and never
    read: refused, naming the file that wrote it and the keys it may have meant; the keys under an open
    mapping (``model.kwargs``: the model's arguments) are the user's own."""
    _write(tmp_path / "parent.yaml", {"train": {"epochs": 3} | ({"lr": 0.1} if where == "parent" else {})})
    child = _write(
        tmp_path / "child.yaml", {"base": "parent.yaml", "train": {"lr": 0.1} if where == "child" else {}}
    )
    with pytest.raises(
        ConfigError, match=rf"{where}.yaml: unknown config key 'train.lr'; did you mean .*train.base_lr"
    ):
        load_config(child)


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("train.base_lr=1e-3", "train.base_lr", 1e-3),
        ("train.epochs=7", "train.epochs", 7),
        ("aug.mixup=null", "aug.mixup", None),
        ("aug.scale=[0.5, 1]", "aug.scale", [0.5, 1]),
        ("model.name=vit3_small", "model.name", "vit3_small"),
        ("train.ema=true", "train.ema", True),
        ("output=a=b", "output", "a=b"),
    ],
    ids=["float", "int", "null", "list", "str", "bool", "equals-in-value"],
)
def test_overrides_are_yaml_typed(text, key, value):
    assert parse_override(text) == (key, value)
    assert load_config(None, [text]).get_path(key) == value


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [("train.epoch=3", "train.epochs"), ("trian.epochs=3", "train.epochs"), ("model.nmae=x", "model.name")],
    ids=["leaf-typo", "section-typo", "model-typo"],
)
def test_unknown_key_is_named_with_close_matches(override, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    key = override.split("=")[0]
    assert f"unknown config key '{key}'" in str(err.value) and suggestion in str(err.value)


def test_kwargs_sections_are_free_form():
    cfg = load_config(None, ["model.kwargs.embed_dim=64"])
    assert cfg.model.kwargs == {"embed_dim": 64}


def test_an_override_inside_a_free_form_mapping_makes_the_mappings_on_its_way():
    """``model.kwargs.ttt_cfg.branches=[...]`` where the config has no ``ttt_cfg`` (what docs/layout.md tells
    a new inner model's user to write) makes it, as a config file writing the same key would; a key beside
    it keeps it; outside a free-form mapping, or through a value that is not a mapping, the key is unknown."""
    cfg = load_config(None, ["model.kwargs.ttt_cfg.branches=[dwconv]", "model.kwargs.ttt_cfg.rope=false"])
    assert cfg.model.kwargs == {"ttt_cfg": {"branches": ["dwconv"], "rope": False}}
    assert {"model.kwargs.ttt_cfg.branches", "model.kwargs.ttt_cfg.rope"} <= set(written_keys(cfg))
    for bad in (["train.foo.bar=1"], ["model.kwargz.ttt_cfg.branches=[dwconv]"],
                ["model.kwargs.depth=4", "model.kwargs.depth.x=1"]):  # fmt: skip
        with pytest.raises(ConfigError, match=f"unknown config key '{bad[-1].split('=')[0]}'"):
            load_config(None, bad)


@pytest.mark.parametrize("bad", ["novalue", "=3", "a..b=1"], ids=["no-equals", "no-key", "empty-part"])
def test_malformed_override_is_rejected(bad):
    with pytest.raises(ConfigError, match="bad override"):
        parse_override(bad)


def test_inheritance_cycle_and_missing_file_are_reported(tmp_path):
    _write(tmp_path / "a.yaml", {"base": "b.yaml"})
    _write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_saved_config_round_trips_with_git_metadata(tmp_path):
    cfg = load_config(None, ["train.epochs=3"])
    path = save_config(cfg, tmp_path)
    saved = yaml.safe_load(path.read_text())
    meta = saved.pop("_meta")
    assert set(meta) >= {"git_commit", "command", "time_utc"}
    assert saved["train"]["epochs"] == 3 and saved == cfg.to_dict()


def test_the_keys_the_user_wrote_are_recorded_and_the_shipped_defaults_are_not(tmp_path):
    """Overrides and the keys of the user's own files (through their base: chain) are written; the shipped
    configs' values are defaults, also where they win the merge over a user's base; a checkpoint's config
    keeps what its run's user wrote, and a resume's overrides add to it."""
    finetune = CONFIG_DIR / "finetune.yaml"
    _write(
        tmp_path / "mine.yaml",
        {"base": str(finetune), "train": {"epochs": 10}, "model": {"kwargs": {"a": 1}}},
    )
    _write(tmp_path / "early.yaml", {"data": {"fit_batch": 4}})  # then overridden by a shipped base
    run_file = _write(
        tmp_path / "run.yaml", {"base": ["early.yaml", "mine.yaml"], "data": {"batch_size": 12}}
    )
    assert not written_keys(load_config(finetune))
    # a checkout's copy of the shipped configs beside an installed package's (the same bytes): not written;
    # an edited copy: the user's
    copy = tmp_path / "checkout" / "configs"
    copy.mkdir(parents=True)
    for name in ("finetune.yaml", "default.yaml"):
        (copy / name).write_bytes((CONFIG_DIR / name).read_bytes())
    assert not written_keys(load_config(copy / "finetune.yaml"))
    (copy / "finetune.yaml").write_text((copy / "finetune.yaml").read_text() + "seed: 7\n")
    assert "seed" in written_keys(load_config(copy / "finetune.yaml"))
    cfg = load_config(run_file, ["train.min_steps=5", "aug.scale=[0.5, 1]", "model.kwargs={b: {c: 2}}"])
    # not model.kwargs.a of mine.yaml: the override's mapping replaced it
    assert written_keys(cfg) == {
        "train.epochs",
        "data.batch_size",
        "train.min_steps",
        "aug.scale",
        "model.kwargs.b.c",
    }
    assert cfg.data.fit_batch == 8  # finetune.yaml's, merged over early.yaml: the recipe's, not written
    resumed = config_from_checkpoint(cfg.to_dict(), ["seed=3"])
    assert written_keys(resumed) == written_keys(cfg) | {"seed"}


def test_unknown_task_is_rejected():
    with pytest.raises(ConfigError, match=r"config key task must be one of classification, .*, got 'depth'"):
        load_config(None, ["task=depth"])
    cfg = load_config(None)
    cfg.task = "depth"  # a config changed in code after it was loaded
    with pytest.raises(ConfigError, match="unknown task 'depth'"):
        run(cfg, "train")


# The paper's ImageNet-1K recipe (official vittt/cfgs + config.py + main_ema.py).
PAPER = {
    "vit3_tiny": (0.0, False, 0.0),
    "vit3_small": (0.1, False, 0.0),
    "vit3_base": (0.4, False, 0.0),
    "h_vit3_tiny": (0.2, True, 1.0),
    "h_vit3_small": (0.4, True, 1.5),
    "h_vit3_base": (0.6, True, 2.0),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_imagenet_recipes_follow_the_paper(name):
    cfg = load_config(CONFIG_DIR / "imagenet" / f"{name}.yaml")
    drop_path, ema, mesa = PAPER[name]
    assert cfg.model.name == name and cfg.model.drop_path_rate == drop_path
    assert cfg.train.ema is ema and cfg.train.mesa == mesa
    if mesa:
        assert cfg.train.mesa_start == 0.25 and cfg.train.ema_decay == 0.9996
    t, a, d = cfg.train, cfg.aug, cfg.data
    assert (t.epochs, t.warmup_epochs, t.base_lr, t.lr_batch) == (300, 20, 5e-4, 512)
    assert (t.warmup_lr, t.min_lr, t.weight_decay, t.clip_grad) == (5e-7, 5e-6, 0.05, 5.0)
    assert (a.mixup, a.cutmix, a.mixup_switch_prob, a.label_smoothing) == (0.8, 1.0, 0.5, 0.1)
    assert (a.auto_augment, a.color_jitter, a.reprob) == ("rand-m9-mstd0.5-inc1", 0.4, 0.25)
    assert (d.img_size, d.interpolation, d.crop_pct) == (224, "bicubic", 224 / 256)


def test_every_shipped_config_loads():
    files = sorted(CONFIG_DIR.rglob("*.yaml"))
    assert DEFAULT_CONFIG in files and len(files) >= 9
    for f in files:
        assert load_config(f).task in TASKS, f


def test_cpu_malloc_tuning_is_applied_and_reports_success():
    from vit3.engine.cpu import tune_malloc

    assert tune_malloc() is True  # glibc (Linux CI): every mallopt call accepted


# ---------------------------------------------------------------------- values that would wreck a run
GEN = CONFIG_DIR / "generation" / "default.yaml"
DENSE = CONFIG_DIR / "dense" / "dense_base.yaml"


# config file -> (override, what the one line says after the key)
WRECKING = {
    None: [
        ("train.clip_grad=-1", "must be > 0 (or null: no clipping), got -1"),
        ("train.base_lr=-1e-3", "must be > 0, got -0.001"),
        ("train.min_lr=1e-2", "must be in [0, train.base_lr (0.0005)], got 0.01"),
        ("train.warmup_lr=-1e-6", "must be in [0, train.base_lr (0.0005)], got -1e-06"),
        ("train.weight_decay=-0.05", "must be >= 0, got -0.05"),
        ("train.warmup_epochs=-1", "must be >= 0, got -1"),
        ("train.epochs=0", "must be >= 1, got 0"),
        ("train.accum_steps=0", "must be >= 1, got 0"),
        ("train.layer_decay=1.5", "must be in (0, 1] (or null: off), got 1.5"),
        ("train.ema_decay=1.5", "must be in [0, 1), got 1.5"),
        ("train.mesa=-1.0", "must be >= 0 (or null: off), got -1.0"),
        ("train.betas=[0.9, 1.0]", "must be a list of 2 values in [0, 1), got [0.9, 1.0]"),
        ("aug.label_smoothing=-0.1", "must be in [0, 1), got -0.1"),
        ("aug.mixup=-0.5", "must be >= 0 (or null: off), got -0.5"),
        ("aug.mixup_prob=1.5", "must be in [0, 1], got 1.5"),
        ("aug.reprob=-0.25", "must be in [0, 1], got -0.25"),
        (
            "aug.scale=[1.0, 0.08]",
            "must be a list of 2 values in (0, 1], in increasing order, got [1.0, 0.08]",
        ),
        ("model.drop_path_rate=1.0", "must be in [0, 1), got 1.0"),
        ("seed=-1", "must be >= 0, got -1"),
        ("data.std=[-0.3]", "must be a list of values > 0 (or null: the model's), got [-0.3]"),
    ],
    DENSE: [
        ("dense.gamma=2", "must be in (0, 1], got 2"),
        ("dense.backbone_lr_mult=-1", "must be >= 0, got -1"),
        ("dense.aux_weight=-0.4", "must be >= 0, got -0.4"),
        ("dense.warmup_factor=2", "must be in [0, 1], got 2"),
        ("dense.poly_power=-1", "must be >= 0, got -1"),
        (
            "dense.anchor_sizes=[64, 32, 16]",
            "must be a list of 5 values > 0, in increasing order, got [64, 32, 16]",
        ),
    ],
    GEN: [
        ("model.class_dropout_prob=1.0", "must be in [0, 1), got 1.0"),
        ("sample.cfg_scale=-1", "(eval.py --cfg-scale) must be >= 0, got -1"),
        ("diffusion.beta_end=1e-5", "must be in [diffusion.beta_start (0.0001), 1), got 1e-05"),
    ],
}
WRECKING_ROWS = [(config, override, what) for config, rows in WRECKING.items() for override, what in rows]


@pytest.mark.parametrize(
    ("config", "override", "what"),
    WRECKING_ROWS,
    ids=[override.partition("=")[0] for _, override, _ in WRECKING_ROWS],
)
def test_a_value_that_would_wreck_training_is_refused_with_its_range(config, override, what):
    """Each of these has the right type but inverts the key's meaning (a negative clip_grad flips every
    gradient, a negative lr or weight decay climbs the loss, a layer decay above 1 trains the stem fastest, a
    min_lr above base_lr makes the cosine climb, descending anchors put big boxes on the fine maps, ...) or
    crashes the run inside a library."""
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=f"^config key {re.escape(f'{key} {what}')}$"):
        load_config(config, [override])


def test_every_bad_value_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.clip_grad=-1", "train.weight_decay=-1"])
    assert str(err.value).splitlines() == [
        "bad config values:",
        "  config key train.weight_decay must be >= 0, got -1",
        "  config key train.clip_grad must be > 0 (or null: no clipping), got -1",
    ]


def test_the_cli_refuses_a_negative_clip_grad_in_one_line(capsys):
    from helpers.train import load_script

    assert load_script("train").main(["train.clip_grad=-1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: config key train.clip_grad must be > 0 (or null: no clipping), got -1\n"


@pytest.mark.parametrize("task", ["classification", "detection", "generation"])
def test_the_engines_check_a_config_built_in_code(task, tmp_path):
    """A config changed after loading (the API, the ablation runner) is checked when a run starts."""
    config = {"classification": None, "detection": DENSE, "generation": GEN}[task]
    cfg = load_config(config, [f"output={tmp_path}"])
    cfg.set_path("train.clip_grad", -1.0)
    with pytest.raises(ConfigError, match=r"train.clip_grad must be > 0"):
        run(cfg, "train")
    assert not any(tmp_path.iterdir())  # refused before anything was written


TASK_DEFAULTS = {
    "classification": None,
    "dense": CONFIG_DIR / "dense" / "dense_base.yaml",
    "generation": CONFIG_DIR / "generation" / "default.yaml",
    "convert": CONFIG_DIR / "convert" / "base.yaml",
}
# mappings whose entries are free-form arguments, checked as a whole
WHOLE = ("model.kwargs", "dense.detector_kwargs", "dense.synthetic.splits")


def _keys(section: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in section.items():
        key = prefix + name
        nested = isinstance(value, dict) and value and key not in WHOLE
        keys += _keys(value, key + ".") if nested else [key]
    return keys


@pytest.mark.parametrize("config", TASK_DEFAULTS.values(), ids=TASK_DEFAULTS.keys())
def test_every_key_has_its_check(config):
    """The validation layer covers every option: each key of each task's defaults has its constraints, is
    checked where the model or the data is built, or takes every value of its type."""
    keys = [k for k in _keys(load_config(config).to_dict()) if not k.startswith("_")]
    known = {*schema.CONSTRAINTS, *schema.CHECKED_ON_USE, *schema.FREE}
    assert [k for k in keys if k not in known] == []


def test_two_written_drop_path_rates_that_differ_are_refused():
    """``model.drop_path_rate`` and ``model.kwargs.drop_path_rate`` both written: one error (the kwargs one
    was silently taken); the top-level one alone is used."""
    from vit3.engine.classification_model import build_model

    both = ["model.name=test_vit3_ttt", "model.drop_path_rate=0.3", "model.kwargs.drop_path_rate=0.0"]
    with pytest.raises(
        ConfigError, match=r"model.drop_path_rate=0.3 and model.kwargs.drop_path_rate=0.0 differ"
    ):
        build_model(load_config(None, both), 10, "")
    model, _ = build_model(load_config(None, both[:2]), 10, "")
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.3)


def test_a_null_image_size_is_the_one_the_model_was_built_at():
    """``data.img_size=null`` with ``model.kwargs.img_size``: the data at the model's size (it took the
    variant's default cfg size, 64, while the model was built for 48)."""
    from vit3.engine.classification_model import build_model, resolve_data_cfg

    for kwargs, size in (("model.kwargs={img_size: 48}", 48), ("model.kwargs={}", 64)):
        cfg = load_config(None, ["model.name=test_vit3_ttt", "data.img_size=null", kwargs])
        model, _ = build_model(cfg, 10, "")
        resolve_data_cfg(cfg, model, 3)
        assert cfg.data.img_size == size, kwargs


@pytest.mark.parametrize("demo", ["demo_detection", "demo_segmentation"])
def test_an_evaluation_reads_the_synthetic_digits_and_never_writes_them(tmp_path, demo):
    """A dense demo's training writes its synthetic digits to ``data.path`` on first use; an evaluation
    reads them: a path that is not there is refused by name (it was filled with a new dataset)."""
    missing = tmp_path / "no" / "such"
    cfg = load_config(CONFIG_DIR / "dense" / f"{demo}.yaml", [f"data.path={missing}", f"output={tmp_path}"])
    with pytest.raises(
        ConfigError, match=rf"data\.path .*must be an existing folder.*{re.escape(str(missing))}"
    ):
        check_config(cfg, "eval")
    check_config(cfg, "train")  # the training run writes them there
    assert not missing.exists()
