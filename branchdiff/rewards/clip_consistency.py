"""`clip-consistency`: temporal consistency of a video as the similarity of its adjacent frames'
CLIP image features (`video = True`), in the manner of VBench's background-consistency dimension.

    consistency = 1/(F − 1) · Σ_{t=1..F−1} <e_t, e_{t−1}>

with e_t the projected, L2-normalised CLIP image embedding of frame t (branchdiff/rewards/hf_clip.py:
the processor's resize and centre crop of the 8-bit frame). In [−1, 1]; higher is steadier. Unlike
`flicker`, which compares pixels, it is indifferent to smooth motion and camera moves that keep the
content, and sensitive to content that changes identity between frames. A one-frame video scores 1.
The default model is OpenAI CLIP ViT-L/14 (`openai/clip-vit-large-patch14`, online only; pass a
local `save_pretrained` folder offline). The prompt is not used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from branchdiff.rewards.hf_clip import TransformersCLIPReward

CONSISTENCY_MODEL = "openai/clip-vit-large-patch14"


class CLIPConsistencyReward(TransformersCLIPReward):
    """Mean cosine similarity of adjacent frames' CLIP image embeddings (module doc).

    Args:
        model: a transformers CLIP model, a local `save_pretrained` folder or a hub id (default
            "openai/clip-vit-large-patch14", online only).
        processor: its processor, a local folder or a hub id; None (default) means `model`.
        device: where the model runs (default "cpu").
        batch_size: frames per forward pass, in whole videos (default 16; at least one video).
    """

    name = "clip-consistency"
    scale = "mean cosine of adjacent frames' CLIP image embeddings, in [-1, 1] (higher: steadier content)"
    higher_is_better = True
    video = True

    def __init__(self, model: str | Path = CONSISTENCY_MODEL, processor: str | Path | None = None,
                 device: str | torch.device = "cpu", batch_size: int = 16) -> None:
        super().__init__(model, processor, device, batch_size, origin=f"https://huggingface.co/{CONSISTENCY_MODEL}")

    def score_chunk(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Consistency (b,) of videos (b, F, 3, H, W) in [0, 1] on `self.device`, F ≥ 2."""
        batch, frames = videos.shape[:2]
        embeddings = self.image_embeddings(videos.flatten(0, 1)).view(batch, frames, -1)  # (b, F, D)
        return (embeddings[:, 1:] * embeddings[:, :-1]).sum(dim=-1).mean(dim=1)

    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Scores (B,) of videos (B, F, 3, H, W), about `batch_size` frames per forward (whole videos)."""
        if videos.dim() != 5 or videos.shape[2] != 3:
            raise ValueError(f"reward 'clip-consistency' scores videos (B, F, 3, H, W), got {tuple(videos.shape)}")
        if videos.shape[0] != len(prompts):
            raise ValueError(f"reward 'clip-consistency' got {videos.shape[0]} videos for {len(prompts)} prompts")
        batch, frames = videos.shape[:2]
        if frames < 2:
            return torch.ones(batch)
        per_chunk = max(1, self.batch_size // frames)
        with torch.no_grad():
            return torch.cat([self.score_chunk(videos[start : start + per_chunk].to(self.device, torch.float32), prompts[start : start + per_chunk])
                              .float().cpu() for start in range(0, batch, per_chunk)])
