"""Stable Diffusion 3 / 3.5 (MMDiT with joint attention, pooled projections, CLIP-L + CLIP-G +
T5 text encoders), rectified flow with the scheduler config's shift (3.0 for SD3.5), CFG.

The transformer is conditioned on t = σ·1000 (the scheduler's timesteps); latents are
(16, H/8, W/8) and decode as `latents / scaling_factor + shift_factor`; images encode the other way
(`encode_images`: SFT and offline DPO).
"""

from __future__ import annotations

import torch

from branchdiff.models.pipeline_adapter import PipelineAdapter

SD3_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]  # both streams
SD3_FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]  # both streams' MLPs


class SD3Adapter(PipelineAdapter):
    family = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    lora_target_sets = {"attention": SD3_ATTENTION,  # Flow-GRPO's SD3.5 targets
                        "attention+ff": SD3_ATTENTION + SD3_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules = ("pos_embed", "time_text_embed", "context_embedder", "norm_out", "proj_out")
    uses_cfg = True
    default_guidance = 4.5  # Flow-GRPO's SD3.5 scale in rollouts and training
    example_hub_id = "stabilityai/stable-diffusion-3.5-medium"
    max_sequence_length = 256  # T5 tokens (the pipeline's default)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.config.in_channels, *self.latent_grid())

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        embeds, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=True, negative_prompt=negatives,
            max_sequence_length=self.max_sequence_length,
        )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled,
                "negative_encoder_hidden_states": negative, "negative_pooled_projections": negative_pooled}

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        dtype = self.dtype
        return self.denoiser(hidden_states=latents.to(dtype), timestep=times, encoder_hidden_states=embeds["encoder_hidden_states"].to(dtype),
                             pooled_projections=embeds["pooled_projections"].to(dtype), return_dict=False)[0]

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        return latents / config.scaling_factor + config.shift_factor

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] → latents: the VAE's posterior mean (its mode, so an image has one
        latent) of the image in [−1, 1], shifted and scaled as the pipeline's latents are (the inverse of
        `vae_input`), `decode_batch` at a time (SFT and offline DPO train on these)."""
        vae, config = self.pipe.vae, self.pipe.vae.config
        latents = []
        with self.modules_on_device(vae):
            for chunk in images.split(self.decode_batch):
                mean = vae.encode((chunk.to(self.device, vae.dtype) * 2 - 1), return_dict=False)[0].mode()
                latents.append((mean.float() - config.shift_factor) * config.scaling_factor)
        return torch.cat(latents)
