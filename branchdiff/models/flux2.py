"""FLUX.2 (Black Forest Labs) through diffusers: [dev] (32B) with `Flux2Pipeline`, and [klein] (4B and 9B)
with `Flux2KleinPipeline`. Both condition the transformer on the hidden states of three layers of their
text encoder, concatenated per token (dev: Mistral 3 Small, layers 10, 20, 30, after a system message;
klein: Qwen3, layers 9, 18, 27, through its chat template with thinking off); on 32-channel latents
patchified 2×2 into 128 channels and normalised by the VAE's batch-norm statistics, read by the
transformer as H/16 · W/16 tokens with 4-D position ids (time, row, column, layer); on the pipeline's σ
grid linspace(1, 1/T, T) with its empirical μ (from the token count and the number of steps).

Latents are kept as the pipelines' `latents=` argument takes them, (128, H/16, W/16); `forward`
flattens them into tokens row by row, as the pipelines pack them. Prompts are padded to
`max_sequence_length` tokens and the transformer sees them whole, padding included, as the pipelines
pass them (no attention mask). Guidance: dev embeds the scale (no CFG); klein's base models use CFG
u + g·(c − u) against the empty prompt for g > 1, and its step-distilled models (`is_distilled` in the
pipeline's config) sample unguided. The transformer is conditioned on σ (the pipeline's timestep / 1000).

tests/test_model_families.py checks sampling, training and the LoRA export of both against `pipe(...)`
(docs/models.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import numpy as np
import torch

from branchdiff.models.pipeline_adapter import PipelineAdapter

FLUX2_ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                   "attn.to_add_out", "attn.to_qkv_mlp_proj"]  # double blocks; the single blocks' fused q, k, v (and MLP input)
FLUX2_FEED_FORWARD = ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]


DISTILLED_KLEIN = ("flux.2-klein-4b", "flux.2-klein-9b")  # black-forest-labs' step-distilled releases (the guided ones: FLUX.2-klein-base-4B, -9B)


def is_distilled(path: str) -> bool:
    """Whether the FLUX.2 [klein] release at `path` is step-distilled: its folder's model_index.json, else its
    name, one of the distilled releases' (`DISTILLED_KLEIN`); any other name counts as guided, the costlier guess
    (a fine-tune of a base release may be named anything)."""
    index = Path(path) / "model_index.json"
    if index.is_file():
        return bool(json.loads(index.read_text()).get("is_distilled", False))
    return Path(path).name.lower() in DISTILLED_KLEIN


class Flux2Adapter(PipelineAdapter):
    family = "flux2"
    pipeline_class_name = "Flux2Pipeline"
    helper_names = ("text_encoder", "vae")
    lora_target_sets = {"attention": FLUX2_ATTENTION, "attention+ff": FLUX2_ATTENTION + FLUX2_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules = ("x_embedder", "context_embedder", "time_guidance_embed", "double_stream_modulation_img", "double_stream_modulation_txt",
                          "single_stream_modulation", "norm_out", "proj_out")
    default_guidance = 4.0  # the pipeline's default guidance_scale, embedded
    example_hub_id = "black-forest-labs/FLUX.2-dev"
    max_sequence_length = 512  # text tokens (the pipeline's default)
    text_layers = (10, 20, 30)  # the encoder's hidden states the pipeline concatenates (its default text_encoder_out_layers)
    time_scale = 1.0  # the transformer takes σ itself

    @classmethod
    def multiple_of(cls, vae_scale_factor: int, patch_size: int) -> int:
        return vae_scale_factor * 2  # the VAE's 2×2 patchify

    @property
    def latent_shape(self) -> tuple[int, ...]:
        height, width = self.latent_grid()
        return (self.config.in_channels, height // 2, width // 2)  # in_channels = 4 × the VAE's latent channels

    def lora_targets(self, targets: str | list[str]) -> list[str] | str:
        """`attention+ff` adds the single blocks' fused output projection (attention and MLP), named in
        full: its suffix `attn.to_out` is also the double blocks' list of output layers."""
        chosen = super().lora_targets(targets)
        if targets != "attention+ff":
            return chosen
        blocks = cast(torch.nn.ModuleList, self.denoiser.single_transformer_blocks)
        return [*chosen, *(f"single_transformer_blocks.{index}.attn.to_out" for index in range(len(blocks)))]

    def scheduler_arguments(self, num_steps: int) -> dict:
        """The pipeline's σ grid linspace(1, 1/T, T) and its empirical μ for this many tokens and steps."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        rows, columns = self.latent_shape[1:]
        sigmas = None if self.pipe.scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps).tolist()
        return {"num_inference_steps": num_steps, "sigmas": sigmas, "mu": compute_empirical_mu(rows * columns, num_steps)}

    def model_times(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / 1000

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        """[dev] embeds its guidance, no CFG: `negatives` is always None (`row_negatives` refuses a row's); [klein] encodes its
        negatives through this too."""
        states, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length,
                                            text_encoder_out_layers=self.text_layers)
        return {"encoder_hidden_states": states}  # (B, max_sequence_length, 3 · hidden)

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        dtype = self.dtype
        batch, channels, rows, columns = latents.shape
        text = embeds["encoder_hidden_states"].to(dtype)
        tokens = latents.reshape(batch, channels, rows * columns).permute(0, 2, 1).to(dtype)  # (B, N, C), row by row
        image_ids = self.pipe._prepare_latent_ids(latents).to(latents.device)  # (B, N, 4)
        text_ids = self.pipe._prepare_text_ids(text).to(latents.device)  # (B, S, 4)
        embedded = torch.full((batch,), guidance, device=latents.device, dtype=torch.float32) if self.config.guidance_embeds else None
        output = self.denoiser(hidden_states=tokens, encoder_hidden_states=text, timestep=times.to(dtype), img_ids=image_ids,
                               txt_ids=text_ids, guidance=embedded, return_dict=False)[0]  # (B, N, C)
        return output.permute(0, 2, 1).reshape(batch, channels, rows, columns)

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device, latents.dtype)
        return self.pipe._unpatchify_latents(latents * std + mean)  # (B, C/4, H/8, W/8)


class Flux2KleinAdapter(Flux2Adapter):
    family = "flux2-klein"
    pipeline_class_name = "Flux2KleinPipeline"
    uses_cfg = True
    default_guidance = 4.0  # the pipeline's default guidance_scale (the base models'; the distilled ones ignore it)
    example_hub_id = "black-forest-labs/FLUX.2-klein-base-4B"
    text_layers = (9, 18, 27)

    @classmethod
    def license_of(cls, path: str) -> str:
        """FLUX.2 [klein] 4B (base and distilled) is Apache 2.0; the 9B is under BFL's non-commercial license."""
        return "apache-2.0" if "4b" in path.lower() else "other"

    @classmethod
    def cfg_rows(cls, guidance: float, path: str | None = None) -> int:
        """One row a prediction for a step-distilled release, which samples unguided (`is_distilled`: a folder
        whose model_index.json says so, or FLUX.2-klein-4B and -9B by name); else the base models' CFG rule."""
        return 1 if path is not None and is_distilled(path) else super().cfg_rows(guidance, path)

    def rows_per_sample(self, guidance: float) -> int:
        """The loaded pipeline says whether it is distilled; else the CFG rule `cfg_rows` plans with."""
        return 1 if self.pipe.config.get("is_distilled", False) else super().cfg_rows(guidance)

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        conditional, negative = super().encode(prompts), super().encode(negatives or [self.negative_prompt] * len(prompts))
        return {**conditional, **{f"negative_{key}": value for key, value in negative.items()}}
