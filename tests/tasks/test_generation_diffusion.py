"""vit3.tasks.diffusion: the official objective against a float64 brute force, the official sampler (fixture),
sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from helpers.common import LOCAL_FIXTURES, default_dtype, load_fixture, load_tree
from torch import nn

from vit3.models.dit3 import create_dit3, dit3_state_from_official
from vit3.tasks import diffusion as diffusion_module
from vit3.tasks.diffusion import SAMPLERS, GaussianDiffusion, LatentAutoencoder, space_timesteps

pytestmark = pytest.mark.usefixtures("one_thread")

integrate = pytest.importorskip("scipy.integrate")


@pytest.fixture(scope="module")
def diffusion():
    return GaussianDiffusion()


# -------------------------------------------------------------------------- float64 brute-force reference
class BruteForce:
    """The variational-bound term from first principles, one pixel at a time in Python floats.

    The posterior q(x_{t-1} | x_t, x_0) comes from Bayes' rule on the forward chain (product of the two
    Gaussians q(x_{t-1} | x_0) and q(x_t | x_{t-1})), the KL divergence and the decoder's bin probability are
    numerical integrals of the Gaussian densities (scipy quad): none of the closed forms of the code under
    test.
    """

    def __init__(self, betas: list[float]) -> None:
        self.betas = betas

    def alpha_bar(self, t: int) -> float:
        return math.prod(1.0 - b for b in self.betas[: t + 1]) if t >= 0 else 1.0

    def posterior(self, x0: float, xt: float, t: int) -> tuple[float, float]:
        ab_prev, b = self.alpha_bar(t - 1), self.betas[t]
        var = 1.0 / (1.0 / (1.0 - ab_prev) + (1.0 - b) / b)
        return var * (math.sqrt(ab_prev) * x0 / (1.0 - ab_prev) + math.sqrt(1.0 - b) * xt / b), var

    @staticmethod
    def pdf(x: float, mean: float, var: float) -> float:
        return math.exp(-((x - mean) ** 2) / (2 * var)) / math.sqrt(2 * math.pi * var)

    def model(self, xt: float, t: int, eps: float, v: float) -> tuple[float, float]:
        ab = self.alpha_bar(t)
        x0_hat = (xt - math.sqrt(1 - ab) * eps) / math.sqrt(ab)
        min_log = math.log(self.posterior(0.0, 0.0, max(t, 1))[1])  # clipped: t = 0 takes t = 1's variance
        frac = (v + 1) / 2
        var = math.exp(frac * math.log(self.betas[t]) + (1 - frac) * min_log)
        mean = x0_hat if t == 0 else self.posterior(x0_hat, xt, t)[0]  # at t = 0 the posterior mean is x0
        return mean, var

    def term_bits(self, x0: float, xt: float, t: int, eps: float, v: float) -> float:
        mean, var = self.model(xt, t, eps, v)
        if t > 0:
            pm, pv = self.posterior(x0, xt, t)
            s = math.sqrt(pv)

            def f(x: float) -> float:
                p = self.pdf(x, pm, pv)
                return p * (math.log(p) - math.log(self.pdf(x, mean, var)))

            kl, _ = integrate.quad(f, pm - 30 * s, pm + 30 * s, epsabs=1e-15, epsrel=1e-13, limit=500)
            return kl / math.log(2)
        lo = -math.inf if x0 < -0.999 else x0 - 1 / 255
        hi = math.inf if x0 > 0.999 else x0 + 1 / 255
        s = math.sqrt(var)
        p, _ = integrate.quad(
            lambda x: self.pdf(x, mean, var),
            max(lo, mean - 40 * s),
            min(hi, mean + 40 * s),
            epsabs=1e-16,
            epsrel=1e-13,
        )
        return -math.log(p) / math.log(2)

    def vb(self, x0, xt, t, eps, v) -> torch.Tensor:
        rows = []
        for i in range(x0.shape[0]):
            vals = [
                self.term_bits(
                    *(float(a[i].flatten()[j]) for a in (x0, xt)),
                    int(t[i]),
                    float(eps[i].flatten()[j]),
                    float(v[i].flatten()[j]),
                )
                for j in range(x0[i].numel())
            ]
            rows.append(sum(vals) / len(vals))
        return torch.tensor(rows, dtype=torch.float64)


def _batch(diffusion, t: list[int], seed: int = 0):
    """8-bit data in [-1, 1] (both edge bins present), its noised version, a near-true eps and a range v."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(t), 1, 2, 3)
    x0 = torch.randint(0, 256, shape, generator=g).double() / 127.5 - 1
    x0[0, 0, 0, :2] = torch.tensor([-1.0, 1.0])
    tt = torch.tensor(t)
    noise = torch.randn(shape, generator=g, dtype=torch.float64)
    xt = diffusion.q_sample(x0, tt, noise)
    eps = noise + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
    return x0, xt, tt, noise, eps, v


