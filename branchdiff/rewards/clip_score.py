"""`clip-score`: CLIPScore of an image and its prompt (Hessel et al. 2021), on the scale torchmetrics
reports.

    CLIPScore = 100 · max(<e_img, e_txt>, 0)

per image, as torchmetrics defines its `CLIPScore` (which reports the mean over images); Hessel et
al. use 2.5·max(cos, 0) with ViT-B/32: divide by 40 to compare. The default model is torchmetrics'
default, OpenAI CLIP ViT-L/14 (`openai/clip-vit-large-patch14`), with its own processor (shortest
side to 224, centre crop 224, CLIP mean/std; prompts truncated to 77 tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch

from branchdiff.rewards.hf_clip import TransformersCLIPReward

CLIP_SCORE_MODEL = "openai/clip-vit-large-patch14"


class CLIPScoreReward(TransformersCLIPReward):
    """CLIP score `100 · max(cosine, 0)` of CLIP image and text embeddings.

    Args:
        model: a transformers CLIP model, a local `save_pretrained` folder or a hub id (default
            "openai/clip-vit-large-patch14", online only).
        processor: its processor, a local folder or a hub id; None (default) means `model`.
        device: where the model runs (default "cpu").
        batch_size: images per forward pass (default 16).
    """

    name = "clip-score"
    scale = "100·max(cosine, 0) (torchmetrics CLIPScore scale, per image; Hessel et al.'s 2.5·max(cos, 0) is this ÷ 40)"
    higher_is_better = True

    def __init__(
        self,
        model: str | Path = CLIP_SCORE_MODEL,
        processor: str | Path | None = None,
        device: str | torch.device = "cpu",
        batch_size: int = 16,
    ) -> None:
        super().__init__(model, processor, device, batch_size, origin=f"https://huggingface.co/{CLIP_SCORE_MODEL}")

    def score_chunk(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        cosine = (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(dim=-1)  # (b,)
        return 100 * cosine.clamp(min=0)
