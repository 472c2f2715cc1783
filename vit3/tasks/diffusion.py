"""Gaussian diffusion for DiT³ on ``diffusers``: forward process, the official training objective, samplers.

* Forward process: ``diffusers.DDPMScheduler`` with the official schedule (linear betas 1e-4 .. 0.02 over
  1000 steps, epsilon prediction, no clipping); ``q_sample`` is its ``add_noise``.
* Objective (the official DiT / improved-DDPM "hybrid" loss, ``LossType.MSE`` with ``LEARNED_RANGE``):
  ``mse = mean((eps - eps_hat)^2)`` and, when the model learns its variance, plus the variational-bound term
  ``vb`` for the variance only (the mean is computed from a stop-gradient copy of ``eps_hat``): at ``t > 0``
  the KL divergence ``KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t))`` and at ``t = 0`` the negative
  log-likelihood of ``x_0`` under the discretised Gaussian decoder, both averaged over the pixels and in bits.
  The model variance interpolates the log of the clipped posterior variance and ``log beta_t`` by
  ``frac = (v + 1) / 2``. diffusers has no training loss for this, so it is written here; the decoder uses
  the official tanh approximation of the normal CDF (``cdf=torch.special.ndtr`` gives the exact one).
* Samplers (generation): ``ddpm`` (``DDPMScheduler``, ``variance_type="learned_range"`` when the model
  learns its variance: it reads ``[eps, v]``), ``ddim`` (``DDIMScheduler``, eta 0) and ``dpm++``
  (``DPMSolverMultistepScheduler``, DPM-Solver++ order 2); the last two read ``eps`` only. ``ddpm`` and
  ``ddim`` use "leading" timestep spacing, which is the official respacing (``250`` steps: 996, 992, ..., 0).
  Classifier-free guidance runs through the model's ``forward_with_cfg``.
* :class:`LatentAutoencoder`: a local ``diffusers.AutoencoderKL`` (a folder in diffusers' layout; nothing is
  downloaded) mapping images in ``[-1, 1]`` to scaled latents and back, as the official train/sample scripts.

The schedule tables of the objective are float64 (computed from the scheduler's betas); the loss runs in the
model output's precision (at least float32).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

try:
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler
    from diffusers.utils.torch_utils import randn_tensor
except ImportError as exc:  # the generation extra is not installed
    raise ImportError(f"DiT³ diffusion needs diffusers: pip install -e '.[generation]' ({exc})") from exc

__all__ = [
    "SAMPLERS",
    "GaussianDiffusion",
    "LatentAutoencoder",
    "approx_standard_normal_cdf",
    "discretized_gaussian_log_likelihood",
    "normal_kl",
]

SAMPLERS = ("ddpm", "ddim", "dpm++")
Generator = torch.Generator | list[torch.Generator] | None


def normal_kl(mean1: Tensor, logvar1: Tensor, mean2: Tensor, logvar2: Tensor) -> Tensor:
    """Elementwise ``KL(N(mean1, e^logvar1) || N(mean2, e^logvar2))`` in nats (arguments broadcast)."""
    return 0.5 * (
        -1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def approx_standard_normal_cdf(x: Tensor) -> Tensor:
    """The tanh approximation of the standard normal CDF used by the official decoder likelihood."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(
    x: Tensor,
    means: Tensor,
    log_scales: Tensor,
    cdf: Callable[[Tensor], Tensor] = approx_standard_normal_cdf,
    half_bin: float = 1.0 / 255.0,
) -> Tensor:
    """Log-probability (nats) of data ``x`` in ``[-1, 1]`` under a Gaussian discretised to 8-bit bins.

    Each value owns the bin ``[x - 1/255, x + 1/255]``; the lowest bin (``x < -0.999``) extends to -inf and
    the highest (``x > 0.999``) to +inf. Probabilities are clamped at 1e-12 before the log.

    Args:
        x: targets ``[B, ...]``.
        means: Gaussian means, shaped like ``x``.
        log_scales: log standard deviations, shaped like ``x``.
        cdf: the standard normal CDF (default: the official tanh approximation).
        half_bin: half the bin width.
    """
    if not x.shape == means.shape == log_scales.shape:
        raise ValueError(
            f"shapes differ: x {tuple(x.shape)}, means {tuple(means.shape)}, log_scales {tuple(log_scales.shape)}"
        )
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = cdf(inv_std * (centered + half_bin))
    cdf_min = cdf(inv_std * (centered - half_bin))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def _mean_flat(x: Tensor) -> Tensor:
    """Mean over every dim but the batch: ``[B, ...] -> [B]``."""
    return x.mean(dim=tuple(range(1, x.ndim)))


