"""``DiT3Pipeline``: class-conditional sampling of a DiT³, called as diffusers' ``DiTPipeline``.
``pipe(class_labels, guidance_scale=4.0, generator=..., num_inference_steps=250, output_type="pil")`` draws
the initial latents with diffusers' ``randn_tensor`` (one generator per image makes each image depend on its
own seed only), runs the scheduler through :func:`vit3.tasks.diffusion.denoise` (the loop of the training
engine's sampler) and decodes with the VAE. ``save_pretrained`` / ``from_pretrained`` store the DiT³, the
scheduler and the VAE in diffusers' layout; ``DiffusionPipeline.from_pretrained`` loads a saved folder as well
once vit3 is imported (diffusers resolves ``_class_name`` in its own namespace: ``vit3._diffusers_names``).
Where it differs from diffusers' ``DiTPipeline``: ``docs/design/generation.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    ImagePipelineOutput,
    randn_tensor,
    register_pipeline,
)
from ..models.dit3 import DiT3
from .diffusion import Generator, RespacedDDPMScheduler, denoise, eps_scheduler

__all__ = ["OUTPUT_TYPES", "DiT3Pipeline"]

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


class DiT3Pipeline(DiffusionPipeline):
    """Samples images of given classes from a DiT³ (``docs/design/generation.md``).

    Args:
        transformer: the DiT³.
        scheduler: a diffusers scheduler (default: the official DDPM, :class:`RespacedDDPMScheduler` with the
            variance the model learns or, for a model without it, the official fixed one). A DPM-Solver-family
            scheduler with a learned ``variance_type`` (which would keep 3 channels) is stepped as a copy
            without it (:func:`vit3.tasks.diffusion.eps_scheduler`); ``self.scheduler`` is left as given.
        vae: the ``AutoencoderKL`` of a latent model (``None``: the model works in pixel space).
    """

    model_cpu_offload_seq = "transformer->vae"
    _optional_components: ClassVar[list[str]] = ["scheduler", "vae"]  # scheduler: a default when not given

    def __init__(
        self, transformer: DiT3, scheduler: Any | None = None, vae: AutoencoderKL | None = None
    ) -> None:
        super().__init__()
        if scheduler is None:
            variance = "learned_range" if transformer.learn_sigma else "fixed_large"
            scheduler = RespacedDDPMScheduler(variance_type=variance)
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)

    @torch.no_grad()
    def __call__(
        self,
        class_labels: int | Sequence[int] | Tensor,
        guidance_scale: float = 4.0,
        generator: Generator = None,
        num_inference_steps: int = 250,
        output_type: str = "pil",
        return_dict: bool = True,
        guided_channels: int | None = None,
        latent_size: int | tuple[int, int] | None = None,
    ) -> ImagePipelineOutput | tuple[Any]:
        """Generates one image per label.

        Args:
            class_labels: class indices (``[N]``).
            guidance_scale: classifier-free guidance scale; 1 turns it off (one model pass per step).
            generator: a ``torch.Generator`` or one per image.
            num_inference_steps: sampling steps (the official respacing for the respaced schedulers).
            output_type: ``"pil"``, ``"np"``, ``"pt"`` or ``"latent"``.
            return_dict: return an ``ImagePipelineOutput`` rather than a tuple.
            guided_channels: leading output channels guided (``None``: the official 3, capped at the latent
                channels).
            latent_size: ``H`` / ``(H, W)`` of the latents (default: the model's ``input_size``).

        Returns:
            ``ImagePipelineOutput(images=...)`` (or ``(images,)``).

        Raises:
            ValueError: an unknown ``output_type``, labels that are not the model's classes, or guidance on
                a model without the null class.
        """
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        model = self.transformer
        labels = torch.as_tensor(class_labels, device=self._execution_device).reshape(-1)
        size = model.input_size if latent_size is None else latent_size
        h, w = (size, size) if isinstance(size, int) else size
        latents = randn_tensor(
            (labels.shape[0], model.in_channels, int(h), int(w)),
            generator=generator,
            device=self._execution_device,
            dtype=model.dtype,
        )
        scheduler = eps_scheduler(self.scheduler)
        scheduler.set_timesteps(int(num_inference_steps), device=self._execution_device)
        latents = denoise(
            model,
            scheduler,
            latents * scheduler.init_noise_sigma,
            labels,
            float(guidance_scale),
            guided_channels,
            generator,
            progress=self.progress_bar,
        )
        if output_type == "latent":
            images: Any = latents
        else:
            if self.vae is not None:
                latents = self.vae.decode(latents.to(self.vae.dtype) / self.vae.config.scaling_factor).sample
            images = (latents.float() / 2 + 0.5).clamp(0, 1)
            if output_type != "pt":
                images = images.cpu().permute(0, 2, 3, 1).numpy()
                if output_type == "pil":
                    images = self.numpy_to_pil(images)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)


register_pipeline(DiT3Pipeline)
