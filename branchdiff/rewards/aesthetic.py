"""`aesthetic`: the LAION aesthetic predictor v2 (C. Schuhmann, github.com/christophschuhmann/
improved-aesthetic-predictor, weights `sac+logos+ava1-l14-linearMSE.pth`), the reward of DDPO.

An MLP on the L2-normalised OpenAI CLIP ViT-L/14 image embedding (768-d, the projected output of
`encode_image`):

    aesthetic = W5 (W4 (W3 (W2 (W1 e + b1) + b2) + b3) + b4) + b5,   e = e_img / |e_img|

with widths 768 → 1024 → 128 → 64 → 16 → 1 and no activations (dropout 0.2, 0.2, 0.1 between the
first four layers only acts in training). Its .pth file is a plain state dict with keys
`layers.{0,2,4,6,7}.{weight,bias}` (dropouts sit at 1, 3, 5), read with `weights_only=True`.
Preprocessing is CLIP's (shortest side to 224, bicubic; centre crop 224; CLIP mean/std), done by the
processor of the CLIP model. Ratings are on the 1–10 scale of the AVA/SAC raters (most images 4–7).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from branchdiff.rewards.hf_clip import TransformersCLIPReward
from branchdiff.rewards.model_reward import load_tensor_file, resolve_weight_file

AESTHETIC_HUB_REPO = "trl-lib/ddpo-aesthetic-predictor"
AESTHETIC_FILE = "aesthetic-model.pth"  # the file in AESTHETIC_HUB_REPO
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_ORIGIN = (
    f"https://huggingface.co/{AESTHETIC_HUB_REPO} (file {AESTHETIC_FILE}) or "
    "https://github.com/christophschuhmann/improved-aesthetic-predictor (file sac+logos+ava1-l14-linearMSE.pth)"
)


class AestheticMLP(nn.Module):
    """The predictor's head: (B, embed_dim) normalised CLIP image embeddings -> (B, 1) ratings."""

    def __init__(self, embed_dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings)


class AestheticReward(TransformersCLIPReward):
    """LAION aesthetic predictor v2 on CLIP ViT-L/14 image embeddings (the prompt is not used).

    Args:
        mlp: the MLP weights, a local .pth/.safetensors file, a folder holding `mlp_filename`, or a hub
            repo id (default "trl-lib/ddpo-aesthetic-predictor", online only).
        mlp_filename: the file's name in a folder or hub repo (default "aesthetic-model.pth").
        clip_model: the CLIP model, a local `save_pretrained` folder or a hub id (default
            "openai/clip-vit-large-patch14", the embedding the MLP was trained on).
        processor: its processor; None (default) means `clip_model`.
        device: where the models run (default "cpu").
        batch_size: images per forward pass (default 16).
    """

    name = "aesthetic"
    scale = "LAION aesthetic v2 rating on the 1–10 scale of its raters (most images 4–7)"
    higher_is_better = True

    def __init__(
        self,
        mlp: str | Path = AESTHETIC_HUB_REPO,
        mlp_filename: str = AESTHETIC_FILE,
        clip_model: str | Path = AESTHETIC_CLIP,
        processor: str | Path | None = None,
        device: str | torch.device = "cpu",
        batch_size: int = 16,
    ) -> None:
        mlp_path = resolve_weight_file(mlp, mlp_filename, reward=self.name, origin=AESTHETIC_ORIGIN)
        state_dict = load_tensor_file(mlp_path, reward=self.name)
        super().__init__(clip_model, processor, device, batch_size, origin=f"https://huggingface.co/{AESTHETIC_CLIP}")
        embed_dim = self.model.config.projection_dim
        self.mlp = AestheticMLP(embed_dim)
        try:
            self.mlp.load_state_dict(state_dict, strict=True)
        except (RuntimeError, TypeError, AttributeError) as error:  # wrong keys or shapes; not a dict at all
            raise ValueError(
                f"reward {self.name!r}: {str(mlp_path)!r} is not an aesthetic MLP for {embed_dim}-d CLIP embeddings "
                "(expected keys layers.{0,2,4,6,7}.{weight,bias})"
            ) from error
        self.mlp = self.mlp.to(self.device).eval().requires_grad_(False)

    def score_chunk(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.mlp(self.image_embeddings(images)).squeeze(-1)  # (b,)
