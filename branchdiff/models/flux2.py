"""FLUX.2 [klein] (Black Forest Labs' 4B and 9B models) through diffusers' `Flux2KleinPipeline`: a Qwen3
text encoder whose hidden states at three layers (9, 18, 27), concatenated per token, condition the
transformer; 32-channel latents patchified 2×2 into 128 channels, normalised by the VAE's batch-norm
statistics, and read by the transformer as H/16 · W/16 tokens with 4-D position ids (time, row,
column, layer); the pipeline's σ grid linspace(1, 1/T, T) with its empirical μ (from the token count
and the number of steps).

Latents are kept as the pipeline's `latents=` argument takes them, (128, H/16, W/16); `forward`
flattens them into tokens row by row, as the pipeline packs them. Prompts are padded to
`max_sequence_length` tokens and the transformer sees them whole, padding included, as the pipeline
passes them (no attention mask). Guidance: CFG u + g·(c − u) against the empty prompt for g > 1 on the
base models; the step-distilled models (`is_distilled` in the pipeline's config) sample unguided.
The transformer is conditioned on σ (the pipeline's timestep / 1000).

tests/test_model_families.py checks sampling, training and the LoRA export against `pipe(...)`
(docs/models.md).
"""

from __future__ import annotations

import numpy as np
import torch

from branchdiff.models.pipeline_adapter import PipelineAdapter

FLUX2_ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                   "attn.to_add_out", "attn.to_qkv_mlp_proj"]  # double blocks; the single blocks' fused q, k, v (and MLP input)
FLUX2_FEED_FORWARD = ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]
TEXT_LAYERS = (9, 18, 27)  # the Qwen3 hidden states the pipeline concatenates (its default text_encoder_out_layers)


class Flux2KleinAdapter(PipelineAdapter):
    family = "flux2-klein"
    pipeline_class_name = "Flux2KleinPipeline"
    helper_names = ("text_encoder", "vae")
    lora_target_sets = {"attention": FLUX2_ATTENTION, "attention+ff": FLUX2_ATTENTION + FLUX2_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules = ("x_embedder", "context_embedder", "time_guidance_embed", "double_stream_modulation_img", "double_stream_modulation_txt",
                          "single_stream_modulation", "norm_out", "proj_out")
    uses_cfg = True
    default_guidance = 4.0  # the pipeline's default guidance_scale (the base models'; the distilled ones ignore it)
    example_hub_id = "black-forest-labs/FLUX.2-klein-base-4B"
    max_sequence_length = 512  # Qwen3 tokens (the pipeline's default)
    time_scale = 1.0  # the transformer takes σ itself

    @classmethod
    def multiple_of(cls, vae_scale_factor: int, patch_size: int) -> int:
        return vae_scale_factor * 2  # the VAE's 2×2 patchify

    @property
    def latent_shape(self) -> tuple[int, ...]:
        height, width = self.latent_grid()
        return (self.config.in_channels, height // 2, width // 2)  # in_channels = 4 × the VAE's latent channels

    def lora_targets(self, targets: str | list[str]) -> list[str] | str:
        """A named set adds, from `attention+ff` on, the single blocks' fused output projection (attention
        and MLP), named in full: its suffix `attn.to_out` is also the double blocks' list of output layers."""
        chosen = super().lora_targets(targets)
        if targets != "attention+ff":
            return chosen
        return [*chosen, *(f"single_transformer_blocks.{index}.attn.to_out" for index in range(len(self.denoiser.single_transformer_blocks)))]

    def rows_per_sample(self, guidance: float) -> int:
        return 2 if guidance > 1 and not self.pipe.config.get("is_distilled", False) else 1

    def scheduler_arguments(self, num_steps: int) -> dict:
        """The pipeline's σ grid linspace(1, 1/T, T) and its empirical μ for this many tokens and steps."""
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        rows, columns = self.latent_shape[1:]
        sigmas = None if self.pipe.scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps).tolist()
        return {"num_inference_steps": num_steps, "sigmas": sigmas, "mu": compute_empirical_mu(rows * columns, num_steps)}

    def model_times(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / 1000

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        rows = {}
        for prefix, texts in (("", prompts), ("negative_", [""] * len(prompts))):
            states, _ = self.pipe.encode_prompt(prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length,
                                                text_encoder_out_layers=TEXT_LAYERS)
            rows[f"{prefix}encoder_hidden_states"] = states  # (B, max_sequence_length, 3 · hidden)
        return rows

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        dtype = self.dtype
        batch, channels, rows, columns = latents.shape
        text = embeds["encoder_hidden_states"].to(dtype)
        tokens = latents.reshape(batch, channels, rows * columns).permute(0, 2, 1).to(dtype)  # (B, N, C), row by row
        image_ids = self.pipe._prepare_latent_ids(latents).to(latents.device)  # (B, N, 4)
        text_ids = self.pipe._prepare_text_ids(text).to(latents.device)  # (B, S, 4)
        output = self.denoiser(hidden_states=tokens, encoder_hidden_states=text, timestep=times.to(dtype), img_ids=image_ids,
                               txt_ids=text_ids, guidance=None, return_dict=False)[0]  # (B, N, C)
        return output.permute(0, 2, 1).reshape(batch, channels, rows, columns)

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device, latents.dtype)
        return self.pipe._unpatchify_latents(latents * std + mean)  # (B, C/4, H/8, W/8)