def test_variational_bound_matches_a_float64_brute_force(diffusion):
    brute = BruteForce([float(b) for b in diffusion.betas])
    x0, xt, t, _, eps, v = _batch(diffusion, [0, 0, 1, 2, 250, 999])
    want = brute.vb(x0, xt, t, eps, v)
    exact = diffusion.vb_terms(x0, xt, t, eps, v, cdf=torch.special.ndtr)
    torch.testing.assert_close(exact, want, rtol=1e-9, atol=0)
    # the official decoder uses a tanh approximation of the normal CDF: same KL terms, a close decoder NLL
    official = diffusion.vb_terms(x0, xt, t, eps, v)
    torch.testing.assert_close(official[2:], want[2:], rtol=1e-9, atol=0)
    torch.testing.assert_close(official[:2], want[:2], rtol=2e-3, atol=0)


def test_training_loss_is_mse_plus_vb_with_the_mean_frozen(diffusion):
    x0, xt, t, noise, eps, v = _batch(diffusion, [0, 5, 400, 900], seed=1)
    out = torch.cat([eps, v], dim=1).requires_grad_(True)
    terms = diffusion.training_losses(out, x0, xt, t, noise)
    mse = ((noise - eps) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(terms["mse"], mse, rtol=1e-12, atol=0)
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"], rtol=1e-12, atol=0)
    (grad_vb,) = torch.autograd.grad(terms["vb"].sum(), out, retain_graph=True)
    assert torch.equal(grad_vb[:, :1], torch.zeros_like(grad_vb[:, :1]))  # stop-gradient on the mean
    assert grad_vb[:, 1:].abs().sum() > 0  # the variance learns from the bound
    (grad_mse,) = torch.autograd.grad(terms["mse"].sum(), out)
    assert torch.equal(grad_mse[:, 1:], torch.zeros_like(grad_mse[:, 1:]))


def test_training_loss_without_learn_sigma_is_the_mse():
    d = GaussianDiffusion(learn_sigma=False)
    x0, xt, t, noise, eps, _ = _batch(d, [3, 700])
    terms = d.training_losses(eps, x0, xt, t, noise)
    assert set(terms) == {"loss", "mse"}
    with pytest.raises(ValueError, match=r"expected 1 channels \(eps, learn_sigma=False\)"):
        d.training_losses(torch.cat([eps, eps], 1), x0, xt, t, noise)


# ------------------------------------------------------------------------------------- schedule and steps
def _alpha_bar64(diffusion) -> torch.Tensor:
    return torch.cumprod(1.0 - diffusion.betas, 0)


def test_official_schedule_and_add_noise_closed_form(diffusion):
    official = torch.from_numpy(np.linspace(1e-4, 0.02, 1000, dtype=np.float64))  # get_named_beta_schedule
    torch.testing.assert_close(diffusion.betas, official, rtol=1e-15, atol=0)
    ab = _alpha_bar64(diffusion)
    x0, t = torch.randn(5, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 10, 500, 999])
    noise = torch.randn_like(x0)
    want = ab[t].sqrt().view(-1, 1, 1, 1) * x0 + (1 - ab[t]).sqrt().view(-1, 1, 1, 1) * noise
    torch.testing.assert_close(diffusion.q_sample(x0, t, noise), want, rtol=1e-13, atol=1e-15)


def _closed_form_prev(ab: torch.Tensor, t: int, prev: int, xt, eps, v):
    """DDPM on a respaced chain (official respacing: betas from the kept alpha bars): mean and
    log-variance."""
    a_t, a_p = ab[t], (ab[prev] if prev >= 0 else torch.tensor(1.0, dtype=ab.dtype))
    beta = 1 - a_t / a_p
    x0 = (xt - (1 - a_t).sqrt() * eps) / a_t.sqrt()
    mean = (a_p.sqrt() * beta / (1 - a_t)) * x0 + ((1 - beta).sqrt() * (1 - a_p) / (1 - a_t)) * xt
    post = beta * (1 - a_p) / (1 - a_t)
    frac = (v + 1) / 2
    return mean, frac * beta.log() + (1 - frac) * post.log()


