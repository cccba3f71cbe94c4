"""`pickscore`: PickScore v1 (Kirstain et al. 2023, "Pick-a-Pic"), CLIP ViT-H/14 fine-tuned on
human preferences.

Weights: the transformers `CLIPModel` in the hub repo `yuvalkirstain/PickScore_v1`
(model.safetensors); preprocessing and tokenizer: the processor of
`laion/CLIP-ViT-H-14-laion2B-s32B-b79K`, as the model card loads them (shortest side to 224,
bicubic; centre crop 224; CLIP mean/std; prompts truncated to 77 tokens). Score, as the model card:

    PickScore = exp(logit_scale) · <e_img, e_txt>

with the model's learned `logit_scale` (exp ≈ 100), so ≈ 100·cosine: SD3.5-M ≈ 21.7, FLUX ≈ 22.7.
"""

from __future__ import annotations

from pathlib import Path

import torch

from branchdiff.rewards.hf_clip import TransformersCLIPReward

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


class PickScoreReward(TransformersCLIPReward):
    """PickScore: `exp(logit_scale) · cosine` of CLIP image and text embeddings.

    Args:
        model: PickScore weights, a local `save_pretrained` folder or a hub id (default
            "yuvalkirstain/PickScore_v1", online only).
        processor: the CLIP processor, a local folder or a hub id (default
            "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", online only).
        device: where the model runs (default "cpu").
        batch_size: images per forward pass (default 16).
    """

    name = "pickscore"
    scale = "exp(logit_scale)·cosine, the model's learned temperature (≈ 100·cosine; SD3.5-M ≈ 21.7)"
    higher_is_better = True

    def __init__(
        self,
        model: str | Path = PICKSCORE_MODEL,
        processor: str | Path = PICKSCORE_PROCESSOR,
        device: str | torch.device = "cpu",
        batch_size: int = 16,
    ) -> None:
        super().__init__(
            model, processor, device, batch_size,
            origin=f"https://huggingface.co/{PICKSCORE_MODEL} with the processor of https://huggingface.co/{PICKSCORE_PROCESSOR}",
        )

    def score_chunk(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        cosine = (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(dim=-1)  # (b,)
        return self.model.logit_scale.exp() * cosine
