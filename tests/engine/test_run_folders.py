"""No run destroys another run's checkpoints, for every task: a new run refuses a folder that holds another
run's checkpoints (one ``error:`` line naming the folder and the ways on), ``--overwrite`` keeps the old files
aside, and ``--resume`` continues the run its checkpoint belongs to (its config, task and folder) without
overwriting a later checkpoint of that run."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from helpers.dense import det_args, seg_args
from helpers.generation import tiny_gen_args
from helpers.train import DEMO, load_script, one_error_line, short_run, tiny_args

from vit3.engine import load_config
from vit3.engine.checkpoint import config_for_resume, save_checkpoint
from vit3.engine.config import CONFIG_DIR

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {
    "classification": DEMO,
    "detection": CONFIG_DIR / "dense" / "demo_detection.yaml",
    "segmentation": CONFIG_DIR / "dense" / "demo_segmentation.yaml",
    "generation": CONFIG_DIR / "generation" / "demo_mnist.yaml",
    "convert": CONFIG_DIR / "convert" / "demo_mnist.yaml",
}


def _args(task: str, request, out: Path) -> list[str]:
    """``train.py`` arguments of a short run of ``task`` into ``out`` (seconds on a CPU)."""
    if task == "classification":
        return tiny_args(request.getfixturevalue("digits"), out, "train.epochs=1")
    if task == "detection":
        return det_args(request.getfixturevalue("coco_root"), out)
    if task == "segmentation":
        return seg_args(request.getfixturevalue("ade_root"), out)
    if task == "convert":  # refused before the teacher is looked for
        digits = request.getfixturevalue("digits")
        return [*short_run(digits, out, 1e-3), f"convert.teacher={out / 'none.pt'}"]
    return tiny_gen_args(request.getfixturevalue("digits"), out, "train.epochs=1")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _earlier_run(folder: Path, task: str) -> dict[str, str]:
    """A folder as a finished run leaves it (its checkpoints' bytes do not matter to the check)."""
    folder.mkdir(parents=True)
    for name in ("last.pt", "best.pt", "config.yaml", "metrics.json"):
        (folder / name).write_bytes(f"{task} run's {name}".encode())
    return _digests(folder)


@pytest.mark.parametrize("task", list(CONFIGS))
def test_a_new_run_refuses_a_folder_holding_another_runs_checkpoints(task, request, tmp_path, capsys):
    """The demo's finished run in output/demo, and a new run (``python train.py train.epochs=1``) aimed at
    it: refused before anything is written, naming the folder and the two ways on."""
    out = tmp_path / "run"
    before = _earlier_run(out, task)
    code = load_script("train").main(["--config", str(CONFIGS[task]), *_args(task, request, out)])
    assert (code, one_error_line(capsys)) == (
        2,
        f"error: {out} holds the checkpoints of another run (last.pt, best.pt), which this run would "
        f"overwrite: continue that run with --resume {out / 'last.pt'}, or give this one a new folder "
        f"(output=<folder>); --overwrite moves its files into {out / 'replaced-<time>'}/ first",
    )
    assert _digests(out) == before and [p.name for p in out.iterdir() if p.is_dir()] == []


def test_overwrite_keeps_the_earlier_runs_files_aside(digits, tmp_path, capsys):
    out = tmp_path / "run"
    train = load_script("train")
    assert train.main(tiny_args(digits, out, "train.epochs=1")) == 0
    first = _digests(out)
    assert train.main([*tiny_args(digits, out, "train.epochs=1"), "--overwrite"]) == 0
    (aside,) = [p for p in out.iterdir() if p.is_dir()]
    assert re.fullmatch(r"replaced-\d{8}T\d{6}Z", aside.name), aside.name
    assert _digests(aside) == first  # every file of the first run, unchanged
    assert {"last.pt", "best.pt", "config.yaml", "metrics.csv", "curves.png"} <= set(first)
    assert (out / "last.pt").is_file() and (out / "config.yaml").is_file()  # the new run's
    assert (
        "warning: train.overwrite=true: moved the earlier run's best.pt, config.yaml"
        in capsys.readouterr().out
    )
    saved = load_config(out / "config.yaml")
    assert saved.train.overwrite is True  # what this run was told; a resume of it does not inherit it
    assert config_for_resume(out / "last.pt").train.overwrite is False


# ---------------------------------------------------------------------------------------------- resume
def _checkpoint(path: Path, step: int, **config) -> Path:
    """A vit3 checkpoint of a classification run at optimizer step ``step`` (enough for the folder checks,
    which come before the run is built)."""
    cfg = load_config(DEMO, [f"{k}={v}" for k, v in config.items()]).to_dict()
    return save_checkpoint(path, {"config": cfg, "global_step": step, "epoch": 0, "batch_in_epoch": step})


def test_a_resume_from_an_earlier_checkpoint_does_not_overwrite_a_later_one(tmp_path, capsys):
    """best.pt of epoch 5 and last.pt of epoch 6: resuming from best.pt in its folder would replace
    last.pt."""
    out = tmp_path / "run"
    _checkpoint(out / "best.pt", 5, output=out)
    _checkpoint(out / "last.pt", 6, output=out)
    before = _digests(out)
    assert load_script("train").main(["--resume", str(out / "best.pt")]) == 2
    assert one_error_line(capsys) == (
        f"error: {out / 'last.pt'} was written later than {out / 'best.pt'} (step 5), which this run resumes "
        f"from, and would be overwritten: resume from {out / 'last.pt'} instead, or continue in a new folder "
        f"(output=<folder>); --overwrite moves its files into {out / 'replaced-<time>'}/ first"
    )
    assert _digests(out) == before


def test_a_resume_into_another_runs_folder_is_refused(tmp_path, capsys):
    mine, other = tmp_path / "mine", tmp_path / "other"
    _checkpoint(mine / "last.pt", 3, output=mine)
    before = _earlier_run(other, "classification")
    assert load_script("train").main(["--resume", str(mine / "last.pt"), f"output={other}"]) == 2
    assert one_error_line(capsys).startswith(
        f"error: {other} holds the checkpoints of another run (last.pt, best.pt)"
    )
    assert _digests(other) == before


def test_a_bare_resume_takes_the_checkpoints_config_and_folder(tmp_path):
    """Not the default demo config and its output/demo (the checkpoint's own: epochs, output, task)."""
    run2 = tmp_path / "run2"
    _checkpoint(run2 / "last.pt", 3, output=run2, **{"train.epochs": 2, "train.save_every_steps": 20})
    cfg = config_for_resume(run2 / "last.pt", None, ["train.log_every=7"])
    assert (cfg.output, cfg.train.epochs, cfg.train.save_every_steps, cfg.task) == (
        str(run2),
        2,
        20,
        "classification",
    )
    assert cfg.train.log_every == 7 and cfg.train.resume == str(run2 / "last.pt")
    # with a config file named, that file's settings, and still the checkpoint's folder unless output= is
    # given
    cfg = config_for_resume(run2 / "last.pt", DEMO)
    assert (cfg.output, cfg.train.epochs) == (str(run2), 6)
    assert config_for_resume(run2 / "last.pt", DEMO, [f"output={tmp_path / 'fork'}"]).output == str(
        tmp_path / "fork"
    )


def test_a_moved_run_continues_in_the_checkpoints_folder(tmp_path):
    started, moved = tmp_path / "output" / "run", tmp_path / "backup" / "run"
    _checkpoint(moved / "last.pt", 3, output=started)
    with pytest.warns(UserWarning, match=rf"written by a run in {re.escape(str(started))}; it continues in"):
        cfg = config_for_resume(moved / "last.pt")
    assert cfg.output == str(moved)


def test_a_resume_does_not_inherit_what_one_command_asked_for(tmp_path):
    """train.force_resume / train.overwrite of the command that wrote the checkpoint apply to that command."""
    run = tmp_path / "run"
    _checkpoint(run / "last.pt", 3, output=run, **{"train.force_resume": True, "train.overwrite": True})
    cfg = config_for_resume(run / "last.pt")
    assert (cfg.train.force_resume, cfg.train.overwrite) == (False, False)


def test_an_old_checkpoints_config_gets_the_keys_added_since(tmp_path):
    """A checkpoint written before train.overwrite existed: its config is merged over the task's defaults."""
    cfg = load_config(CONFIGS["generation"], [f"output={tmp_path}"]).to_dict()
    del cfg["train"]["overwrite"], cfg["train"]["force_resume"]
    save_checkpoint(tmp_path / "last.pt", {"task": "generation", "config": cfg, "global_step": 1})
    resumed = config_for_resume(tmp_path / "last.pt")
    assert (
        resumed.task == "generation" and resumed.train.overwrite is False and resumed.model.name == "dit3_s_2"
    )
    assert json.loads(json.dumps(resumed.to_dict()))["train"]["final_eval"] is True
