"""SANA: linear-attention DiT on a deep-compression autoencoder (DC-AE, 32× downsampling, 32
channels), a Gemma-2 text encoder, rectified flow with the scheduler config's shift, CFG.

Prompts are encoded as `SanaPipeline.__call__` encodes them: with its default
`complex_human_instruction` prepended (its `encode_prompt` alone does not add it), so a LoRA
trained here sees the conditioning the pipeline gives at inference; `model.prompt_instruction:
false` encodes the bare prompt (the pipeline's `complex_human_instruction=None`). The transformer is
conditioned on t·`timestep_scale` (t = σ·1000). The release samples with DPM-Solver++; branchdiff
samples and trains with flow-matching Euler steps and their SDEs on the same σ schedule.
"""

from __future__ import annotations

import inspect

import torch

from branchdiff.models.pipeline_adapter import PipelineAdapter

SANA_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
SANA_FEED_FORWARD = ["ff.conv_inverted", "ff.conv_point"]  # the GLU-MBConv's pointwise convolutions (not the depthwise one)


class SanaAdapter(PipelineAdapter):
    family = "sana"
    pipeline_class_name = "SanaPipeline"
    helper_names = ("text_encoder", "vae")
    lora_target_sets = {"attention": SANA_ATTENTION, "attention+ff": SANA_ATTENTION + SANA_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules = ("patch_embed", "time_embed", "caption_projection", "norm_out", "proj_out")
    uses_cfg = True
    default_guidance = 4.5  # SanaPipeline's default
    example_hub_id = "Efficient-Large-Model/Sana_1600M_1024px_diffusers"
    max_sequence_length = 300  # Gemma tokens after the instruction (the pipeline's default)

    @classmethod
    def multiple_of(cls, vae_scale_factor: int, patch_size: int) -> int:
        return 32  # SanaPipeline.check_inputs

    @property
    def time_scale(self) -> float:
        return 1000.0 * self.config.timestep_scale

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.config.in_channels, *self.latent_grid())

    def model_times(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps * self.config.timestep_scale

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        default = inspect.signature(type(self.pipe).__call__).parameters["complex_human_instruction"].default
        instruction = default if self.instruction else None  # model.prompt_instruction=false: the bare prompt
        embeds, mask, negative, negative_mask = self.pipe.encode_prompt(
            prompts, do_classifier_free_guidance=True, negative_prompt=negatives or self.negative_prompt, device=self.device,
            max_sequence_length=self.max_sequence_length, complex_human_instruction=instruction,
        )
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask,
                "negative_encoder_hidden_states": negative, "negative_encoder_attention_mask": negative_mask}

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        dtype = self.dtype
        output = self.denoiser(latents.to(dtype), encoder_hidden_states=embeds["encoder_hidden_states"].to(dtype),
                               encoder_attention_mask=embeds["encoder_attention_mask"], timestep=times, return_dict=False)[0].float()
        if self.config.out_channels // 2 == latents.shape[1]:  # a learned-σ head: keep the mean half
            output = output.chunk(2, dim=1)[0]
        return output
