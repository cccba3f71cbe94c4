"""Z-Image (Tongyi-MAI's single-stream DiT, e.g. Z-Image-Turbo) through diffusers' `ZImagePipeline`:
a Qwen3 text encoder whose second-to-last hidden states, at the prompt's tokens only, condition the
transformer; latents (C, H/8, W/8) patchified 2×2 by the transformer; the pipeline's σ grid
linspace(1, 1/T, T) with μ from the token count (used when the scheduler shifts dynamically, else
the scheduler's own shift).

Three conventions differ from the other flow families, each taken from the pipeline:
- the transformer is conditioned on 1 − σ (the pipeline's (1000 − t) / 1000) and predicts the
  negated velocity: `forward` returns −output, the velocity the scheduler steps with;
- CFG is on for any guidance g > 0 and is pos + g·(pos − neg), i.e. u + (g + 1)·(c − u) in the
  shared formula (`guidance_scale` returns g + 1); guidance 0 (Turbo's) is one unguided row. The
  pipeline's `cfg_truncation` and `cfg_normalization` are left at their defaults (off);
- prompts have different token counts: embeddings are kept padded to `max_sequence_length` with
  their attention mask (rows of one batch, as every family's), and cut to their tokens per row for
  the transformer, which takes lists.

tests/test_model_families.py checks that ODE sampling equals `pipe(...)` at a square and a
non-square size, that a training step's log-probs match the rollout's, and that a LoRA export loads
with `pipe.load_lora_weights()` to the same image (docs/models.md).
"""

from __future__ import annotations

import numpy as np
import torch

from branchdiff.models.pipeline_adapter import PipelineAdapter
from branchdiff.schedulers.schedule import FlowSchedule, Schedule, sigma_schedule

Z_IMAGE_ATTENTION = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]
Z_IMAGE_FEED_FORWARD = ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
PATCH = 2  # the pipeline's patch_size: its image processor works on multiples of vae_scale_factor · 2


class ZImageAdapter(PipelineAdapter):
    family = "z-image"
    pipeline_class_name = "ZImagePipeline"
    helper_names = ("text_encoder", "vae")
    lora_target_sets = {"attention": Z_IMAGE_ATTENTION, "attention+ff": Z_IMAGE_ATTENTION + Z_IMAGE_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules = ("all_x_embedder", "all_final_layer", "t_embedder", "cap_embedder")
    uses_cfg = True
    default_guidance = 5.0  # ZImagePipeline's default guidance_scale (Z-Image-Turbo's card samples with 0.0: no CFG)
    example_hub_id = "Tongyi-MAI/Z-Image-Turbo"
    card_license = "apache-2.0"
    max_sequence_length = 512  # Qwen3 tokens (the pipeline's default)

    @classmethod
    def multiple_of(cls, vae_scale_factor: int, patch_size: int) -> int:
        return vae_scale_factor * PATCH  # its config names the patch `all_patch_size`: the pipeline's fixed 2

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.config.in_channels, *self.latent_grid())

    def scheduler_arguments(self, num_steps: int) -> dict:
        """The pipeline's σ grid linspace(1, 1/T, T) and μ from the number of 2×2 tokens."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

        config = self.pipe.scheduler.config
        height, width = self.latent_grid()
        mu = calculate_shift((height // PATCH) * (width // PATCH), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        return {"num_inference_steps": num_steps, "sigmas": np.linspace(1.0, 1 / num_steps, num_steps).tolist(), "mu": mu}

    def model_times(self, timesteps: torch.Tensor) -> torch.Tensor:
        return (1000 - timesteps) / 1000

    def schedule(self, num_steps: int, shift: float | None = None) -> Schedule:
        """The pipeline's schedule, or the anchors' σ with shift s, the transformer conditioned on 1 − σ."""
        if shift is None:
            return super().schedule(num_steps)
        sigmas = sigma_schedule(num_steps, shift)
        return FlowSchedule(sigmas, self.model_times(sigmas[:-1] * 1000))

    @classmethod
    def cfg_rows(cls, guidance: float, path: str | None = None) -> int:
        return 2 if guidance > 0 else 1

    def guidance_scale(self, times: torch.Tensor, guidance: float) -> float:
        return guidance + 1

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        # copies: the pipeline writes each prompt's chat-templated text into the list it is given
        embeds, negative = self.pipe.encode_prompt(prompt=list(prompts), negative_prompt=None if negatives is None else list(negatives),
                                                   device=self.device, do_classifier_free_guidance=True,
                                                   max_sequence_length=self.max_sequence_length)
        (states, mask), (negative_states, negative_mask) = self._padded(embeds), self._padded(negative)
        return {"encoder_hidden_states": states, "encoder_attention_mask": mask,
                "negative_encoder_hidden_states": negative_states, "negative_encoder_attention_mask": negative_mask}

    def _padded(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prompt's token states (L_i, D) zero-padded to (B, max_sequence_length, D), and the mask (B, S) of its tokens."""
        states = rows[0].new_zeros((len(rows), self.max_sequence_length, rows[0].shape[-1]))
        mask = torch.zeros((len(rows), self.max_sequence_length), dtype=torch.bool, device=rows[0].device)
        for index, row in enumerate(rows):
            states[index, : len(row)] = row
            mask[index, : len(row)] = True
        return states, mask

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        dtype = self.dtype
        images = list(latents.to(dtype).unsqueeze(2).unbind(0))  # B × (C, 1, h, w): one frame each
        texts = [states[mask].to(dtype) for states, mask in zip(embeds["encoder_hidden_states"], embeds["encoder_attention_mask"])]
        output = self.denoiser(images, times.float(), texts, return_dict=False)[0]  # B × (C, 1, h, w); float32 times, as the pipeline's
        return -torch.stack(output).squeeze(2)  # (B, C, h, w): the velocity

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        return latents / config.scaling_factor + config.shift_factor
