"""Prompt sources: the tiny grammar's splits, or a file (.txt one prompt a line, .jsonl with a
"prompt" field, .csv with a "prompt" column); and the per-iteration prompt draw."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from branchdiff.tiny_task import all_prompts, split_prompts

TINY_SOURCES = {"tiny:train": lambda: split_prompts()[0], "tiny:held_out": lambda: split_prompts()[1], "tiny:all": all_prompts}


def load_prompts(source: str) -> list[str]:
    if source in TINY_SOURCES:
        return [p.text for p in TINY_SOURCES[source]()]
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"prompt source {source!r} is neither {', '.join(TINY_SOURCES)} nor an existing file")
    if path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".csv":
        with path.open(newline="") as handle:
            prompts = [row["prompt"] for row in csv.DictReader(handle)]
    else:
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt source {source!r} holds no prompts")
    return prompts


def draw_prompts(prompts: list[str], count: int, seed: int, iteration: int) -> list[int]:
    """Indices of `count` prompts for an iteration, a pure function of (seed, iteration): without
    replacement while the source is large enough, so a resumed run draws the same prompts."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    if count <= len(prompts):
        return torch.randperm(len(prompts), generator=generator)[:count].tolist()
    return torch.randint(len(prompts), (count,), generator=generator).tolist()
