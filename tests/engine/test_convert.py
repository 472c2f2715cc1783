"""vit3.convert and the ``convert`` task: an attention teacher distilled into its TTT swap.

What is protected: the layer pairs (ViT/DeiT with prefix tokens, Swin in both scopes) record the teacher's own
layer inputs and attention outputs and apply the student's mixer as the student's forward does; the student
starts as the teacher; attention transfer trains the mixers only; the distillation loss is timm's; the task
runs from a config (teacher trained first when missing), writes per-stage metrics and curves, resumes exactly,
and leaves a checkpoint that eval and fine-tuning take; bad settings end in one clear error.
"""

from __future__ import annotations

import json

import pytest
import timm
import torch
from helpers.train import (
    Crashed,
    assert_same_tensors,
    crash_after_checkpoint,
    load_script,
    read_ckpt,
    short_run,
)
from timm.models.swin_transformer import SwinTransformerBlock

import vit3
from vit3.convert import (
    LayerCapture,
    TransferNet,
    distillation_loss,
    init_student,
    layer_pairs,
    transfer_losses,
)
from vit3.engine import load_config, run
from vit3.engine.checkpoint import config_for_checkpoint
from vit3.engine.classification import build_model
from vit3.engine.config import CONFIG_DIR, ConfigError
from vit3.models.swap import SWAP_MODEL

pytestmark = pytest.mark.usefixtures("one_thread")

SWIN_KW = dict(img_size=64, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4)
CASES = [
    pytest.param("test_vit", dict(img_size=64), "stage", "token", id="vit-cls"),
    pytest.param(
        "deit_tiny_distilled_patch16_224",
        dict(img_size=64, embed_dim=32, depth=2, num_heads=2),
        "stage",
        "token",
        id="deit-distilled",
    ),
    pytest.param("swin_tiny_patch4_window7_224", SWIN_KW, "stage", "stage", id="swin-stage"),
    pytest.param("swin_tiny_patch4_window7_224", SWIN_KW, "window", "window", id="swin-window"),
]


def _pair_models(name, kwargs, scope):
    teacher = timm.create_model(name, num_classes=5, **kwargs).eval()
    student = timm.create_model(SWAP_MODEL, base=name, num_classes=5, scope=scope, **kwargs).eval()
    pairs = layer_pairs(teacher, student)
    init_student(student, teacher, pairs)
    return teacher, student, pairs


# ------------------------------------------------------------------------------------------- layer pairs
@pytest.mark.parametrize(("name", "kwargs", "scope", "pair_scope"), CASES)
def test_student_starts_as_the_teacher_swapped(name, kwargs, scope, pair_scope):
    teacher, student, pairs = _pair_models(name, kwargs, scope)
    n_attn = sum(1 for m in teacher.modules() if isinstance(m, SwinTransformerBlock)) or len(teacher.blocks)
    assert len(pairs) == n_attn and {p.scope for p in pairs} == {pair_scope}
    theirs, ours = teacher.state_dict(), student.state_dict()
    mixer_keys = [
        k
        for k in ours
        if any(k.startswith(f"{n}.") for n, m in student.named_modules() if m in {p.mixer for p in pairs})
    ]
    assert mixer_keys and all(".attn." in k for k in mixer_keys)
    for key in set(ours) - set(mixer_keys):  # everything else is the teacher's
        assert torch.equal(ours[key], theirs[key]), key
    for pair in pairs:  # the main branch of each mixer is its attention's qkv / proj
        c = pair.mixer.dim
        assert torch.equal(pair.mixer.qkv.weight[: 3 * c], pair.attention.qkv.weight)
        assert torch.equal(pair.mixer.proj.weight[:, :c], pair.attention.proj.weight)
    # the same model (up to the mixers' fresh weights) as swapping a copy of the teacher
    swapped = vit3.swap_attention_for_ttt(timm.create_model(name, num_classes=5, **kwargs), scope=scope)
    assert swapped.state_dict().keys() == ours.keys()


