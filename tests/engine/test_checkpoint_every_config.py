"""Every run's checkpoint reloads with weights-only loading: for every config in ``configs/`` that a run can
start from, the checkpoint's model record is plain data; a one-step run of each kind of config (each model
family, task and mixer config: nested ``ttt_cfg`` of the ablation rows and of DiT³) saves a checkpoint that
``eval.py``, a bare ``train.py --resume`` and fine-tuning read back; checkpoints of earlier vit3 versions,
whose records pickled a ``Config``, still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.train import load_script, make_digit_folder, read_ckpt

from vit3.engine import load_config
from vit3.engine.checkpoint import check_plain, make_model_record, save_checkpoint
from vit3.engine.config import CONFIG_DIR, Config
from vit3.errors import CheckpointError
from vit3.models.record import load_checkpoint, model_record, peek_vit3_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

FINETUNE = CONFIG_DIR / "finetune.yaml"
# Every config a run can start from (the budgets are overlays of the ablation runner, not runs).
STARTABLE = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if "budgets" not in p.relative_to(CONFIG_DIR).parts)


def _name(path: Path) -> str:
    return path.relative_to(CONFIG_DIR).with_suffix("").as_posix()


# A model of each family small enough for a one-step run at 32 px (model.kwargs given key by key, so that a
# config's own kwargs, e.g. its ttt_cfg, stay as they are).
SHRINK = {
    "vit3": [
        "model.kwargs.patch_size=8", "model.kwargs.embed_dim=24", "model.kwargs.depth=1",
        "model.kwargs.num_heads=2",
    ],
    "h_vit3": [
        "model.kwargs.dims=[8, 16, 24, 32]", "model.kwargs.depths=[1, 1, 1, 1]",
        "model.kwargs.num_heads=[1, 1, 1, 2]",
    ],
    "dit3": ["model.kwargs.hidden_size=16", "model.kwargs.depth=1", "model.kwargs.num_heads=2"],
}  # fmt: skip


def _family(name: str) -> str:
    return next(f for f in ("h_vit3", "dit3", "vit3") if f in name)


def _shrunk(cfg: Config) -> list[str]:
    """Overrides that make ``cfg``'s model tiny (nothing for the test models, which are tiny already)."""
    name = str(cfg.model.name)
    return [] if name.startswith("test_") else ["model.kwargs.img_size=32", *SHRINK[_family(name)]]


@pytest.mark.parametrize("path", STARTABLE, ids=_name)
def test_every_configs_model_record_is_plain_data(path, tmp_path):
    """What a run of the config would record about its model reads back with weights-only loading (a nested
    ``ttt_cfg``, the ablation rows', used to be pickled as a ``Config``, which that loader refuses)."""
    cfg = load_config(path)
    record = make_model_record(cfg, 10, [f"c{i}" for i in range(10)], [0.5], [0.25])
    check_plain(record)
    save_checkpoint(tmp_path / "c.pt", {"record": record, "config": cfg.to_dict()})
    back = torch.load(tmp_path / "c.pt", weights_only=True)
    assert back["record"] == record and back["record"]["kwargs"] == cfg.model.kwargs.to_dict()


def test_saving_a_config_object_is_refused_naming_where():
    with pytest.raises(
        TypeError, match=r"checkpoint\.record\.kwargs\.ttt_cfg is a vit3\.engine\.config\.Config"
    ):
        check_plain({"record": {"kwargs": {"ttt_cfg": Config({"loss": "mse"})}}})


# ------------------------------------------------------------------------------------- one-step runs
@pytest.fixture(scope="module")
def few_digits(tmp_path_factory):
    """Two digit classes, 4 training images each: one optimizer step per epoch at batch 8."""
    return make_digit_folder(tmp_path_factory.mktemp("few"), digits=(0, 1), n_train=4, n_val=2)


