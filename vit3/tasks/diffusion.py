"""Gaussian diffusion for DiT³ on ``diffusers``: forward process, the official training objective, the
official samplers on the official respaced chain.

Schedule, objective, respacing and samplers, and why not diffusers' schedulers: ``docs/design/generation.md``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._diffusers import (
    ConfigMixin,
    DDPMScheduler,
    DDPMSchedulerOutput,
    DPMSolverMultistepInverseScheduler,
    DPMSolverMultistepScheduler,
    DPMSolverSinglestepScheduler,
    SASolverScheduler,
    SchedulerMixin,
    randn_tensor,
    register_to_config,
)
from .diffusion_chain import (
    Take,
    approx_standard_normal_cdf,
    chain_tables,
    discretized_gaussian_log_likelihood,
    learned_logvar,
    mean_flat,
    normal_kl,
    posterior_mean,
    predict_x0,
    space_timesteps,
)
from .latent import LatentAutoencoder

__all__ = [
    "SAMPLERS",
    "GaussianDiffusion",
    "LatentAutoencoder",
    "RespacedDDIMScheduler",
    "RespacedDDPMScheduler",
    "approx_standard_normal_cdf",
    "chain_tables",
    "denoise",
    "discretized_gaussian_log_likelihood",
    "eps_scheduler",
    "normal_kl",
    "reads_variance",
    "schedule_betas",
    "space_timesteps",
]

SAMPLERS = ("ddpm", "ddim", "dpm++")
VARIANCE_TYPES = ("learned_range", "fixed_large", "fixed_small")
LEARNED_VARIANCE = ("learned", "learned_range")  # diffusers' variance_type values for a [eps, v] model output
# diffusers schedulers whose learned variance_type only drops the variance, by keeping the first 3 channels of
# the model output (written for RGB pixel models)
VARIANCE_DROPPERS = (
    DPMSolverMultistepScheduler,
    DPMSolverSinglestepScheduler,
    DPMSolverMultistepInverseScheduler,
    SASolverScheduler,
)
Generator = torch.Generator | list[torch.Generator] | None


# -------------------------------------------------------------------------------------------- schedule
def schedule_betas(
    num_timesteps: int = 1000, beta_schedule: str = "linear", beta_start: float = 1e-4, beta_end: float = 0.02
) -> Tensor:
    """The betas ``[T]`` in float64: ``"linear"`` (official) computed here, other schedules diffusers'
    (float32)."""
    if beta_schedule == "linear":
        return torch.linspace(float(beta_start), float(beta_end), int(num_timesteps), dtype=torch.float64)
    sched = DDPMScheduler(
        num_train_timesteps=int(num_timesteps),
        beta_schedule=beta_schedule,
        beta_start=float(beta_start),
        beta_end=float(beta_end),
    )
    return sched.betas.double()


# ------------------------------------------------------------------------------------------ schedulers
class _RespacedScheduler(SchedulerMixin, ConfigMixin):
    """What the respaced samplers share: the float64 chain of the kept timesteps and diffusers' interface.

    ``set_timesteps(S)`` keeps :func:`space_timesteps` ``(T, S)``; ``timesteps`` lists them in sampling order
    (descending), as diffusers schedulers do. Built with the full chain (``S = T``). A sampler implements
    :meth:`_step`.

    Args:
        num_train_timesteps: training diffusion steps T.
        beta_schedule: ``"linear"`` (official, float64) or another diffusers schedule.
        beta_start: first beta.
        beta_end: last beta.
    """

    order = 1
    init_noise_sigma = 1.0

    # diffusers reads a scheduler's config from its __init__ signature: a sampler with more arguments (DDPM's
    # variance_type) spells the whole signature out again.
    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        beta_schedule: str = "linear",
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
    ) -> None:
        self._build()

    def _build(self) -> None:
        c = self.config
        betas = schedule_betas(c.num_train_timesteps, c.beta_schedule, c.beta_start, c.beta_end)
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.set_timesteps(c.num_train_timesteps)

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        """Keeps the official respacing of ``num_inference_steps`` steps (see :func:`space_timesteps`)."""
        kept = space_timesteps(self.config.num_train_timesteps, int(num_inference_steps))
        self.tables = chain_tables(self.alphas_cumprod[kept])
        self.num_inference_steps = len(kept)
        self.timesteps = torch.tensor(kept[::-1], dtype=torch.long, device=device)
        self._index = {t: i for i, t in enumerate(kept)}

    def scale_model_input(self, sample: Tensor, timestep: int | Tensor | None = None) -> Tensor:
        """The model input is the sample itself."""
        return sample

    def step(
        self,
        model_output: Tensor,
        timestep: int | Tensor,
        sample: Tensor,
        generator: Generator = None,
        return_dict: bool = True,
    ) -> DDPMSchedulerOutput | tuple[Tensor, Tensor]:
        """One step from ``timestep`` to the previous kept timestep.

        Args:
            model_output: ``[B, 2C, H, W]`` (``[eps, v]``) or ``[B, C, H, W]`` (``eps``; extra channels are
                ignored by a sampler that reads ``eps`` only).
            timestep: a kept timestep (one of ``timesteps``).
            sample: ``x_t`` ``[B, C, H, W]``.
            generator: the noise's generator(s) (one per sample: each sample depends on its own seed only).
            return_dict: return a ``DDPMSchedulerOutput`` rather than a tuple.

        Returns:
            ``prev_sample`` (``x_prev``) and ``pred_original_sample`` (``x0``), both ``[B, C, H, W]``.
        """
        t = int(timestep)
        if t not in self._index:
            raise ValueError(
                f"timestep {t} is not one of the {self.num_inference_steps} kept by "
                f"set_timesteps({self.num_inference_steps})"
            )
        i = self._index[t]
        # the entries at chain index i (0-dim float64: applied in the sample's dtype)
        prev, x0 = self._step(i, lambda name: self.tables[name][i], model_output, sample, generator)
        return DDPMSchedulerOutput(prev, x0) if return_dict else (prev, x0)

    def _step(
        self, i: int, take: Take, model_output: Tensor, sample: Tensor, generator: Generator
    ) -> tuple[Tensor, Tensor]:
        """``(x_prev, x0)`` from chain index ``i`` (0: the last step) with the tables there (``take``)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return int(self.config.num_train_timesteps)


