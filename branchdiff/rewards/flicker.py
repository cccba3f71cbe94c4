"""`flicker`: how much a video's frames change from one to the next, a temporal-consistency measure of
videos (`video = True`; it needs no weights).

    flicker = mean over t = 1..F−1 and pixels of |b(x_t) − b(x_{t−1})|

with b a 3×3 box blur (edge pixels average the neighbours they have), so that a one-pixel shimmer
counts and a smooth motion counts little. In [0, 1]; lower is steadier (`higher_is_better` False: in
a weighted signal it enters negated). A one-frame video scores 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Flicker:
    name = "flicker"
    scale = "mean |blurred frame t − blurred frame t−1| over pixels and adjacent frames, in [0, 1] (lower: steadier)"
    higher_is_better = False
    video = True

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)

    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        if videos.dim() != 5 or videos.shape[2] != 3:
            raise ValueError(f"reward 'flicker' scores videos (B, F, 3, H, W), got {tuple(videos.shape)}")
        batch, frames = videos.shape[:2]
        if frames < 2:
            return torch.zeros(batch)
        flat = videos.to(self.device, torch.float32).flatten(0, 1)  # (B·F, 3, H, W)
        blurred = F.avg_pool2d(flat, kernel_size=3, stride=1, padding=1, count_include_pad=False).view_as(videos)  # (B, F, 3, H, W)
        return (blurred[:, 1:] - blurred[:, :-1]).abs().flatten(1).mean(dim=1).cpu()  # (B,)
