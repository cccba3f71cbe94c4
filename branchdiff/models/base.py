"""The model-adapter contract: the only family-specific code in branchdiff.

An adapter owns the denoiser (`denoiser`, the module LoRA is attached to), encodes prompts,
predicts the velocity for a batch of latents at given σ, and decodes latents to images in [0, 1].
Nothing outside `branchdiff.models` knows which family it runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

PromptEmbeds = dict[str, torch.Tensor]  # every tensor has the prompt batch as its first dimension


def select_embeds(embeds: PromptEmbeds, index: torch.Tensor) -> PromptEmbeds:
    """Rows `index` (N,) of every tensor of a batch of prompt embeddings."""
    return {key: value.index_select(0, index.to(value.device)) for key, value in embeds.items()}


class ModelAdapter(ABC):
    denoiser: torch.nn.Module  # the network that LoRA adapts
    latent_shape: tuple[int, ...]  # per-sample latent shape, e.g. (3, 32, 32)
    lora_target_modules: list[str]  # module-name suffixes LoRA wraps (attention projections)
    device: torch.device

    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Conditioning for each prompt; computed without gradients (encoders stay frozen)."""

    @abstractmethod
    def predict_velocity(self, latents: torch.Tensor, sigmas: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """v ≈ ε - x0 for latents (B, *latent_shape) at noise levels sigmas (B,), embeds with B rows."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1]."""