def _one_epoch(path: Path, dataset: str, data: Path, out: Path, *overrides: str) -> list[str]:
    """``train.py`` arguments for one epoch of the config at ``path`` on ``dataset`` at ``data`` into ``out``,
    on the CPU (one thread, no loader workers), then ``overrides``."""
    return [
        "--config", str(path), f"data.dataset={dataset}", f"data.path={data}", f"output={out}", "device=cpu",
        "threads=1", "data.num_workers=0", "train.epochs=1", *overrides,
    ]  # fmt: skip


def _train_one_epoch(path: Path, dataset: str, data: Path, out: Path, *overrides: str) -> dict:
    """Runs ``train.py`` with :func:`_one_epoch`'s arguments; returns the checkpoint it saved,
    ``out/last.pt``, read with weights-only loading (as every vit3 tool reads it)."""
    assert load_script("train").main(_one_epoch(path, dataset, data, out, *overrides)) == 0
    return read_ckpt(out / "last.pt")


def _a_bare_resume_takes_one_more_step(out: Path) -> None:
    """``train.py --resume out/last.pt train.epochs=2`` (no --config: the task's own) runs one more step in
    ``out``."""
    assert load_script("train").main(["--resume", str(out / "last.pt"), "train.epochs=2"]) == 0
    assert read_ckpt(out / "last.pt")["global_step"] == 2


def _classification_args(path: Path, data: Path, out: Path) -> list[str]:
    return [
        *_one_epoch(path, "folder", data, out),
        *("data.batch_size=8", "data.img_size=32", "train.warmup_epochs=0", "train.progress=false"),
        *_shrunk(load_config(path)),
    ]


def _eval_args(ckpt: Path, tmp_path: Path) -> list[str]:
    return ["--checkpoint", str(ckpt), "--json", str(tmp_path / "eval.json"), "eval.flops=false"]


# One config of each kind (the demo's H-ViT³, the plain ViT³, EMA + MESA, the ablation rows' nested ttt_cfg);
# the ablation row that broke (a checkpoint no vit3 tool could read back) runs in the fast selection too.
CLASSIFICATION = [
    pytest.param(name, marks=[] if name == "ablations/ttt_mlp" else pytest.mark.slow, id=name)
    for name in (
        "demo_mnist", "default", "imagenet/h_vit3_small", "ablations/base", "ablations/ttt_linear",
        "ablations/ttt_mlp", "ablations/inner_model/conv",
    )
]  # fmt: skip


@pytest.mark.parametrize("name", CLASSIFICATION)
def test_a_one_step_classification_run_is_read_back(name, few_digits, tmp_path):
    """train.py saves; eval.py evaluates it, a bare --resume continues it, configs/finetune.yaml fine-tunes
    it."""
    train, evaluate = load_script("train"), load_script("eval")
    out = tmp_path / "run"
    assert train.main(_classification_args(CONFIG_DIR / f"{name}.yaml", few_digits, out)) == 0
    record = read_ckpt(out / "last.pt")["record"]  # weights-only loading, as every vit3 tool reads it
    assert record["kwargs"] == load_config(out / "config.yaml").model.kwargs.to_dict()
    assert evaluate.main(_eval_args(out / "best.pt", tmp_path)) == 0
    assert json.loads((tmp_path / "eval.json").read_text())["results"][0]["images"] == 4
    _a_bare_resume_takes_one_more_step(out)
    ft = [
        "--config", str(FINETUNE), f"model.pretrained={out / 'best.pt'}", f"data.path={few_digits}",
        f"output={tmp_path / 'ft'}", "data.batch_size=8", "data.num_workers=0", "train.epochs=1",
        "train.min_steps=0", "train.warmup_epochs=0", "train.progress=false", "aug.mixup=0", "aug.cutmix=0",
    ]  # fmt: skip
    assert train.main(ft) == 0
    assert read_ckpt(tmp_path / "ft" / "last.pt")["record"]["kwargs"] == record["kwargs"]