class GaussianDiffusion:
    """The official DiT diffusion on diffusers' schedulers (see the module docstring).

    Args:
        num_timesteps: training diffusion steps T.
        beta_schedule: a diffusers beta schedule name (official: ``"linear"``).
        beta_start: first beta.
        beta_end: last beta.
        learn_sigma: the model outputs ``[eps, v]`` (learned variance range) instead of ``eps``.
    """

    def __init__(
        self,
        num_timesteps: int = 1000,
        beta_schedule: str = "linear",
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
        learn_sigma: bool = True,
    ) -> None:
        if num_timesteps < 2:
            raise ValueError(f"num_timesteps must be >= 2, got {num_timesteps}")
        self.num_timesteps = int(num_timesteps)
        self.learn_sigma = bool(learn_sigma)
        self._schedule = dict(
            num_train_timesteps=self.num_timesteps,
            beta_schedule=beta_schedule,
            beta_start=float(beta_start),
            beta_end=float(beta_end),
            prediction_type="epsilon",
        )
        self.scheduler = DDPMScheduler(
            **self._schedule,
            variance_type="learned_range" if learn_sigma else "fixed_large",
            clip_sample=False,
            timestep_spacing="leading",
        )
        betas = self.scheduler.betas.double()
        ac = torch.cumprod(1.0 - betas, dim=0)
        ac_prev = torch.cat([ac.new_ones(1), ac[:-1]])
        post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
        # log clipped at t = 0, where the posterior variance is 0: the official code repeats t = 1's value
        self._tables = {
            "sqrt_recip_ac": torch.sqrt(1.0 / ac),
            "sqrt_recipm1_ac": torch.sqrt(1.0 / ac - 1.0),
            "post_logvar": torch.log(torch.cat([post_var[1:2], post_var[1:]])),
            "post_coef1": betas * torch.sqrt(ac_prev) / (1.0 - ac),
            "post_coef2": (1.0 - ac_prev) * torch.sqrt(1.0 - betas) / (1.0 - ac),
            "log_betas": torch.log(betas),
        }
        self._on: dict[tuple[torch.device, torch.dtype], dict[str, Tensor]] = {}

    def _take(self, name: str, t: Tensor, like: Tensor) -> Tensor:
        """Table ``name`` at timesteps ``t`` ``[B]``, shaped ``[B, 1, ...]`` to broadcast against ``like``."""
        key = (like.device, like.dtype)
        if key not in self._on:
            self._on[key] = {k: v.to(device=like.device, dtype=like.dtype) for k, v in self._tables.items()}
        return self._on[key][name][t].view(-1, *([1] * (like.ndim - 1)))

    def _check_timesteps(self, t: Tensor, batch: int) -> None:
        if t.ndim != 1 or t.shape[0] != batch or t.is_floating_point():
            raise ValueError(
                f"timesteps must be integer indices [B] = [{batch}], got {t.dtype} {tuple(t.shape)}"
            )
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_timesteps):
            raise ValueError(
                f"timesteps must lie in [0, {self.num_timesteps - 1}], got [{int(t.min())}, {int(t.max())}]"
            )

    # --- forward process ------------------------------------------------------------------------------

    def sample_timesteps(
        self, batch: int, device: torch.device | str, generator: torch.Generator | None = None
    ) -> Tensor:
        """Uniform training timesteps ``[B]`` in ``[0, T)``."""
        return torch.randint(0, self.num_timesteps, (batch,), device=device, generator=generator)

    def q_sample(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise`` (diffusers ``add_noise``); all ``[B, C, H, W]``."""
        self._check_timesteps(t, x0.shape[0])
        return self.scheduler.add_noise(x0, noise, t)

    def q_posterior(self, x0: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and clipped log-variance of ``q(x_{t-1} | x_t, x_0)``, each ``[B, C, H, W]`` (variance broadcast)."""
        mean = self._take("post_coef1", t, x_t) * x0 + self._take("post_coef2", t, x_t) * x_t
        return mean, self._take("post_logvar", t, x_t).expand_as(x_t)

    def p_mean_logvar(self, eps: Tensor, v: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and log-variance of the model's ``p(x_{t-1} | x_t)`` from ``eps`` and the range output ``v``.

        ``x0_hat = sqrt(1 / a_t) x_t - sqrt(1 / a_t - 1) eps`` (not clipped), the mean is the posterior mean
        at ``x0_hat``, and ``logvar = frac * log(beta_t) + (1 - frac) * post_logvar_t`` with ``frac = (v + 1) / 2``.
        """
        x0_hat = self._take("sqrt_recip_ac", t, x_t) * x_t - self._take("sqrt_recipm1_ac", t, x_t) * eps
        mean, _ = self.q_posterior(x0_hat, x_t, t)
        frac = (v + 1) / 2
        logvar = frac * self._take("log_betas", t, x_t) + (1 - frac) * self._take("post_logvar", t, x_t)
        return mean, logvar

    # --- objective ------------------------------------------------------------------------------------

    def vb_terms(
        self,
        x0: Tensor,
        x_t: Tensor,
        t: Tensor,
        eps: Tensor,
        v: Tensor,
        cdf: Callable[[Tensor], Tensor] = approx_standard_normal_cdf,
    ) -> Tensor:
        """The variational-bound term per sample ``[B]`` in bits per dimension.

        ``t > 0``: ``mean_pixels KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) / ln 2``;
        ``t = 0``: ``-mean_pixels log p(x_0 | x_1) / ln 2`` under the discretised Gaussian decoder.
        """
        true_mean, true_logvar = self.q_posterior(x0, x_t, t)
        mean, logvar = self.p_mean_logvar(eps, v, x_t, t)
        kl = _mean_flat(normal_kl(true_mean, true_logvar, mean, logvar)) / math.log(2.0)
        nll = -_mean_flat(discretized_gaussian_log_likelihood(x0, mean, 0.5 * logvar, cdf)) / math.log(2.0)
        return torch.where(t == 0, nll, kl)

    def training_losses(
        self, model_output: Tensor, x0: Tensor, x_t: Tensor, t: Tensor, noise: Tensor
    ) -> dict[str, Tensor]:
        """The official objective for one batch.

        Args:
            model_output: ``[B, C, H, W]`` (``eps``) or ``[B, 2C, H, W]`` (``[eps, v]`` with ``learn_sigma``).
            x0: clean data ``[B, C, H, W]``; x_t: its noised version at ``t``; noise: the noise used.
            t: integer timesteps ``[B]``.

        Returns:
            ``{"loss", "mse"}`` and, with ``learn_sigma``, ``"vb"``: per-sample ``[B]`` (``loss = mse + vb``).
            The gradient of ``vb`` reaches the variance output only.
        """
        c = x0.shape[1]
        want = 2 * c if self.learn_sigma else c
        if model_output.shape[1] != want or model_output.shape[2:] != x0.shape[2:]:
            raise ValueError(
                f"model output {tuple(model_output.shape)} does not fit data {tuple(x0.shape)}: expected {want} "
                f"channels ({'[eps, v]' if self.learn_sigma else 'eps'}, learn_sigma={self.learn_sigma})"
            )
        self._check_timesteps(t, x0.shape[0])
        dtype = torch.promote_types(model_output.dtype, torch.float32)
        out, x0, x_t, noise = (a.to(dtype) for a in (model_output, x0, x_t, noise))
        eps = out[:, :c]
        terms = {"mse": _mean_flat((noise - eps) ** 2)}
        if self.learn_sigma:
            terms["vb"] = self.vb_terms(x0, x_t, t, eps.detach(), out[:, c:])  # stop-gradient on the mean
            terms["loss"] = terms["mse"] + terms["vb"]
        else:
            terms["loss"] = terms["mse"]
        return terms

    # --- sampling -------------------------------------------------------------------------------------

    def make_scheduler(self, sampler: str):
        """A fresh diffusers scheduler for ``sampler`` on this diffusion's schedule."""
        if sampler == "ddpm":
            return DDPMScheduler.from_config(self.scheduler.config)
        if sampler == "ddim":
            return DDIMScheduler(
                **self._schedule, clip_sample=False, set_alpha_to_one=True, timestep_spacing="leading"
            )
        if sampler == "dpm++":
            return DPMSolverMultistepScheduler(
                **self._schedule, algorithm_type="dpmsolver++", solver_order=2, lower_order_final=True
            )
        raise ValueError(f"unknown sampler {sampler!r}: choose from {', '.join(SAMPLERS)}")

    @torch.no_grad()
    def sample(
        self,
        model: nn.Module,
        labels: Tensor,
        shape: Sequence[int],
        sampler: str = "ddpm",
        steps: int = 250,
        cfg_scale: float = 1.0,
        generator: Generator = None,
        guided_channels: int | None = None,
        progress: Callable[[Any], Any] | None = None,
    ) -> Tensor:
        """Generates latents for ``labels`` by running a diffusers sampler over the model.

        Args:
            model: a DiT³ (``forward`` / ``forward_with_cfg``; put in eval mode for the call).
            labels: class labels ``[N]`` (in ``[0, num_classes)``).
            shape: ``(C, H, W)`` of one latent.
            sampler: ``"ddpm"``, ``"ddim"`` or ``"dpm++"``.
            steps: sampling steps (at most ``num_timesteps``).
            cfg_scale: classifier-free guidance scale (1: no guidance, one pass per step).
            generator: a ``torch.Generator`` or one per sample (then each sample depends on its own seed
                only, not on the batch it is drawn in).
            guided_channels: passed to ``forward_with_cfg`` (``None``: the official choice).
            progress: optional wrapper of the timestep iterator (e.g. ``tqdm``).

        Returns:
            Latents ``[N, C, H, W]``.

        Raises:
            ValueError: unknown sampler, bad step count, labels out of range, or guidance without a null class.
        """
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}: choose from {', '.join(SAMPLERS)}")
        if not 1 <= int(steps) <= self.num_timesteps:
            raise ValueError(f"sampling steps must be in [1, {self.num_timesteps}], got {steps}")
        if cfg_scale != 1.0 and not model.has_null_class:
            raise ValueError(
                f"cfg_scale={cfg_scale} needs the null class, but the model was trained with "
                f"class_dropout_prob=0 (no unconditional embedding): sample with cfg_scale=1"
            )
        if labels.ndim != 1 or labels.is_floating_point():
            raise ValueError(
                f"labels must be integer class indices [N], got {labels.dtype} {tuple(labels.shape)}"
            )
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= model.num_classes):
            raise ValueError(
                f"labels must lie in [0, {model.num_classes - 1}] (the model's classes), got "
                f"[{int(labels.min())}, {int(labels.max())}]"
            )
        if model.learn_sigma != self.learn_sigma:
            raise ValueError(
                f"model learn_sigma={model.learn_sigma} but the diffusion has learn_sigma={self.learn_sigma}"
            )
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        n, c = labels.shape[0], int(shape[0])
        labels = labels.to(device)
        sched = self.make_scheduler(sampler)
        sched.set_timesteps(int(steps), device=device)
        x = randn_tensor((n, *map(int, shape)), generator=generator, device=device, dtype=dtype)
        x = x * sched.init_noise_sigma
        null = torch.full_like(labels, model.num_classes)
        keep_variance = sampler == "ddpm" and self.learn_sigma
        was_training = model.training
        model.eval()
        try:
            timesteps = sched.timesteps if progress is None else progress(sched.timesteps)
            for t in timesteps:
                tt = torch.full((n,), int(t), device=device, dtype=torch.long)
                xin = sched.scale_model_input(x, t)
                if cfg_scale == 1.0:
                    out = model(xin, tt, labels)
                else:
                    both = model.forward_with_cfg(
                        torch.cat([xin, xin]),
                        torch.cat([tt, tt]),
                        torch.cat([labels, null]),
                        cfg_scale,
                        guided_channels,
                    )
                    out = both[:n]
                out = out if keep_variance else out[:, :c]
                x = sched.step(out, t, x, generator=generator).prev_sample
        finally:
            model.train(was_training)
        return x