@pytest.mark.parametrize("steps", [1000, 250, 23], ids=["full", "respaced-250", "respaced-23"])
def test_ddpm_step_samples_the_distribution_of_the_objective(diffusion, steps):
    """The learned-range DDPM step draws from N(mean, exp(logvar)) of the closed form on the chain of the kept
    timesteps (and, at 1000 steps, of the distribution the variational bound trains)."""
    sched = diffusion.make_scheduler("ddpm")
    sched.set_timesteps(steps)
    ab = _alpha_bar64(diffusion)
    ts = sched.timesteps.tolist()
    for i in (0, len(ts) // 2, len(ts) - 2):
        t, prev = ts[i], ts[i + 1]
        xt, eps = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64)
        v = torch.rand(2, 3, 4, 4, dtype=torch.float64) * 2 - 1
        got = sched.step(
            torch.cat([eps, v], 1), t, xt, generator=torch.Generator().manual_seed(7)
        ).prev_sample
        z = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        mean, logvar = _closed_form_prev(ab, t, prev, xt, eps, v)
        torch.testing.assert_close(got, mean + (0.5 * logvar).exp() * z, rtol=1e-12, atol=1e-12)
        if steps == 1000:
            ours_mean, ours_logvar = diffusion.p_mean_logvar(eps, v, xt, torch.full((2,), t))
            torch.testing.assert_close(ours_mean, mean, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ours_logvar, logvar, rtol=1e-12, atol=1e-12)


def test_ddpm_step_agrees_with_diffusers_given_the_official_timesteps(diffusion):
    """diffusers' DDPMScheduler, handed the official timesteps, takes the same respaced step (within its
    float32 tables): the same chain, the same learned-range variance, the same noise from a generator."""
    ours = diffusion.make_scheduler("ddpm")
    ours.set_timesteps(250)
    theirs = DDPMScheduler(variance_type="learned_range", clip_sample=False)
    theirs.set_timesteps(timesteps=ours.timesteps.tolist())
    for t in (999, 169, 164, 4):  # 169 -> 164: a gap of 5
        xt, out = (
            torch.randn(2, 3, 4, 4),
            torch.cat([torch.randn(2, 3, 4, 4), torch.rand(2, 3, 4, 4) * 2 - 1], 1),
        )
        a = ours.step(out, t, xt, generator=torch.Generator().manual_seed(t)).prev_sample
        b = theirs.step(out, t, xt, generator=torch.Generator().manual_seed(t)).prev_sample
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"t={t}")


def test_ddpm_last_step_adds_no_noise(diffusion):
    sched = diffusion.make_scheduler("ddpm")
    sched.set_timesteps(250)
    assert sched.timesteps[0] == 999 and sched.timesteps[-1] == 0  # the official respacing
    xt, eps, v = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)
    a = sched.step(torch.cat([eps, v], 1), 0, xt, generator=torch.Generator().manual_seed(1)).prev_sample
    b = sched.step(torch.cat([eps, v], 1), 0, xt, generator=torch.Generator().manual_seed(2)).prev_sample
    assert torch.equal(a, b)


def test_ddim_step_is_the_closed_form(diffusion):
    """Each DDIM step goes to the next kept timestep, even where the official set's gaps are uneven."""
    sched = diffusion.make_scheduler("ddim")
    sched.set_timesteps(50)
    ab = _alpha_bar64(diffusion)
    ts = sched.timesteps.tolist()
    assert {ts[i] - ts[i + 1] for i in range(49)} == {20, 21}  # the official 50-step set
    for i in (0, 25, 49):
        t = ts[i]
        a_p = ab[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0, dtype=torch.float64)
        xt, eps = torch.randn(2, 1, 3, 3, dtype=torch.float64), torch.randn(2, 1, 3, 3, dtype=torch.float64)
        x0 = (xt - (1 - ab[t]).sqrt() * eps) / ab[t].sqrt()
        want = a_p.sqrt() * x0 + (1 - a_p).sqrt() * eps
        torch.testing.assert_close(sched.step(eps, t, xt).prev_sample, want, rtol=1e-12, atol=1e-12)


def test_a_step_at_a_timestep_that_is_not_kept_is_refused(diffusion):
    sched = diffusion.make_scheduler("ddim")
    sched.set_timesteps(250)
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match=r"timestep 996 is not one of the 250 kept by set_timesteps\(250\)"):
        sched.step(x, 996, x)
    with pytest.raises(ValueError, match=r"expected 2 channels \(\[eps, v\]\)"):
        diffusion.make_scheduler("ddpm").step(x, 999, x)