DENSE = {
    "dense/demo_detection": ("coco_root", "coco"),
    "dense/mask_rcnn_h_vit3_tiny_coco_1x": ("coco_root", "coco"),
    "dense/faster_rcnn_vit3_small_coco_1x": ("coco_root", "coco"),
    "dense/demo_segmentation": ("ade_root", "ade20k"),
    "dense/upernet_h_vit3_tiny_ade20k": ("ade_root", "ade20k"),
    "dense/semantic_fpn_h_vit3_tiny_ade20k": ("ade_root", "ade20k"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DENSE))
def test_a_one_step_dense_run_is_read_back(name, request, tmp_path):
    """A detector's / segmenter's checkpoint (a backbone with the config's kwargs) reads back in eval.py and a
    bare --resume."""
    fixture, dataset = DENSE[name]
    data = request.getfixturevalue(fixture)
    path = CONFIG_DIR / f"{name}.yaml"
    cfg = load_config(path)
    # one step: the 7 annotated training canvases of coco_root (one is empty), the 8 of ade_root
    splits = ["data.train_split=train", "data.val_split=val", "data.batch_size=7"] if dataset == "coco" else [
        "data.train_split=training", "data.val_split=validation", "dense.num_classes=3",
        "dense.class_names=null",
        "dense.scale=[64, 64]", "dense.crop_size=[64, 64]", "dense.head_channels=16", "data.batch_size=8",
        "dense.slide_crop=[64, 64]", "dense.slide_stride=[64, 64]",
    ]  # fmt: skip
    out = tmp_path / "run"
    overrides = [
        "train.log_every=0", "train.amp=none", "dense.iters=0", "dense.eval_interval=0",
        "dense.warmup_iters=1", "dense.min_size=64", "dense.max_size=64", "dense.out_channels=16",
        "dense.box_head_dim=32", "dense.mask_head_dim=16", "dense.anchor_sizes=[8, 16, 32, 64, 128]",
        "model.pretrained=",
        *splits, *[o for o in _shrunk(cfg) if "img_size" not in o],
    ]  # fmt: skip
    ckpt = _train_one_epoch(path, dataset, data, out, *overrides)
    assert (
        ckpt["task"] == cfg.task and ckpt["record"]["kwargs"] == load_config(out / "config.yaml").model.kwargs
    )
    assert (
        load_script("eval").main(["--checkpoint", str(out / "last.pt"), "--json", str(tmp_path / "e.json")])
        == 0
    )
    _a_bare_resume_takes_one_more_step(out)


GENERATION = {
    "generation/demo_mnist": [],
    "generation/default": [],
    "generation/default+ttt_cfg": ["model.kwargs.ttt_cfg={branches: [linear], loss: mse, lr_mode: token}"],
    "generation/imagenet256": ["data.channels=3"],  # a local (tiny) VAE's latents
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[] if n.endswith("ttt_cfg") else pytest.mark.slow, id=n) for n in GENERATION],
)
def test_a_one_step_generation_run_is_read_back(name, few_digits, tmp_path):
    """A DiT³ checkpoint (a custom ttt_cfg too) samples in eval.py, continues in a bare --resume (the task
    taken from the checkpoint) and initialises a new run (model.pretrained)."""
    path = CONFIG_DIR / f"{name.partition('+')[0]}.yaml"
    extra = list(GENERATION[name])
    if "imagenet256" in name:
        from helpers.generation import write_tiny_vae

        extra.append(f"vae.path={write_tiny_vae(tmp_path / 'vae')}")
    else:
        extra.append("vae.path=")
    out = tmp_path / "run"
    overrides = [
        "data.batch_size=8", "data.img_size=16", "train.warmup_epochs=0", "train.progress=false",
        "train.final_eval=false", "model.num_classes=null",
        "model.kwargs.hidden_size=16", "model.kwargs.depth=1", "model.kwargs.num_heads=2",
        "model.name=dit3_s_8",
        *extra,
    ]  # fmt: skip
    ckpt = _train_one_epoch(path, "folder", few_digits, out, *overrides)
    assert ckpt["task"] == "generation" and ckpt["model_kwargs"]["num_classes"] == 2
    sample = [
        "--num-samples",
        "2",
        "--steps",
        "2",
        "sample.batch_size=2",
        "metrics.fid=false",
        "metrics.classifier=",
    ]
    assert (
        load_script("eval").main(
            ["--checkpoint", str(out / "last.pt"), *sample, f"sample.out={tmp_path / 's'}"]
        )
        == 0
    )
    assert json.loads((tmp_path / "s" / "eval.json").read_text())["num_samples"] == 2
    _a_bare_resume_takes_one_more_step(out)
    init = [*overrides, f"model.pretrained={out / 'last.pt'}"]
    _train_one_epoch(path, "folder", few_digits, tmp_path / "init", *init)


