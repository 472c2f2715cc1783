"""The latent space of DiT³: a local ``diffusers.AutoencoderKL`` (a folder in diffusers' layout; nothing is
downloaded) mapping images in ``[-1, 1]`` to scaled latents and back, as the official train/sample scripts."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn

from .._diffusers import AutoencoderKL

__all__ = ["LatentAutoencoder"]


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
        root = Path(path)
        if not str(path) or not root.exists():
            raise FileNotFoundError(
                f"VAE path {str(path)!r} does not exist: vae.path must be a local diffusers AutoencoderKL "
                "folder "
                f"(config.json + weights, e.g. a copy of stabilityai/sd-vae-ft-mse); nothing is downloaded"
            )
        if not (root.is_dir() and (root / "config.json").is_file()):
            raise FileNotFoundError(
                f"VAE path {root} is not a diffusers AutoencoderKL folder (expected {root / 'config.json'} "
                "and the weights)"
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
