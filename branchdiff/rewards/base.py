"""The reward protocol: what every reward provides, built in, user-written or served remotely.

A reward is a callable

    reward(images, prompts, metadata) -> scores

with `images` a float tensor (B, 3, H, W) in [0, 1], `prompts` B strings, `metadata` B dicts (the
prompt set's extra fields, e.g. an HPDv2 style), and `scores` a float tensor (B,) on the CPU. It
declares, as class or instance attributes, what a user needs to read its numbers:

- `name`: the registry name (`hpsv2.1`, `pickscore`, ...) or a user's own;
- `scale`: what one unit means, e.g. "cosine in [-1, 1]", "100·cosine", "logit";
- `higher_is_better`: False for a loss-like score (GRPO then maximises its negative);
- `device`: where its model runs.

`Reward` is a base class with these defaults; any object with the same attributes and call works
(duck typing), so a user's reward need not import branchdiff.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Reward(ABC):
    name: str = "reward"
    scale: str = "unspecified"
    higher_is_better: bool = True
    device: torch.device = torch.device("cpu")

    @abstractmethod
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Scores (B,) for images (B, 3, H, W) in [0, 1] and their prompts and metadata."""


def check_scores(scores: object, batch: int, name: str) -> torch.Tensor:
    """The scores a reward returned as a float CPU tensor (B,), or a one-line ValueError naming the
    reward and what it returned instead."""
    scores = torch.as_tensor(scores)
    if scores.shape != (batch,):
        raise ValueError(f"reward {name!r} returned shape {tuple(scores.shape)} for {batch} images; it must return one score per image, shape ({batch},)")
    return scores.detach().float().cpu()


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] as the 8-bit pixels a saved image holds: uint8 on the CPU,
    `round(255 · clamp(x, 0, 1))`, ties to even (torch.round). Rewards that score saved-image pixels
    and the reward server's wire both use it, so their pixels agree bit for bit."""
    return images.detach().to("cpu", torch.float32).clamp(0, 1).mul(255).round().to(torch.uint8)
