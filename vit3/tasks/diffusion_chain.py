"""The math of DiT³'s Gaussian diffusion chain, in plain torch: the official objective's densities, the
official respacing and the tables of a chain (:mod:`vit3.tasks.diffusion` builds the schedule, the
objective and the samplers on them).

* :func:`normal_kl`, :func:`discretized_gaussian_log_likelihood` (the official tanh CDF,
  :func:`approx_standard_normal_cdf`): the variational-bound terms.
* :func:`space_timesteps`: the timesteps ``S`` sampling steps keep (official respacing);
  :func:`chain_tables`: the float64 tables of the chain through them; :func:`predict_x0`,
  :func:`posterior_mean`, :func:`learned_logvar`: the formulas the objective and the samplers share, read
  through a :data:`Take` (a table's entry at the current timestep(s)).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "Take",
    "approx_standard_normal_cdf",
    "chain_tables",
    "discretized_gaussian_log_likelihood",
    "learned_logvar",
    "mean_flat",
    "normal_kl",
    "posterior_mean",
    "predict_x0",
    "space_timesteps",
]

Take = Callable[[str], Tensor]  # a chain table's entry at the current timestep(s), broadcastable


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
            f"shapes differ: x {tuple(x.shape)}, means {tuple(means.shape)}, log_scales "
            f"{tuple(log_scales.shape)}"
        )
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = cdf(inv_std * (centered + half_bin))
    cdf_min = cdf(inv_std * (centered - half_bin))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def mean_flat(x: Tensor) -> Tensor:
    """Mean over every dim but the batch: ``[B, ...] -> [B]``."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def space_timesteps(num_timesteps: int, steps: int) -> list[int]:
    """The timesteps ``[S]`` (ascending) that ``steps`` sampling steps visit: the official respacing.

    ``steps`` evenly spaced timesteps from 0 to ``num_timesteps - 1``: a stride of ``(T - 1) / (S - 1)``
    accumulated in floating point from 0, each position rounded half to even (as improved-DDPM / DiT's
    ``space_timesteps(T, str(S))``). One step keeps ``[0]``.

    Raises:
        ValueError: ``steps`` outside ``[1, num_timesteps]``.
    """
    if not 1 <= int(steps) <= int(num_timesteps):
        raise ValueError(f"sampling steps must be in [1, {num_timesteps}], got {steps}")
    stride = (int(num_timesteps) - 1) / (int(steps) - 1) if steps > 1 else 1.0
    kept, position = [], 0.0
    for _ in range(int(steps)):
        kept.append(round(position))
        position += stride
    return kept


def chain_tables(alphas_cumprod: Tensor) -> dict[str, Tensor]:
    """The tables ``[S]`` of a diffusion chain given the alpha-bars ``[S]`` of its timesteps (float64).

    A respaced chain (the kept timesteps' alpha-bars) has the betas ``1 - abar_i / abar_{i-1}`` (``abar_{-1} =
    1``); the full chain's are the schedule's. Entries: ``alphas_cumprod``, ``alphas_cumprod_prev``,
    ``betas``, ``sqrt_ac`` / ``sqrt_1m_ac`` (``q(x_t | x0)``), ``post_var`` (the posterior variance ``beta (1
    - abar_prev) / (1 - abar)``), ``post_logvar`` (its log,
    clipped: at index 0, where it is 0, the official code repeats index 1's), ``large_logvar`` (the official
    ``FIXED_LARGE``: ``log beta`` with index 0 clipped alike), ``post_coef1`` / ``post_coef2`` (posterior mean
    ``coef1 x0 + coef2 x_t``), ``sqrt_recip_ac`` / ``sqrt_recipm1_ac`` (``x0`` from ``eps``), ``log_betas``.
    """
    ac = alphas_cumprod.double()
    ac_prev = torch.cat([ac.new_ones(1), ac[:-1]])
    betas = 1.0 - ac / ac_prev
    post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
    first = post_var[1:2] if len(ac) > 1 else post_var[:1]
    return {
        "alphas_cumprod": ac,
        "alphas_cumprod_prev": ac_prev,
        "betas": betas,
        "sqrt_ac": torch.sqrt(ac),
        "sqrt_1m_ac": torch.sqrt(1.0 - ac),
        "post_var": post_var,
        "post_logvar": torch.log(torch.cat([first, post_var[1:]])),
        "large_logvar": torch.log(torch.cat([first, betas[1:]])),
        "post_coef1": betas * torch.sqrt(ac_prev) / (1.0 - ac),
        "post_coef2": (1.0 - ac_prev) * torch.sqrt(1.0 - betas) / (1.0 - ac),
        "sqrt_recip_ac": torch.sqrt(1.0 / ac),
        "sqrt_recipm1_ac": torch.sqrt(1.0 / ac - 1.0),
        "log_betas": torch.log(betas),
    }


def predict_x0(take: Take, x_t: Tensor, eps: Tensor) -> Tensor:
    """``x0 = sqrt(1 / abar) x_t - sqrt(1 / abar - 1) eps`` (not clipped)."""
    return take("sqrt_recip_ac") * x_t - take("sqrt_recipm1_ac") * eps


def posterior_mean(take: Take, x0: Tensor, x_t: Tensor) -> Tensor:
    """The mean of ``q(x_prev | x_t, x0)``."""
    return take("post_coef1") * x0 + take("post_coef2") * x_t


def learned_logvar(take: Take, v: Tensor) -> Tensor:
    """``frac * log(beta) + (1 - frac) * post_logvar`` with ``frac = (v + 1) / 2`` (learned range)."""
    frac = (v + 1) / 2
    return frac * take("log_betas") + (1 - frac) * take("post_logvar")
