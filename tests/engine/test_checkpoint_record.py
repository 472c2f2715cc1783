"""What a vit3 checkpoint carries (the model record) and how fine-tuning, eval.py and resuming use it: the
model is built from the checkpoint, the head is replaced unless kept, labels follow class names, explicit
settings win with a warning, a resume that would change the data stream is refused; atomic, durable writes."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from helpers.train import load_script, make_digit_folder, read_ckpt, tiny_cfg

from vit3.engine import ConfigError, load_config, run
from vit3.engine.checkpoint import CheckpointMismatchError, config_for_checkpoint, save_checkpoint
from vit3.engine.config import CONFIG_DIR
from vit3.errors import DataError
from vit3.models.record import model_record

pytestmark = pytest.mark.usefixtures("one_thread")

FINETUNE = CONFIG_DIR / "finetune.yaml"
# The tiny demo-like run's architecture: what fine-tuning must take from the checkpoint, not from a config.
DEMO_KWARGS = "model.kwargs={img_size: 32, in_chans: 1, dims: [16, 32, 48, 64], depths: [1, 1, 1, 1]}"


@pytest.fixture(scope="module")
def pretrained(digits, tmp_path_factory):
    """A small one-channel H-ViT³ trained on the digit folder (what `python train.py` gives, in miniature)."""
    out = tmp_path_factory.mktemp("pretrained")
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        run(tiny_cfg(digits, out, "train.epochs=3", "data.mean=[0.13]", "data.std=[0.31]"), "train")
    return out / "last.pt"


def _finetune(data, out, pretrained, *extra) -> list[str]:
    """One short epoch (no stretching to the recipe's min_steps) at a tiny lr."""
    return [
        f"data.path={data}", f"model.pretrained={pretrained}", f"output={out}", "data.batch_size=10",
        "train.epochs=1", "train.min_steps=0", "train.warmup_epochs=0", "train.base_lr=1e-5",
        "train.progress=false", "data.num_workers=0",
        "aug.auto_augment=null", "aug.reprob=0", "aug.mixup=0", "aug.cutmix=0", *extra,
    ]  # fmt: skip


def test_the_checkpoint_records_the_model_its_input_and_its_classes(pretrained):
    record = read_ckpt(pretrained)["record"]
    assert record["name"] == "test_h_vit3" and record["kwargs"] == {"img_size": 32, "in_chans": 1}
    assert (record["in_chans"], record["img_size"], record["num_classes"]) == (1, 32, 4)
    assert record["classes"] == ["digit_0", "digit_1", "digit_2", "digit_3"]
    assert record["mean"] == [0.13] and record["std"] == [0.31]
    assert (record["interpolation"], record["crop_pct"]) == ("bicubic", 1.0)


def test_version_1_checkpoints_give_a_record_from_their_fields(pretrained):
    ckpt = read_ckpt(pretrained)
    old = {k: v for k, v in ckpt.items() if k != "record"}
    assert model_record(old) == ckpt["record"]


def test_finetune_config_builds_the_checkpoints_model_and_replaces_the_head(pretrained, tmp_path):
    """configs/finetune.yaml names no model: the checkpoint's (custom kwargs, one channel, 32 px, its
    normalisation) is built, on an RGB folder of other classes, and the head is new even for as many
    classes."""
    data = make_digit_folder(tmp_path / "other", digits=(5, 6, 7, 8), n_train=20, n_val=10)
    cfg = load_config(FINETUNE, _finetune(data, tmp_path / "ft", pretrained))
    run(cfg, "train")
    ckpt = read_ckpt(tmp_path / "ft" / "last.pt")
    rec, source = ckpt["record"], read_ckpt(pretrained)
    assert (rec["name"], rec["kwargs"], rec["img_size"]) == (
        "test_h_vit3",
        {"img_size": 32, "in_chans": 1},
        32,
    )
    assert rec["mean"] == [0.13] and rec["classes"] == ["digit_5", "digit_6", "digit_7", "digit_8"]
    # The head was re-initialised although the class count is the same (4), the rest was loaded: one short
    # epoch at a tiny lr moves the loaded weights by far less than a new head differs from the old one.
    moved = {
        k: float((ckpt["model"][k] - v).abs().max())
        for k, v in source["model"].items()
        if v.is_floating_point() and "running_" not in k  # BatchNorm statistics follow the new data
    }
    assert moved["head.weight"] > 1e-2, "the old head was kept"
    assert max(v for k, v in moved.items() if not k.startswith("head.")) < 1e-3


def test_keep_head_keeps_the_classifier_and_its_class_names(pretrained, digits, tmp_path):
    """model.keep_head: the folder (a subset, other order of names is fine) is labelled by the head's
    classes."""
    subset = make_digit_folder(tmp_path / "subset", digits=(3, 1), n_train=10, n_val=5)
    cfg = load_config(FINETUNE, _finetune(subset, tmp_path / "keep", pretrained, "model.keep_head=true"))
    from vit3.engine.classification import _setup
    from vit3.engine.distributed import distributed

    with distributed("cpu", "auto") as info:
        run_ = _setup(cfg, info)
    assert run_.classes == ["digit_0", "digit_1", "digit_2", "digit_3"] and run_.num_classes == 4
    assert sorted(set(run_.wrapped.dataset.targets)) == [1, 3]
    assert torch.equal(run_.model.head.weight, read_ckpt(pretrained)["model"]["head.weight"])
    unknown = make_digit_folder(tmp_path / "unknown", digits=(9,), n_train=2, n_val=1)
    cfg = load_config(FINETUNE, _finetune(unknown, tmp_path / "keep2", pretrained, "model.keep_head=true"))
    with pytest.raises(DataError, match=r"digit_9"):
        run(cfg, "train")


def test_keep_head_of_an_official_file_labels_the_folders_by_its_synsets(tmp_path):
    """model.keep_head with an official (ImageNet-1k) file: the folders are labelled by the head's synsets,
    as eval.py labels them (they took their sorted order: n15075141 trained as class 2, not 999)."""
    import timm
    from PIL import Image

    from vit3.engine.classification import _setup
    from vit3.engine.distributed import distributed

    synsets = ("n01440764", "n01443537", "n15075141")  # ImageNet classes 0, 1 and 999
    for split in ("train", "val"):
        for name in synsets:
            (tmp_path / "data" / split / name).mkdir(parents=True)
            for i in range(4 if split == "train" else 2):
                Image.new("RGB", (64, 64), (60 * i, 0, 0)).save(tmp_path / "data" / split / name / f"{i}.png")
    official = tmp_path / "official.pth"
    torch.save({"model": timm.create_model("test_h_vit3", num_classes=1000).state_dict()}, official)
    args = _finetune(tmp_path / "data", tmp_path / "out", official, "model.keep_head=true")
    cfg = load_config(FINETUNE, [*args, "model.name=test_h_vit3", "data.img_size=64"])
    with distributed("cpu", "auto") as info:
        run_ = _setup(cfg, info)
    assert run_.num_classes == 1000 and [run_.classes[i] for i in (0, 1, 999)] == list(synsets)
    assert sorted(set(run_.wrapped.dataset.targets)) == [0, 1, 999]


def test_an_explicit_model_name_wins_with_a_warning(pretrained, digits, tmp_path):
    cfg = load_config(FINETUNE, _finetune(digits, tmp_path / "x", pretrained, "model.name=h_vit3_tiny"))
    with pytest.warns(UserWarning, match=r"'h_vit3_tiny' was asked for, but .* holds a 'test_h_vit3'"):
        with pytest.raises(CheckpointMismatchError, match="mismatched keys"):
            run(cfg, "train")
    # a model of another family cannot take the checkpoint's weights or settings at all
    cfg = load_config(FINETUNE, _finetune(digits, tmp_path / "z", pretrained, "model.name=test_vit3_ttt"))
    with pytest.raises(
        ConfigError, match=r"model 'test_vit3_ttt' .* does not fit .*: it holds a 'test_h_vit3'"
    ):
        run(cfg, "train")
    cfg = load_config(FINETUNE, _finetune(digits, tmp_path / "y", pretrained, "model.kwargs.img_size=48"))
    with pytest.warns(UserWarning, match=r"model.kwargs.img_size=48 differs from .*'s 32: using 48"):
        run(cfg, "train")
    assert read_ckpt(tmp_path / "y" / "last.pt")["record"]["kwargs"] == {"img_size": 48, "in_chans": 1}


def test_an_official_file_needs_the_model_name(digits, tmp_path):
    torch.save({"model": {"w": torch.zeros(1)}, "epoch": 299}, tmp_path / "official.pth")
    cfg = load_config(FINETUNE, _finetune(digits, tmp_path / "o", tmp_path / "official.pth"))
    with pytest.raises(
        ConfigError, match=r"model.name is empty and model.pretrained=.*official.pth is no vit3"
    ):
        run(cfg, "train")


# ------------------------------------------------------------------------------------------- eval.py
def _eval(tmp_path, *args) -> dict:
    out = tmp_path / f"eval{len(list(tmp_path.glob('eval*.json')))}.json"
    assert load_script("eval").main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())["results"][0]


