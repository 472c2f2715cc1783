"""DiT³ as a diffusers citizen: ModelMixin/ConfigMixin round trips, DiT3Pipeline (determinism, outputs, the
official guidance against a direct computation, save/load, diffusers' scheduler swaps, half precision)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.common import REPO, default_dtype
from PIL import Image

from vit3.models.dit3 import DiT3, create_dit3
from vit3.tasks.diffusion import (
    RespacedDDIMScheduler,
    RespacedDDPMScheduler,
    denoise,
    eps_scheduler,
    reads_variance,
)
from vit3.tasks.pipeline import DiT3Pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

# 4 latent channels (the official guidance leaves the 4th alone), 5 classes (null class 5, not 1000)
TINY = dict(input_size=8, in_channels=4, hidden_size=32, depth=1, num_heads=2, num_classes=5)


def _model(seed: int = 0, **kw) -> DiT3:
    """A tiny DiT³ with small random weights everywhere (the official init zeroes the output layer)."""
    model = create_dit3("dit3_s_2", **{**TINY, **kw})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model.eval()


def _pipe(model: DiT3, **kw) -> DiT3Pipeline:
    pipe = DiT3Pipeline(model, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _gens(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


# ------------------------------------------------------------------------------------------- the model
class TestModelMixin:
    @pytest.mark.parametrize(
        "kw",
        [
            dict(ttt_cfg={"loss": "mse", "branches": ["swiglu", "dwconv:1"], "inner_lr": 0.5}),
            dict(mixer="attention"),
        ],
        ids=["custom-ttt", "attention"],
    )
    def test_save_pretrained_round_trip(self, tmp_path, kw):
        model = _model(**kw)
        model.save_pretrained(tmp_path)
        assert (tmp_path / "diffusion_pytorch_model.safetensors").is_file()
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["_class_name"] == "DiT3" and config["num_classes"] == 5
        back = DiT3.from_pretrained(tmp_path)
        public = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
        assert public(back.config) == public(model.config)
        assert back.ttt_cfg == model.ttt_cfg and back.mixer == model.mixer
        x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 900]), torch.tensor([1, 5])
        with torch.no_grad():
            torch.testing.assert_close(back(x, t, y), model(x, t, y), rtol=0, atol=0)

    def test_config_holds_the_constructor_arguments_as_plain_data(self):
        model = create_dit3("dit3_b_4", input_size=(8, 6), in_channels=1, num_classes=3, depth=1)
        c = model.config
        assert (c.patch_size, c.hidden_size, c.depth, c.num_heads, c.num_classes) == (4, 768, 1, 12, 3)
        assert c.ttt_cfg["branches"] == ("swiglu", "dwconv:1") and c.ttt_cfg["loss"] == "dot"
        json.loads(model.to_json_string())  # JSON throughout
        assert create_dit3("dit3_s_2", mixer="attention", depth=1).config.ttt_cfg is None

    def test_importing_vit3_does_not_need_diffusers(self):
        code = (
            "import sys, vit3, vit3.models; assert 'diffusers' not in sys.modules; print(vit3.DiT3.__name__)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "DiT3"


# ---------------------------------------------------------------------------------------- the pipeline
class TestPipeline:
    def test_generator_makes_it_deterministic(self):
        pipe = _pipe(_model())
        call = dict(class_labels=[0, 4, 2], guidance_scale=3.0, num_inference_steps=5, output_type="latent")
        a = pipe(generator=_gens([10, 11, 12]), **call).images
        b = pipe(generator=_gens([10, 11, 12]), **call).images
        assert a.shape == (3, 4, 8, 8) and torch.isfinite(a).all() and torch.equal(a, b)
        alone = pipe(class_labels=[4], guidance_scale=3.0, num_inference_steps=5, output_type="latent",
                     generator=_gens([11])).images  # fmt: skip
        torch.testing.assert_close(alone, a[1:2], rtol=1e-5, atol=1e-5)  # each image depends on its seed only
        assert not torch.allclose(pipe(generator=_gens([1, 2, 3]), **call).images, a)

    def test_output_types(self, tiny_vae):
        from diffusers import AutoencoderKL

        pipe = _pipe(_model(), vae=AutoencoderKL.from_pretrained(tiny_vae))
        call = dict(class_labels=[1, 3], num_inference_steps=3, guidance_scale=2.0)
        pil = pipe(generator=_gens([0, 1]), **call).images
        assert [im.size for im in pil] == [(16, 16)] * 2 and all(isinstance(im, Image.Image) for im in pil)
        arr = pipe(generator=_gens([0, 1]), output_type="np", **call).images
        assert arr.shape == (2, 16, 16, 3) and arr.min() >= 0 and arr.max() <= 1
        np.testing.assert_array_equal(np.asarray(pil[0]), (arr[0] * 255).round().astype(np.uint8))
        pt = pipe(generator=_gens([0, 1]), output_type="pt", **call).images
        assert pt.shape == (2, 3, 16, 16)
        with pytest.raises(ValueError, match=r"output_type must be one of"):
            pipe(output_type="latents", **call)

    def test_pixel_space_without_a_vae(self):
        pipe = _pipe(_model(in_channels=1, input_size=(6, 10)))
        (images,) = pipe(
            [0, 1], num_inference_steps=2, guidance_scale=1.0, output_type="pil", return_dict=False
        )
        assert [(im.size, im.mode) for im in images] == [((10, 6), "L")] * 2

    @pytest.mark.parametrize("scheduler", ["ddpm", "ddim"])
    def test_guidance_is_the_official_one(self, scheduler):
        """Against a direct loop: separate conditional and null-class (label 5) passes, guidance on the first
        3 of 4 noise channels, the 4th channel and the learned variance conditional (official
        forward_with_cfg), not the all-channel guidance of diffusers' DiTPipeline."""
        with default_dtype(torch.float64):
            model = _model()
        make = {"ddpm": RespacedDDPMScheduler, "ddim": RespacedDDIMScheduler}[scheduler]
        pipe = _pipe(model, scheduler=make())
        labels, s, steps = torch.tensor([2, 0]), 3.0, 6
        got = pipe(labels, guidance_scale=s, num_inference_steps=steps, output_type="latent",
                   generator=_gens([5, 6])).images  # fmt: skip

        def direct(k: int) -> torch.Tensor:
            sched = make()
            sched.set_timesteps(steps)
            gens = _gens([5, 6])
            x = torch.cat([torch.randn(1, 4, 8, 8, generator=g, dtype=torch.float64) for g in gens])
            with torch.no_grad():
                for t in sched.timesteps:
                    tt = torch.full((2,), int(t))
                    cond, uncond = model(x, tt, labels), model(x, tt, torch.full_like(labels, 5))
                    eps = uncond[:, :k] + s * (cond[:, :k] - uncond[:, :k])
                    out = torch.cat([eps, cond[:, k:]], 1)
                    x = sched.step(
                        out if scheduler == "ddpm" else out[:, :4], t, x, generator=gens
                    ).prev_sample
            return x

        torch.testing.assert_close(got, direct(3), rtol=1e-10, atol=1e-10)
        assert not torch.allclose(got, direct(4), rtol=1e-3, atol=1e-3)  # the guidance choice is visible

    def test_guidance_needs_the_null_class(self):
        pipe = _pipe(_model(class_dropout_prob=0.0))
        with pytest.raises(ValueError, match=r"cfg_scale=4.0 needs the null class"):
            pipe([0], num_inference_steps=2)
        assert pipe([0], guidance_scale=1.0, num_inference_steps=2, output_type="latent").images.shape[0] == 1

    def test_save_pretrained_round_trip(self, tmp_path):
        pipe = _pipe(_model(), scheduler=RespacedDDIMScheduler())
        pipe.save_pretrained(tmp_path)
        index = json.loads((tmp_path / "model_index.json").read_text())
        assert index["transformer"] == ["vit3.models.dit3", "DiT3"]
        assert index["scheduler"] == ["vit3.tasks.diffusion", "RespacedDDIMScheduler"]
        back = DiT3Pipeline.from_pretrained(tmp_path)
        back.set_progress_bar_config(disable=True)
        assert isinstance(back.scheduler, RespacedDDIMScheduler) and back.vae is None
        call = dict(class_labels=[1, 2], num_inference_steps=4, output_type="latent")
        torch.testing.assert_close(back(generator=_gens([0, 1]), **call).images,
                                   pipe(generator=_gens([0, 1]), **call).images, rtol=0, atol=0)  # fmt: skip

    def test_default_scheduler_is_the_official_ddpm(self):
        assert _pipe(_model()).scheduler.config.variance_type == "learned_range"
        assert _pipe(_model(learn_sigma=False)).scheduler.config.variance_type == "fixed_large"

    def test_diffusion_pipeline_from_pretrained_loads_a_saved_folder(self, tmp_path):
        """diffusers' generic loader finds DiT3Pipeline (model_index.json's _class_name) with no arguments."""
        from diffusers import DiffusionPipeline

        pipe = _pipe(_model())
        pipe.save_pretrained(tmp_path)
        back = DiffusionPipeline.from_pretrained(tmp_path)
        back.set_progress_bar_config(disable=True)
        assert type(back) is DiT3Pipeline and isinstance(back.scheduler, RespacedDDPMScheduler)
        call = dict(class_labels=[1, 2], num_inference_steps=3, output_type="latent")
        torch.testing.assert_close(back(generator=_gens([0, 1]), **call).images,
                                   pipe(generator=_gens([0, 1]), **call).images, rtol=0, atol=0)  # fmt: skip
        half = DiffusionPipeline.from_pretrained(tmp_path, dtype=torch.bfloat16)
        half.set_progress_bar_config(disable=True)
        latents = half(generator=_gens([0, 1]), **call).images
        assert half.transformer.dtype == torch.bfloat16 and latents.dtype == torch.bfloat16
        assert torch.isfinite(latents).all()

    @pytest.mark.parametrize("first", ["vit3", "diffusers"])
    def test_importing_vit3_is_all_diffusion_pipeline_from_pretrained_needs(self, first, tmp_path):
        """diffusers looks a saved pipeline's class up in its own namespace only: ``import vit3``, before
        diffusers or after it, has it find DiT3Pipeline, importing neither diffusers nor the pipeline itself
        (a fresh interpreter)."""
        _pipe(_model()).save_pretrained(tmp_path)
        imports = {
            "vit3": "import sys, vit3; assert 'diffusers' not in sys.modules; import diffusers",
            "diffusers": "import sys, diffusers, vit3",
        }[first]
        code = (
            f"{imports}; assert 'vit3.tasks.pipeline' not in sys.modules; "
            f"print(type(diffusers.DiffusionPipeline.from_pretrained({str(tmp_path)!r})).__name__)"
        )
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "DiT3Pipeline"


