"""FLUX.1 Kontext [dev] (instruction editing) through diffusers' `FluxKontextPipeline`: FLUX.1-dev's
conditioning (CLIP pooled + T5, the embedded guidance, the resolution-dependent shift) plus the
prompt's source image, encoded by the VAE (its mode, shifted and scaled as the pipeline does),
packed 2×2 and appended to the noisy image's tokens with position ids whose first coordinate is 1;
the transformer's output keeps the noisy tokens only.

Edits are made at the run's image size (`model.resolution`) and the source is encoded at that size,
resized with the pipeline's own image processor: `pipe(image=..., height=H, width=W, max_area=H·W,
_auto_resize=False)` for a source of that size. The pipeline's defaults instead rescale the output to
about one megapixel (`max_area`) and the source to the nearest of Kontext's preferred resolutions;
training at the run's size keeps a step's token count at twice the image's. One source image per prompt,
of the edits' aspect ratio (`check_sources`: it is resized, never stretched).
tests/test_editing.py checks sampling against the pipeline's edits and the LoRA export (docs/editing.md).
"""

from __future__ import annotations

import torch

from branchdiff.models.flux import FluxAdapter

SOURCE_LATENTS = "source_latents"  # embeds key: each prompt's encoded source image, packed (B, N, 64)


class FluxKontextAdapter(FluxAdapter):
    family = "flux-kontext"
    pipeline_class_name = "FluxKontextPipeline"
    edits = True
    max_sources = 1
    default_guidance = 2.5  # the model card's guidance_scale for Kontext [dev]
    example_hub_id = "black-forest-labs/FLUX.1-Kontext-dev"

    def encode_edits(self, prompts: list[str], sources: list[list], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Embedded guidance, no CFG: `negatives` is always None (`row_negatives` refuses a row's)."""
        return {**self.encode(prompts), SOURCE_LATENTS: torch.cat([self.source_latents(images) for images in sources])}

    def source_latents(self, images: list) -> torch.Tensor:
        """One prompt's source (an RGB PIL image of the edits' aspect ratio) at the run's size as the pipeline encodes it: (1, N, 64)."""
        processor, vae = self.pipe.image_processor, self.pipe.vae
        pixels = processor.preprocess(processor.resize(images[0], self.height, self.width), self.height, self.width)  # (1, 3, H, W) in [-1, 1]
        latents = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode()  # the pipeline's sample_mode="argmax"
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor  # (1, C, H/8, W/8)
        return self.pipe._pack_latents(latents, 1, latents.shape[1], *latents.shape[2:])

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        count = latents.shape[1]
        ids = self.pipe._prepare_latent_image_ids(len(latents), *self.token_grid(), latents.device, self.dtype)  # (N, 3)
        source_ids = ids.clone()
        source_ids[:, 0] = 1  # the source's tokens: the same grid, marked as the first reference image
        tokens = torch.cat([latents, embeds[SOURCE_LATENTS].to(latents.dtype)], dim=1)  # (B, 2N, 64)
        return self.transformer_output(tokens, torch.cat([ids, source_ids]), times, embeds, guidance)[:, :count]