def test_eval_maps_class_folders_by_name(pretrained, digits, tmp_path):
    """A folder with a subset of the classes, listed in another order: by position its folders would be
    labelled digit_0 and digit_1 and nearly every answer counted wrong; by name each image keeps its class."""
    full = _eval(tmp_path, "--checkpoint", str(pretrained), "--data", str(digits))
    subset = make_digit_folder(tmp_path / "subset", digits=(3, 2), n_train=1, n_val=25)
    part = _eval(tmp_path, "--checkpoint", str(pretrained), "--data", str(subset))
    assert full["top1"] > 60 and part["images"] == 50 and part["top1"] > 50, (full, part)
    unknown = make_digit_folder(tmp_path / "unknown", digits=(2, 9), n_train=1, n_val=2)
    cfg = config_for_checkpoint(
        pretrained, None, ["data.dataset=folder", f"data.path={unknown}", f"eval.checkpoint={pretrained}"]
    )
    with pytest.raises(DataError, match=r"class folders that the model of .* does not know: digit_9"):
        run(cfg, "eval")


def test_eval_model_flag_takes_effect_with_a_warning(pretrained, tmp_path, capsys):
    with pytest.warns(UserWarning, match=r"model 'h_vit3_tiny' was asked for, .* building 'h_vit3_tiny'"):
        code = load_script("eval").main(["--checkpoint", str(pretrained), "--model", "h_vit3_tiny"])
    err = capsys.readouterr().err
    assert code == 2 and "does not fit the model being built" in err


