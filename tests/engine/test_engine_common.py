"""The plumbing every engine shares (vit3.engine.process, .resume): AMP, DDP, resume."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from helpers.dist import ranks_agree_worker

from vit3.engine import ConfigError, load_config
from vit3.engine.optim import epoch_steps
from vit3.engine.process import amp_dtype
from vit3.engine.resume import Progress, check_resume_task


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("none", None), ("bf16", torch.bfloat16), ("fp16", torch.float16), ("auto", None)],
    ids=["none", "bf16", "fp16", "auto-on-cpu"],
)
def test_amp_modes_resolve_to_one_dtype_on_cpu(mode, expected):
    assert amp_dtype(mode, torch.device("cpu")) is expected


@pytest.mark.parametrize("task", ["classification", "detection", "generation"])
def test_every_engine_refuses_an_unknown_amp_mode_naming_the_key(task, tmp_path):
    config = {"classification": "demo_mnist.yaml", "detection": "dense/demo_detection.yaml"}.get(
        task, "generation/demo_mnist.yaml"
    )
    from vit3.engine import run
    from vit3.engine.config import CONFIG_DIR

    with pytest.raises(ConfigError, match=r"train\.amp must be one of auto, none, bf16, fp16, got 'fp8'"):
        run(load_config(CONFIG_DIR / config, [f"output={tmp_path}", "train.amp=fp8", "device=cpu"]), "train")


def test_resume_from_another_task_is_refused():
    with pytest.raises(
        ConfigError, match=r"cannot resume a detection run from x\.pt: it is a classification"
    ):
        check_resume_task({}, "detection", "x.pt")
    check_resume_task({"task": "segmentation"}, "segmentation", "x.pt")


@pytest.mark.parametrize("perturb", [None, 1], ids=["same-weights", "rank-1-differs"])
def test_ranks_are_compared_for_real_in_a_two_process_group(perturb, tmp_path):
    """One weight of rank 1 off by 1e-6 is found; differing BatchNorm statistics (buffers) are not."""
    mp.spawn(
        ranks_agree_worker, args=(2, str(tmp_path / "store"), perturb, str(tmp_path)), nprocs=2, join=True
    )
    results = [(tmp_path / f"{r}.txt").read_text() for r in range(2)]
    if perturb is None:
        assert all(r.startswith("ok ") for r in results), results
        digests = results[0].split()[1:]
        assert len(digests) == 2 and digests[0] == digests[1] and results[0] == results[1]
    else:
        for r in results:
            assert r.startswith("error DDP ranks [1] disagree with rank 0 on the final weights"), r


def _counters(epoch: int, batch: int, step: int, batch_size: int = 10, accum: int = 1) -> dict:
    """A checkpoint's counters and the settings they were counted in (one process)."""
    config = {"data": {"batch_size": batch_size}, "train": {"accum_steps": accum}}
    return {"epoch": epoch, "batch_in_epoch": batch, "global_step": step, "world_size": 1, "config": config}


def test_a_resume_with_another_batch_per_update_goes_on_after_the_images_seen():
    """7 batches of 10 images into epoch 3 of 20 batches, an update a batch: resumed with the same settings
    the counters come back; with another batch per update the batch goes on after the same images, in whole
    accumulation steps, and the step is where the new schedule is there (dense runs by iterations keep
    theirs); a finished epoch moves on to the next."""
    cases = [  # (batch size, accumulation, batches an epoch, by epochs) -> (epoch, batch, step)
        ((10, 1, 20, True), (2, 7, 47)),
        ((10, 2, 20, True), (2, 6, 2 * 10 + 3)),
        ((5, 1, 40, True), (2, 14, 2 * 40 + 14)),
        ((5, 1, 40, False), (2, 14, 47)),
    ]
    for (batch_size, accum, batches, by_epochs), want in cases:
        p = Progress()
        p.restore(_counters(2, 7, 47), batch_size, 1, accum, epoch_steps(batches, accum), by_epochs=by_epochs)
        assert (p.epoch, p.batch_in_epoch, p.global_step) == want, (batch_size, accum, by_epochs)
    p = Progress()
    p.restore(_counters(1, 20, 40), 10, 1, 2, epoch_steps(20, 2))
    assert (p.epoch, p.batch_in_epoch, p.global_step) == (2, 0, 2 * 10)
