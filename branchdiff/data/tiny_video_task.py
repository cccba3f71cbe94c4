"""The built-in "tiny-video" text-to-video task: a prompt grammar of moving shapes and a ground-truth
renderer of short clips.

A prompt names a count, a colour, a shape and a direction of motion, e.g. "two red circles moving
left". A clip is `FRAMES` frames of 32×32 RGB in [0, 1] on a black background: the objects (sizes
9–12 px, one colour and shape) move together, `SPEEDS` pixels a frame along the named direction
(the speed is drawn per clip, not named), stay inside the frame the whole clip and never touch each
other, so connected components recover them in every frame. The verifier reward that scores
generated clips against a prompt lives in `rewards.tiny_video`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from branchdiff.data.tiny_task import COLORS, IMAGE_SIZE, SHAPES, by_text, shape_mask, split_grammar
from branchdiff.errors import quote

FRAMES = 5  # frames per clip (4·1 + 1, the r·k + 1 form of Wan's videos)
COUNTS = {"one": 1, "two": 2}
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (dy, dx) per unit step
SPEEDS = (4, 5)  # pixels per frame: a clip travels 16 or 20 px, more than an object's side, so that a still object never fits the clip
SIZES = (9, 13)  # object sides in [9, 13) px: larger than the image task's 7–9, so that shapes survive 8-px patches and motion
GAP = 2  # the fewest background pixels between two objects
_PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}


@dataclass(frozen=True)
class TinyClipPrompt:
    """One point of the grammar."""

    count: int  # 1..2
    color: str  # a key of COLORS
    shape: str  # one of SHAPES
    direction: str  # a key of DIRECTIONS

    @property
    def text(self) -> str:
        count_word = next(word for word, n in COUNTS.items() if n == self.count)
        noun = self.shape if self.count == 1 else _PLURAL[self.shape]
        return f"{count_word} {self.color} {noun} moving {self.direction}"


def all_prompts() -> list[TinyClipPrompt]:
    """Every prompt of the grammar (2 counts × 4 colours × 3 shapes × 4 directions = 96)."""
    return [TinyClipPrompt(*point) for point in itertools.product(COUNTS.values(), COLORS, SHAPES, DIRECTIONS)]


def split_prompts(held_out_fraction: float = 0.25, seed: int = 0) -> tuple[list[TinyClipPrompt], list[TinyClipPrompt]]:
    """A fixed (train, held-out) split of the grammar (72 and 24 prompts); held-out prompts are never trained on."""
    return split_grammar(all_prompts(), held_out_fraction, seed)


def parse_prompt(text: str) -> TinyClipPrompt:
    """Inverse of `TinyClipPrompt.text`; raises ValueError naming the text if it is not in the grammar."""
    found = by_text(all_prompts).get(text.strip().lower())
    if found is not None:
        return found
    raise ValueError(
        f"prompt {quote(text)} is not in the tiny-video grammar; expected e.g. 'two red circles moving left' "
        f"(counts {list(COUNTS)}, colours {list(COLORS)}, shapes {list(SHAPES)}, directions {list(DIRECTIONS)})"
    )


def render(prompt: TinyClipPrompt, rng: np.random.Generator, frames: int = FRAMES) -> np.ndarray:
    """Ground-truth clip (F, 3, 32, 32) float32 in [0, 1]: `count` objects placed at random where
    their whole path fits in the frame, at least `GAP` px apart (they move together, so the gap holds
    in every frame); a layout that leaves no room for the next object is redrawn."""
    dy, dx = DIRECTIONS[prompt.direction]
    color = np.asarray(COLORS[prompt.color], dtype=np.float32)[:, None]  # (3, 1)
    for _ in range(100):
        speed = int(rng.choice(SPEEDS))
        travel_y, travel_x = dy * speed * (frames - 1), dx * speed * (frames - 1)
        occupied = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)  # at frame 0
        boxes: list[tuple[int, int, int]] = []  # (top, left, size) at frame 0
        for _ in range(50):
            size = int(rng.integers(*SIZES))
            top = int(rng.integers(max(0, -travel_y), IMAGE_SIZE - size + 1 - max(0, travel_y)))
            left = int(rng.integers(max(0, -travel_x), IMAGE_SIZE - size + 1 - max(0, travel_x)))
            if occupied[max(top - GAP, 0) : top + size + GAP, max(left - GAP, 0) : left + size + GAP].any():
                continue
            occupied[top : top + size, left : left + size] = True
            boxes.append((top, left, size))
            if len(boxes) == prompt.count:
                break
        if len(boxes) < prompt.count:
            continue
        clip = np.zeros((frames, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
        for frame in range(frames):
            for top, left, size in boxes:
                y, x = top + dy * speed * frame, left + dx * speed * frame
                clip[frame, :, y : y + size, x : x + size][:, shape_mask(prompt.shape, size)] = color
        return clip
    raise RuntimeError(f"could not place {prompt.count} objects for {prompt.text!r}")


def render_batch(prompts: list[TinyClipPrompt], seed: int, frames: int = FRAMES) -> np.ndarray:
    """(B, F, 3, 32, 32) ground-truth clips, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    return np.stack([render(p, rng, frames) for p in prompts])