def test_eval_at_another_size_and_dense_img_size_refused(tmp_path):
    cfg = load_config(
        CONFIG_DIR / "dense" / "demo_detection.yaml",
        ["eval.img_sizes=[64]", "device=cpu", f"data.path={tmp_path}"],
    )
    with pytest.raises(
        ConfigError, match=r"eval.img_sizes=\[64\] sets classification resolutions.*dense.min_size"
    ):
        run(cfg, "eval")


# ------------------------------------------------------------------------------------------- resuming
@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("data.batch_size=10", "data.batch_size: was 20, now 10"),
        ("data.img_size=48", "data.img_size: was 32, now 48"),
        ("seed=1", "seed: was 0, now 1"),
    ],
    ids=["batch-size", "img-size", "seed"],
)
def test_resume_refuses_a_changed_data_stream(pretrained, digits, tmp_path, change, key):
    out = tmp_path / "run"
    out.mkdir()
    (out / "last.pt").write_bytes(pretrained.read_bytes())
    cfg = tiny_cfg(
        digits, out, "train.epochs=4", "train.resume=auto", "data.mean=[0.13]", "data.std=[0.31]", change
    )
    with pytest.raises(ConfigError, match=rf"cannot resume exactly .*{key}.*train.force_resume=true"):
        run(cfg, "train")


def test_resume_refuses_another_world_size_and_force_resume_continues(pretrained, digits, tmp_path, capsys):
    out = tmp_path / "run"
    ckpt = read_ckpt(pretrained)
    ckpt.update(world_size=2, epoch=2, batch_in_epoch=3, history=ckpt["history"][:2])  # inside epoch 3
    save_checkpoint(out / "last.pt", {k: v for k, v in ckpt.items() if k not in ("format", "version")})
    args = ("train.epochs=3", "train.resume=auto", "data.mean=[0.13]", "data.std=[0.31]")
    with pytest.raises(ConfigError, match=r"world size \(processes\): was 2, now 1"):
        run(tiny_cfg(digits, out, *args), "train")
    run(tiny_cfg(digits, out, *args, "train.force_resume=true"), "train")
    text = capsys.readouterr().out
    assert "warning: train.force_resume=true: world size (processes): was 2, now 1" in text
    # 3 batches of 2 x 20 images were done: one process continues after those 120 images, at batch 6 of 12.
    assert "resumed from" in text and "epoch 3, batch 6," in text
    assert [r["epoch"] for r in json.loads((out / "metrics.json").read_text())] == [1, 2, 3]


