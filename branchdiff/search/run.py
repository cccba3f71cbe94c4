"""The search loop shared by every search: rounds of select → add a child → complete it to images
→ score → back up, for all prompts at once (their forwards batched), until each prompt's budget of
network rows is spent (a prompt stops when its next round would pass its budget, or its tree is
exhausted).

A round's cost is known before it runs (`SearchForest.cost_of_child`), so no prompt passes its
budget. The trace records, after every round of a prompt, its network rows spent, the best reward
found, the mean reward of its images so far (over the finite ones) and how many scored non-finite (NaN
or infinite rewards count as −inf, the worst, and never stop a search); the result names each prompt's best images by
their noise paths (`SearchForest.path`), which `regenerate_path` turns back into the same latents.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from branchdiff.search.backup import backup_path
from branchdiff.search.forest import SearchForest

# (images (L, 3, H, W), their prompts) → rewards (L,) and other scores by name, (L,) each (tiny-geneval's strict, ...)
Score = Callable[[torch.Tensor, list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Search(Protocol):
    backup: str  # the backup rule (branchdiff/search/backup.py)
    temperature: float  # λ of the soft backup

    def select(self, forest: SearchForest, prompt: int, generator: torch.Generator) -> int | None: ...

    def branching(self, forest: SearchForest) -> list[int] | None: ...


@dataclass
class SearchResult:
    leaves: list[list[int]]  # per prompt: its leaves (node indices), in the order made
    rewards: list[list[float]]  # per prompt: each leaf's reward (−inf where it was not finite)
    extras: list[list[dict[str, float]]]  # per prompt: each leaf's other scores
    trace: list[list[dict]] = field(default_factory=list)  # per prompt: {"nfe", "best", "mean", "images", "nonfinite"} after each round

    def best(self, prompt: int, count: int = 1) -> list[int]:
        """The prompt's `count` best leaves (first made first among equal rewards)."""
        order = sorted(range(len(self.rewards[prompt])), key=lambda i: (-self.rewards[prompt][i], i))
        return [self.leaves[prompt][i] for i in order[:count]]


@torch.no_grad()
def run_search(forest: SearchForest, search: Search, budget: int, score: Score, seed: int = 0) -> SearchResult:
    """Search every prompt of `forest` within `budget` network rows each (module doc); `score`
    rewards decoded images; `seed` seeds the selection's draws."""
    generator = torch.Generator().manual_seed(seed)
    branching = search.branching(forest)
    result = SearchResult(*([[] for _ in range(forest.num_prompts)] for _ in range(4)))
    active = list(range(forest.num_prompts))
    while active:
        picks = {}
        for prompt in active:
            node = search.select(forest, prompt, generator)
            if node is not None and forest.nfe[prompt] + forest.cost_of_child(node, branching) <= budget:
                picks[prompt] = node
        active = sorted(picks)
        if not active:
            break
        new = forest.add_children([picks[p] for p in active])
        leaves = forest.complete(new, branching)
        rewards, extras = score(forest.adapter.decode(forest.leaf_latents(leaves)), [forest.prompt[n] for n in leaves])  # (L,), {name: (L,)}
        for row, (leaf, reward) in enumerate(zip(leaves, rewards.tolist())):
            prompt = forest.prompt[leaf]
            forest.value[leaf] = reward if math.isfinite(reward) else -math.inf  # a NaN or infinite reward is the worst
            for node in backup_path(forest.parent, forest.children, forest.value, leaf, search.backup, search.temperature):
                forest.visits[node] += 1
            result.leaves[prompt].append(leaf)
            result.rewards[prompt].append(forest.value[leaf])
            result.extras[prompt].append({name: float(values[row]) for name, values in extras.items()})
        for prompt in active:
            seen = result.rewards[prompt]
            finite = [reward for reward in seen if math.isfinite(reward)]
            result.trace[prompt].append({"nfe": forest.nfe[prompt], "best": max(seen), "mean": sum(finite) / len(finite) if finite else -math.inf,
                                         "images": len(seen), "nonfinite": len(seen) - len(finite)})
    return result