class LatentAutoencoder(nn.Module):
    """A local ``diffusers.AutoencoderKL``: images in ``[-1, 1]`` <-> latents scaled by ``scaling_factor``.

    Args:
        path: a folder in diffusers' layout (``config.json`` + weights, e.g. a copy of
            ``stabilityai/sd-vae-ft-mse``); read with ``local_files_only``, nothing is downloaded.
        scaling_factor: latent scale (``None``: the VAE config's, 0.18215 for the SD VAEs).
        sample_posterior: encode with a sample of the posterior (official) instead of its mean.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a diffusers AutoencoderKL folder.
    """

    def __init__(
        self, path: str | os.PathLike, scaling_factor: float | None = None, sample_posterior: bool = True
    ) -> None:
        super().__init__()
        from diffusers import AutoencoderKL

        root = Path(path)
        if not str(path) or not root.exists():
            raise FileNotFoundError(
                f"VAE path {str(path)!r} does not exist: vae.path must be a local diffusers AutoencoderKL folder "
                f"(config.json + weights, e.g. a copy of stabilityai/sd-vae-ft-mse); nothing is downloaded"
            )
        if not (root.is_dir() and (root / "config.json").is_file()):
            raise FileNotFoundError(
                f"VAE path {root} is not a diffusers AutoencoderKL folder (expected {root / 'config.json'} and the weights)"
            )
        try:
            self.vae = AutoencoderKL.from_pretrained(str(root), local_files_only=True)
        except Exception as exc:  # corrupt weights, another model class: name the folder
            raise ValueError(
                f"cannot load an AutoencoderKL from {root}: {type(exc).__name__}: {exc}"
            ) from exc
        self.vae.eval().requires_grad_(False)
        config = self.vae.config
        self.scaling_factor = float(scaling_factor if scaling_factor is not None else config.scaling_factor)
        self.sample_posterior = sample_posterior
        self.latent_channels = int(config.latent_channels)
        self.image_channels = int(config.in_channels)
        self.downsample = 2 ** (len(config.block_out_channels) - 1)

    @torch.no_grad()
    def encode(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Images ``[B, C_img, H, W]`` in ``[-1, 1]`` -> latents ``[B, C_lat, H / f, W / f]``."""
        dist = self.vae.encode(x.to(self.vae.dtype)).latent_dist
        z = dist.sample(generator) if self.sample_posterior else dist.mode()
        return z * self.scaling_factor

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        """Latents ``[B, C_lat, h, w]`` -> images ``[B, C_img, h * f, w * f]`` in about ``[-1, 1]``."""
        return self.vae.decode(z.to(self.vae.dtype) / self.scaling_factor).sample
