"""The built-in "tiny" text-to-image task: a prompt grammar and a ground-truth renderer.

A prompt names a count, a colour, a shape and a position, e.g. "two red circles on the left".
Images are 32×32 RGB in [0, 1] on a black background; objects lie inside the named half of the
image and never touch each other, so connected components recover them exactly. The verifier
reward that scores generated images against a prompt lives in `rewards.tiny_geneval`.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from branchdiff.errors import quote

IMAGE_SIZE = 32
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.1),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.9, 0.1),
}
SHAPES = ("circle", "square", "triangle")
COUNTS = {"one": 1, "two": 2, "three": 3}
POSITIONS = ("left", "right", "top", "bottom")
_PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}
_POSITION_PHRASE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}


@dataclass(frozen=True)
class TinyPrompt:
    """One point of the grammar."""

    count: int  # 1..3
    color: str  # a key of COLORS
    shape: str  # one of SHAPES
    position: str  # one of POSITIONS

    @property
    def text(self) -> str:
        count_word = next(word for word, n in COUNTS.items() if n == self.count)
        noun = self.shape if self.count == 1 else _PLURAL[self.shape]
        return f"{count_word} {self.color} {noun} {_POSITION_PHRASE[self.position]}"


def all_prompts() -> list[TinyPrompt]:
    """Every prompt of the grammar (4 colours × 3 shapes × 3 counts × 4 positions = 144)."""
    return [
        TinyPrompt(count, color, shape, position)
        for count, color, shape, position in itertools.product(COUNTS.values(), COLORS, SHAPES, POSITIONS)
    ]


def split_grammar(prompts: list, held_out_fraction: float, seed: int) -> tuple[list, list]:
    """A fixed (train, held-out) split of a grammar's prompts, shuffled by `seed`; held-out prompts are never trained on."""
    shuffled = list(prompts)
    random.Random(seed).shuffle(shuffled)
    n_held = round(len(shuffled) * held_out_fraction)
    return shuffled[n_held:], shuffled[:n_held]


def check_grammar(prompts: list[str], parse) -> None:
    """Refuse the first prompt `parse` rejects, naming its number (a verifier's `check_prompts`, which
    preflight calls before a run starts; docs/rewards.md)."""
    for number, text in enumerate(prompts, start=1):
        try:
            parse(text)
        except ValueError as error:
            raise ValueError(f"prompt {number}: {error}") from None


def split_prompts(held_out_fraction: float = 0.25, seed: int = 0) -> tuple[list[TinyPrompt], list[TinyPrompt]]:
    """A fixed (train, held-out) split of the grammar (108 and 36 prompts)."""
    return split_grammar(all_prompts(), held_out_fraction, seed)


@functools.cache
def by_text(grammar: Callable[[], list]) -> dict[str, Any]:
    """Every prompt of a grammar (its `all_prompts`) by its text, built once per grammar: what parsing looks up."""
    return {prompt.text: prompt for prompt in grammar()}


def parse_prompt(text: str) -> TinyPrompt:
    """Inverse of `TinyPrompt.text`; raises ValueError naming the text if it is not in the grammar."""
    found = by_text(all_prompts).get(text.strip().lower())
    if found is not None:
        return found
    raise ValueError(
        f"prompt {quote(text)} is not in the tiny grammar; expected e.g. 'two red circles on the left' "
        f"(counts {list(COUNTS)}, colours {list(COLORS)}, shapes {list(SHAPES)}, positions {list(POSITIONS)})"
    )


def shape_mask(shape: str, size: int) -> np.ndarray:
    """Boolean (size, size) mask of a shape filling its bounding box: disc, full square, or an
    upright isosceles triangle with its apex at the top centre and its base on the bottom row."""
    centres = np.arange(size) + 0.5  # pixel centres
    yy, xx = np.meshgrid(centres, centres, indexing="ij")  # (size, size)
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "circle":
        r = size / 2
        return (yy - r) ** 2 + (xx - r) ** 2 <= r**2
    if shape == "triangle":
        half_width = (yy / size) * (size / 2)  # grows linearly from apex (0) to base (size/2)
        return np.abs(xx - size / 2) <= half_width + 0.25
    raise ValueError(f"unknown shape {shape!r}; allowed: {SHAPES}")


def region_bounds(position: str) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1) of the half of the image a position names (end-exclusive)."""
    half = IMAGE_SIZE // 2
    return {
        "left": (0, IMAGE_SIZE, 0, half),
        "right": (0, IMAGE_SIZE, half, IMAGE_SIZE),
        "top": (0, half, 0, IMAGE_SIZE),
        "bottom": (half, IMAGE_SIZE, 0, IMAGE_SIZE),
    }[position]


def render(prompt: TinyPrompt, rng: np.random.Generator) -> np.ndarray:
    """Ground-truth image (3, 32, 32) float32 in [0, 1] for a prompt: `count` objects of one colour
    and shape, sizes 7–9 px, placed at random inside the region with at least a 2-px gap (a layout
    that leaves no room for the next object is redrawn)."""
    y0, y1, x0, x1 = region_bounds(prompt.position)
    color = np.asarray(COLORS[prompt.color], dtype=np.float32)[:, None]  # (3, 1)
    for _ in range(100):
        image = np.zeros((3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
        occupied = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
        placed = 0
        for _ in range(50):
            size = int(rng.integers(7, 10))
            top = int(rng.integers(y0, y1 - size + 1))
            left = int(rng.integers(x0, x1 - size + 1))
            if occupied[max(top - 2, 0) : top + size + 2, max(left - 2, 0) : left + size + 2].any():
                continue
            mask = shape_mask(prompt.shape, size)
            occupied[top : top + size, left : left + size] |= mask
            image[:, top : top + size, left : left + size][:, mask] = color
            placed += 1
            if placed == prompt.count:
                return image
    raise RuntimeError(f"could not place {prompt.count} objects for {prompt.text!r}")


def render_batch(prompts: list[TinyPrompt], seed: int) -> np.ndarray:
    """(B, 3, 32, 32) ground-truth images, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    return np.stack([render(p, rng) for p in prompts])
