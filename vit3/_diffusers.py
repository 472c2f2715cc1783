"""The diffusers names DiT³, its diffusion and its pipeline use, imported in this one place: without the
``generation`` extra, importing any of them says how to install it."""

try:
    from diffusers import (
        AutoencoderKL,
        ConfigMixin,
        DDPMScheduler,
        DiffusionPipeline,
        DPMSolverMultistepScheduler,
        ImagePipelineOutput,
        ModelMixin,
        SchedulerMixin,
    )
    from diffusers.configuration_utils import register_to_config
    from diffusers.schedulers.scheduling_ddpm import DDPMSchedulerOutput
    from diffusers.utils.torch_utils import randn_tensor
except ImportError as exc:  # the generation extra is not installed
    raise ImportError(f"DiT³ needs diffusers: pip install -e '.[generation]' ({exc})") from exc

__all__ = [
    "AutoencoderKL",
    "ConfigMixin",
    "DDPMScheduler",
    "DDPMSchedulerOutput",
    "DPMSolverMultistepScheduler",
    "DiffusionPipeline",
    "ImagePipelineOutput",
    "ModelMixin",
    "SchedulerMixin",
    "randn_tensor",
    "register_to_config",
]