@pytest.mark.parametrize(("name", "kwargs", "scope", "kind"), CASES)
def test_capture_records_the_teachers_layer_inputs_and_attention_outputs(name, kwargs, scope, kind):
    teacher, _, pairs = _pair_models(name, kwargs, scope)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), LayerCapture(pairs) as capture:
        logits = teacher(x)
    torch.testing.assert_close(logits, teacher(x).detach())  # the hooks change nothing
    for pair, h, target in zip(pairs, capture.inputs(), capture.targets()):
        with torch.no_grad():
            # recomputed independently: the attention (the Swin block's whole windowed branch) on its input
            if kind == "window":  # with its block's shift mask
                again = pair.teacher(h, mask=teacher.get_submodule(pair.name.rpartition(".")[0]).attn_mask)
            else:
                again = pair.teacher._attn(h) if kind == "stage" else pair.teacher(h)
        torch.testing.assert_close(target, again)
    with torch.no_grad():  # the first layer's input is the normalised embedding of the images
        if kind == "token":
            emb = teacher.norm_pre(teacher._pos_embed(teacher.patch_embed(x)))
            expected = teacher.blocks[0].norm1(emb)
        else:
            expected = teacher.layers[0].blocks[0].norm1(teacher.layers[0].downsample(teacher.patch_embed(x)))
            if kind == "window":  # partitioned into 4x4 windows, as the block does
                expected = expected.reshape(2, 4, 4, 4, 4, 16).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16, 16)
    torch.testing.assert_close(capture.inputs()[0], expected)
    assert capture._handles == [] and not teacher._forward_hooks
    assert (capture.grids()[0] == (4, 4)) == (kind == "token")


@pytest.mark.parametrize(("name", "kwargs", "scope", "kind"), CASES)
def test_mixer_on_the_teachers_input_is_the_students_own_first_layer(name, kwargs, scope, kind):
    """Layer 0 sees the same input in both models, so the transfer output there must be what the student's
    own forward computes (prefix tokens, patch grid, windows or stage map handled alike)."""
    teacher, student, pairs = _pair_models(name, kwargs, scope)
    x = torch.randn(2, 3, 64, 64)
    inside = {}
    module = pairs[0].student.attn if kind == "stage" else pairs[0].student
    hook = module.register_forward_hook(lambda m, a, out: inside.setdefault("out", out))
    with torch.no_grad(), LayerCapture(pairs) as capture:
        teacher(x)
        student(x)
        outputs = TransferNet(student, pairs)(layer_inputs=capture.inputs(), grids=capture.grids())
    hook.remove()
    own = inside["out"].reshape(outputs[0].shape)
    torch.testing.assert_close(outputs[0], own)
    assert [o.shape for o in outputs] == [t.shape for t in capture.targets()]


@pytest.mark.parametrize(("name", "kwargs", "scope", "kind"), CASES)
def test_attention_transfer_trains_the_mixers_only_and_lowers_every_layers_loss(name, kwargs, scope, kind):
    teacher, student, pairs = _pair_models(name, kwargs, scope)
    mixers = {id(q) for p in pairs for q in p.mixer.parameters()}
    for q in student.parameters():
        q.requires_grad_(id(q) in mixers)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    net = TransferNet(student, pairs)
    opt = torch.optim.Adam([q for q in student.parameters() if q.requires_grad], lr=3e-3)
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad(), LayerCapture(pairs) as capture:
        teacher(x)
    losses = []
    for _ in range(15):
        per_layer = transfer_losses(
            net(layer_inputs=capture.inputs(), grids=capture.grids()), capture.targets()
        )
        opt.zero_grad()
        per_layer.mean().backward()
        opt.step()
        losses.append(per_layer.detach())
    assert (losses[-1] < 0.7 * losses[0]).all(), (losses[0], losses[-1])
    after = student.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(".attn." in k for k in changed)
    assert all(k in changed for k in after if k.endswith("inner.0.w1"))


def test_layer_pairs_refuse_a_student_that_is_not_the_teacher_swapped():
    teacher = timm.create_model("test_vit", img_size=64)
    with pytest.raises(ValueError, match="no TTT mixer in place of an attention"):
        layer_pairs(teacher, timm.create_model("test_vit", img_size=64))
    other = timm.create_model(SWAP_MODEL, base="test_vit", img_size=64, depth=2)
    with pytest.raises(ValueError, match="outside the TTT mixers"):
        init_student(
            timm.create_model(SWAP_MODEL, base="test_vit", img_size=32), teacher, layer_pairs(teacher, other)
        )


