"""The diffusers names DiT³, its diffusion and its pipeline use, imported in this one place: without the
``generation`` extra, importing any of them says how to install it. :func:`register_pipeline` makes a vit3
pipeline loadable by ``DiffusionPipeline.from_pretrained``."""

try:
    from diffusers import (
        AutoencoderKL,
        ConfigMixin,
        DDPMScheduler,
        DiffusionPipeline,
        DPMSolverMultistepInverseScheduler,
        DPMSolverMultistepScheduler,
        DPMSolverSinglestepScheduler,
        ImagePipelineOutput,
        ModelMixin,
        SASolverScheduler,
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
    "DPMSolverMultistepInverseScheduler",
    "DPMSolverMultistepScheduler",
    "DPMSolverSinglestepScheduler",
    "DiffusionPipeline",
    "ImagePipelineOutput",
    "ModelMixin",
    "SASolverScheduler",
    "SchedulerMixin",
    "randn_tensor",
    "register_pipeline",
    "register_to_config",
]


def register_pipeline(cls: type) -> None:
    """Makes a pipeline class loadable by ``DiffusionPipeline.from_pretrained(folder)``.

    diffusers looks the ``_class_name`` of a saved ``model_index.json`` up in the ``diffusers`` namespace only
    (a pipeline class from elsewhere needs a code file in the folder and ``trust_remote_code=True``), so the
    class is added there under its name; a diffusers class of that name is left alone.
    """
    import diffusers

    if getattr(diffusers, cls.__name__, cls).__module__ == cls.__module__:
        setattr(diffusers, cls.__name__, cls)
