"""Wan image-to-video through diffusers' `WanImageToVideoPipeline`: Wan 2.1 I2V (14B, 480P and 720P), Wan 2.2
I2V-A14B (two experts, as text-to-video A14B: branchdiff/models/wan.py) and Wan 2.2 TI2V-5B started from an image.
Everything but the source image is text-to-video Wan's (prompts, schedule, experts, guidance, VAE, LoRA); each
prompt comes with one source image (`image` in a JSONL or CSV prompt set, `sample --image`), the video's first
frame, of any size: like the pipeline, the adapter stretches it to the video's size (`sources.fit: resize`, the
default; crop, pad and refuse fit it otherwise, docs/video.md). It enters as the pipeline enters it:

- Wan 2.1 I2V and Wan 2.2 I2V-A14B concatenate to the noise, along the channels, a condition the size of the
  latent video: a mask (r channels, r the VAE's temporal factor: 1 on the first frame's latent, 0 after) and the
  latents of the source followed by black frames (the VAE's mode, standardised by latents_mean and latents_std).
  Wan 2.1 I2V's transformer also reads the CLIP vision encoder's penultimate hidden states of the source
  (`image_dim` in its config; Wan 2.2's has none).
- TI2V-5B (`expand_timesteps`) keeps the first latent frame clean: the transformer sees the source's latent
  there, with timestep 0 on its tokens and the step's on the others, and the pipeline puts the source's latent
  in place of the first frame at the end. branchdiff's latents keep that frame too, and its predicted velocity
  there is (x − source)/σ, whose clean estimate x − σ·v is the source: an ODE ends on the source's latent as the
  pipeline's video does, and as the velocity does not depend on the weights, that frame adds nothing to the
  log-probability ratios. σ is the step's own, looked up from the schedules the adapter made (`step_sigmas`): the
  released UniPC scheduler hands the transformer whole timesteps, ⌊1000·σ⌋, from which σ cannot be read back.

Unconditional (CFG) rows see the same source as the conditional ones, as in the pipeline. The pipeline makes one
source's videos per call; branchdiff encodes each prompt's source alone and batches the rows. A text-to-video folder
under this family, or an image-to-video one under `wan`, is refused in one line (their transformers' input channels
say which they are).
tests/test_wan_i2v.py checks sampling against `pipe(...)` for the three layouts, `--solver release`, and the LoRA
and full fine-tuning exports (docs/models.md).
"""

from __future__ import annotations

from typing import Any

import torch

from branchdiff.models.base import NEGATIVE
from branchdiff.models.wan import WAN_ATTENTION, WAN_FEED_FORWARD, WanAdapter
from branchdiff.schedulers.schedule import FlowSchedule, Schedule

SOURCE_CONDITION = "source_condition"  # embeds key: (B, r + C, F', h, w) mask and source latents; TI2V: the first frame's latent (B, C, 1, h, w)
SOURCE_IMAGE_STATES = "source_image_states"  # embeds key: (B, N, D) the CLIP vision encoder's penultimate states (Wan 2.1 I2V)
IMAGE_ATTENTION = ["attn2.add_k_proj", "attn2.add_v_proj"]  # Wan 2.1 I2V's keys and values of the source's CLIP states