# ------------------------------------------------------------------------------------------ distillation
def test_soft_distillation_is_timms_logit_distillation():
    from timm.task.distillation import DistillationTeacher, LogitDistillationTask

    torch.manual_seed(0)
    teacher, student = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    student.pretrained_cfg = {"mean": (0.5,), "std": (0.5,)}
    teacher.pretrained_cfg = student.pretrained_cfg
    x, y = torch.randn(7, 6), torch.randint(0, 5, (7,))
    task = LogitDistillationTask(
        student, DistillationTeacher(teacher), criterion=torch.nn.CrossEntropyLoss(), temperature=2.5,
        task_loss_weight=0.0,
        distill_loss_weight=1.0, verbose=False,
    )  # fmt: skip
    expected = task(x, y)["kd_loss"]
    torch.testing.assert_close(distillation_loss(student(x), teacher(x), "soft", 2.5), expected)
    hard = distillation_loss(student(x), teacher(x), "hard")
    torch.testing.assert_close(hard, torch.nn.functional.cross_entropy(student(x), teacher(x).argmax(-1)))
    assert float(distillation_loss(student(x), teacher(x), "none")) == 0.0
    with pytest.raises(ValueError, match="distillation kind"):
        distillation_loss(student(x), teacher(x), "feature")


# ------------------------------------------------------------------------------------------ the task
TEACHER_KW = "{img_size: 32, patch_size: 8, in_chans: 1, embed_dim: 64, depth: 2, num_heads: 2}"


def _teacher_config(digits, tmp_path):
    """A classification config training a tiny timm ViT on the digit folder (3 epochs x 12 steps: ~50% val
    top-1 on the 4 digits, a teacher that knows something)."""
    path = tmp_path / "teacher.yaml"
    path.write_text(
        f"base: {CONFIG_DIR / 'convert' / 'teacher_mnist.yaml'}\n"
        f"model: {{name: vit_tiny_patch16_224, kwargs: {TEACHER_KW}}}\n"
        "data: {dataset: folder, path: " + str(digits) + ", batch_size: 20}\n"
        "train: {epochs: 3, warmup_epochs: 0, lr_batch: 20, base_lr: 1.0e-3, progress: false}\n"
    )
    return path


