"""FLUX.1-dev / schnell: MMDiT on 2×2-packed latents, CLIP (pooled) + T5 text encoders, a guidance
embedding instead of CFG (dev; schnell has none), and a resolution-dependent σ shift (the
scheduler's dynamic shifting with μ from the packed sequence length, as the pipeline computes it).

Latents are packed, (H/16 · W/16, 64): each token holds a 2×2 patch of the 16-channel VAE latent
(any H and W that are multiples of 16);
the positional ids (`img_ids` from the latent grid, `txt_ids` zeros) are not batched and are made
here from shapes. The transformer is conditioned on σ (the pipeline's `timestep / 1000`).
"""

from __future__ import annotations

import numpy as np
import torch

from branchdiff.models.pipeline_adapter import PackedLatentsAdapter

FLUX_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
FLUX_FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"]  # double and single blocks


class FluxAdapter(PackedLatentsAdapter):
    family = "flux"
    pipeline_class_name = "FluxPipeline"
    helper_names = ("text_encoder", "text_encoder_2", "vae")
    lora_target_sets = {"attention": FLUX_ATTENTION, "attention+ff": FLUX_ATTENTION + FLUX_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules = ("x_embedder", "time_text_embed", "context_embedder", "norm_out", "proj_out")
    default_guidance = 3.5  # FLUX.1-dev's guidance embedding (DanceGRPO, BranchGRPO)
    example_hub_id = "black-forest-labs/FLUX.1-dev"
    max_sequence_length = 512  # T5 tokens (the pipeline's default)
    time_scale = 1.0  # the transformer takes σ itself

    def scheduler_arguments(self, num_steps: int) -> dict:
        """The pipeline's σ grid linspace(1, 1/T, T) and μ from the packed sequence length."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipe.scheduler.config
        mu = calculate_shift(self.latent_shape[0], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        return {"num_inference_steps": num_steps, "sigmas": sigmas, "mu": mu}

    def model_times(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / 1000

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Embedded guidance, no CFG: `negatives` is always None (`row_negatives` refuses a row's)."""
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        img_ids = self.pipe._prepare_latent_image_ids(len(latents), *self.token_grid(), latents.device, self.dtype)  # (rows · columns, 3)
        return self.transformer_output(latents, img_ids, times, embeds, guidance)

    def transformer_output(self, tokens: torch.Tensor, img_ids: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor],
                           guidance: float) -> torch.Tensor:
        """The transformer on image tokens (B, N, 64) with their ids (N, 3), conditioned on the prompts' embeddings."""
        dtype, batch = self.dtype, tokens.shape[0]
        text = embeds["encoder_hidden_states"]  # (B, S, D)
        txt_ids = torch.zeros(text.shape[1], 3, device=tokens.device, dtype=dtype)
        embedded = torch.full((batch,), guidance, device=tokens.device, dtype=torch.float32) if self.config.guidance_embeds else None
        return self.denoiser(hidden_states=tokens.to(dtype), timestep=times.to(dtype), guidance=embedded,
                             pooled_projections=embeds["pooled_projections"].to(dtype), encoder_hidden_states=text.to(dtype),
                             txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        unpacked = self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        return unpacked / config.scaling_factor + config.shift_factor
