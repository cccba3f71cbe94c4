"""A dense, model-agnostic reward for trainer tests: how red an image is (mean of R - (G+B)/2)."""

import torch


class Redness:
    name = "redness"
    scale = "mean of R - (G + B) / 2, in [-1, 1]"

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        return (images[:, 0] - images[:, 1:].mean(dim=1)).flatten(1).mean(dim=1)