def test_a_resume_takes_its_configs_optimizer_settings_and_schedule(pretrained, digits, tmp_path, capsys):
    """A forced resume at half the batch runs twice the steps per epoch at half the lr, from the step its
    schedule has after the images already seen, and a new weight decay is the one AdamW uses: the
    checkpoint's optimizer moments come back, not its settings."""
    out = tmp_path / "run"
    ckpt = read_ckpt(pretrained)
    ckpt.update(epoch=2, batch_in_epoch=3, history=ckpt["history"][:2])  # inside epoch 3
    save_checkpoint(out / "last.pt", {k: v for k, v in ckpt.items() if k not in ("format", "version")})
    args = ("train.epochs=3", "train.resume=auto", "data.mean=[0.13]", "data.std=[0.31]")
    changes = ("data.batch_size=10", "train.force_resume=true", "train.weight_decay=0.123")
    run(tiny_cfg(digits, out, *args, *changes), "train")
    assert "note: the lr schedule differs from" in capsys.readouterr().out
    old, new = ckpt["scheduler"], read_ckpt(out / "last.pt")["scheduler"]
    assert new["t_initial"] == 2 * old["t_initial"] and new["warmup_t"] == 2 * old["warmup_t"]
    assert new["base_values"] == pytest.approx([v / 2 for v in old["base_values"]])
    decays = {g["weight_decay"] for g in read_ckpt(out / "last.pt")["optimizer"]["param_groups"]}
    assert decays == {0.0, 0.123} and ckpt["config"]["train"]["weight_decay"] != 0.123
    # the step goes on from where this run's schedule is after the same images: the run ends on its last step
    assert read_ckpt(out / "last.pt")["global_step"] == new["t_initial"]


def test_a_resume_with_no_weight_decay_carries_the_moments_into_one_group(pretrained, digits, tmp_path):
    """``train.weight_decay=0`` on resume: timm builds one parameter group, not the checkpoint's two (decay
    and no-decay); the run resumes (its moments follow their parameters) instead of failing in torch's
    ``load_state_dict``."""
    out = tmp_path / "run"
    ckpt = read_ckpt(pretrained)
    ckpt.update(epoch=2, batch_in_epoch=3, history=ckpt["history"][:2])
    save_checkpoint(out / "last.pt", {k: v for k, v in ckpt.items() if k not in ("format", "version")})
    assert len(ckpt["optimizer"]["param_groups"]) > 1
    args = (
        "train.epochs=3",
        "train.resume=auto",
        "data.mean=[0.13]",
        "data.std=[0.31]",
        "train.weight_decay=0",
    )
    run(tiny_cfg(digits, out, *args), "train")
    groups = read_ckpt(out / "last.pt")["optimizer"]["param_groups"]
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0


def test_a_resume_into_another_folder_names_the_best_checkpoint_that_exists(pretrained, digits, tmp_path):
    """Resumed into another folder, a run that does not beat its checkpoint's best writes no ``best.pt``:
    its summary names the resumed run's, not a file that does not exist (or none where that has none)."""
    source = tmp_path / "source"
    ckpt = read_ckpt(pretrained)
    ckpt.update(best_top1=100.0)  # no epoch can beat it
    save_checkpoint(source / "last.pt", {k: v for k, v in ckpt.items() if k not in ("format", "version")})
    args = ("train.epochs=4", "data.mean=[0.13]", "data.std=[0.31]", f"train.resume={source / 'last.pt'}")
    run(tiny_cfg(digits, tmp_path / "a", *args), "train")
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["best"] is None
    shutil.copy(pretrained.parent / "best.pt", source / "best.pt")
    run(tiny_cfg(digits, tmp_path / "b", *args), "train")
    assert not (tmp_path / "b" / "best.pt").exists()
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["best"] == str(source / "best.pt")


# ----------------------------------------------------------------------------------- checkpoint files
def test_stale_temp_files_are_removed_and_writes_are_fsynced(tmp_path, monkeypatch):
    stale = tmp_path / ".last.pt.tmp999999999"  # left by a killed writer (no such process)
    stale.write_bytes(b"half a checkpoint")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    save_checkpoint(tmp_path / "last.pt", {"model": {}})
    assert not stale.exists() and [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    assert events[:2] == ["fsync", "replace"]  # the data reaches the disk before the rename


def test_ctrl_c_during_a_checkpoint_write_waits_for_the_write(tmp_path, monkeypatch):
    """SIGINT in the middle of ``torch.save``: the checkpoint is written whole, then the interrupt is raised
    (cut short, torch's zip writer finishes its archive into the closed file later and the process aborts)."""
    real = torch.save

    def interrupted(obj, f):
        os.kill(os.getpid(), signal.SIGINT)  # Python runs its handler at the next instruction, here
        real(obj, f)

    monkeypatch.setattr(torch, "save", interrupted)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "last.pt", {"model": {"w": torch.arange(3.0)}})
    assert signal.getsignal(signal.SIGINT) is before
    got = torch.load(tmp_path / "last.pt", weights_only=True)
    torch.testing.assert_close(got["model"]["w"], torch.arange(3.0))
