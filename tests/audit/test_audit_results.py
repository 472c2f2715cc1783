"""No result is ever destroyed: what a user does never replaces or truncates a result vit3 made earlier, nor
a file of the user's.

Grouped by what each protects: run folders (a lock held for a run's whole life, a dead run's lock taken
over, results without checkpoints, a user's own config.yaml, every run file written atomically, nothing
written by a refused run, a finished run resumed), reports (``eval.py --json`` never over a run's own files
or a JSON file of the user's, never truncated), exports (ONNX and features: no partial file, no earlier export
replaced or mixed with), tables (the ablation runner's folder lock and ``results.*``) and samples (the photo
folder writer). A full disk is simulated in-process: the files asked for meet ``ENOSPC`` halfway through their
first write.
"""

from __future__ import annotations

import builtins
import csv
import errno
import hashlib
import io
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.dense import det_args, seg_args
from helpers.generation import tiny_gen_args
from helpers.train import TINY_MODEL, load_script, make_digit_folder, one_error_line, short_run
from PIL import Image
from safetensors.torch import load_file

from vit3 import ablate
from vit3.engine.checkpoint import save_checkpoint
from vit3.engine.config import CONFIG_DIR, load_config
from vit3.outputs import LOCK_FILE, hold_folder, lock_holder

pytestmark = pytest.mark.usefixtures("one_thread")

FULL = os.strerror(errno.ENOSPC)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return make_digit_folder(tmp_path_factory.mktemp("digits"), digits=(0, 1), n_train=12, n_val=4)


