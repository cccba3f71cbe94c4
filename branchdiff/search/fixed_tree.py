"""Fixed trees: BranchGRPO's tree shape at sampling time. Each round draws a new initial noise and
grows a whole tree from it (k children at each split step, one elsewhere; siblings share their
parent's forward), as many trees as the budget pays for; the best leaf wins. Against best-of-N it
spends fewer rows per image (shared prefixes) but its images are correlated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchdiff.core.tree import Split
from branchdiff.search.forest import SearchForest


@dataclass
class FixedTree:
    splits: tuple[Split, ...] = (Split(0, 2), Split(1, 2), Split(2, 2))  # k per split step (default: 8 leaves per tree)
    backup: str = "max"  # mean | max | soft (branchdiff/search/backup.py); max: a node's value is the best reward below it
    temperature: float = 1.0  # λ, when backup is soft

    def select(self, forest: SearchForest, prompt: int, generator: torch.Generator) -> int | None:
        return prompt

    def branching(self, forest: SearchForest) -> list[int] | None:
        k = {split.step: split.branches for split in self.splits}
        if max(k, default=0) >= forest.num_steps:
            raise ValueError(f"a split at step {max(k)} is outside the {forest.num_steps} sampling steps")
        return [k.get(depth, 1) for depth in range(forest.num_steps)]