def _split_output(model_output: Tensor, sample: Tensor, with_variance: bool) -> tuple[Tensor, Tensor | None]:
    """``eps`` (the first C channels) and, ``with_variance``, ``v`` (the next C) of a model output."""
    c = sample.shape[1]
    need = 2 * c if with_variance else c
    if model_output.shape[1] < need or model_output.shape[2:] != sample.shape[2:]:
        raise ValueError(
            f"model output {tuple(model_output.shape)} does not fit the sample {tuple(sample.shape)}: "
            f"expected {need} channels ({'[eps, v]' if with_variance else 'eps'})"
        )
    return model_output[:, :c], model_output[:, c : 2 * c] if with_variance else None


class RespacedDDPMScheduler(_RespacedScheduler):
    """The official DDPM sampler (ancestral ``p_sample``) on the respaced chain, as a diffusers scheduler.

    Args:
        num_train_timesteps, beta_schedule, beta_start, beta_end: the schedule (as the DDIM sampler's).
        variance_type: ``"learned_range"`` (the model output is ``[eps, v]``), ``"fixed_large"`` (official for
            a model without ``v``: the chain's betas) or ``"fixed_small"`` (the posterior variance).
    """

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        beta_schedule: str = "linear",
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
        variance_type: str = "learned_range",
    ) -> None:
        if variance_type not in VARIANCE_TYPES:
            raise ValueError(f"variance_type must be one of {VARIANCE_TYPES}, got {variance_type!r}")
        self._build()

    def _step(
        self, i: int, take: Take, model_output: Tensor, sample: Tensor, generator: Generator
    ) -> tuple[Tensor, Tensor]:
        learned = self.config.variance_type == "learned_range"
        eps, v = _split_output(model_output, sample, learned)
        x0 = predict_x0(take, sample, eps)
        prev = posterior_mean(take, x0, sample)
        if i > 0:  # no noise at the last step
            if learned:
                logvar = learned_logvar(take, v)
            else:
                logvar = take("large_logvar" if self.config.variance_type == "fixed_large" else "post_logvar")
            noise = randn_tensor(eps.shape, generator=generator, device=sample.device, dtype=sample.dtype)
            prev = prev + torch.exp(0.5 * logvar) * noise
        return prev, x0