class WanImageToVideoAdapter(WanAdapter):
    family = "wan-i2v"
    pipeline_class_name = "WanImageToVideoPipeline"
    helper_names = ("text_encoder", "image_encoder", "vae")
    edits = True  # each prompt comes with a source image: the first frame
    max_sources = 1
    source_use = "starts each video from an image"
    made, source_docs = "videos", "docs/video.md"
    example_hub_id = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"

    def __init__(self, pipe, device: torch.device | str = "cpu", size: tuple[int, int] = (480, 832), offload: bool = False,
                 frames: int = 81, expert: str = "high", guidance_2: float | None = None) -> None:
        self.expand = bool(pipe.config.expand_timesteps)  # TI2V-5B: the first frame kept clean (module doc)
        config, temporal = pipe.transformer.config, pipe.vae_scale_factor_temporal
        if not self.expand and config.in_channels != 2 * config.out_channels + temporal:
            raise ValueError(f"model.path holds a text-to-video Wan (its transformer reads {config.in_channels} channels, not the noise, a "
                             f"{temporal}-channel mask and the first frame's latents: {2 * config.out_channels + temporal}); use model.family=wan")
        super().__init__(pipe, device, size, offload, frames, expert, guidance_2)
        self.lora_target_sets = self.target_sets_for(self.config)
        self.step_sigmas: dict[float, float] = {}  # the σ of each model time of the schedules made (module doc)

    @classmethod
    def target_sets_for(cls, config) -> dict[str, list[str] | str]:
        """The LoRA target sets of a transformer of `config`: with Wan 2.1 I2V's image states (`image_dim`) the attention sets
        take their keys and values too (`IMAGE_ATTENTION`), an image-to-video LoRA as diffusers loads one."""
        if config.get("image_dim") is None:
            return cls.lora_target_sets
        return {"attention": WAN_ATTENTION + IMAGE_ATTENTION, "attention+ff": WAN_ATTENTION + IMAGE_ATTENTION + WAN_FEED_FORWARD, "all-linear": "all-linear"}

    def schedule(self, num_steps: int, shift: float | None = None) -> Schedule:
        schedule = super().schedule(num_steps, shift)
        assert isinstance(schedule, FlowSchedule)  # Wan is a flow family
        self.step_sigmas.update(zip(schedule.model_times.tolist(), schedule.sigmas[:-1].tolist()))
        return schedule

    @torch.no_grad()
    def release_denoise(self, latents: torch.Tensor, embeds: dict[str, torch.Tensor], num_steps: int, guidance: float | None = None) -> torch.Tensor:
        self.schedule(num_steps)  # the released scheduler's σ of each of its timesteps, for the clean first frame
        return super().release_denoise(latents, embeds, num_steps, guidance)

    def encode_edits(self, prompts: list[str], sources: list[list], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        rows = [self.encode_source(images[0]) for images in sources]
        source = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
        return {**self.encode(prompts, negatives), **source, **{NEGATIVE + key: value for key, value in source.items()}}

    def fit_source(self, image: Any, fit: str) -> Any:
        """Under resize, the source as it is: the pipeline's video processor stretches it to the video's size and Wan 2.1's
        CLIP vision encoder reads it whole, as `encode_source` does."""
        return image if fit == "resize" else super().fit_source(image, fit)

    def encode_source(self, image) -> dict[str, torch.Tensor]:
        """One prompt's source (an RGB PIL image; of another aspect ratio than the video's, stretched as the pipeline stretches
        it, or fitted by sources.fit) as the pipeline encodes it at the run's size."""
        pipe, embeds = self.pipe, {}
        if self.config.image_dim is not None:
            embeds[SOURCE_IMAGE_STATES] = pipe.encode_image(image, self.device)  # (1, N, D)
        pixels = pipe.video_processor.preprocess(image, height=self.height, width=self.width).to(self.device, torch.float32)  # (1, 3, H, W)
        unused = torch.zeros((1, *self.latent_shape), device=self.device)  # the pipeline's initial noise, returned unchanged
        prepared = pipe.prepare_latents(pixels, 1, self.latent_shape[0], self.height, self.width, self.frames, torch.float32, self.device,
                                        latents=unused)
        embeds[SOURCE_CONDITION] = prepared[1]
        return embeds

    def model_inputs(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = super().model_inputs(latents, times, embeds)
        condition = embeds[SOURCE_CONDITION].to(latents.dtype)
        if self.expand:  # the source's latent as the first frame, its tokens at timestep 0 (the pipeline's per-token timesteps)
            inputs["hidden_states"] = torch.cat([condition, latents[:, :, 1:]], dim=2)
            frames, rows, columns = latents.shape[2:]
            per_frame = (rows // self.config.patch_size[1]) * (columns // self.config.patch_size[2])
            timestep = times[:, None].expand(-1, frames * per_frame).clone()  # (B, tokens)
            timestep[:, :per_frame] = 0
            inputs["timestep"] = timestep
        else:
            inputs["hidden_states"] = torch.cat([latents, condition], dim=1)  # (B, C + r + C, F', h, w)
        if SOURCE_IMAGE_STATES in embeds:
            inputs["encoder_hidden_states_image"] = embeds[SOURCE_IMAGE_STATES]
        return inputs

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        output = super().forward(latents, times, embeds, guidance)
        if not self.expand:
            return output
        sigma = torch.tensor([self.step_sigmas.get(t, t / self.time_scale) for t in times.tolist()], dtype=latents.dtype,
                             device=latents.device).view(-1, 1, 1, 1, 1)  # the step's σ (module doc); a time of no schedule made: time / 1000
        pinned = (latents[:, :, :1] - embeds[SOURCE_CONDITION].to(latents.dtype)) / sigma  # x − σ·v = the source's latent
        return torch.cat([pinned.to(output.dtype), output[:, :, 1:]], dim=2)