# -------------------------------------------------------------------------------- the official sampler
@pytest.fixture(scope="module")
def official():
    """The official DiTTT sampler's numbers (tests/fixtures/make_official_sampling.py) and its model."""
    fx = load_tree(LOCAL_FIXTURES / "official_dittt_sampling.npz")
    weights = load_fixture(fx["model_fixture"])
    with default_dtype(torch.float64):
        model = create_dit3("dit3_s_2", **weights["config"])
    model.load_state_dict(dit3_state_from_official(weights["state_dict"], model))
    return fx, model.eval()


def test_respacing_visits_the_official_timesteps(official):
    fx, _ = official
    assert space_timesteps(1000, 250)[:4] == [0, 4, 8, 12] and space_timesteps(1000, 250)[-2:] == [995, 999]
    for steps, want in fx["spacing"].items():
        assert space_timesteps(1000, steps) == want.tolist(), f"{steps} steps"
        for sampler in ("ddpm", "ddim"):
            sched = GaussianDiffusion().make_scheduler(sampler)
            sched.set_timesteps(steps)
            assert sched.timesteps.tolist() == want.flip(0).tolist(), f"{sampler}, {steps} steps"


@pytest.mark.parametrize("steps", [250, 50])
def test_respaced_chain_is_the_official_one(official, steps):
    """Betas 1 - abar_t / abar_prev over the kept timesteps, and the posterior means and variances of them."""
    fx, _ = official
    sched = GaussianDiffusion().make_scheduler("ddpm")
    sched.set_timesteps(steps)
    want = fx["tables"][steps]
    names = {
        "betas": "betas",
        "alphas_cumprod": "alphas_cumprod",
        "alphas_cumprod_prev": "alphas_cumprod_prev",
        "post_var": "posterior_variance",
        "post_logvar": "posterior_log_variance_clipped",
        "post_coef1": "posterior_mean_coef1",
        "post_coef2": "posterior_mean_coef2",
    }
    for ours, theirs in names.items():
        torch.testing.assert_close(sched.tables[ours], want[theirs], rtol=1e-12, atol=0, msg=ours)
    assert sched.timesteps.flip(0).tolist() == want["timestep_map"].tolist()


@pytest.mark.parametrize("run", ["ddpm250_cfg1.5", "ddim50_cfg4", "ddpm25_cond"])
def test_sampling_reproduces_the_official_loop(official, run, monkeypatch):
    """From the same initial and per-step noise, a whole sampling run equals the official one in float64."""
    fx, model = official
    r = fx["runs"][run]
    draws = iter([r["z"], *(r["noise"].double() if r["noise"] is not None else [])])

    def fixed_noise(shape, generator=None, device=None, dtype=None):
        out = next(draws)
        assert tuple(out.shape) == tuple(shape) and dtype == torch.float64
        return out

    monkeypatch.setattr(diffusion_module, "randn_tensor", fixed_noise)
    got = GaussianDiffusion().sample(
        model, r["labels"], (4, 8, 8), r["sampler"], r["steps"], cfg_scale=r["cfg_scale"]
    )
    err = ((got - r["sample"]).abs().max() / r["sample"].abs().max()).item()
    assert err < 1e-10, f"relative error {err:.3g} against the official {run}"


