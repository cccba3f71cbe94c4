"""`tiny-geneval`: a programmatic verifier for the built-in tiny task (GenEval-style).

An image is segmented into objects (connected components of bright pixels, 8-connected, at least
`MIN_AREA` pixels). Each object gets
- a colour: the palette colour nearest (Euclidean, RGB) to its mean pixel colour;
- a shape: the template (disc, full box, upright triangle) inscribed in its bounding box with the
  highest IoU, accepted only if that IoU ≥ 0.7, the box aspect is within [0.7, 1.43], and, for a
  square, all four corner pixels are set and, for a circle, none is. A rounded square or a blob
  therefore fails both "square" and "circle" (fill ratio alone can be gamed);
- a position: its centroid inside the half of the image the prompt names.

Scores per image against its prompt (n detected objects, c the prompt's count):
    count      = 1[n = c]                 colour/shape/position = 1[n ≥ 1 and every object matches]
    strict     = count · colour · shape · position
    partial    = mean(max(0, 1 - |n - c| / 3), f_colour, f_shape, f_position)
    f_a        = min(m_a, c) / max(n, c)
where m_a counts the detected objects whose attribute a matches. A missing or an extra object
lowers every f_a as well as the count term, so drawing fewer objects than asked (dropping the one
whose shape came out wrong) never wins credit: with two asked, one correct object scores
mean(2/3, 1/2, 1/2, 1/2) ≈ 0.54, two objects with one wrong shape mean(1, 1, 1/2, 1) = 0.875.
(Dividing by n instead, the fraction of the objects drawn, gave the single object 0.92 and taught
the policy to drop objects.) The reward returned by `TinyGenEval.__call__` is `partial` (dense
enough for GRPO); `strict` and the binary attributes are reported by `TinyGenEval.score`. With
`strict_weight` w > 0 the reward is the blend

    blended    = (1 - w) · partial + w · strict

which keeps partial credit's dense signal and pays for what the verifier finally asks: every
attribute right at once (on the built-in task w = 0.5 was no better than w = 0: docs/sweep.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage

from branchdiff.data.tiny_task import COLORS, SHAPES, TinyPrompt, check_grammar, parse_prompt, region_bounds

FOREGROUND_THRESHOLD = 0.5  # half intensity: objects are ≥ 0.8 in their brightest channel, background 0
MIN_AREA = 8  # smaller components are noise, not objects
MIN_TEMPLATE_IOU = 0.7  # at 7–9 px one pixel of boundary error costs ~0.2 IoU
ATTRIBUTES = ("count", "color", "shape", "position")
_PALETTE = np.asarray(list(COLORS.values()), dtype=np.float32)  # (n_colors, 3)
_EIGHT_CONNECTED = np.ones((3, 3), dtype=bool)


@dataclass(frozen=True)
class DetectedObject:
    color: str
    shape: str  # one of SHAPES, or "unknown"
    centroid_yx: tuple[float, float]
    area: int
    nearest_shape: str  # the best-fitting template before the corner rules (`nearest_shape`), or "unknown"
    corners: int  # how many of the bounding box's four corner pixels are set (`shape_by_corners`' evidence)


@functools.lru_cache(maxsize=4096)  # box sizes are bounded by the image (32 × 32 in the built-in tasks)
def template(shape: str, height: int, width: int) -> np.ndarray:
    """Boolean (height, width) mask of `shape` inscribed in a height×width box (read-only: one array per
    shape and size, shared by every call)."""
    yy, xx = np.meshgrid(np.arange(height) + 0.5, np.arange(width) + 0.5, indexing="ij")
    if shape == "square":
        mask = np.ones((height, width), dtype=bool)
    elif shape == "circle":
        mask = ((yy - height / 2) / (height / 2)) ** 2 + ((xx - width / 2) / (width / 2)) ** 2 <= 1.0
    elif shape == "triangle":
        mask = np.abs(xx - width / 2) <= (yy / height) * (width / 2) + 0.25 * width / height
    else:
        raise ValueError(f"unknown shape {shape!r}; allowed: {SHAPES}")
    mask.flags.writeable = False
    return mask


def nearest_shape(mask: np.ndarray) -> str:
    """The template (of SHAPES) with the highest IoU against a component's bounding-box crop `mask`
    (h, w), if that IoU is ≥ MIN_TEMPLATE_IOU and the box's aspect within [0.7, 1/0.7]; else "unknown"."""
    height, width = mask.shape
    if not 0.7 <= height / width <= 1 / 0.7:
        return "unknown"
    ious = {}
    for shape in SHAPES:
        reference = template(shape, height, width)
        ious[shape] = (mask & reference).sum() / (mask | reference).sum()
    best = max(ious, key=ious.get)
    return best if ious[best] >= MIN_TEMPLATE_IOU else "unknown"


def corner_count(mask: np.ndarray) -> int:
    """How many of the four corner pixels of a bounding-box crop `mask` (h, w) are set."""
    return int(mask[[0, 0, -1, -1], [0, -1, 0, -1]].sum())


def shape_by_corners(nearest: str, corners: int, square_corners: int = 4) -> str:
    """The corner rules on the nearest template: a square must set `square_corners` of its box's four
    corner pixels (all four here; tiny-video asks two) and a circle none; otherwise "unknown"."""
    if nearest == "square" and corners < square_corners:
        return "unknown"
    if nearest == "circle" and corners > 0:
        return "unknown"
    return nearest