class RespacedDDIMScheduler(_RespacedScheduler):
    """The official DDIM sampler (``ddim_sample``, eta 0) on the respaced chain, as a diffusers scheduler.

    ``x_prev = sqrt(abar_prev) x0 + sqrt(1 - abar_prev) eps`` (the official code re-derives ``eps`` from the
    unclipped ``x0``, the same number). Deterministic (``generator`` is unused); reads ``eps`` only. Takes the
    schedule arguments (``num_train_timesteps``, ``beta_schedule``, ``beta_start``, ``beta_end``).
    """

    def _step(
        self, i: int, take: Take, model_output: Tensor, sample: Tensor, generator: Generator
    ) -> tuple[Tensor, Tensor]:
        eps, _ = _split_output(model_output, sample, False)
        x0 = predict_x0(take, sample, eps)
        ac_prev = take("alphas_cumprod_prev")
        return torch.sqrt(ac_prev) * x0 + torch.sqrt(1.0 - ac_prev) * eps, x0


# ----------------------------------------------------------------------------------------- sampling loop
def _drops_to_three_channels(scheduler: Any) -> bool:
    return isinstance(scheduler, VARIANCE_DROPPERS) and scheduler.config.variance_type in LEARNED_VARIANCE


def reads_variance(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` takes the model's ``[eps, v]`` (``2C`` channels) or ``eps`` (``C``).

    True when ``variance_type`` is one of the scheduler's own arguments and is learned:
    :class:`RespacedDDPMScheduler` and diffusers' ``DDPMScheduler`` with ``"learned_range"``. Not for a
    ``variance_type`` that ``from_config`` carried into the config of a scheduler without one
    (``DDIMScheduler.from_config(pipe.scheduler.config)`` keeps it there unused), nor for the DPM-Solver
    family, whose learned variance only drops it (see :func:`eps_scheduler`): those get ``eps``, as
    diffusers' ``DiTPipeline`` hands its schedulers.
    """
    if isinstance(scheduler, VARIANCE_DROPPERS):
        return False
    own = "variance_type" in inspect.signature(type(scheduler).__init__).parameters
    return own and getattr(scheduler.config, "variance_type", None) in LEARNED_VARIANCE


def eps_scheduler(scheduler: Any) -> Any:
    """``scheduler``, or for a DPM-Solver-family scheduler with a learned ``variance_type`` a copy without it.

    That setting means "the model output holds the variance: keep its first 3 channels", which cuts the noise
    of a latent with another channel count; :func:`denoise` hands such a scheduler ``eps`` alone, so the copy
    steps the same ``eps`` for any channel count. ``DPMSolverMultistepScheduler.from_config(cfg)`` carries the
    learned variance of the default DDPM scheduler's config ``cfg`` over.
    """
    if _drops_to_three_channels(scheduler):
        return type(scheduler).from_config(scheduler.config, variance_type=None)
    return scheduler


def _check_labels(model: nn.Module, labels: Tensor, cfg_scale: float) -> None:
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


@torch.no_grad()
def denoise(
    model: nn.Module,
    scheduler: Any,
    latents: Tensor,
    labels: Tensor,
    cfg_scale: float = 1.0,
    guided_channels: int | None = None,
    generator: Generator = None,
    progress: Callable[[Any], Any] | None = None,
) -> Tensor:
    """The sampling loop: ``latents`` (the noise at the first timestep) through ``scheduler.timesteps``.

    Each step calls the model in eval mode at the original timestep: with ``cfg_scale == 1`` once on the
    labels, otherwise the official ``forward_with_cfg`` on ``[x, x]`` with ``[labels, null]`` (null = the
    model's ``num_classes``; guidance on its first ``guided_channels`` channels). A scheduler that reads the
    learned variance (:func:`reads_variance`) gets ``[eps, v]``, the others ``eps``. The model gets the
    scheduler's timesteps as they are (fractional for Euler-type schedulers).

    Args:
        model: a DiT³ (``forward``, ``forward_with_cfg``, ``num_classes``, ``has_null_class``).
        scheduler: a diffusers scheduler whose ``set_timesteps`` has been called (pass a DPM-Solver-family
            one with a learned ``variance_type`` through :func:`eps_scheduler` first).
        latents: ``[N, C, H, W]``.
        labels: class labels ``[N]`` in ``[0, num_classes)``.
        cfg_scale: classifier-free guidance scale (1: no guidance, one pass per step).
        guided_channels: passed to ``forward_with_cfg`` (``None``: the official choice).
        generator: the scheduler's noise generator(s).
        progress: optional wrapper of the timestep iterator (e.g. ``tqdm``).

    Returns:
        The final latents ``[N, C, H, W]``.

    Raises:
        ValueError: labels that are not class indices of the model, guidance without a null class, or a
            scheduler that would keep 3 channels of a latent with another count.
    """
    _check_labels(model, labels, cfg_scale)
    n, c = latents.shape[:2]
    if c != 3 and _drops_to_three_channels(scheduler):
        raise ValueError(
            f"{type(scheduler).__name__} with variance_type={scheduler.config.variance_type!r} keeps the "
            f"first 3 channels of the model output, the latents have {c}: pass eps_scheduler(scheduler)"
        )
    labels = labels.to(latents.device)
    null = torch.full_like(labels, model.num_classes)
    keep_variance = reads_variance(scheduler)
    x = latents
    was_training = model.training
    model.eval()
    try:
        timesteps = scheduler.timesteps if progress is None else progress(scheduler.timesteps)
        for t in timesteps:
            tt = torch.as_tensor(t, device=x.device).reshape(1).expand(n)
            xin = scheduler.scale_model_input(x, t)
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
            x = scheduler.step(out, t, x, generator=generator).prev_sample
    finally:
        model.train(was_training)
    return x


class GaussianDiffusion:
    """The official DiT diffusion: schedule, objective and samplers (``docs/design/generation.md``).

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
        )
        self.betas = schedule_betas(self.num_timesteps, beta_schedule, beta_start, beta_end)
        self._tables = chain_tables(torch.cumprod(1.0 - self.betas, dim=0))
        self._on: dict[tuple[torch.device, torch.dtype], dict[str, Tensor]] = {}

    def _taker(self, t: Tensor, like: Tensor) -> Take:
        """Tables at timesteps ``t`` ``[B]``, shaped ``[B, 1, ...]`` to broadcast against ``like``."""
        key = (like.device, like.dtype)
        if key not in self._on:
            self._on[key] = {k: v.to(device=like.device, dtype=like.dtype) for k, v in self._tables.items()}
        tables, shape = self._on[key], (-1, *([1] * (like.ndim - 1)))
        return lambda name: tables[name][t].view(shape)

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
        """``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise``; all ``[B, C, H, W]`` (computed in ``x0``'s
        dtype)."""
        self._check_timesteps(t, x0.shape[0])
        take = self._taker(t, x0)
        return take("sqrt_ac") * x0 + take("sqrt_1m_ac") * noise

    def q_posterior(self, x0: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and clipped log-variance of ``q(x_{t-1} | x_t, x_0)``, each ``[B, C, H, W]`` (variance
        broadcast)."""
        take = self._taker(t, x_t)
        return posterior_mean(take, x0, x_t), take("post_logvar").expand_as(x_t)

    def p_mean_logvar(self, eps: Tensor, v: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and log-variance of the model's ``p(x_{t-1} | x_t)`` from ``eps`` and the range output ``v``.

        ``x0_hat = sqrt(1 / a_t) x_t - sqrt(1 / a_t - 1) eps`` (not clipped), the mean is the posterior mean
        at ``x0_hat``, and ``logvar = frac * log(beta_t) + (1 - frac) * post_logvar_t`` with ``frac = (v + 1)
        / 2``.
        """
        take = self._taker(t, x_t)
        return posterior_mean(take, predict_x0(take, x_t, eps), x_t), learned_logvar(take, v)

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
        kl = mean_flat(normal_kl(true_mean, true_logvar, mean, logvar)) / math.log(2.0)
        nll = -mean_flat(discretized_gaussian_log_likelihood(x0, mean, 0.5 * logvar, cdf)) / math.log(2.0)
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
                f"model output {tuple(model_output.shape)} does not fit data {tuple(x0.shape)}: expected "
                f"{want} "
                f"channels ({'[eps, v]' if self.learn_sigma else 'eps'}, learn_sigma={self.learn_sigma})"
            )
        self._check_timesteps(t, x0.shape[0])
        dtype = torch.promote_types(model_output.dtype, torch.float32)
        out, x0, x_t, noise = (a.to(dtype) for a in (model_output, x0, x_t, noise))
        eps = out[:, :c]
        terms = {"mse": mean_flat((noise - eps) ** 2)}
        if self.learn_sigma:
            terms["vb"] = self.vb_terms(x0, x_t, t, eps.detach(), out[:, c:])  # stop-gradient on the mean
            terms["loss"] = terms["mse"] + terms["vb"]
        else:
            terms["loss"] = terms["mse"]
        return terms

    # --- sampling -------------------------------------------------------------------------------------

    def make_scheduler(self, sampler: str) -> Any:
        """A fresh diffusers scheduler for ``sampler`` on this diffusion's schedule (see the module
        docstring)."""
        if sampler == "ddpm":
            variance = "learned_range" if self.learn_sigma else "fixed_large"
            return RespacedDDPMScheduler(**self._schedule, variance_type=variance)
        if sampler == "ddim":
            return RespacedDDIMScheduler(**self._schedule)
        if sampler == "dpm++":
            return DPMSolverMultistepScheduler(
                **self._schedule,
                prediction_type="epsilon",
                algorithm_type="dpmsolver++",
                solver_order=2,
                lower_order_final=True,
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
        """Generates latents for ``labels``: noise from ``generator``, then :func:`denoise` with ``sampler``.

        Args:
            model: a DiT³ (``forward`` / ``forward_with_cfg``; put in eval mode for the call).
            labels: class labels ``[N]`` (in ``[0, num_classes)``).
            shape: ``(C, H, W)`` of one latent.
            sampler: ``"ddpm"``, ``"ddim"`` or ``"dpm++"``.
            steps: sampling steps (at most ``num_timesteps``; ``ddpm`` / ``ddim``: the official respacing).
            cfg_scale: classifier-free guidance scale (1: no guidance, one pass per step).
            generator: a ``torch.Generator`` or one per sample (then each sample depends on its own seed
                only, not on the batch it is drawn in).
            guided_channels: passed to ``forward_with_cfg`` (``None``: the official choice).
            progress: optional wrapper of the timestep iterator (e.g. ``tqdm``).

        Returns:
            Latents ``[N, C, H, W]``.

        Raises:
            ValueError: unknown sampler, bad step count, labels out of range, or guidance without a null
                class.
        """
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}: choose from {', '.join(SAMPLERS)}")
        if not 1 <= int(steps) <= self.num_timesteps:
            raise ValueError(f"sampling steps must be in [1, {self.num_timesteps}], got {steps}")
        if model.learn_sigma != self.learn_sigma:
            raise ValueError(
                f"model learn_sigma={model.learn_sigma} but the diffusion has learn_sigma={self.learn_sigma}"
            )
        _check_labels(model, labels, cfg_scale)
        param = next(model.parameters())
        sched = self.make_scheduler(sampler)
        sched.set_timesteps(int(steps), device=param.device)
        n = labels.shape[0]
        x = randn_tensor((n, *map(int, shape)), generator=generator, device=param.device, dtype=param.dtype)
        return denoise(
            model, sched, x * sched.init_noise_sigma, labels, cfg_scale, guided_channels, generator, progress
        )