class Oracle(nn.Module):
    """The exact noise prediction when class c's data is the single point ``targets[c]`` (null: zeros)."""

    learn_sigma, in_channels = True, 2

    def __init__(self, diffusion: GaussianDiffusion, targets: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("targets", torch.cat([targets, torch.zeros_like(targets[:1])]))
        self.ab = _alpha_bar64(diffusion).float()
        self.num_classes, self.has_null_class = len(targets), True
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, x, t, y):
        ab = self.ab[t].view(-1, 1, 1, 1)
        eps = (x - ab.sqrt() * self.targets[y]) / (1 - ab).sqrt()
        return torch.cat([eps, torch.zeros_like(eps)], 1)

    def forward_with_cfg(self, x, t, y, cfg_scale, guided_channels=None):
        out = self.forward(x, t, y)
        n = len(x) // 2
        eps = out[n:, :2] + cfg_scale * (out[:n, :2] - out[n:, :2])
        return torch.cat([torch.cat([eps, eps]), out[:, 2:]], 1)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_recovers_the_data_under_an_exact_model(diffusion, sampler):
    targets = torch.rand(3, 2, 4, 4) * 2 - 1
    oracle = Oracle(diffusion, targets)
    labels = torch.tensor([2, 0, 1, 2])
    out = diffusion.sample(
        oracle, labels, (2, 4, 4), sampler=sampler, steps=20, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(out, targets[labels], rtol=1e-3, atol=2e-3)
    # guidance s from the null point 0 towards x_c is the exact model of the point s * x_c
    guided = diffusion.sample(oracle, labels, (2, 4, 4), sampler=sampler, steps=20, cfg_scale=1.5)
    torch.testing.assert_close(guided, 1.5 * targets[labels], rtol=1e-3, atol=3e-3)


# --------------------------------------------------------------------------------------------------- sampling
def _random_model(**kw):
    model = create_dit3(
        "dit3_s_2", input_size=8, in_channels=2, hidden_size=32, depth=1, num_heads=2, num_classes=5, **kw
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sampling_shapes_and_determinism_under_a_seed(diffusion, sampler):
    model = _random_model()
    labels = torch.tensor([0, 4, 2])
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(3)]  # noqa: E731
    a = diffusion.sample(model, labels, (2, 8, 6), sampler, steps=4, cfg_scale=3.0, generator=gens())
    b = diffusion.sample(model, labels, (2, 8, 6), sampler, steps=4, cfg_scale=3.0, generator=gens())
    assert a.shape == (3, 2, 8, 6) and torch.isfinite(a).all()
    assert torch.equal(a, b)
    # one generator per sample: sample 1 does not depend on the others in its batch
    alone = diffusion.sample(
        model, labels[1:2], (2, 8, 6), sampler, steps=4, cfg_scale=3.0, generator=gens()[1:2]
    )
    torch.testing.assert_close(alone, a[1:2], rtol=1e-5, atol=1e-5)
    other = diffusion.sample(
        model,
        labels,
        (2, 8, 6),
        sampler,
        steps=4,
        cfg_scale=3.0,
        generator=[torch.Generator().manual_seed(99)] * 3,
    )
    assert not torch.allclose(other, a)
    assert not model.training


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(sampler="euler"), r"unknown sampler 'euler'"),
        (dict(steps=0), r"sampling steps must be in \[1, 1000\]"),
        (dict(labels=torch.tensor([0, 5])), r"labels must lie in \[0, 4\]"),
        (dict(labels=torch.tensor([0.5])), r"integer class indices"),
    ],
    ids=["sampler", "steps", "label-range", "float-labels"],
)
def test_bad_sampling_requests_are_named(diffusion, kwargs, match):
    model = _random_model()
    args = dict(labels=torch.tensor([0, 1]), shape=(2, 8, 8), sampler="ddim", steps=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        diffusion.sample(model, **args)


def test_guidance_without_a_null_class_is_refused_by_the_sampler(diffusion):
    model = _random_model(class_dropout_prob=0.0)
    with pytest.raises(ValueError, match=r"cfg_scale=4.0 needs the null class"):
        diffusion.sample(model, torch.tensor([0]), (2, 8, 8), "ddim", 2, cfg_scale=4.0)
    assert diffusion.sample(model, torch.tensor([0]), (2, 8, 8), "ddim", 2).shape == (1, 2, 8, 8)


def test_objective_checks_timesteps_and_model_outputs(diffusion):
    x = torch.zeros(2, 1, 2, 2)
    with pytest.raises(ValueError, match=r"timesteps must lie in \[0, 999\]"):
        diffusion.q_sample(x, torch.tensor([0, 1000]), x)
    with pytest.raises(ValueError, match=r"integer indices"):
        diffusion.q_sample(x, torch.tensor([0.0, 1.0]), x)
    with pytest.raises(ValueError, match=r"expected 2 channels \(\[eps, v\]"):
        diffusion.training_losses(x, x, x, torch.tensor([1, 2]), x)


# ---------------------------------------------------------------------------------------------------- VAE
def test_a_missing_vae_path_is_named(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"VAE path '.*nowhere' does not exist.*nothing is downloaded"
    ):
        LatentAutoencoder(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"not a diffusers AutoencoderKL folder"):
        LatentAutoencoder(tmp_path / "empty")


def test_local_vae_encodes_and_decodes(tiny_vae):
    vae = LatentAutoencoder(tiny_vae)
    assert (vae.latent_channels, vae.downsample, vae.scaling_factor) == (4, 2, 0.18215)
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    z = vae.encode(x, generator=torch.Generator().manual_seed(0))
    assert z.shape == (2, 4, 8, 8)
    assert vae.decode(z).shape == (2, 3, 16, 16)
    mean = LatentAutoencoder(tiny_vae, sample_posterior=False)
    torch.testing.assert_close(mean.encode(x), mean.encode(x))


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    from helpers.generation import write_tiny_vae

    return write_tiny_vae(tmp_path_factory.mktemp("vae"))
