"""The built-in tiny text-to-video model: a 4-layer Wan transformer (diffusers' `WanTransformer3DModel`,
the Wan family's denoiser class) on clips of 5 frames of 32×32 RGB pixels, with the tiny image model's
2-layer CLIP text encoder and tokenizer, so the tiny-video task runs Wan's code paths (3-D patches and
rotary positions over frames, peft LoRA on Wan attention, a `WanPipeline`-loadable LoRA export).

Latents are clips (3, F, 32, 32) in pixel space (Wan's (C, F', H', W') layout, no VAE); like the tiny
image model the transformer predicts x0 and the velocity is v = (x − x̂0) / σ. `decode` returns
videos (B, F, 3, H, W) in [0, 1]. The frame count is the shipped model's, 5: the pretraining renders
5-frame clips.
"""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel

from branchdiff.data.tiny_video_task import FRAMES
from branchdiff.models.tiny import TinyAdapter
from branchdiff.models.wan import WAN_ATTENTION, WAN_FEED_FORWARD

TRANSFORMER_CONFIG = dict(
    patch_size=(1, 8, 8), num_attention_heads=4, attention_head_dim=32, in_channels=3, out_channels=3, text_dim=64,
    freq_dim=64, ffn_dim=256, num_layers=4, rope_max_seq_len=32,
)


class TinyVideoAdapter(TinyAdapter):
    family = "tiny-video"
    lora_target_sets = {"attention": WAN_ATTENTION, "attention+ff": WAN_ATTENTION + WAN_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules = ("patch_embedding", "condition_embedder", "norm_out", "proj_out")
    pipeline_class_name = "WanPipeline"  # its LoRA loads into a Wan transformer
    denoiser_class = WanTransformer3DModel
    denoiser_config = TRANSFORMER_CONFIG
    assets = ("tiny-video", "BRANCHDIFF_TINY_VIDEO_MODEL")
    pretrain_script = "pretrain_tiny.py --task tiny-video"
    frames = FRAMES

    @classmethod
    def from_pretrained(cls, path=None, device="cpu", size=(32, 32), dtype=torch.float32, offload=False,
                        frames: int = FRAMES, expert: str = "high", guidance_2: float | None = None) -> TinyVideoAdapter:
        """As the tiny image model; `frames` must be the shipped 5, `expert` the one transformer, no `guidance_2`."""
        cls.folder_frames(path, frames)
        if expert != "high" or guidance_2 is not None:
            raise ValueError("model.expert and model.guidance_2 are Wan 2.2's low-noise expert's; the tiny-video model has one transformer: "
                             "leave them unset")
        return super().from_pretrained(path, device, size, dtype, offload)

    @classmethod
    def folder_frames(cls, path, frames: int) -> None:
        if frames != FRAMES:
            raise ValueError(f"the tiny-video model makes {FRAMES}-frame clips; model.frames={frames} is not possible")

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (3, self.frames, self.resolution, self.resolution)  # pixel space, Wan's (C, F, H, W)

    def predict_x0(self, latents: torch.Tensor, sigmas: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.denoiser(hidden_states=latents, timestep=sigmas * 1000, encoder_hidden_states=embeds["encoder_hidden_states"],
                             return_dict=False)[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Clips (B, 3, F, H, W) in [−1, 1] → videos (B, F, 3, H, W) in [0, 1]."""
        return ((latents.float().transpose(1, 2) + 1) / 2).clamp(0, 1)

    @staticmethod
    def encode_images(images: torch.Tensor) -> torch.Tensor:
        """Videos (B, F, 3, H, W) in [0, 1] → latents (B, 3, F, H, W) in [−1, 1] (the inverse of `decode`)."""
        return images.transpose(1, 2) * 2 - 1
