"""What a run writes as it goes: progress as a bar on a terminal, whole log lines anywhere else (a log file
keeps no carriage returns), nothing where progress is off; the bars an error leaves open are ended. The
run's first line says when ``model.kwargs`` changed the model it names."""

from __future__ import annotations

import io
import re
import sys

import pytest
from helpers.dense import det_args
from helpers.generation import tiny_gen_cfg
from helpers.train import Terminal, tiny_cfg
from tqdm import tqdm

from vit3.engine import bars, load_config, run
from vit3.engine.bars import LogLines, close_bars, progress_bar, progress_iter
from vit3.engine.config import CONFIG_DIR
from vit3.engine.dense import train as train_dense

pytestmark = pytest.mark.usefixtures("one_thread")

DET = CONFIG_DIR / "dense" / "demo_detection.yaml"
TIMES = r"\[\d\d:\d\d<\d\d:\d\d\]"


def test_a_bar_off_a_terminal_writes_a_whole_line_each_time_its_figures_are_set(monkeypatch):
    """Each line: the steps done, the time since the bar began and the time left at its rate so far (a
    resumed epoch's bar counts from where it began), then the figures."""
    clock = iter([100.0, 110.0, 112.0])  # made, then read at each line
    monkeypatch.setattr(bars.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = progress_bar(62, "epoch 1/6", True, initial=2, file=out)
    assert isinstance(bar, LogLines)
    bar.update(3)
    assert out.getvalue() == ""  # a step alone writes nothing
    bar.set_postfix(loss="2.3106", lr="7.39e-05")
    bar.set_description("n4 epoch 2/6")
    bar.update()
    bar.set_postfix(loss="2.2938")
    bar.close()
    assert out.getvalue().splitlines() == [
        "epoch 1/6 5/62 [00:10<03:10] loss 2.3106 lr 7.39e-05",  # 3 steps in 10 s, 57 left
        "n4 epoch 2/6 6/62 [00:12<02:48] loss 2.2938",  # 4 in 12 s, 56 left
    ]


def test_a_bar_on_a_terminal_draws_and_close_bars_ends_it():
    """``close_bars``: what the scripts call on an error or Ctrl-C before their one ``error:`` line."""
    out = Terminal()
    bar = progress_bar(10, "epoch 1/2", True, file=out)
    assert isinstance(bar, tqdm)
    bar.update(3)
    bar.set_postfix(loss="1.0")
    assert "\r" in out.getvalue() and "3/10" in out.getvalue()
    close_bars()
    assert bar.disable and out.getvalue().endswith("\r")  # closed, its line cleared
    drawn = out.getvalue()
    close_bars()  # a closed bar is ended once
    assert out.getvalue() == drawn


@pytest.mark.parametrize("out", [io.StringIO(), Terminal()], ids=["log", "terminal"])
def test_a_disabled_bar_writes_nothing(out):
    bar = progress_bar(10, "epoch 1/2", False, file=out)
    bar.update(3)
    bar.set_postfix(loss="1.0")
    bar.close()
    assert out.getvalue() == ""


@pytest.mark.parametrize("stdout", [io.StringIO(), Terminal()], ids=["log", "terminal"])
def test_progress_over_items_draws_on_a_terminal_and_logs_each_tenth_elsewhere(stdout, monkeypatch):
    monkeypatch.setattr(sys, "stdout", stdout)
    assert list(progress_iter(range(0, 9, 3), "sampling", False)) == [0, 3, 6]
    assert stdout.getvalue() == ""  # off: nothing anywhere
    seen = []
    for item in progress_iter(range(25), "sampling", True):
        seen.append((item, stdout.getvalue().count("\n")))
    assert [item for item, _ in seen] == list(range(25))
    if stdout.isatty():
        assert "sampling" in stdout.getvalue() and "\r" in stdout.getvalue()
        return
    lines = stdout.getvalue().splitlines()
    done = [int(re.fullmatch(rf"sampling (\d+)/25 {TIMES}", line)[1]) for line in lines]
    assert done == [3, 6, 9, 12, 15, 18, 21, 24, 25]  # a tenth of 25 is 3 (rounded up), then the last
    assert [count for _, count in seen[:4]] == [0, 0, 0, 1]  # a line once an item is done, not before


def _log_lines(out: str, steps: int, desc: str = "epoch 1/1") -> list[tuple[int, int]]:
    """The (step, total) of every progress line ``desc``, of ``steps`` steps, in a run's stdout, which holds
    no carriage return."""
    assert "\r" not in out
    found = [(int(m[1]), int(m[2])) for m in re.finditer(rf"{desc} (\d+)/(\d+) {TIMES} loss \d", out)]
    assert found and all(total == steps for _, total in found), out
    return found


SHOWN = ("train.epochs=1", "train.progress=true")


def test_a_classification_run_logged_to_a_file_writes_a_line_every_log_every_batches(
    four_digits, tmp_path, capsys
):
    run(tiny_cfg(four_digits, tmp_path / "out", *SHOWN, "train.log_every=2"), "train")
    out = capsys.readouterr().out
    assert out.startswith("model test_h_vit3 + model.kwargs: ")
    assert _log_lines(out, 4) == [(2, 4), (4, 4)]  # 80 images, batches of 20


def test_a_classification_run_logs_no_figures_with_log_every_0_and_one_count_with_progress_run(
    four_digits, tmp_path, capsys
):
    run(tiny_cfg(four_digits, tmp_path / "quiet", *SHOWN, "train.log_every=0"), "train")
    out = capsys.readouterr().out
    assert "\r" not in out and "done in" in out and not re.search(TIMES, out), out  # the run, no figures
    whole = ("train.epochs=2", "train.progress=run", "train.log_every=2")
    run(tiny_cfg(four_digits, tmp_path / "whole", *whole), "train")
    out = capsys.readouterr().out
    found = re.finditer(rf"whole (epoch ./2) (\d+)/(\d+) {TIMES} loss", out)
    lines = [(m[1], int(m[2]), int(m[3])) for m in found]
    assert lines == [("epoch 1/2", 2, 8), ("epoch 1/2", 4, 8), ("epoch 2/2", 6, 8), ("epoch 2/2", 8, 8)], out


@pytest.mark.parametrize("shown", [True, False], ids=["progress", "no-progress"])
def test_a_generation_run_logged_to_a_file_writes_a_line_every_log_every_updates(
    shown, four_digits, tmp_path, capsys
):
    """With its final evaluation: sampling's lines too (8 samples in batches of 4), and neither where
    ``train.progress=false``."""
    overrides = ("train.epochs=1", f"train.progress={str(shown).lower()}", "train.log_every=1")
    run(tiny_gen_cfg(four_digits, tmp_path / "gen", *overrides, "train.final_eval=true"), "train")
    out = capsys.readouterr().out
    assert "model dit3_s_4 (ttt) + model.kwargs: " in out
    sampled = [int(m[1]) for m in re.finditer(rf"^sampling (\d)/2 {TIMES}$", out, re.MULTILINE)]
    if not shown:
        assert "\r" not in out and not re.search(TIMES, out) and "done in" in out, out
        return
    assert _log_lines(out, 4) == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert sampled == [1, 2], out


def test_a_dense_run_logged_to_a_file_writes_a_line_every_log_every_updates(coco_root, tmp_path, capsys):
    """Detection counts its updates over the whole run (one bar), and its evaluation lines stay whole."""
    cfg = load_config(DET, [*det_args(coco_root, tmp_path / "det"), *SHOWN, "train.log_every=2"])
    train_dense(cfg)
    out = capsys.readouterr().out
    assert _log_lines(out, 4, "step") == [(2, 4), (4, 4)]  # 7 annotated images, batches of 2
    assert re.search(r"^step 4: bbox_AP \d", out, re.MULTILINE), out
