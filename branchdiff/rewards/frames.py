"""Videos scored by a reward of images: every N-th frame is scored as an image of the video's prompt,
and a video's frame scores are reduced to one, their mean or their minimum (a reward spec's
`frames: N` and `reduce: mean | min`; docs/rewards.md). A reward that scores videos itself declares
`video = True` and receives the videos (B, F, 3, H, W) whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch

REDUCTIONS = ("mean", "min")


@dataclass(frozen=True)
class FrameAggregation:
    every: int = 1  # score frames 0, N, 2N, … of each video
    reduce: str = "mean"  # a video's score: the mean or the minimum of its frames' scores

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"frames must be a whole number ≥ 1 (score every N-th frame), got {self.every!r}")
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {', '.join(REDUCTIONS)}, got {self.reduce!r}")

    def frames_of(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> tuple[torch.Tensor, list[str], list[dict]]:
        """Videos (B, F, 3, H, W) → the frames scored (B·K, 3, H, W), video by video, with their video's
        prompt and metadata (K = ⌈F / every⌉ frames per video)."""
        picked = videos[:, :: self.every]  # (B, K, 3, H, W)
        per_video = picked.shape[1]
        return (picked.flatten(0, 1), [p for p in prompts for _ in range(per_video)],
                [m for m in metadata for _ in range(per_video)])

    def reduce_scores(self, scores: torch.Tensor, videos: int) -> torch.Tensor:
        """Frame scores (B·K,) → one score per video (B,)."""
        per_video = scores.reshape(videos, -1)  # (B, K)
        return per_video.mean(dim=1) if self.reduce == "mean" else per_video.min(dim=1).values