def classify_shape(mask: np.ndarray) -> str:
    """Shape of a component given its bounding-box crop `mask` (h, w), or "unknown"."""
    return shape_by_corners(nearest_shape(mask), corner_count(mask))


def detect_objects(image: np.ndarray) -> list[DetectedObject]:
    """Objects in one (3, H, W) image with values in [0, 1]."""
    foreground = image.max(axis=0) > FOREGROUND_THRESHOLD  # (H, W)
    labels, n_components = ndimage.label(foreground, structure=_EIGHT_CONNECTED)
    objects = []
    for index, box in enumerate(ndimage.find_objects(labels), start=1):
        mask = labels[box] == index  # (h, w) crop
        area = int(mask.sum())
        if area < MIN_AREA:
            continue
        mean_rgb = image[:, box[0], box[1]][:, mask].mean(axis=1)  # (3,)
        color = list(COLORS)[int(np.argmin(((_PALETTE - mean_rgb) ** 2).sum(axis=1)))]
        ys, xs = np.nonzero(mask)
        centroid = (float(ys.mean() + box[0].start + 0.5), float(xs.mean() + box[1].start + 0.5))
        nearest, corners = nearest_shape(mask), corner_count(mask)
        objects.append(DetectedObject(color, shape_by_corners(nearest, corners), centroid, area, nearest, corners))
    return objects


def score_image(image: np.ndarray, prompt: TinyPrompt) -> dict[str, float]:
    """Binary attributes, strict and partial scores of one image against its prompt."""
    return scores_and_terms(image, prompt)[0]


def scores_and_terms(image: np.ndarray, prompt: TinyPrompt) -> tuple[dict[str, float], dict[str, float]]:
    """`score_image`'s scores, and the four partial-credit terms whose mean is `partial` (count: max(0, 1 − |n − c| / 3);
    colour, shape, position: f_a; module doc), by attribute."""
    objects = detect_objects(image)
    n = len(objects)
    y0, y1, x0, x1 = region_bounds(prompt.position)
    matches = {
        "color": [o.color == prompt.color for o in objects],
        "shape": [o.shape == prompt.shape for o in objects],
        "position": [y0 <= o.centroid_yx[0] < y1 and x0 <= o.centroid_yx[1] < x1 for o in objects],
    }
    scores = {"count": float(n == prompt.count)}
    terms = {"count": max(0.0, 1 - abs(n - prompt.count) / 3)}
    for name, hits in matches.items():
        scores[name] = float(n > 0 and all(hits))
        terms[name] = min(sum(hits), prompt.count) / max(n, prompt.count)
    scores["strict"] = float(all(scores[a] for a in ATTRIBUTES))
    scores["partial"] = float(np.mean([terms[a] for a in ATTRIBUTES]))
    return scores, terms


class PartialCreditVerifier:
    """What the built-in tasks' verifiers share: the reward `(pixels, prompts, metadata) -> tensor[B]` in
    [0, 1] is `partial`, or with `strict_weight` w > 0 the blend (1 - w)·partial + w·strict (module doc);
    `score` returns every key of `score_keys`. A subclass names itself, its `attributes` and `scale`,
    and scores a batch's rows (`scores_of`)."""

    name: str
    scale: str
    attributes: tuple[str, ...]

    def __init__(self, device: str | torch.device = "cpu", strict_weight: float = 0.0) -> None:
        if not 0.0 <= strict_weight <= 1.0:  # also refuses NaN
            raise ValueError(f"{self.name}'s strict_weight must be in [0, 1] (the blend (1 - w)·partial + w·strict); got {strict_weight}")
        self.device = torch.device(device)
        self.strict_weight = float(strict_weight)
        self.reward_key = "blended" if self.strict_weight else "partial"  # the key of `score` that is the reward
        self.score_keys = ("strict", "partial", *self.attributes, *(("blended",) if self.strict_weight else ()))  # every key `score` returns
        if self.strict_weight:
            self.scale = f"{1 - self.strict_weight:g}·partial + {self.strict_weight:g}·strict, in [0, 1]"

    def scores_of(self, rows: list[dict[str, float]]) -> dict[str, torch.Tensor]:
        """The rows' scores as tensors (B,) by key, and the blend when `strict_weight` > 0."""
        scores = {key: torch.tensor([row[key] for row in rows]) for key in rows[0]} if rows else {}
        if self.strict_weight and scores:
            scores["blended"] = (1 - self.strict_weight) * scores["partial"] + self.strict_weight * scores["strict"]  # (B,)
        return scores

    def score(self, pixels: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __call__(self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        return self.score(pixels, prompts)[self.reward_key]


class TinyGenEval(PartialCreditVerifier):
    """The built-in image task's verifier (module doc)."""

    name = "tiny-geneval"
    scale = "partial credit in [0, 1]: mean of count, colour, shape and position scores, missing and extra objects counted against each"
    attributes = ATTRIBUTES

    @staticmethod
    def check_prompts(prompts: list[str]) -> None:
        """Refuse, before a run starts, a prompt the verifier cannot score (one outside the tiny grammar);
        the reward protocol's optional check, which preflight calls (docs/rewards.md)."""
        check_grammar(prompts, parse_prompt)

    def score(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Every score of `score_image` for a batch: images (B, 3, H, W) in [0, 1]; and the blend."""
        if images.shape[0] != len(prompts):
            raise ValueError(f"got {images.shape[0]} images for {len(prompts)} prompts")
        pixels = images.detach().float().clamp(0, 1).cpu().numpy()
        return self.scores_of([score_image(image, parse_prompt(text)) for image, text in zip(pixels, prompts)])
