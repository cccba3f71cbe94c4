"""Images and plots of a run: sample grids."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.utils import save_image


def save_grid(images: torch.Tensor, path: Path, nrow: int = 8, upscale: int = 4) -> None:
    """Save images (B, 3, H, W) in [0, 1] as one PNG grid, each image enlarged `upscale`× (nearest)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    big = torch.nn.functional.interpolate(images.float().cpu(), scale_factor=upscale, mode="nearest")
    save_image(big, path, nrow=nrow, padding=2, pad_value=0.5)