# ------------------------------------------------------------------------------- earlier checkpoints
def _as_written_before(ckpt_path: Path, old_path: Path) -> Path:
    """The checkpoint as vit3 wrote it before records held plain data: its model kwargs pickled as a
    Config."""
    ckpt = read_ckpt(ckpt_path)
    for where in (ckpt, ckpt["record"]):
        where["kwargs" if where is ckpt["record"] else "model_kwargs"] = Config(ckpt["record"]["kwargs"])
    torch.save(ckpt, old_path)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(old_path, weights_only=True)
    return old_path


@pytest.fixture(scope="module")
def old_checkpoint(few_digits, tmp_path_factory):
    """An ablation row's checkpoint (nested ttt_cfg) as an earlier vit3 wrote it."""
    root = tmp_path_factory.mktemp("old")
    path = CONFIG_DIR / "ablations" / "ttt_mlp.yaml"
    with torch.random.fork_rng():
        assert load_script("train").main(_classification_args(path, few_digits, root / "run")) == 0
    return _as_written_before(root / "run" / "last.pt", root / "old.pt")


def test_an_earlier_checkpoint_with_a_pickled_config_loads_as_plain_data(old_checkpoint):
    ckpt = load_checkpoint(old_checkpoint)
    assert type(ckpt["record"]["kwargs"]) is dict and type(ckpt["record"]["kwargs"]["ttt_cfg"]) is dict
    assert type(ckpt["model_kwargs"]) is dict
    check_plain(ckpt)  # it re-saves as plain data
    assert peek_vit3_checkpoint(old_checkpoint) is not None and model_record(ckpt)["name"] == "vit3_small"


def test_an_earlier_checkpoint_evaluates_resumes_and_fine_tunes(old_checkpoint, few_digits, tmp_path):
    """The ablation runner's 'evaluate: python eval.py --checkpoint ...' line, a resume and fine-tuning."""
    train = load_script("train")
    assert load_script("eval").main(_eval_args(old_checkpoint, tmp_path)) == 0
    run_dir = tmp_path / "continued"
    assert train.main(["--resume", str(old_checkpoint), f"output={run_dir}", "train.epochs=2"]) == 0
    assert read_ckpt(run_dir / "last.pt")["global_step"] == 2
    ft = [
        "--config", str(FINETUNE), f"model.pretrained={old_checkpoint}", f"data.path={few_digits}",
        f"output={tmp_path / 'ft'}", "data.batch_size=8", "data.num_workers=0", "train.epochs=1",
        "train.progress=false",
    ]  # fmt: skip
    assert train.main(ft) == 0


def test_an_unreadable_pickle_fails_in_one_line(tmp_path, capsys):
    """A file pickling another class than vit3's Config is not read (nothing is imported from it)."""
    torch.save({"format": "vit3-checkpoint", "config": {}, "x": Path("p")}, tmp_path / "odd.pt")
    with pytest.raises(
        CheckpointError, match=r"cannot read checkpoint .*odd\.pt: it pickles pathlib\.PosixPath"
    ):
        load_checkpoint(tmp_path / "odd.pt")
    assert load_script("train").main(["--resume", str(tmp_path / "odd.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read checkpoint") and len(err.strip().splitlines()) == 1, err
