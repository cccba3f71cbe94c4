"""`tiny-video`: a programmatic verifier of clips of the built-in tiny-video task (`video = True`).

Every frame is segmented into objects as `tiny-geneval` segments an image (connected components of
bright pixels, each with a palette colour and a template shape), with one difference in the shape
rule: an object whose best-fitting template is the square is a square when at least
SQUARE_MIN_CORNERS = 2 of its bounding box's four corner pixels are set (tiny-geneval asks all four).
Moving objects drawn through 8-pixel patches lose corner pixels: about 9 in 10 of the model's
square-fitting objects missed at least one, before and after training, so the stricter rule measured
pixel noise rather than shape (docs/video.md). A circle inscribed in its box sets none of them.
Per frame f, with n_f objects detected and c asked, the count, colour and shape terms are tiny-geneval's:

    count_f   = 1[n_f = c]                       partial: max(0, 1 − |n_f − c| / 3)
    colour_f  = 1[n_f ≥ 1, every object's colour matches]   partial: min(m, c) / max(n_f, c)
    shape_f   likewise with shapes

A clip has an attribute when most of its frames (more than half) have it. The direction of motion
comes from the track of the mean centroid of each frame's objects, over the frames that have any:
its least-squares velocity v (px per frame) times F − 1 is the clip's travel d. With u the asked
direction's unit vector, along = d·u and across = |d × u|:

    direction = 1[along ≥ MIN_TRAVEL and across ≤ along / 2]
    partial   = clamp((along − across) / EXPECTED_TRAVEL, 0, 1)

(the ground truth travels 16 or 20 px; a still clip, or one with fewer than two frames holding
objects, scores 0). Then, as for images,

    strict    = count · colour · shape · direction
    partial   = mean of the four partial terms (count, colour, shape averaged over frames)

The reward is `partial`; `score` also returns `strict` and the four binary attributes. With
`strict_weight` w > 0 the reward is tiny-geneval's blend (1 − w)·partial + w·strict.
"""

from __future__ import annotations

import numpy as np
import torch

from branchdiff.data.tiny_task import check_grammar
from branchdiff.data.tiny_video_task import DIRECTIONS, TinyClipPrompt, parse_prompt
from branchdiff.rewards.tiny_geneval import DetectedObject, PartialCreditVerifier, detect_objects, shape_by_corners

ATTRIBUTES = ("count", "color", "shape", "direction")
MIN_TRAVEL = 8.0  # px over the clip: half the ground truth's shortest travel; less is a still clip
EXPECTED_TRAVEL = 16.0  # px: the ground truth's shortest travel, full credit from here on
SQUARE_MIN_CORNERS = 2  # corner pixels of its bounding box a square-fitting object must set (module doc)


def clip_shape(obj: DetectedObject) -> str:
    """The shape of a detected object under the video rule: tiny-geneval's corner rules with
    SQUARE_MIN_CORNERS of a square's four box-corner pixels instead of all four."""
    return shape_by_corners(obj.nearest_shape, obj.corners, SQUARE_MIN_CORNERS)


def clip_direction(centroids: list[tuple[int, np.ndarray]], frames: int, direction: str) -> tuple[float, float]:
    """(binary, partial) direction scores from the (frame index, mean centroid (y, x)) of the frames
    holding objects."""
    if len(centroids) < 2:
        return 0.0, 0.0
    times = np.array([t for t, _ in centroids], dtype=np.float64)  # (K,)
    points = np.stack([c for _, c in centroids])  # (K, 2)
    centred = times - times.mean()
    velocity = (centred[:, None] * (points - points.mean(axis=0))).sum(axis=0) / (centred**2).sum()  # (2,) px per frame
    travel = velocity * (frames - 1)
    unit = np.asarray(DIRECTIONS[direction], dtype=np.float64)  # (dy, dx)
    along = float(travel @ unit)
    across = abs(float(travel[0] * unit[1] - travel[1] * unit[0]))
    binary = float(along >= MIN_TRAVEL and across <= along / 2)
    return binary, float(np.clip((along - across) / EXPECTED_TRAVEL, 0.0, 1.0))


def score_clip(clip: np.ndarray, prompt: TinyClipPrompt) -> dict[str, float]:
    """Binary attributes, strict and partial scores of one clip (F, 3, H, W) in [0, 1] against its prompt."""
    return scores_and_terms(clip, prompt)[0]


def scores_and_terms(clip: np.ndarray, prompt: TinyClipPrompt) -> tuple[dict[str, float], dict[str, float]]:
    """`score_clip`'s scores, and the four partial-credit terms whose mean is `partial` (count, colour, shape averaged
    over frames; direction), by attribute."""
    frames = clip.shape[0]
    binary = {name: [] for name in ("count", "color", "shape")}
    partial = {name: [] for name in ("count", "color", "shape")}
    centroids = []
    for index, image in enumerate(clip):
        objects = detect_objects(image)
        n, c = len(objects), prompt.count
        binary["count"].append(n == c)
        partial["count"].append(max(0.0, 1 - abs(n - c) / 3))
        for name, hits in (("color", [o.color == prompt.color for o in objects]), ("shape", [clip_shape(o) == prompt.shape for o in objects])):
            binary[name].append(n > 0 and all(hits))
            partial[name].append(min(sum(hits), c) / max(n, c))
        if objects:
            centroids.append((index, np.mean([o.centroid_yx for o in objects], axis=0)))
    scores = {name: float(sum(hits) > frames / 2) for name, hits in binary.items()}
    scores["direction"], direction_partial = clip_direction(centroids, frames, prompt.direction)
    scores["strict"] = float(all(scores[a] for a in ATTRIBUTES))
    terms = {**{name: float(np.mean(values)) for name, values in partial.items()}, "direction": direction_partial}
    scores["partial"] = float(np.mean([terms[a] for a in ATTRIBUTES]))
    return scores, terms


class TinyVideoVerifier(PartialCreditVerifier):
    """The built-in video task's verifier (module doc)."""

    name = "tiny-video"
    scale = "partial credit in [0, 1]: mean of count, colour, shape (averaged over frames) and direction-of-motion scores"
    attributes = ATTRIBUTES
    video = True

    @staticmethod
    def check_prompts(prompts: list[str]) -> None:
        """Refuse, before a run starts, a prompt outside the tiny-video grammar (preflight calls it)."""
        check_grammar(prompts, parse_prompt)

    def score(self, videos: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Every score of `score_clip` for videos (B, F, 3, H, W) in [0, 1]."""
        if videos.dim() != 5 or videos.shape[2] != 3:
            raise ValueError(f"reward 'tiny-video' scores videos (B, F, 3, H, W), got {tuple(videos.shape)}")
        if videos.shape[0] != len(prompts):
            raise ValueError(f"got {videos.shape[0]} videos for {len(prompts)} prompts")
        pixels = videos.detach().float().clamp(0, 1).cpu().numpy()
        return self.scores_of([score_clip(clip, parse_prompt(text)) for clip, text in zip(pixels, prompts)])