# ----------------------------------------------------------------------------------- scheduler swaps
def _swap(name: str, config, **kw):
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

    make = {
        "ddim": DDIMScheduler,
        "dpm++": DPMSolverMultistepScheduler,
        "euler": EulerDiscreteScheduler,
        "ddpm": DDPMScheduler,
    }[name]
    return make.from_config(config, **kw)


class TestSchedulerSwaps:
    """``pipe.scheduler = X.from_config(pipe.scheduler.config)``: the default scheduler's learned variance
    (``variance_type="learned_range"``) rides along in the config."""

    @pytest.mark.parametrize("name", ["ddim", "dpm++", "euler", "ddpm"])
    def test_swap_samples_as_a_direct_loop(self, name):
        """Against a loop written as diffusers' DiTPipeline: eps alone for DDIM (eta 0), DPM-Solver++ (stepped
        as built without the variance) and Euler (fractional timesteps to the model), [eps, v] for diffusers'
        DDPMScheduler, which reads the learned variance."""
        model = _model()
        pipe = _pipe(model)
        pipe.scheduler = _swap(name, pipe.scheduler.config)
        assert pipe.scheduler.config.variance_type == "learned_range"
        labels, steps = torch.tensor([2, 0]), 4
        got = pipe(labels, guidance_scale=1.0, num_inference_steps=steps, output_type="latent",
                   generator=_gens([5, 6])).images  # fmt: skip
        assert got.shape == (2, 4, 8, 8) and torch.isfinite(got).all()
        assert pipe.scheduler.config.variance_type == "learned_range"  # the given scheduler is left as it is

        sched = _swap(name, pipe.scheduler.config, **({"variance_type": None} if name == "dpm++" else {}))
        sched.set_timesteps(steps)
        gens = _gens([5, 6])
        x = torch.cat([torch.randn(1, 4, 8, 8, generator=g) for g in gens]) * sched.init_noise_sigma
        with torch.no_grad():
            for t in sched.timesteps:
                out = model(sched.scale_model_input(x, t), t.reshape(1).expand(2), labels)
                x = sched.step(out if name == "ddpm" else out[:, :4], t, x, generator=gens).prev_sample
        torch.testing.assert_close(got, x, rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize("name", ["ddim", "dpm++", "euler"])
    def test_swap_with_guidance_is_deterministic(self, name):
        pipe = _pipe(_model())
        pipe.scheduler = _swap(name, pipe.scheduler.config)
        call = dict(class_labels=[0, 4], guidance_scale=3.0, num_inference_steps=3, output_type="latent")
        a = pipe(generator=_gens([1, 2]), **call).images
        assert a.shape == (2, 4, 8, 8) and torch.isfinite(a).all()
        assert torch.equal(a, pipe(generator=_gens([1, 2]), **call).images)

    def test_which_schedulers_read_the_variance(self):
        config = _pipe(_model()).scheduler.config  # the default scheduler's: variance_type="learned_range"
        assert reads_variance(RespacedDDPMScheduler()) and reads_variance(_swap("ddpm", config))
        assert not reads_variance(RespacedDDPMScheduler(variance_type="fixed_large"))
        for name in ("ddim", "euler", "dpm++"):
            assert not reads_variance(_swap(name, config)), name
        ddim = _swap("ddim", config)
        assert eps_scheduler(ddim) is ddim
        dpm = _swap("dpm++", config)
        assert eps_scheduler(dpm).config.variance_type is None and dpm.config.variance_type == "learned_range"

    def test_denoise_refuses_a_three_channel_dpm_solver_on_four_channels(self):
        sched = _swap("dpm++", _pipe(_model()).scheduler.config)
        sched.set_timesteps(2)
        with pytest.raises(ValueError, match=r"variance_type='learned_range' keeps the first 3 channels"):
            denoise(_model(), sched, torch.randn(1, 4, 8, 8), torch.tensor([0]))


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    from helpers.generation import write_tiny_vae

    return write_tiny_vae(tmp_path_factory.mktemp("vae"))