def _convert_cfg(digits, tmp_path, out, *overrides):
    return load_config(
        CONFIG_DIR / "convert" / "demo_mnist.yaml",
        [
            *short_run(digits, out, 3e-3),
            f"convert.teacher={tmp_path / 'teacher' / 'best.pt'}",
            f"convert.teacher_config={_teacher_config(digits, tmp_path)}",
            "convert.transfer_epochs=1",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def converted(digits, tmp_path_factory):
    """The teacher trained through convert.teacher_config, then converted: 1 epoch of transfer, 1 of
    distillation (12 steps each), a checkpoint every 4 steps."""
    tmp = tmp_path_factory.mktemp("convert")
    summary = run(_convert_cfg(digits, tmp, tmp / "run", "train.save_every_steps=4"), "train")
    return tmp, summary


def test_convert_task_runs_both_stages_and_reports_them(converted):
    tmp, summary = converted
    assert (tmp / "teacher" / "best.pt").is_file()  # trained first, by convert.teacher_config
    out = tmp / "run"
    history = json.loads((out / "metrics.json").read_text())
    assert [r["epoch"] for r in history] == [0, 1, 2] and [r["stage"] for r in history] == [0, 1, 2]
    start, transfer, tuned = history
    teacher_best = max(r["val_top1"] for r in json.loads((tmp / "teacher" / "metrics.json").read_text()))
    assert start["teacher_top1"] == summary["teacher_top1"] == teacher_best > 35.0  # 4 classes: chance is 25%
    layers = [f"val_transfer_loss_{i}" for i in range(2)]
    assert all(transfer[k] < start[k] for k in layers)  # attention transfer fits every layer
    assert all(f"train_transfer_loss_{i}" in transfer for i in range(2)) and "train_kd_loss" in tuned
    assert summary["layers"] == ["blocks.0.attn", "blocks.1.attn"]
    assert (out / "curves.png").stat().st_size > 1000
    assert "val_transfer_loss_1" in (out / "metrics.csv").read_text().splitlines()[0]
    ckpt = read_ckpt(out / "last.pt")
    assert ckpt["task"] == "convert" and ckpt["record"]["name"] == SWAP_MODEL
    assert ckpt["record"]["kwargs"]["base"] == "vit_tiny_patch16_224" and ckpt["record"]["classes"]


def test_stage_one_changes_the_mixers_only_at_the_scaled_lr(digits, converted, tmp_path):
    from vit3.engine.optim import build_scheduler, scaled_lrs

    tmp, _ = converted
    out = tmp_path / "stage1"
    cfg = _convert_cfg(digits, tmp, out, "train.epochs=1", "convert.transfer_lr_scale=3")
    run(cfg, "train")
    student, teacher = read_ckpt(out / "last.pt")["model"], read_ckpt(tmp / "teacher" / "best.pt")["model"]
    changed = {k for k in student if k in teacher and not torch.equal(student[k], teacher[k])}
    assert not changed, changed  # every weight the teacher has is still the teacher's
    history = json.loads((out / "metrics.json").read_text())
    assert history[1]["val_transfer_loss"] < history[0]["val_transfer_loss"]  # the mixers learnt
    # the last step's lr: 3x what the schedule gives (cosine over the 12 steps of the epoch)
    lrs = scaled_lrs(cfg.train, 20)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lrs["base_lr"])
    scheduler = build_scheduler(optimizer, cfg.train, lrs, 12)
    scheduler.step_update(11)
    assert history[1]["lr"] == pytest.approx(3 * optimizer.param_groups[0]["lr"])


def test_the_ema_of_a_conversion_follows_the_mixers_and_is_validated(digits, converted, tmp_path):
    tmp, _ = converted
    out = tmp_path / "ema"
    run(_convert_cfg(digits, tmp, out, "train.epochs=1", "train.ema=true", "train.ema_decay=0.5"), "train")
    ckpt = read_ckpt(out / "last.pt")
    model, ema, teacher = ckpt["model"], ckpt["ema"], read_ckpt(tmp / "teacher" / "best.pt")["model"]
    assert all(torch.equal(ema[k], teacher[k]) for k in teacher if k in ema)  # frozen in stage 1: unchanged
    mixer = [k for k in model if ".attn.mixer." in k and model[k].is_floating_point()]
    assert mixer and any(not torch.equal(ema[k], model[k]) for k in mixer)  # an average, not a copy
    assert json.loads((out / "metrics.json").read_text())[1]["ema_top1"] is not None


def test_conversion_checkpoint_is_taken_by_eval_export_and_fine_tuning(digits, converted, tmp_path):
    tmp, summary = converted
    best = tmp / "run" / "best.pt"
    cfg = config_for_checkpoint(best, None, [f"eval.checkpoint={best}", f"eval.json={tmp_path / 'e.json'}"])
    report = run(cfg, "eval")
    assert report["model"] == SWAP_MODEL
    assert report["results"][0]["top1"] == pytest.approx(summary["best_top1"])
    feats = tmp_path / "feats"
    export = ["features", "--checkpoint", str(best), "--images", str(digits / "val" / "digit_0")]
    assert load_script("export").main([*export, "--out-indices", "0", "1", "--out", str(feats)]) == 0
    manifest = json.loads((feats / "manifest.json").read_text())
    assert manifest["model"] == SWAP_MODEL and manifest["preprocessing"]["input_size"] == [1, 32, 32]
    assert [f["shape"] for f in manifest["features"]] == [[64, 4, 4]] * 2 and manifest["files"]
    ft = load_config(CONFIG_DIR / "finetune.yaml", [f"model.pretrained={best}"])
    from vit3.engine.checkpoint import apply_model_record
    from vit3.models.record import model_record, peek_vit3_checkpoint

    apply_model_record(ft, model_record(peek_vit3_checkpoint(best)), str(best))
    model, fresh = build_model(ft, 3, str(best))
    assert fresh == ["head.weight", "head.bias"] and model.blocks[0].attn.mixer is not None


def test_conversion_resumes_exactly_in_either_stage(digits, converted, tmp_path, monkeypatch):
    tmp, _ = converted
    out = tmp_path / "killed"
    cfg = lambda *o: _convert_cfg(digits, tmp, out, "train.save_every_steps=4", *o)  # noqa: E731
    for step in (4, 16):  # inside stage 1, then inside stage 2
        with monkeypatch.context() as m, pytest.raises(Crashed):
            crash_after_checkpoint(m, step)
            run(cfg("train.resume=auto"), "train")
        torch.manual_seed(123)  # a resumed process starts from unrelated RNG states
    run(cfg("train.resume=auto"), "train")
    keys = ("model", "optimizer", "global_step", "epoch", "convert")
    full, resumed = read_ckpt(tmp / "run" / "last.pt"), read_ckpt(out / "last.pt")
    assert_same_tensors({k: full[k] for k in keys}, {k: resumed[k] for k in keys})
    a = json.loads((tmp / "run" / "metrics.json").read_text())
    b = json.loads((out / "metrics.json").read_text())
    assert [r.get("val_transfer_loss") for r in a] == [r.get("val_transfer_loss") for r in b]


def test_a_bare_resume_of_an_older_conversion_gets_the_keys_added_since(tmp_path):
    """``train.py --resume last.pt`` of a conversion written before convert.transfer_lr_scale existed: its
    config is merged over the conversion's defaults (configs/convert/base.yaml), not classification's."""
    from vit3.engine.checkpoint import config_for_resume, save_checkpoint
    from vit3.engine.convert import check_convert_cfg

    saved = load_config(CONFIG_DIR / "convert" / "demo_mnist.yaml", [f"output={tmp_path}"]).to_dict()
    del saved["convert"]["transfer_lr_scale"]
    save_checkpoint(tmp_path / "last.pt", {"task": "convert", "config": saved, "global_step": 1})
    resumed = config_for_resume(tmp_path / "last.pt")
    assert (resumed.task, resumed.convert.transfer_lr_scale, resumed.train.epochs) == ("convert", 1.0, 3)
    check_convert_cfg(resumed)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("convert.scope=global", "convert.scope must be one of stage, window"),
        ("convert.distill=feature", "convert.distill must be one of"),
        ("convert.transfer_epochs=5", "convert.transfer_epochs must be in [0, train.epochs (2)], got 5"),
        ("convert.temperature=0", "convert.temperature must be > 0, got 0"),
        ("convert.ttt_kwargs={loss: l3}", "convert.ttt_kwargs is not a TTT mixer config"),
        ("model.name=vit3_tiny", "leave model.name empty"),
        ("convert.teacher_config=", "convert.teacher file not found"),
        (
            "convert.teacher_kwargs={num_classes: 4}",
            "convert.teacher_kwargs.num_classes is set by the conversion",
        ),
        (
            "convert.student_kwargs={scope: window}",
            "convert.student_kwargs.scope is set by the conversion (set ",
        ),
    ],
    ids=[
        *("scope", "distill", "transfer-epochs", "temperature", "ttt-kwargs", "model-name", "no-teacher"),
        *("teacher-num-classes", "student-scope"),
    ],
)
def test_bad_settings_end_in_one_error_line(digits, tmp_path, capsys, override, message):
    train = load_script("train")
    args = [
        "--config", str(CONFIG_DIR / "convert" / "demo_mnist.yaml"), *short_run(digits, tmp_path / "o", 1e-3),
        f"convert.teacher={tmp_path / 'missing' / 'best.pt'}", override,
    ]  # fmt: skip
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_teacher_without_attention_or_model_name_is_refused(digits, converted, tmp_path):
    tmp, _ = converted
    ttt_ckpt = tmp / "run" / "best.pt"  # a TTT model has no attention left to convert
    with pytest.raises(ConfigError, match="cannot convert the teacher"):
        run(_convert_cfg(digits, tmp, tmp_path / "a", f"convert.teacher={ttt_ckpt}"), "train")
    weights = tmp_path / "weights.pth"
    torch.save(read_ckpt(tmp / "teacher" / "best.pt")["model"], weights)
    with pytest.raises(ConfigError, match=r"name its timm model in convert\.teacher_model"):
        run(_convert_cfg(digits, tmp, tmp_path / "b", f"convert.teacher={weights}"), "train")


