"""Best-of-N: independent SDE samples of the prompt, each a new initial noise rolled out to an
image (T network rows each, 2T under CFG); the best by reward wins. The baseline every search is
measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchdiff.search.forest import SearchForest


@dataclass
class BestOfN:
    backup: str = "max"  # mean | max | soft (branchdiff/search/backup.py); max: a node's value is the best reward below it
    temperature: float = 1.0  # λ, when backup is soft

    def select(self, forest: SearchForest, prompt: int, generator: torch.Generator) -> int | None:
        """Always a new initial noise: the prompt's virtual root (node `prompt`)."""
        return prompt

    def branching(self, forest: SearchForest) -> list[int] | None:
        return None
