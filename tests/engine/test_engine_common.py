"""The plumbing every engine shares (vit3.engine.process, .resume, .optim): AMP, lr scaling, DDP, resume."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from helpers.dist import ranks_agree_worker

from vit3.engine import ConfigError, load_config
from vit3.engine.process import amp_dtype
from vit3.engine.resume import check_resume_task


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
