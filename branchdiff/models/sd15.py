"""Stable Diffusion 1.x (UNet, CLIP-L text encoder, ε-prediction, CFG) with DDIM steps: the
policy is the DDIM η-step as a Gaussian (DDPO; `schedulers.ddim`), sampled and trained on the
timesteps diffusers' `DDIMScheduler` sets for the pipeline's scheduler config ("leading" spacing
with SD 1.5's steps_offset 1; the final step goes to ᾱ = alphas_cumprod[0] as set_alpha_to_one =
False). Checkpoints that ship another scheduler (SD 1.5 ships PNDM) are sampled with a
DDIMScheduler made from their scheduler config, as DDPO does.
"""

from __future__ import annotations

import torch

from branchdiff.models.pipeline_adapter import PipelineAdapter
from branchdiff.schedulers.schedule import DDIMSchedule

UNET_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
UNET_FEED_FORWARD = ["ff.net.0.proj", "ff.net.2"]  # the transformer blocks' MLPs


class SD15Adapter(PipelineAdapter):
    family = "sd15"
    pipeline_class_name = "StableDiffusionPipeline"
    denoiser_name = "unet"
    lora_prefix = "unet"
    helper_names = ("text_encoder", "vae")
    lora_target_sets = {"attention": UNET_ATTENTION,  # DDPO's targets
                        "attention+ff": UNET_ATTENTION + UNET_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules = ("conv_in", "time_embedding", "conv_norm_out", "conv_out")
    uses_cfg = True
    default_guidance = 7.5  # StableDiffusionPipeline's default
    stepped_scheduler = "DDIMScheduler"
    example_hub_id = "stable-diffusion-v1-5/stable-diffusion-v1-5"
    card_license = "creativeml-openrail-m"

    @classmethod
    def multiple_of(cls, vae_scale_factor: int, patch_size: int) -> int:
        return vae_scale_factor

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.config.in_channels, *self.latent_grid())

    def ddim_scheduler(self):
        from diffusers import DDIMScheduler

        scheduler = self.pipe.scheduler
        return DDIMScheduler.from_config(scheduler.config) if not isinstance(scheduler, DDIMScheduler) else scheduler

    def schedule(self, num_steps: int, shift: float | None = None) -> DDIMSchedule:
        """ᾱ at each of diffusers' DDIM timesteps and at each step's target (t − 1000/T, or the final
        ᾱ after the last step), as `DDIMScheduler.step` looks them up."""
        if shift is not None:
            raise ValueError(f"sampling.shift={shift} applies to flow families; sd15 samples on its scheduler's DDIM timesteps (leave shift unset)")
        scheduler = self.ddim_scheduler()
        scheduler.set_timesteps(num_steps, device="cpu")
        timesteps = scheduler.timesteps  # (T,) descending
        alphas = scheduler.alphas_cumprod.double()
        stride = scheduler.config.num_train_timesteps // num_steps
        targets = timesteps - stride
        final = torch.as_tensor(float(scheduler.final_alpha_cumprod), dtype=torch.float64)
        after = torch.where(targets >= 0, alphas[targets.clamp(min=0)], final)  # (T,)
        return DDIMSchedule(torch.cat([alphas[timesteps[:1]], after]), timesteps)

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        embeds, negative = self.pipe.encode_prompt(prompts, self.device, 1, True, negative_prompt=negatives)
        return {"encoder_hidden_states": embeds, "negative_encoder_hidden_states": negative}

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        dtype = self.dtype
        return self.denoiser(latents.to(dtype), times, encoder_hidden_states=embeds["encoder_hidden_states"].to(dtype), return_dict=False)[0]