def _run_args(digits: Path, out: Path, *extra: str) -> list[str]:
    """``train.py`` arguments of a one-epoch run of the tiny classifier (about two CPU seconds)."""
    return [
        "data.dataset=folder", f"data.path={digits}", f"output={out}", "data.batch_size=8",
        "train.epochs=1", "train.warmup_epochs=0", "train.progress=false", *TINY_MODEL, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(digits, tmp_path_factory) -> Path:
    """The folder of a finished one-epoch run (copy it before changing it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with torch.random.fork_rng():
        assert load_script("train").main(_run_args(digits, out)) == 0
    return out


def _digests(folder: Path) -> dict[str, str]:
    """SHA-1 of every file under ``folder``, by relative path."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _refused_leaving_whole(folder: Path, script: str, args: list[str], capsys, last: bool = False) -> str:
    """Runs ``<script>.py args``: it must exit 2 with one error line (``last``: and nothing after it) and
    leave every file under ``folder`` as it was; returns that line."""
    before = _digests(folder)
    assert load_script(script).main(args) == 2
    line = one_error_line(capsys, last=last)
    assert _digests(folder) == before
    return line


def _copy_of(finished_run: Path, tmp_path: Path) -> Path:
    """A copy of the finished run, ``tmp_path/run``, to change or to try to overwrite."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    return run


def _temp_files(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".tmp" in p.name]


class _FillingFile:
    """A file that meets a full disk: half of the first write reaches it, then ``ENOSPC`` (it has no
    ``fileno``, so that writers such as PIL's encoders go through ``write``)."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, FULL)

    def fileno(self):
        raise io.UnsupportedOperation("fileno")

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.fixture
def full_disk(monkeypatch) -> list[str]:
    """The names that meet a full disk (append to it; clear it for space again): every file opened for
    writing whose name holds one (``summary.json`` and its temporary ``.summary.json.tmp<pid>`` alike, through
    ``open`` or ``pathlib``)."""
    real_open, names = builtins.open, []

    def opening(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, str | os.PathLike) and set(mode) & set("wax"):
            if any(n in Path(file).name for n in names):
                return _FillingFile(f)
        return f

    monkeypatch.setattr(builtins, "open", opening)
    monkeypatch.setattr(io, "open", opening)
    return names


# ------------------------------------------------------------------------------------------- run folders
def _task_args(task: str, request, out: Path) -> list[str]:
    """``train.py`` arguments of a short run of ``task`` into ``out``."""
    if task == "classification":
        return _run_args(request.getfixturevalue("digits"), out)
    if task == "detection":
        return ["--config", str(CONFIG_DIR / "dense" / "demo_detection.yaml"),
                *det_args(request.getfixturevalue("coco_root"), out)]  # fmt: skip
    if task == "segmentation":
        return ["--config", str(CONFIG_DIR / "dense" / "demo_segmentation.yaml"),
                *seg_args(request.getfixturevalue("ade_root"), out)]  # fmt: skip
    if task == "generation":
        gen = CONFIG_DIR / "generation" / "demo_mnist.yaml"
        return [
            "--config",
            str(gen),
            *tiny_gen_args(request.getfixturevalue("digits"), out, "train.epochs=1"),
        ]
    digits = request.getfixturevalue("digits")  # convert: a teacher file that is not there, no recipe for one
    return ["--config", str(CONFIG_DIR / "convert" / "demo_mnist.yaml"), *short_run(digits, out, 1e-3),
            f"convert.teacher={out.parent / 'teacher.pt'}", "convert.teacher_config=null"]  # fmt: skip


@pytest.mark.parametrize("task", ["classification", "detection", "segmentation", "generation", "convert"])
def test_a_run_into_a_folder_a_live_run_holds_is_refused(task, request, tmp_path, capsys):
    """Two runs started into one folder at once: the second stops before writing anything, naming the folder
    and the first run's process (here this test's process holds the lock)."""
    out = tmp_path / "run"
    with hold_folder(out):
        code = load_script("train").main(_task_args(task, request, out))
        line = one_error_line(capsys)
        assert os.listdir(out) == [LOCK_FILE] and lock_holder(out)["pid"] == os.getpid()
    assert code == 2
    assert line.startswith(
        f"error: {out} is held by a run that is still going (process {os.getpid()}, since "
    )
    assert line.endswith("wait for it to end, or give this run another folder (output=<folder>)")
    assert not out.exists()  # the lock's own folder goes with it


def test_a_dead_runs_lock_is_taken_over_and_held_for_the_whole_run(digits, tmp_path, monkeypatch):
    """A run killed with kill -9 leaves its lock file; the next run takes it over, holds it from its first
    checkpoint to its summary, and removes it at the end."""
    out = tmp_path / "run"
    child = os.fork()
    if child == 0:  # a run that takes the lock and dies with kill -9
        try:
            with hold_folder(out):
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert lock_holder(out)["pid"] == child  # the lock file the killed run left
    import vit3.engine.resume as resume
    import vit3.outputs as outputs

    holders, write_text = [], outputs.write_text

    def save(path, state, real=resume.save_checkpoint):
        holders.append(lock_holder(out)["pid"])
        return real(path, state)

    def write(path, *args, **kwargs):
        holders.append(lock_holder(out)["pid"])
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(resume, "save_checkpoint", save)
    monkeypatch.setattr("vit3.engine.classification.write_text", write)  # the summary, at the very end
    assert load_script("train").main(_run_args(digits, out)) == 0
    assert holders and set(holders) == {os.getpid()}
    assert LOCK_FILE not in os.listdir(out) and (out / "summary.json").is_file()


def test_a_run_refuses_a_folder_holding_another_runs_results(digits, tmp_path, capsys):
    """Checkpoints deleted to save space, the history kept: a new run there would replace the history."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.json").write_text("[the earlier run's history]")
    (out / "summary.json").write_text("{the earlier run's summary}")
    assert _refused_leaving_whole(out, "train", _run_args(digits, out), capsys) == (
        f"error: {out} holds the results of another run (summary.json, metrics.json), which this run would "
        f"overwrite: give this one a new folder (output=<folder>); --overwrite moves its files into "
        f"{out / 'replaced-<time>'}/ first"
    )


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("config.yaml", "config"),
        ("metrics.csv", "metrics"),
        ("metrics.json", "metrics"),
        ("curves.png", "plot"),
        ("summary.json", "summary"),
    ],
)
def test_a_full_disk_never_truncates_a_run_file(name, what, finished_run, tmp_path, full_disk, capsys):
    """A resumed run meets a full disk while it rewrites one of its files: one line naming the file, the
    earlier file whole, no temporary file left."""
    out = _copy_of(finished_run, tmp_path)
    before = (out / name).read_bytes()
    full_disk.append(name)
    args = ["--resume", str(out / "last.pt"), "--output", str(out), "train.epochs=2"]
    assert load_script("train").main(args) == 2
    assert one_error_line(capsys, last=True) == (
        f"error: cannot write {what} {out / name}: {FULL} (the {what} already there is left as it was)"
    )
    assert (out / name).read_bytes() == before and _temp_files(out) == []


# ---------------------------------------------------------------------------------------------- reports
def _fake_checkpoint(folder: Path, task: str) -> Path:
    """A vit3 checkpoint of a ``task`` run in ``folder`` (what the report checks read: its config)."""
    configs = {
        "classification": CONFIG_DIR / "demo_mnist.yaml",
        "segmentation": CONFIG_DIR / "dense" / "demo_segmentation.yaml",
        "generation": CONFIG_DIR / "generation" / "demo_mnist.yaml",
    }
    data = [f"data.path={folder}"] if task == "segmentation" else []  # an evaluation reads the digits there
    cfg = load_config(configs[task], [f"output={folder}", *data]).to_dict()
    return save_checkpoint(folder / "last.pt", {"task": task, "config": cfg, "global_step": 1})


@pytest.mark.parametrize(
    ("task", "name"),
    [("classification", "metrics.json"), ("segmentation", "metrics.json"), ("generation", "summary.json")],
)
def test_an_eval_report_never_replaces_a_runs_own_files(task, name, tmp_path, capsys):
    """``eval.py --json R/metrics.json`` would replace the run's history without a word: refused first."""
    ckpt = _fake_checkpoint(tmp_path, task)
    (tmp_path / name).write_text("[the run's own record]")
    before = _digests(tmp_path)
    assert load_script("eval").main(["--checkpoint", str(ckpt), "--json", str(tmp_path / name)]) == 2
    line = one_error_line(capsys, last=True)
    assert line.startswith(
        "error: config key eval.json (eval.py --json) must be a .json file this run can write, got "
    )
    assert line.endswith(
        f"{name} is one of a training run's own files, which a report must not replace: give the report "
        "another "
        "name (without --json it goes beside the checkpoint as <name>.eval.json, <name>.<folder>.eval.json "
        "for another data folder)"
    )
    assert _digests(tmp_path) == before


def test_a_full_disk_never_truncates_an_eval_report(finished_run, tmp_path, full_disk, capsys):
    out = _copy_of(finished_run, tmp_path)
    args = ["--checkpoint", str(out / "last.pt"), "eval.throughput_batches=1", "eval.flops=false"]
    assert load_script("eval").main(args) == 0
    report = out / "last.eval.json"
    before = report.read_bytes()
    full_disk.append("last.eval.json")
    assert load_script("eval").main(args) == 2
    assert one_error_line(capsys, last=True) == (
        f"error: cannot write report {report}: {FULL} (the report already there is left as it was)"
    )
    assert report.read_bytes() == before and _temp_files(out) == []


# ---------------------------------------------------------------------------------------------- exports
@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Three small photographs-to-be (noise), ``img0.png`` ... ``img2.png``."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(root / f"img{i}.png")
    return root


def _export_features(images: Path, out: Path, *extra: str) -> list[str]:
    return ["features", "--model", "test_vit3_ttt", "--random-init", "--img-size", "32",
            "--images", str(images), "--out", str(out), *extra]  # fmt: skip


def _fake_onnx_export(model, args, f, **kwargs):
    """torch.onnx.export's writing of the file (a full disk meets it: ``full_disk``), without the export."""
    with open(f, "wb") as file:
        file.write(b"half an ONNX graph")


@pytest.mark.filterwarnings("ignore:--random-init")
def test_an_onnx_export_refuses_an_earlier_file_and_keeps_it_aside(tmp_path, capsys, monkeypatch, full_disk):
    """An earlier .onnx at --out: refused; with --overwrite moved into replaced-<time>/ first, so the export
    meeting a full disk leaves the earlier file whole and no partial one at --out."""
    out = tmp_path / "features.onnx"
    out.write_bytes(b"the earlier export")
    args = ["onnx", "--model", "test_vit3_ttt", "--random-init", "--img-size", "32", "--out", str(out),
            "--exporter", "torchscript", "--static-size", "--no-check"]  # fmt: skip
    assert load_script("export").main(args) == 2
    assert one_error_line(capsys) == (
        f"error: --out {out} exists, and this export would replace it: give another --out, or --overwrite to "
        f"move it into {tmp_path / 'replaced-<time>'}/ first"
    )
    assert out.read_bytes() == b"the earlier export"
    monkeypatch.setattr(torch.onnx, "export", _fake_onnx_export)
    full_disk.append("features.onnx")
    assert load_script("export").main([*args, "--overwrite"]) == 2
    assert one_error_line(capsys) == f"error: cannot write ONNX file {out}: {FULL} (nothing was written)"
    (aside,) = tmp_path.glob("replaced-*/features.onnx")
    assert aside.read_bytes() == b"the earlier export" and not out.exists() and _temp_files(tmp_path) == []


@pytest.mark.filterwarnings("ignore:--random-init")
def test_a_feature_export_never_sits_beside_an_earlier_one(images, tmp_path, capsys):
    """A second export into the folder of a first one: refused; with --overwrite the whole earlier export is
    moved aside, so the new manifest's files are all the folder holds."""
    out = tmp_path / "feats"
    export = load_script("export")
    assert export.main(_export_features(images, out)) == 0
    first = _digests(out)
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    shutil.copy(images / "img2.png", fewer / "other.png")
    assert export.main(_export_features(fewer, out)) == 2
    assert one_error_line(capsys) == (
        f"error: --out {out} holds an earlier feature export (manifest.json), whose files would sit beside "
        "the "
        f"new manifest: give another --out, or --overwrite to move it into {out / 'replaced-<time>'}/ first"
    )
    assert _digests(out) == first
    assert export.main([*_export_features(fewer, out), "--overwrite"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    (aside,) = out.glob("replaced-*")
    assert sorted(p.name for p in out.iterdir() if p != aside) == ["manifest.json", "other.safetensors"]
    assert [f["file"] for f in manifest["files"]] == ["other.safetensors"]
    assert _digests(aside) == first


@pytest.mark.filterwarnings("ignore:--random-init")
def test_a_feature_export_refuses_a_folder_of_other_files(images, tmp_path, capsys):
    """--out naming the image folder itself: the features would mix with the photographs, --overwrite or
    not."""
    folder = tmp_path / "photos"
    shutil.copytree(images, folder)
    before = _digests(folder)
    for extra in ((), ("--overwrite",)):
        assert load_script("export").main(_export_features(folder, folder, *extra)) == 2
        assert one_error_line(capsys) == (
            f"error: --out {folder} holds files that are no feature export (e.g. img0.png), which the export "
            f"would mix with: give an empty or new folder"
        )
    assert _digests(folder) == before


@pytest.mark.filterwarnings("ignore:--random-init")
def test_a_full_disk_mid_export_leaves_no_truncated_feature_file_and_no_manifest(
    images, tmp_path, capsys, full_disk
):
    """The second feature file meets a full disk: the first is whole, no manifest describes a partial export,
    and the next export into the folder is refused until --overwrite moves the partial one aside."""
    out = tmp_path / "feats"
    export = load_script("export")
    full_disk.append("img1.safetensors")
    assert export.main(_export_features(images, out)) == 2
    assert one_error_line(capsys) == (
        f"error: cannot write feature file {out / 'img1.safetensors'}: {FULL} (nothing was written)"
    )
    assert os.listdir(out) == ["img0.safetensors"] and list(load_file(out / "img0.safetensors"))
    full_disk.clear()
    assert export.main(_export_features(images, out)) == 2
    assert one_error_line(capsys).startswith(
        f"error: --out {out} holds an earlier feature export (feature files without a manifest.json)"
    )
    assert export.main([*_export_features(images, out), "--overwrite"]) == 0
    (aside,) = out.glob("replaced-*")
    assert os.listdir(aside) == ["img0.safetensors"] and (out / "manifest.json").is_file()


# ------------------------------------------------------------------------------- more run folders, reports
def test_a_refused_batch_of_one_writes_nothing(digits, tmp_path, capsys):
    """A batch of one image that reaches a BatchNorm layer as one value per channel: refused before the run
    writes anything (its config.yaml was written before the step that met BatchNorm's refusal)."""
    out = tmp_path / "run"
    assert load_script("train").main(_run_args(digits, out, "data.batch_size=1")) == 2
    assert one_error_line(capsys, last=True).startswith(
        "error: data.batch_size=1: a BatchNorm layer of test_h_vit3 gets one value per channel in training "
        "(stages.3.downsample.2.norm: input [1, 64, 1, 1] for one image at data.img_size=32)"
    )
    assert not out.exists()


def test_a_users_own_config_in_the_run_folder_is_never_replaced(digits, tmp_path, capsys):
    """``train.py --config exp/config.yaml output=exp``: the run saved its resolved config over the user's
    hand-written one. Refused; with --overwrite it is moved aside first."""
    out = tmp_path / "exp"
    out.mkdir()
    mine = out / "config.yaml"
    mine.write_text(f"# my experiment\nbase: {CONFIG_DIR / 'demo_mnist.yaml'}\ntrain:\n  epochs: 1\n")
    before = mine.read_bytes()
    args = ["--config", str(mine), *_run_args(digits, out)]
    assert load_script("train").main(args) == 2
    assert one_error_line(capsys, last=True) == (
        f"error: {mine} is a config file that no run saved, which this run would replace with its resolved "
        f"config: keep your config outside the run's folder, or give this run a new folder "
        f"(output=<folder>); --overwrite moves it into {out / 'replaced-<time>'}/ first"
    )
    assert os.listdir(out) == ["config.yaml"] and mine.read_bytes() == before
    assert load_script("train").main([*args, "--overwrite"]) == 0
    (aside,) = out.glob("replaced-*")
    assert (aside / "config.yaml").read_bytes() == before and (out / "last.pt").is_file()


@pytest.mark.filterwarnings("ignore:.*was written by a run in")
def test_resuming_a_finished_run_says_so_and_changes_no_result(finished_run, tmp_path, capsys):
    """``train.py --resume last.pt`` of a run that has done its epochs said "resumed from ...: epoch 2" and
    "done", as if it had trained; now it says there is nothing left to train, and its checkpoints and history
    stay as they were."""
    out = _copy_of(finished_run, tmp_path)
    kept = {
        name: digest for name, digest in _digests(out).items() if name not in ("config.yaml", "summary.json")
    }
    assert load_script("train").main(["--resume", str(out / "last.pt")]) == 0
    log = capsys.readouterr().out
    assert (
        f"note: {out / 'last.pt'} ends a finished run (1 epoch(s) done, train.epochs=1): nothing is left to "
        f"train; raise train.epochs to train on" in log
    )
    assert "resumed from" not in log
    assert {name: _digests(out)[name] for name in kept} == kept


def test_a_resume_into_another_folder_leaves_the_first_untouched(finished_run, tmp_path):
    """``train.py --resume R/last.pt --output NEW``: the run goes on in NEW; R stays as it was."""
    first = _copy_of(finished_run, tmp_path)
    before = _digests(first)
    args = ["--resume", str(first / "last.pt"), "--output", str(tmp_path / "more"), "train.epochs=2"]
    assert load_script("train").main(args) == 0
    assert _digests(first) == before and (tmp_path / "more" / "last.pt").is_file()


def test_a_rerun_into_a_finished_runs_folder_is_refused(finished_run, digits, tmp_path, capsys):
    """The same command again: refused, naming the earlier run's checkpoints and how to continue it."""
    out = _copy_of(finished_run, tmp_path)
    assert _refused_leaving_whole(out, "train", _run_args(digits, out), capsys).startswith(
        f"error: {out} holds the checkpoints of another run (last.pt, best.pt)"
    )


def test_overwrite_moves_the_earlier_run_aside_and_deletes_nothing(finished_run, digits, tmp_path):
    """--overwrite: every file of the earlier run is in replaced-<time>/, byte for byte."""
    out = _copy_of(finished_run, tmp_path)
    before = _digests(out)
    assert load_script("train").main([*_run_args(digits, out), "--overwrite"]) == 0
    (aside,) = out.glob("replaced-*")
    assert _digests(aside) == before


@pytest.mark.parametrize("kind", ["user-json", "coco-annotations"])
def test_an_eval_report_never_replaces_a_json_file_of_the_users(
    kind, finished_run, coco_root, tmp_path, capsys
):
    """``eval.py --json data.json`` (or a COCO annotation file) replaced the user's file without a word: a
    file that is there and no vit3 evaluation report is refused."""
    if kind == "coco-annotations":
        theirs = tmp_path / "instances_val.json"
        shutil.copy(coco_root / "annotations" / "instances_val.json", theirs)
    else:
        theirs = tmp_path / "data.json"
        theirs.write_text('{"the user": "own data"}')
    before = theirs.read_bytes()
    args = ["--checkpoint", str(finished_run / "last.pt"), "--json", str(theirs)]
    assert load_script("eval").main(args) == 2
    assert one_error_line(capsys, last=True).endswith(
        f"{theirs} exists and is no vit3 evaluation report, which this report would replace: give the report "
        "another name (without --json it goes beside the checkpoint as <name>.eval.json, "
        "<name>.<folder>.eval.json for another data folder)"
    )
    assert theirs.read_bytes() == before


def test_an_eval_report_replaces_an_earlier_report(finished_run, tmp_path):
    """A report vit3 wrote is replaced by the next evaluation's (as the default beside the checkpoint is)."""
    report = tmp_path / "r.json"
    args = ["--checkpoint", str(finished_run / "last.pt"), "--json", str(report), "eval.flops=false"]
    assert load_script("eval").main(args) == 0
    report.write_text(report.read_text().replace('"results"', '"earlier results"'))
    assert load_script("eval").main(args) == 0
    assert '"earlier results"' not in report.read_text()


@pytest.mark.parametrize("name", ["best.pt", "notes.txt"])
def test_an_onnx_export_never_replaces_a_file_of_another_kind(name, finished_run, tmp_path, capsys):
    """``export.py onnx --out`` naming the run's checkpoint or a user's file: refused, both left whole."""
    why = "the file name must end in .onnx, so that no other file (a checkpoint, say) is overwritten"
    run = _copy_of(finished_run, tmp_path)
    (run / "notes.txt").write_text("the user's notes")
    args = ["onnx", "--checkpoint", str(run / "best.pt"), "--out", str(run / name), "--no-check"]
    assert _refused_leaving_whole(run, "export", args, capsys) == (
        f"error: --out must be a .onnx file this run can write, got '{run / name}': {why}"
    )


def test_a_feature_export_never_mixes_into_a_run_folder(finished_run, images, tmp_path, capsys):
    """``export.py features --out R`` naming a run's folder: refused, the run left whole."""
    run = _copy_of(finished_run, tmp_path)
    args = ["features", "--checkpoint", str(run / "best.pt"), "--images", str(images), "--out", str(run)]
    assert _refused_leaving_whole(run, "export", args, capsys).startswith(
        f"error: --out {run} holds files that are no feature export (e.g. "
    )


def test_an_eval_report_never_replaces_a_runs_config(finished_run, tmp_path, capsys):
    """``eval.py --json R/config.yaml``: a report is a .json file; the run's config is left whole."""
    run = _copy_of(finished_run, tmp_path)
    args = ["--checkpoint", str(run / "last.pt"), "--json", str(run / "config.yaml")]
    assert "the file name must end in .json, so that no other file (a checkpoint, say) is overwritten" in (
        _refused_leaving_whole(run, "eval", args, capsys, last=True)
    )


# ----------------------------------------------------------------------------------------------- tables
def _fake_rows(monkeypatch) -> None:
    """Replaces the training of a row by writing its checkpoint and history."""

    def fake_train(cfg):
        out = Path(cfg.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "last.pt").write_bytes(b"row " + out.name.encode())
        return {"final": {"val_top1": 50.0, "val_top5": 90.0, "val_loss": 1.0}}

    monkeypatch.setattr(ablate, "_train_row", fake_train)


def _table(name: str, out: Path, *extra: str) -> list[str]:
    return [str(ablate.ABLATIONS_DIR / name), "--quick", "--output", str(out), *extra]


def test_another_table_into_the_same_output_is_refused(monkeypatch, tmp_path, capsys):
    """The loss table, then the batch table into the same --output: its rows' folders differ, its
    results.csv / .md / .png would replace the loss table's."""
    _fake_rows(monkeypatch)
    assert ablate.main(_table("loss", tmp_path)) == 0
    before = _digests(tmp_path)
    capsys.readouterr()
    for extra in ((), ("--resume",)):
        assert ablate.main(_table("batch", tmp_path, *extra)) == 2
        held = "an earlier" if not extra else "another"
        assert capsys.readouterr().err == (
            f"error: {tmp_path} holds the results of {held} table (results.csv, results.md, results.png), "
            "which "
            f"this one would overwrite: give it a new --output; --overwrite moves them into "
            f"{tmp_path}/replaced-<time>/ first\n"
        )
    assert _digests(tmp_path) == before
    assert ablate.main(_table("batch", tmp_path, "--overwrite")) == 0
    (aside,) = tmp_path.glob("replaced-*")
    assert {p.name for p in aside.iterdir()} == {"results.csv", "results.md", "results.png"}
    assert all(_digests(aside)[n] == before[n] for n in ("results.csv", "results.md", "results.png"))


def test_a_second_table_runner_into_a_held_folder_is_refused(monkeypatch, tmp_path, capsys):
    _fake_rows(monkeypatch)
    with hold_folder(tmp_path):
        assert ablate.main(_table("loss", tmp_path)) == 2
        err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path} is held by a run that is still going (process {os.getpid()}, ")
    assert err.endswith("wait for it to end, or give this table another --output\n")
    assert os.listdir(tmp_path) == []


def test_a_full_disk_never_truncates_a_table(monkeypatch, tmp_path, full_disk, capsys):
    """The table continued (--resume) meets a full disk as it rewrites results.csv: the earlier one stays, and
    the runner says so in one line (it raised the error, a traceback under ``python -m vit3.ablate``)."""
    _fake_rows(monkeypatch)
    assert ablate.main(_table("loss", tmp_path)) == 0
    before = (tmp_path / "results.csv").read_bytes()
    full_disk.append("results.csv")
    capsys.readouterr()
    assert ablate.main(_table("loss", tmp_path, "--resume")) == 2
    assert one_error_line(capsys, last=True) == (
        f"error: cannot write table {tmp_path / 'results.csv'}: {FULL} (the table already there is left as "
        f"it was)"
    )
    assert (tmp_path / "results.csv").read_bytes() == before and _temp_files(tmp_path) == []
    with open(tmp_path / "results.csv", newline="", encoding="utf-8") as f:
        assert len(list(csv.DictReader(f))) == 5


# ---------------------------------------------------------------------------------------------- samples
def test_the_sample_writer_refuses_a_folder_holding_files(tmp_path, capsys):
    """``python -m vit3.data.samples photos`` into the user's own photo folder: it would replace their
    train/china/000.jpg and mix its crops into their classes."""
    from vit3.data import samples

    mine = tmp_path / "photos" / "train" / "china" / "000.jpg"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"the user's own photograph")
    assert samples.main([str(tmp_path / "photos"), "--train", "1", "--val", "1"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'photos'} holds other files (e.g. train/china/000.jpg), which the sample photos "
        f"would replace or mix with: give a new or empty folder\n"
    )
    assert (
        mine.read_bytes() == b"the user's own photograph"
        and len(list((tmp_path / "photos").rglob("*.jpg"))) == 1
    )


def test_a_full_disk_never_leaves_a_truncated_sample_photo(tmp_path, capsys, full_disk):
    from vit3.data import samples

    full_disk.append("002.jpg")
    assert samples.main([str(tmp_path / "photos"), "--train", "4", "--val", "1"]) == 2
    assert f"002.jpg: {FULL}" in capsys.readouterr().err
    written = sorted((tmp_path / "photos").rglob("*.jpg"))
    assert [p.name for p in written] == ["000.jpg", "001.jpg"] and _temp_files(tmp_path) == []
    for p in written:
        with Image.open(p) as img:
            img.load()  # whole JPEGs
