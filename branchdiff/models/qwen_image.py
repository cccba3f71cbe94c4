"""Qwen-Image (Alibaba's 20B MMDiT) through diffusers' `QwenImagePipeline`: a Qwen2.5-VL text encoder
whose last hidden states, after the pipeline's chat template and without its system-prompt tokens,
condition the transformer; 16-channel latents of a causal video VAE (one frame) packed 2×2 into
tokens of 64 features, as FLUX.1's; the pipeline's σ grid linspace(1, 1/T, T) with μ from the packed
sequence length (its scheduler shifts dynamically, exponentially, and stretches to a terminal σ).

Two conventions are the pipeline's own:
- true CFG with a negative prompt (" " unless the run says otherwise, as the model card samples), on
  for guidance g > 1, and rescaled: c̃ = u + g·(c − u), then c̃ · ‖c‖ / ‖c̃‖ per token (the norm over
  the packed features), so the guided prediction keeps the conditional one's norm (`guide`);
- prompts have different token counts: embeddings are kept zero-padded to `max_sequence_length` with
  their attention mask, and the transformer always sees that length with the mask, so a row's output
  does not depend on the other prompts of its batch (the pipeline pads to its batch's longest prompt;
  the masked padding changes its result only by rounding). Prompts longer than `max_sequence_length`
  tokens are cut, as the pipeline cuts them.

The transformer is conditioned on σ (the pipeline's timestep / 1000) and takes each row's token grid
(`img_shapes`). Decoding: latents · std + mean per channel (the VAE's `latents_std`, `latents_mean`),
the VAE on one frame. tests/test_model_families.py checks sampling, training and the LoRA export
against `pipe(...)` (docs/models.md).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from branchdiff.models.pipeline_adapter import PackedLatentsAdapter

QWEN_IMAGE_ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                        "attn.to_add_out"]  # both streams
QWEN_IMAGE_FEED_FORWARD = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
NEGATIVE_PROMPT = " "  # the model card's negative prompt when there is nothing to steer away from


class QwenImageAdapter(PackedLatentsAdapter):
    family = "qwen-image"
    pipeline_class_name = "QwenImagePipeline"
    helper_names = ("text_encoder", "vae")
    lora_target_sets = {"attention": QWEN_IMAGE_ATTENTION, "attention+ff": QWEN_IMAGE_ATTENTION + QWEN_IMAGE_FEED_FORWARD,
                        "all-linear": "all-linear"}
    quant_skip_modules = ("img_in", "txt_in", "txt_norm", "time_text_embed", "norm_out", "proj_out")
    uses_cfg = True
    negative_prompt = NEGATIVE_PROMPT
    default_guidance = 4.0  # the pipeline's default true_cfg_scale (the model card's example)
    example_hub_id = "Qwen/Qwen-Image"
    card_license = "apache-2.0"  # Qwen-Image and Qwen-Image-Edit
    max_sequence_length = 512  # Qwen2.5-VL tokens after the template (the pipeline's default; it allows 1024)
    time_scale = 1.0  # the transformer takes σ itself

    @classmethod
    def multiple_from_configs(cls, vae: dict, denoiser: dict) -> int:
        return cls.multiple_of(2 ** len(vae.get("temperal_downsample", [])), 2)  # the pipeline's VAE factor

    @classmethod
    def unused_modules_of(cls, denoiser: torch.nn.Module) -> list[str]:
        """The last block's text-stream output (its attention's text projection and text MLP): only the
        image stream leaves the last block."""
        last = f"transformer_blocks.{len(cast(torch.nn.ModuleList, denoiser.transformer_blocks)) - 1}"
        return [f"{last}.attn.to_add_out", f"{last}.txt_mlp.net.0.proj", f"{last}.txt_mlp.net.2"]

    def scheduler_arguments(self, num_steps: int) -> dict:
        """The pipeline's σ grid linspace(1, 1/T, T) and μ from the packed sequence length."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        config = self.pipe.scheduler.config
        mu = calculate_shift(self.latent_shape[0], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        return {"num_inference_steps": num_steps, "sigmas": np.linspace(1.0, 1 / num_steps, num_steps).tolist(), "mu": mu}

    def model_times(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / 1000

    def pipeline_call_arguments(self, guidance: float) -> dict:
        return {"true_cfg_scale": guidance, "negative_prompt": NEGATIVE_PROMPT}

    def guide(self, uncond: torch.Tensor, cond: torch.Tensor, times: torch.Tensor, guidance: float) -> torch.Tensor:
        """u + g·(c − u) with g = `guidance_scale`, rescaled per token (B, N, ·) to the conditional output's norm."""
        combined = uncond + self.guidance_scale(times, guidance) * (cond - uncond)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        rows = {}
        for prefix, texts in (("", prompts), ("negative_", negatives or [self.negative_prompt] * len(prompts))):
            states, mask = self.pipe.encode_prompt(prompt=texts, device=self.device, max_sequence_length=self.max_sequence_length)
            rows.update(self.padded_text(states, mask, prefix))
        return rows

    def padded_text(self, states: torch.Tensor, mask: torch.Tensor | None, prefix: str = "") -> dict[str, torch.Tensor]:
        """Prompt states (B, L, D) and their mask (None: no padding) zero-padded to `max_sequence_length`."""
        if states.shape[1] > self.max_sequence_length:  # Qwen-Image-Edit's pipeline does not cut its prompts: a longer one is an error
            raise ValueError(f"a prompt of {states.shape[1]} tokens (with its sources' image tokens) is longer than {self.family} reads "
                             f"({self.max_sequence_length}); shorten the prompt or use fewer sources")
        mask = torch.ones(states.shape[:2], dtype=torch.long, device=states.device) if mask is None else mask
        padding = self.max_sequence_length - states.shape[1]
        return {f"{prefix}encoder_hidden_states": torch.nn.functional.pad(states, (0, 0, 0, padding)),  # (B, S, D)
                f"{prefix}encoder_attention_mask": torch.nn.functional.pad(mask, (0, padding)).bool()}  # (B, S)

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        return self.transformer_output(latents, [(1, *self.token_grid())], times, embeds)

    def transformer_output(self, tokens: torch.Tensor, grids: list[tuple[int, int, int]], times: torch.Tensor,
                           embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer on image tokens (B, N, 64) made of the (frames, rows, columns) `grids`, in order, of every row."""
        dtype, batch = self.dtype, tokens.shape[0]
        return self.denoiser(hidden_states=tokens.to(dtype), timestep=times.to(dtype), encoder_hidden_states=embeds["encoder_hidden_states"].to(dtype),
                             encoder_hidden_states_mask=embeds["encoder_attention_mask"], img_shapes=[list(grids)] * batch, return_dict=False)[0]

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        unpacked = self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)  # (B, C, 1, h, w)
        mean = torch.tensor(config.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
        return unpacked * std.to(unpacked.dtype) + mean.to(unpacked.dtype)

    def vae_output(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded[:, :, 0]  # (B, 3, 1, H, W) → (B, 3, H, W)
