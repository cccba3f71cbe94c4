"""`imagereward`: ImageReward v1.0 (Xu et al. 2023, github.com/THUDM/ImageReward), a BLIP ViT-L
image encoder and BERT text encoder with cross-attention, and an MLP head on the text [CLS] state.

Optional: it needs the `image-reward` package (import name `ImageReward`), which pins old
dependencies (timm 0.6, which branchdiff's open-clip-torch 3 excludes), so it is served from
its own environment with `branchdiff serve-reward imagereward`. The package is imported only when
the reward is built; without it, building the reward raises one ImportError line naming the extra.

Weights: `ImageReward.pt` (a plain state dict, read here with `weights_only=True` rather than the
package's unrestricted `torch.load`) and `med_config.json`, both in the hub repo `THUDM/ImageReward`.
Preprocessing as the package: shortest side to 224 (bicubic), centre crop 224, CLIP mean/std;
prompts padded/truncated to 35 BERT tokens. Score, as the package's `score`:

    ImageReward = (mlp(h_CLS) - 0.16717362830052426) / 1.0333394966054072

(the package's mean and std of the raw head over its training comparisons), so ≈ N(0, 1).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.transforms.v2 import functional as TF

from branchdiff.rewards.model_reward import (
    CLIP_MEAN,
    CLIP_STD,
    ModelReward,
    import_optional,
    load_tensor_file,
    resolve_weight_file,
    to_uint8,
)

IMAGEREWARD_HUB_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
IMAGEREWARD_INSTALL = ("install image-reward in its own environment (pip install image-reward; it pins timm 0.6, which "
                       "open-clip-torch 3 excludes) and serve it: branchdiff serve-reward imagereward (docs/reward-server.md)")
PROMPT_TOKENS = 35  # the package's max_length for BERT tokens


def center_crop_preprocess(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """(B, 3, H, W) uint8 -> (B, 3, size, size): shortest side to `size` (bicubic, antialiased),
    centre crop, `x / 255`, CLIP mean/std."""
    images = TF.resize(images, [size], interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    images = TF.center_crop(images, [size, size]).float() / 255
    return TF.normalize(images, mean=list(CLIP_MEAN), std=list(CLIP_STD))


class ImageRewardReward(ModelReward):
    """ImageReward v1.0, standardised.

    Args:
        checkpoint: `ImageReward.pt`, a local file, a folder holding it, or a hub repo id (default
            "THUDM/ImageReward", online only).
        med_config: `med_config.json`, a local file, a folder or a hub repo id; None (default) means
            the folder of a local `checkpoint` when it holds one, else the hub repo.
        device: where the model runs (default "cpu").
        batch_size: images per forward pass (default 16).
    """

    name = "imagereward"
    scale = "standardised ImageReward, (head - 0.1672) / 1.0333, ≈ N(0, 1) over its training comparisons"
    higher_is_better = True

    def __init__(
        self,
        checkpoint: str | Path = IMAGEREWARD_HUB_REPO,
        med_config: str | Path | None = None,
        device: str | torch.device = "cpu",
        batch_size: int = 16,
    ) -> None:
        super().__init__(device, batch_size)
        reward_module = import_optional(
            "ImageReward.ImageReward", reward=self.name, package="image-reward", install=IMAGEREWARD_INSTALL
        )
        origin = f"https://huggingface.co/{IMAGEREWARD_HUB_REPO} (files {IMAGEREWARD_FILE} and {MED_CONFIG_FILE})"
        weights = resolve_weight_file(checkpoint, IMAGEREWARD_FILE, reward=self.name, origin=origin)
        if med_config is None:
            med_config = weights.parent if (weights.parent / MED_CONFIG_FILE).is_file() else IMAGEREWARD_HUB_REPO
        config = resolve_weight_file(med_config, MED_CONFIG_FILE, reward=self.name, origin=origin)
        model = reward_module.ImageReward(med_config=str(config), device=self.device)
        result = model.load_state_dict(load_tensor_file(weights, reward=self.name), strict=False)  # strict=False as the package
        missing = [key for key in result.missing_keys if not key.endswith("position_ids")]
        if missing:
            raise ValueError(f"reward {self.name!r}: {str(weights)!r} lacks {len(missing)} ImageReward weights, e.g. {missing[0]!r}")
        self.model = model.to(self.device).eval().requires_grad_(False)

    def score_chunk(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        blip = self.model.blip
        pixels = center_crop_preprocess(to_uint8(images).to(self.device))  # (b, 3, 224, 224)
        tokens = blip.tokenizer(prompts, padding="max_length", truncation=True, max_length=PROMPT_TOKENS, return_tensors="pt").to(self.device)
        image_states = blip.visual_encoder(pixels)  # (b, 1 + patches, 1024)
        image_mask = torch.ones(image_states.shape[:-1], dtype=torch.long, device=self.device)
        text = blip.text_encoder(
            tokens.input_ids, attention_mask=tokens.attention_mask, encoder_hidden_states=image_states,
            encoder_attention_mask=image_mask, return_dict=True,
        )
        raw = self.model.mlp(text.last_hidden_state[:, 0, :].float()).squeeze(-1)  # (b,)
        return (raw - self.model.mean) / self.model.std