def test_a_weights_file_teacher_keeps_its_classifier(digits, converted, tmp_path):
    """A plain state dict and its timm name: the teacher is rebuilt with the file's head (4 classes)."""
    from vit3.engine.convert import _teacher_and_data

    tmp, _ = converted
    saved = read_ckpt(tmp / "teacher" / "best.pt")["model"]
    weights = tmp_path / "teacher.pth"
    torch.save(saved, weights)
    cfg = _convert_cfg(
        digits, tmp, tmp_path / "w", f"convert.teacher={weights}",
        "convert.teacher_model=vit_tiny_patch16_224",
        f"convert.teacher_kwargs={TEACHER_KW}",
    )  # fmt: skip
    teacher, record, data, num_classes = _teacher_and_data(cfg)
    assert num_classes == 4 == len(data["classes"]) and record["name"] == "vit_tiny_patch16_224"
    assert_same_tensors(teacher.state_dict(), saved)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("num_classes: 4", "error: convert.teacher_kwargs.num_classes is set by the conversion"),
        (
            "qkv_biass: true",
            "error: convert.teacher_kwargs.qkv_biass is not an argument of vit_tiny_patch16_224",
        ),
    ],
    ids=["num-classes", "unknown-argument"],
)
def test_a_weights_file_teachers_bad_kwarg_ends_in_one_error_line(digits, tmp_path, capsys, extra, message):
    """A timm weights file teacher (untrained here: the run stops before any training) with a kwarg the
    conversion passes itself, or one its model does not take: one line naming the key, not a TypeError."""
    kwargs = dict(img_size=32, patch_size=8, in_chans=1, embed_dim=64, depth=2, num_heads=2)
    weights = tmp_path / "teacher.pth"
    torch.save(timm.create_model("vit_tiny_patch16_224", num_classes=4, **kwargs).state_dict(), weights)
    args = [
        "--config", str(CONFIG_DIR / "convert" / "demo_mnist.yaml"), *short_run(digits, tmp_path / "o", 1e-3),
        f"convert.teacher={weights}", "convert.teacher_model=vit_tiny_patch16_224",
        f"convert.teacher_kwargs={{{TEACHER_KW[1:-1]}, {extra}}}",
    ]  # fmt: skip
    assert load_script("train").main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


