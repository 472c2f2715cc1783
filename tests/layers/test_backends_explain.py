"""The mixer's backend registry (``vit3.layers.backends``): what it chooses and why (``explain``), for one
mixer and for a whole model, its CLI, and that the registry's backends are the ops' declared paths.

The registry's decisions for CPU tensors under the interpreter ask for it (``interpreter``);
``TRITON_INTERPRET=0 pytest tests/layers/test_backends_explain.py`` imports Triton as a GPU host does."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import timm
import torch
from helpers import backends as hb
from helpers.backends import BIG_GRID, CPU, GRID
from helpers.common import REPO, count_calls
from helpers.ops import AMD_GPUS, needs_kernels

import vit3
from vit3.kernels import cpp, triton_path
from vit3.kernels.triton import device as tdev
from vit3.kernels.triton import program as tprogram
from vit3.layers import TTTMixer, ttt
from vit3.layers import backends as reg
from vit3.scripts.explain import main as cli_main

pytestmark = pytest.mark.usefixtures("no_backend_env")


# ------------------------------------------------------------------------------------------------ explain


@pytest.mark.usefixtures("interpreter")
def test_explain_default_cpu_config_cpu_kernel_from_32_tokens():
    mixer = hb.make_mixer(dtype=torch.float32)
    big = mixer.explain(hb.tokens(BIG_GRID, dtype=torch.float32), BIG_GRID)
    assert hb.backends_of(big) == ["cpu", "cpu"] and big.fused
    assert "ranks higher on cpu" in hb.reason_of(big, 0, "eager")
    assert "'cpu' ranks higher on cpu" in hb.reason_of(big, 1, "eager")  # the depthwise branch too
    assert "unless named" in hb.reason_of(big, 0, "triton")  # the interpreter serves only when named
    small = mixer.explain(hb.tokens(GRID, dtype=torch.float32), GRID)
    assert hb.backends_of(small) == ["eager", "cpu"] and small.fused  # the token rule is SwiGLU's only
    assert "fewer than 32 tokens per head" in hb.reason_of(small, 0, "cpu")
    text = str(big)
    assert "one fused node" in text and "0 swiglu x2 d=16" in text and "cpu" in text
    assert json.loads(json.dumps(big.to_dict()))["branches"][0]["backend"] == "cpu"


def test_explain_says_triton_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expl = hb.make_mixer().explain(hb.tokens(GRID), GRID)
    assert hb.reason_of(expl, 0, "triton") == "CPU tensors: Triton runs them only under TRITON_INTERPRET=1"


def test_explain_default_cuda_route_is_triton_then_generic():
    """The CUDA route is resolved without a GPU: the registry only reads the device type."""
    mixer = hb.make_mixer(dim=64, heads=2)
    expl = reg.explain_mixer(mixer, torch.device("cuda"), torch.bfloat16, BIG_GRID, grad=True)
    assert hb.backends_of(expl) == ["triton", "triton"] and expl.fused  # one node: the Triton hooks
    assert hb.reason_of(expl, 0, "cpu") == "cuda tensors: the C++ kernel runs CPU tensors"
    assert hb.reason_of(expl, 0, "generic") == "'triton' ranks higher on cuda"
    wide = reg.explain_mixer(
        hb.make_mixer(dim=512, heads=2), torch.device("cuda"), torch.bfloat16, GRID, grad=True
    )
    assert hb.backends_of(wide) == ["generic", "generic"]  # the eager tile walk is tuned for CPU caches
    assert "head dim 256 > 128" in hb.reason_of(wide, 0, "triton")
    assert hb.reason_of(wide, 0, "eager") == "'generic' ranks higher on cuda"


def test_a_gpu_that_cannot_run_the_kernels_steps_aside_with_a_warning(fake_gpu):
    """ROCm on an MI250 (Triton's AMD backend takes no TF32 dots there): auto says why, warns once and lets
    the generic path serve; with IEEE dots (float64) the kernels serve."""
    gpu = fake_gpu(AMD_GPUS["gfx90a"], hip="6.3")
    mixer = hb.make_mixer(dim=64, heads=2)
    expl = reg.explain_mixer(mixer, gpu, torch.bfloat16, BIG_GRID, grad=True)
    assert hb.backends_of(expl) == ["generic", "generic"]
    assert hb.reason_of(expl, 0, "triton").startswith("ROCm gfx90a: Triton's AMD backend takes")
    args = ((mixer.cfg.loss, 1, 1, "fixed"), "auto", mixer.route_branches, gpu)
    with pytest.warns(reg.BackendWarning) as caught:
        assert reg.route(*args, torch.bfloat16, "N>=32", True, "").backends == ("generic", "generic")
        reg.route(*args, torch.bfloat16, "N>=32", False, "")  # another key: no second warning
    warned = [str(w.message) for w in caught if "'swiglu' branch" in str(w.message)]
    assert len(warned) == 1
    for part in (
        "the Triton kernels cannot run",
        "AMD Instinct MI250X/MI250 (cuda:0)",
        "ROCm gfx90a",
        "'generic'",
    ):
        assert part in warned[0], warned[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.route(*args, torch.float64, "N>=32", True, "").backends == ("triton", "triton")


def test_explain_without_triton_names_the_import_error_and_keeps_the_cpp_kernel(monkeypatch):
    monkeypatch.setattr(
        triton_path,
        "_kernels",
        lambda: (None, "the Triton kernels cannot be imported (ImportError: no triton)"),
    )
    expl = reg.explain_mixer(hb.make_mixer(), torch.device("cuda"), torch.float16, GRID, grad=False)
    assert hb.backends_of(expl) == ["generic", "generic"]
    assert "ImportError: no triton" in hb.reason_of(expl, 0, "triton")
    cpu = hb.make_mixer().explain(hb.tokens(BIG_GRID), BIG_GRID)  # the C++ kernel needs no Triton
    assert hb.backends_of(cpu) == ["cpu", "cpu"] and "ImportError: no triton" in hb.reason_of(
        cpu, 0, "triton"
    )


VARIANTS = {
    # name: (config, expected backends per branch, (branch, backend, reason substring))
    "mse-loss": ({"loss": "mse"}, ["generic", "generic"], (0, "eager", "loss 'mse' is not fused")),
    "two-steps": ({"steps": 2}, ["generic", "generic"], (0, "cpu", "steps=2")),
    "mini-batches": ({"mini_batches": 2}, ["generic", "generic"], (1, "eager", "mini_batches=2")),
    "token-lr": ({"lr_mode": "token"}, ["generic", "generic"], (0, "triton", "lr_mode='token'")),
    "mlp": ({"branches": ("mlp",)}, ["generic"], (0, "triton", "no 'mlp' in the Triton kernels")),
    "with-linear": (
        {"branches": ("swiglu:2", "linear:2", "dwconv:1")},
        ["generic", "generic", "generic"],
        (0, "cpu", "branch 1 ('linear') has no fast path here, and the mixer op runs every branch or none"),
    ),
    "named-generic": ({"backend": "generic"}, ["generic", "generic"], (0, "cpu", "'generic' is named")),
    "named-triton": ({"backend": "triton"}, ["triton", "triton"], (0, "cpu", "'triton' is named")),
    "named-eager": ({"backend": "eager"}, ["eager", "eager"], (0, "cpu", "'eager' is named")),
    "named-triton-narrow-heads": (
        {"backend": "triton", "heads": 4},
        ["cpu", "cpu"],
        (0, "triton", "head dim 8 < 16"),
    ),
}


@pytest.mark.parametrize(("cfg", "expected", "why"), list(VARIANTS.values()), ids=list(VARIANTS))
@pytest.mark.usefixtures("interpreter")
def test_explain_variants(cfg, expected, why):
    cfg = dict(cfg)
    mixer = hb.make_mixer(heads=cfg.pop("heads", 2), **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reg.BackendWarning)
        expl = mixer.explain(hb.tokens(BIG_GRID), BIG_GRID)
    assert hb.backends_of(expl) == expected
    branch, backend, text = why
    assert text in hb.reason_of(expl, branch, backend)


@pytest.mark.usefixtures("interpreter")
def test_traced_calls_route_portable_ops_and_compiled_ones_the_mixer_op():
    mixer = hb.make_mixer()
    args = (
        (mixer.cfg.loss, 1, 1, "fixed"),
        "auto",
        mixer.route_branches,
        CPU,
        torch.float64,
        "N>=32",
        True,
    )
    assert reg.route(*args, "trace").backends == ("generic", "generic")
    assert reg.route(*args, "export").backends == ("generic", "generic")
    compiled = "cpu" if cpp.load()[0] is not None else "generic"  # the mixer op on the C++ kernel, if built
    assert reg.route(*args, "compile").backends == (compiled, compiled)
    assert reg.route(*args, "").backends == ("cpu", "cpu")
    named = ((mixer.cfg.loss, 1, 1, "fixed"), "triton", *args[2:])
    assert reg.route(*named, "compile").backends == ("triton", "triton")  # the custom op compiles
    with pytest.warns(reg.BackendWarning, match="jit tracing / ONNX export"):
        assert reg.route(*named, "trace").backends == ("generic", "generic")


def test_compiled_mixer_has_no_graph_break_and_matches_eager():
    """The route is a constant of the compiled graph (fullgraph fails on any break)."""
    mixer = hb.make_mixer()
    x, dout = hb.tokens(BIG_GRID), hb.tokens(BIG_GRID)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: mixer(t, BIG_GRID), fullgraph=True, backend="eager")
    x_ = x.detach().requires_grad_()
    out = compiled(x_)
    got = [out, *torch.autograd.grad((out * dout).sum(), [x_, *mixer.parameters()])]
    hb.assert_same(got, hb.run_grads(mixer, x, BIG_GRID, dout), hb.param_names(mixer))


# --------------------------------------------------------------------------------- model-level explain


def test_model_explain_groups_mixers_with_one_route():
    model = timm.create_model("test_vit3_ttt")
    report = vit3.explain(model, 64)
    ((names, expl),) = report.groups
    assert names == ("blocks.0.attn", "blocks.1.attn", "blocks.2.attn")
    assert expl.tokens == 16 and not expl.grad and hb.backends_of(expl) == ["eager", "cpu"]
    assert "blocks.0.attn ... blocks.2.attn (3 mixers)" in str(report)
    assert hb.backends_of(vit3.explain(model, torch.randn(1, 3, 176, 176), grad=True).groups[0][1]) == [
        "cpu",
        "cpu",
    ]


def test_model_explain_of_a_hierarchical_model_lists_each_stage():
    model = timm.create_model("test_h_vit3")
    report = vit3.explain(model, (64, 96))
    assert len(report.groups) > 1
    assert sum(len(names) for names, _ in report.groups) == sum(
        isinstance(m, TTTMixer) for m in model.modules()
    )
    assert len({expl.tokens for _, expl in report.groups}) == len(report.groups)


def test_cli_prints_the_explanation(capsys):
    cli_main(["test_vit3_ttt", "--img-size", "64", "--batch", "2"])
    out = capsys.readouterr().out
    assert "test_vit3_ttt" in out and "blocks.0.attn ... blocks.2.attn (3 mixers)" in out
    cli_main(["test_vit3_ttt", "--img-size", "64", "--dtype", "bf16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert (
        data["mixers"][0]["dtype"] == "torch.bfloat16" and data["mixers"][0]["mixers"][0] == "blocks.0.attn"
    )


def test_cli_builds_a_fixed_size_model_for_its_image_size(capsys):
    """A timm ViT with TTT swapped in fixes its patch grid at build time: built for ``--img-size``, it
    explains 64 px images (built for its default 224, the forward refused them)."""
    assert cli_main(["ttt_swap", "--img-size", "64"]) == 0
    assert "img_size 64" in capsys.readouterr().out


@pytest.mark.parametrize("device", ["foo", "mps"])
def test_cli_refuses_a_device_in_one_line(device, capsys):
    """A device torch does not know, or one vit3 does not run on: one error line, not a traceback."""
    assert cli_main(["test_vit3_ttt", "--device", device]) == 2
    assert capsys.readouterr().err.startswith(f"error: --device must be cpu, cuda or cuda:N, got '{device}'")


def test_cli_points_a_dit3_name_to_its_mixers(capsys):
    """A DiT³ name is no timm model: the error says what it is and how to ask its mixers (timm's near names
    were suggested instead); the way it names works."""
    assert cli_main(["dit3_s_2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: dit3_s_2 is a DiT³ generator") and "pit_s_224" not in err
    model = vit3.create_dit3("dit3_s_2")
    mixer = model.blocks[0].attn
    assert mixer.explain(torch.randn(1, 16, mixer.dim), (4, 4)).branches


def test_cli_explains_the_model_of_a_config(tmp_path, capsys):
    """``--config``: the model ``train.py`` builds from the config (its ``model.kwargs``, a ``ttt_cfg`` of its
    own) at the run's image size, ``data.img_size`` or, null, the size the model was built at, and under its
    ``train.amp``; a flag given wins; a config of another task, of another model than the one named or of
    none, and a bad ``--device``, are refused in one line."""

    def run(*argv: str, **sections: str) -> dict:
        config = tmp_path / "mine.yaml"
        body = "".join(f"{key}: {{{value}}}\n" for key, value in sections.items())
        config.write_text(
            "base: configs/demo_mnist.yaml\nmodel: {kwargs: {ttt_cfg: {branches: [silu]}}}\n" + body
        )
        assert cli_main(["--config", str(config), "--device", "cpu", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    def tokens(report: dict) -> list[int]:  # each stage's first mixer: 8x8, 4x4, ... tokens at 32 px
        return sorted({mixer["tokens"] for mixer in report["mixers"]}, reverse=True)

    report = run()
    assert (report["model"], report["img_size"], report["dtype"]) == ("h_vit3_tiny", 32, "fp32")
    branches = [b for mixer in report["mixers"] for b in mixer["branches"]]
    assert {(b["inner_model"], b["backend"]) for b in branches} == {("silu", "generic")}
    assert tokens(report) == [64, 16, 4, 1]
    assert tokens(run("--img-size", "64")) == [256, 64, 16, 4]
    null = run(data="img_size: null")  # the size model.kwargs built it at
    assert null["img_size"] == 32 and tokens(null) == [64, 16, 4, 1]
    assert run(train="amp: bf16")["dtype"] == "bf16 (autocast)"
    assert run("--dtype", "fp64", train="amp: bf16")["dtype"] == "fp64"
    config = tmp_path / "mine.yaml"
    assert cli_main(["--config", str(REPO / "configs" / "dense" / "demo_detection.yaml")]) == 2
    assert "this one's task is detection" in capsys.readouterr().err
    assert cli_main(["vit3_small", "--config", str(config)]) == 2
    assert "model.name h_vit3_tiny differ" in capsys.readouterr().err
    assert cli_main(["--config", str(config), "--device", "gpu"]) == 2
    assert capsys.readouterr().err.startswith("error: --device must be cpu, cuda or cuda:N")
    config.write_text("base: configs/finetune.yaml\n")
    assert cli_main(["--config", str(config)]) == 2
    assert "has no model.name" in capsys.readouterr().err
    assert cli_main([]) == 2
    assert "or give --config" in capsys.readouterr().err


def test_cli_runs_as_a_module_and_rejects_bad_arguments():
    proc = subprocess.run(
        [sys.executable, "-m", "vit3.scripts.explain", "test_vit3_ttt", "--img-size", "32", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RuntimeWarning" not in proc.stderr
    assert json.loads(proc.stdout)["model"] == "test_vit3_ttt"
    assert cli_main(["test_vit3_ttt", "--dtype", "fp8"]) == 2  # the usage error's one line and exit code


def test_backends_implement_exactly_the_ops_that_declare_their_path():
    """Each op under ``kernels/`` declares its fast paths; the registry's inner-model lists follow them, and
    the Triton op serves exactly those ops."""
    import vit3.kernels as kernels

    assert reg.BACKENDS["triton"].models == kernels.ops_with("triton") == tuple(tdev.TRITON_LOSSES)
    assert reg.BACKENDS["cpu"].models == kernels.ops_with("cpu") == ("swiglu", "dwconv")
    assert reg.BACKENDS["eager"].models == kernels.ops_with("eager") == ("swiglu", "dwconv")
    assert reg.BACKENDS["generic"].models is None


def test_the_backends_a_config_may_name_are_the_registrys():
    """TTTConfig checks backend names against vit3.layers.config (below the registry, which it must not
    import): the same names, in the registry's order."""
    from vit3.layers.config import BACKEND_NAMES

    assert BACKEND_NAMES == ("auto", *reg.BACKENDS)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("rope", [False, True], ids=["rope-off", "rope-on"])
def test_explain_says_when_the_fused_node_is_one_launch_program(monkeypatch, rope):
    """Both branches on Triton: one launch program, with or without RoPE on the SwiGLU branch (its q, k
    rotated by the program's own launches); on the C++ kernel one C++ call. As the mixer's call runs it."""
    mixer = hb.make_mixer(dtype=torch.float32, rope=rope)
    x = hb.tokens(BIG_GRID, dtype=torch.float32)
    cpu = mixer.explain(x, BIG_GRID)
    assert hb.backends_of(cpu) == ["cpu", "cpu"] and cpu.program and "as one C++ call" in str(cpu)
    monkeypatch.setenv(reg.BACKEND_ENV, "triton")
    expl = mixer.explain(x, BIG_GRID)
    assert hb.backends_of(expl) == ["triton", "triton"] and expl.fused
    assert expl.program and "as one launch program" in str(expl)
    assert json.loads(json.dumps(expl.to_dict()))["whole_call"]
    needs_kernels(CPU)
    called = count_calls(monkeypatch, tprogram.MixProgram, "forward")
    mixer(x, BIG_GRID)
    mixer(x, BIG_GRID)  # settled: the fused node itself
    assert called["n"] > 0


@pytest.mark.parametrize("case", ["fp32", "fp64", "eager", "bf16-autocast", "cpp-node-off"])
def test_explain_says_when_settled_calls_run_as_the_cpp_op(monkeypatch, case):
    """Every branch on the C++ kernel, the parameters in the tokens' dtype: settled calls run the whole-mixer
    C++ op (its autograd node in the graph); explain says so exactly then (not on eager, under bf16 autocast,
    nor with ``ttt.CPP_NODE`` off)."""
    if cpp.load()[0] is None:
        pytest.skip("the C++ CPU kernel is not built here")
    dtype = torch.float64 if case == "fp64" else torch.float32
    mixer = hb.make_mixer(dtype=dtype)
    x = hb.tokens(BIG_GRID, dtype=dtype).requires_grad_()
    if case == "eager":
        monkeypatch.setenv(reg.BACKEND_ENV, "eager")
    if case == "cpp-node-off":
        monkeypatch.setattr(ttt, "CPP_NODE", False)
    expected = case in ("fp32", "fp64")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16-autocast"):
        expl = mixer.explain(x, BIG_GRID)
        assert expl.fused and expl.cpp_op is expected
        assert ("as one C++ op, vit3_cpu::mix" in str(expl)) is expected
        assert json.loads(json.dumps(expl.to_dict()))["cpp_op"] is expected
        for _ in range(3):  # the first calls (and their backward) guarded through the Python node: settled
            mixer.mix(mixer.qkv(x), BIG_GRID).sum().backward()
        out = mixer.mix(mixer.qkv(x), BIG_GRID)  # (``forward`` may wrap it in its recompute node)
    assert any("MixFunction" in node.name() for node in _graph(out.grad_fn)) is expected


def _graph(node) -> list:
    """Every autograd node behind ``node``."""
    seen, stack = [], [node]
    while stack:
        n = stack.pop()
        if n is not None and n not in seen:
            seen.append(n)
            stack += [nxt for nxt, _ in n.next_functions]
    return seen
