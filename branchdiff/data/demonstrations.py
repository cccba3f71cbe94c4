"""Image datasets the dataset objectives train on instead of rollouts (docs/objectives.md): demonstrations
for SFT (`sft.data`, rows {"prompt", "image"}) and preference pairs for offline Diffusion-DPO
(`dpo_offline.data`, rows {"prompt", "chosen", "rejected"}).

A file source is JSONL, one row per line; image paths are relative to the file's folder. When the
set is read, every row must have a non-empty prompt and each of its images must exist, decode whole
(branchdiff/data/sources.py reads them: EXIF orientation, 16-bit levels) and have the size the model makes
(`size`, width × height), and a pair's chosen and rejected images must differ: the first row that does not
is refused with its file and line, before any model loads. The built-in tasks have two sets each, made from their ground
truth: `tiny:demonstrations` (each training prompt drawn correctly) and `tiny:preferences` (the correct
drawing chosen over one with the next colour, or the next count, every other row); for the video task,
`tiny-video:demonstrations` (each training prompt's clip) and `tiny-video:preferences` (the correct clip
chosen over one with the next colour, or moving the next way, every other row), rendered with the
model's frames. A video family trains on those; JSONL sets are read as images.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from branchdiff.data import tiny_task, tiny_video_task
from branchdiff.data.sources import _decode, image_size, resolve_image
from branchdiff.errors import quote, read_utf8

FIELDS = {"demonstrations": ("image",), "preferences": ("chosen", "rejected")}  # the image fields of each kind of set


@dataclass
class ImageSet:
    """A dataset's rows: a prompt and its images (paths, or pixels for a built-in set)."""
    name: str
    fields: tuple[str, ...]
    prompts: list[str]
    images: list[tuple[str | torch.Tensor, ...]] = field(repr=False)  # per row, one per field

    def pixels(self, row: int) -> list[torch.Tensor]:
        """Row `row`'s images as (3, H, W) float tensors in [0, 1] (a video set's clips: (F, 3, H, W)), in field order."""
        return [image if isinstance(image, torch.Tensor) else _as_tensor(image) for image in self.images[row]]


def _as_tensor(path: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(_decode(path), dtype=np.float32) / 255).permute(2, 0, 1)


def _next(values: list, value: object) -> object:
    return values[(values.index(value) + 1) % len(values)]


def _ground_truth_set(name: str, kind: str, prompts: list, render: Callable[[list, int], np.ndarray],
                      odd_change: Callable[[Any], Any]) -> ImageSet:
    """A built-in task's training `prompts` drawn correctly by `render(prompts, seed)`; for preferences, each chosen over a
    drawing with the next colour (even rows) or with `odd_change` made to its prompt (odd rows)."""
    truth = torch.from_numpy(render(prompts, 0))  # (P, 3, H, W), a clip task's (P, F, 3, H, W)
    texts = [p.text for p in prompts]
    if kind == "demonstrations":
        return ImageSet(name, FIELDS[kind], texts, [(image,) for image in truth])
    colors = list(tiny_task.COLORS)
    wrong = [replace(p, color=_next(colors, p.color)) if i % 2 == 0 else odd_change(p) for i, p in enumerate(prompts)]
    return ImageSet(name, FIELDS[kind], texts, list(zip(truth, torch.from_numpy(render(wrong, 1)))))


def _tiny_set(kind: str) -> ImageSet:
    counts = sorted(tiny_task.COUNTS.values())
    return _ground_truth_set(f"tiny:{kind}", kind, tiny_task.split_prompts()[0], lambda prompts, seed: tiny_task.render_batch(prompts, seed),
                             lambda p: replace(p, count=_next(counts, p.count)))


def _tiny_video_set(kind: str, frames: int) -> ImageSet:
    directions = list(tiny_video_task.DIRECTIONS)
    return _ground_truth_set(f"tiny-video:{kind}", kind, tiny_video_task.split_prompts()[0],
                             lambda prompts, seed: tiny_video_task.render_batch(prompts, seed, frames),
                             lambda p: replace(p, direction=_next(directions, p.direction)))


BUILT_IN = {"tiny:demonstrations": "demonstrations", "tiny:preferences": "preferences",
            "tiny-video:demonstrations": "demonstrations", "tiny-video:preferences": "preferences"}


def load_image_set(source: str, kind: str, size: tuple[int, int], frames: int = 0) -> ImageSet:
    """The rows of `source` (a built-in name or a JSONL file) for a set of `kind` ("demonstrations" or
    "preferences"), every image checked to be `size` (width, height); `frames`: a video model's frames
    per clip (0: the model makes images). Raises ValueError naming the row."""
    video = source.startswith("tiny-video:")
    own = "tiny-video" if frames else "tiny"
    if source in BUILT_IN:
        if BUILT_IN[source] != kind:
            raise ValueError(f"{source} is a set of {BUILT_IN[source]}, not {kind}; use {own}:{kind} or a JSONL file of {kind}")
        if video != bool(frames):
            made = f"videos of {frames} frames" if frames else "images"
            raise ValueError(f"{source} holds {'clips' if video else 'images'} and the model makes {made}; use {own}:{kind}")
        if (32, 32) != size:
            raise ValueError(f"{source} holds 32×32 {'clips' if video else 'images'} and the model makes {size[0]}×{size[1]}; "
                             f"it trains the built-in {own} model")
        return _tiny_video_set(kind, frames) if video else _tiny_set(kind)
    if frames:
        raise ValueError(f"{kind} set {quote(source, 80)}: a video model trains on tiny-video:{kind} only (JSONL sets hold images; "
                         "sets of videos are not read yet)")
    path = Path(source)
    fields = FIELDS[kind]
    expected = ", ".join(f'"{name}"' for name in ("prompt", *fields))
    if not path.is_file():
        raise ValueError(f"{kind} set {quote(source, 80)} is neither {', '.join(BUILT_IN)} nor an existing file: give a JSONL file of rows "
                         f"with the fields {expected} (docs/objectives.md)")
    prompts: list[str] = []
    images: list[tuple[str | torch.Tensor, ...]] = []
    for number, line in enumerate(read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: expected a JSON object with the fields {expected}, got {quote(line)}") from None
        if not isinstance(record, dict) or any(name not in record for name in ("prompt", *fields)):
            raise ValueError(f"{where}: expected a JSON object with the fields {expected}")
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise ValueError(f"{where}: \"prompt\" must be a non-empty string, got {quote(json.dumps(record['prompt']))}")
        row = []
        for name in fields:
            if not isinstance(record[name], str):
                raise ValueError(f"{where}: \"{name}\" must be the path of one image, got {quote(json.dumps(record[name]))}")
            resolved = resolve_image(record[name].strip(), path.parent, where, f"\"{name}\"")
            if image_size(resolved) != size:
                found = image_size(resolved)
                raise ValueError(f"{where}: \"{name}\" {quote(record[name])} is {found[0]}×{found[1]} (width × height) and the model makes "
                                 f"{size[0]}×{size[1]}; resize the {kind} to {size[0]}×{size[1]} or set model.resolution")
            row.append(resolved)
        if kind == "preferences" and (row[0] == row[1] or np.array_equal(np.asarray(_decode(row[0])), np.asarray(_decode(row[1])))):
            raise ValueError(f"{where}: \"chosen\" and \"rejected\" are the same image, and a pair trains on their difference: give "
                             "the rejected image of the pair, or drop the row")
        prompts.append(record["prompt"])
        images.append(tuple(row))
    if not prompts:
        raise ValueError(f"{kind} set {quote(source, 80)} holds no rows")
    return ImageSet(str(path), fields, prompts, images)
