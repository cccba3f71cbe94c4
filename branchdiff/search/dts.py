"""Diffusion Tree Sampling and Search (Jain et al., arXiv 2506.20701).

Each round, per prompt: descend from the virtual root; at a node with fewer children than its cap
(`max_children`; one where the step is deterministic, none at the last depth) stop and add a child
there (a new initial noise under the virtual root, else one SDE step from the node's kept model
output); roll the child out to an image with the SDE, every state appended to the tree; score the
image and back its reward up the path with the soft Bellman update
V(n) = (1/λ)·log mean_c exp(λ·V(c)) (branchdiff/search/backup.py). Below a full node the descent
picks a child with probability ∝ exp(λ·V(c)) (DTS: a sampler of p_θ(x)·exp(λ·r(x)) in the limit) or
the child of highest value (DTS*, `greedy`: a search for the maximum). A node whose subtree is full
to the leaves is exhausted and never picked again; a prompt whose tree is exhausted stops.

Choices of this implementation (the paper leaves them to the user): the same cap for every node,
the virtual root included; ties of DTS* go to the first child. A non-finite reward counts as −inf
(the worst); children that have nothing else are drawn uniformly (`selection_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from branchdiff.search.forest import SearchForest


def dts_star(**settings: object) -> DTS:
    """DTS*: DTS that selects the child of highest value (a search for the maximum)."""
    return DTS(greedy=True, **settings)  # type: ignore[arg-type]


@dataclass
class DTS:
    greedy: bool = False  # DTS* (argmax) instead of DTS (Boltzmann)
    temperature: float = 10.0  # λ of the selection and of the soft backup (rewards × λ are log-weights)
    max_children: int = 4  # children per node
    backup: str = "soft"
    exhausted: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.max_children < 1:
            raise ValueError(f"DTS needs a temperature λ > 0 and max_children ≥ 1; got {self.temperature} and {self.max_children}")

    def select(self, forest: SearchForest, prompt: int, generator: torch.Generator) -> int | None:
        """The node to add a child to (module doc), or None when the prompt's tree is exhausted."""
        node = prompt
        while prompt not in self.exhausted:
            cap = forest.child_cap(node, self.max_children)
            if len(forest.children[node]) < cap:
                return node
            open_children = [c for c in forest.children[node] if c not in self.exhausted]
            if not open_children:  # a full node (or a leaf) with nothing left below: never again
                self.exhausted.add(node)
                node = prompt
                continue
            values = torch.tensor([forest.value[c] for c in open_children], dtype=torch.float64)  # (K,)
            if self.greedy:
                node = open_children[int(torch.argmax(values))]
            else:
                node = open_children[int(torch.multinomial(selection_weights(values, self.temperature), 1, generator=generator))]
        return None

    def branching(self, forest: SearchForest) -> list[int] | None:
        return None


def selection_weights(values: torch.Tensor, temperature: float) -> torch.Tensor:
    """DTS's selection probabilities softmax(λ·v) over children values (K,); a child whose rewards were all
    non-finite has the value −inf (weight 0), and when every child has, they are drawn uniformly."""
    if not torch.isfinite(values).any():
        return torch.full_like(values, 1 / len(values))
    return torch.softmax(temperature * values, 0)