def test_a_misspelt_key_in_a_config_file_is_named(tmp_path):
    from vit3.engine.convert import check_convert_cfg

    path = tmp_path / "convert.yaml"
    path.write_text(f"base: {CONFIG_DIR / 'convert' / 'demo_mnist.yaml'}\nconvert: {{transfr_epochs: 2}}\n")
    with pytest.raises(
        ConfigError, match=r"'convert\.transfr_epochs'; did you mean convert\.transfer_epochs"
    ):
        check_convert_cfg(load_config(path))
    check_convert_cfg(load_config(CONFIG_DIR / "convert" / "demo_mnist.yaml"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.pretrained=some/best.pt",
            r"^model\.pretrained='some/best\.pt': the conversion's student starts",
        ),
        ("train.freeze=backbone", r"^train\.freeze='backbone': the conversion chooses what trains"),
    ],
    ids=["pretrained", "freeze"],
)
def test_settings_the_conversion_would_ignore_are_refused(override, message):
    """A student checkpoint (``model.pretrained``) and a freeze were silently ignored: the student starts
    from the teacher, and each stage sets what trains (a freeze left stage 1 training nothing)."""
    from vit3.engine.convert import check_convert_cfg

    with pytest.raises(ConfigError, match=message):
        check_convert_cfg(load_config(CONFIG_DIR / "convert" / "demo_mnist.yaml", [override]))
