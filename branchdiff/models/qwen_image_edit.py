"""Qwen-Image-Edit 2509 / 2511 (instruction editing, one or more source images) through diffusers'
`QwenImageEditPlusPipeline`: Qwen-Image's transformer, schedule, true CFG with its rescale and VAE
(branchdiff/models/qwen_image.py), with each prompt's sources entering twice, as the pipeline does:

- as image tokens of the Qwen2.5-VL prompt ("Picture k: <image>" before the instruction, in the edit
  template), each source resized to the pipeline's condition area (`CONDITION_IMAGE_SIZE`, 384², at
  its aspect ratio, sides multiples of 32); the negative prompt " " sees them too;
- as VAE latents (the mode, normalised by the VAE's latents_mean and latents_std, packed 2×2)
  appended to the noisy image's tokens, each source at the pipeline's VAE area (`VAE_IMAGE_SIZE`,
  1024², at its aspect ratio), with its own token grid in the transformer's `img_shapes`.

The pipeline edits one prompt per call; branchdiff encodes each prompt alone too, and batches the
rows. The sources of one batch must therefore make the same grids: every prompt of a set carries as
many sources, each of the edits' aspect ratio (`check_sources`, and the run's preflight, say so
otherwise, naming the prompt). Edits are made at the run's size
(`model.resolution`), with the sources at the pipeline's areas whatever that size: a step's tokens
are the image's plus about 4,096 per source at the released areas.
tests/test_editing.py checks sampling against the pipeline's edits and the LoRA export (docs/editing.md).
"""

from __future__ import annotations

import torch

from branchdiff.models.qwen_image import QwenImageAdapter

SOURCE_LATENTS = "source_latents"  # embeds key: each prompt's encoded sources, packed and joined (B, N, 64)
SOURCE_GRIDS = "source_grids"  # embeds key: the (frames, rows, columns) token grid of each source (B, K, 3)


class QwenImageEditAdapter(QwenImageAdapter):
    family = "qwen-image-edit"
    pipeline_class_name = "QwenImageEditPlusPipeline"
    edits = True
    example_hub_id = "Qwen/Qwen-Image-Edit-2509"
    max_sequence_length = 1024  # the template, the sources' image tokens and the instruction, which the pipeline keeps whole

    def encode_edits(self, prompts: list[str], sources: list[list], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        negatives = negatives or [self.negative_prompt] * len(prompts)
        rows = [self.encode_edit(prompt, images, negative) for prompt, images, negative in zip(prompts, sources, negatives)]
        return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}

    def encode_edit(self, prompt: str, images: list, negative: str) -> dict[str, torch.Tensor]:
        """One prompt, its sources (RGB PIL images) and its negative prompt as the pipeline encodes them."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as release

        processor, conditions, latents, grids = self.pipe.image_processor, [], [], []
        for image in images:
            ratio = image.width / image.height
            condition_width, condition_height = release.calculate_dimensions(release.CONDITION_IMAGE_SIZE, ratio)
            vae_width, vae_height = release.calculate_dimensions(release.VAE_IMAGE_SIZE, ratio)
            conditions.append(processor.resize(image, condition_height, condition_width))
            pixels = processor.preprocess(image, vae_height, vae_width).unsqueeze(2)  # (1, 3, 1, h, w)
            encoded = self.pipe._encode_vae_image(pixels.to(self.device, self.pipe.vae.dtype), generator=None)  # (1, C, 1, h/8, w/8)
            rows, columns = encoded.shape[-2:]
            latents.append(self.pipe._pack_latents(encoded, 1, encoded.shape[1], rows, columns))
            grids.append((1, rows // 2, columns // 2))
        embeds = {}
        for prefix, text in (("", prompt), ("negative_", negative)):  # CFG's unconditional rows see the same sources
            states, mask = self.pipe.encode_prompt(prompt=[text], image=conditions, device=self.device)
            embeds.update(self.padded_text(states, mask, prefix))
            embeds.update({f"{prefix}{SOURCE_LATENTS}": torch.cat(latents, dim=1), f"{prefix}{SOURCE_GRIDS}": torch.tensor([grids])})
        return embeds

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        sources = embeds[SOURCE_GRIDS]  # (B, K, 3)
        if not torch.equal(sources, sources[:1].expand_as(sources)):  # the transformer takes one layout of tokens per call
            raise ValueError(f"{self.family} got a batch of prompts whose sources make different token grids "
                             f"({sorted({tuple(map(tuple, row)) for row in sources.tolist()})}); give every source the edits' aspect ratio")
        grids = [(1, *self.token_grid()), *map(tuple, sources[0].tolist())]
        tokens = torch.cat([latents, embeds[SOURCE_LATENTS].to(latents.dtype)], dim=1)  # (B, N + N_sources, 64)
        return self.transformer_output(tokens, grids, times, embeds)[:, : latents.shape[1]]
