"""Rewards on a transformers `CLIPModel` and its processor (PickScore, CLIP score, aesthetic).

Preprocessing is the processor's own (loaded from the processor path or id): for CLIP that is the
shortest side resized to 224 (bicubic, antialiased), a 224×224 centre crop, `x / 255`, then CLIP
mean/std. It receives the 8-bit images (`to_uint8`), as it would receive the saved PNGs. In
transformers 5 the processor resizes with torchvision's uint8 kernel; the references ran PIL's,
which differs by 1–2 levels on under 1% of pixels (scores agree to ~1e-3 relative). Prompts are
tokenised by the processor's tokenizer, padded to the longest in the chunk and truncated to the
text model's context (77 tokens for CLIP).

Features are the projected, L2-normalised embeddings:

    e_img = P_v(pool(ViT(x))) / |·|        e_txt = P_t(h_EOS) / |·|        cos = <e_img, e_txt>
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from branchdiff.rewards.model_reward import ModelReward, load_pretrained, to_uint8


class TransformersCLIPReward(ModelReward):
    """Base of rewards on a transformers CLIPModel; subclasses implement `score_chunk` with
    `image_embeddings` and `text_embeddings`.

    Args:
        model: a local folder written by `CLIPModel.save_pretrained`, or a hub id (online only).
        processor: a local folder written by `CLIPProcessor.save_pretrained`, or a hub id; None
            means the same as `model`.
        device: where the model runs.
        batch_size: images per forward pass.
        origin: where a user gets the weights, for the missing-weights message.
    """

    def __init__(
        self,
        model: str | Path,
        processor: str | Path | None,
        device: str | torch.device,
        batch_size: int,
        origin: str,
    ) -> None:
        super().__init__(device, batch_size)
        from transformers import CLIPModel, CLIPProcessor

        self.model = load_pretrained(CLIPModel.from_pretrained, model, reward=self.name, what="CLIP model", origin=origin)
        self.model = self.model.to(self.device).eval().requires_grad_(False)
        self.processor = load_pretrained(
            CLIPProcessor.from_pretrained, processor if processor is not None else model, reward=self.name, what="CLIP processor", origin=origin
        )
        self.max_text_tokens = self.model.config.text_config.max_position_embeddings  # 77 for CLIP

    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """(b, 3, H, W) in [0, 1] -> (b, D) L2-normalised projected image embeddings."""
        pixels = self.processor.image_processor(
            images=to_uint8(images).cpu(), input_data_format="channels_first", return_tensors="pt"
        )["pixel_values"].to(self.device)  # (b, 3, 224, 224)
        return F.normalize(self.model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)

    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """b prompts -> (b, D) L2-normalised projected text embeddings."""
        tokens = self.processor.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_text_tokens, return_tensors="pt"
        ).to(self.device)
        return F.normalize(self.model.get_text_features(**tokens).pooler_output, dim=-1)
