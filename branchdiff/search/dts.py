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

Choices of this implementation (the paper leaves them to the user): by default the same cap for
every node, the virtual root included; ties of DTS* go to the first child. A non-finite reward counts
as −inf (the worst); children that have nothing else are drawn uniformly (`selection_weights`).
Levers, off by default: `root_children` (a cap of its own for the virtual root, i.e. the number of
initial noises), `widening` (progressive widening: a node may have ⌈widening·√visits⌉ children, so
much-visited nodes keep branching), `exploration` (DTS*: a UCT bonus c·√(ln N(node)/N(child)) on
the children's values, N the images below each) and `guided=False` (the growing descent ignores
values: the tree is then an unbiased sample of p_θ, reweighted only when a sample is drawn). With
selections in flight (`parallel`), `x0_value` values a child whose first image is not back yet by the
reward of its predicted clean sample x̂0 (scored after each forward, no network row) instead of its
parent's value.

As a sampler, DTS's output is `draw_leaf`: one descent of the finished tree by the same Boltzmann
rule, i.e. its leaves resampled by exp(λ·r) times their share of the tree's mass. The descent that
grows the tree chooses where children are added from the values seen so far, and that choice biases
the mass a finite tree gives each region (branchdiff/bench/sampler.py and docs/search.md measure it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from branchdiff.search.forest import WAIT, SearchForest


def dts_star(**settings: object) -> DTS:
    """DTS*: DTS that selects the child of highest value (a search for the maximum)."""
    return DTS(greedy=True, **settings)  # type: ignore[arg-type]


@dataclass
class DTS:
    greedy: bool = False  # DTS* (argmax) instead of DTS (Boltzmann)
    temperature: float = 10.0  # λ of the selection and of the soft backup (rewards × λ are log-weights)
    max_children: int = 4  # children per node
    root_children: int | None = None  # children of the virtual root (initial noises); None: max_children
    widening: float = 0.0  # progressive widening: a node may have ⌈widening·√visits⌉ children when that is more than its cap (0: off)
    guided: bool = True  # the descent weighs children by value; False: uniformly (the tree then grows as an unbiased sample of p_θ)
    exploration: float = 0.0  # DTS*: c of a visit-count bonus, argmax V(c) + c·√(ln N(node) / N(c)) (UCT; 0: plain argmax)
    x0_value: bool = False  # a child whose first image is still in flight is worth the reward of its predicted clean sample (else its parent's value)
    rollout_depth: int = 0  # early stops: a rollout goes k steps below the node it adds and is valued by r(x̂0) there (0: to the last depth; run.py)
    backup: str = "soft"
    exhausted: set[int] = field(default_factory=set)
    one_selection_in_flight: ClassVar[bool] = False  # True: the search runs with parallel 1 only

    def __post_init__(self) -> None:
        if (self.temperature <= 0 or self.max_children < 1 or (self.root_children is not None and self.root_children < 1) or self.widening < 0
                or self.exploration < 0 or self.rollout_depth < 0):
            raise ValueError(f"DTS needs a temperature λ > 0, max_children ≥ 1, root_children ≥ 1 (or unset), widening ≥ 0, exploration ≥ 0 and "
                             f"rollout_depth ≥ 0; got {self.temperature}, {self.max_children}, {self.root_children}, {self.widening}, "
                             f"{self.exploration} and {self.rollout_depth}")
        if self.exploration > 0 and not self.greedy:
            raise ValueError(f"exploration {self.exploration} is DTS*'s visit-count bonus on its greedy choice of a child, and dts and dts-is "
                             "draw their children by their values, so it would be ignored: use dts-star, or leave exploration at 0")

    def cap(self, forest: SearchForest, node: int) -> int:
        """Children `node` may have now: its cap (the root's own, if set), raised by progressive widening to
        ⌈widening·√visits⌉, except where the step allows none or one (`SearchForest.child_cap`)."""
        own = self.root_children if forest.depth[node] < 0 and self.root_children is not None else self.max_children
        if self.widening > 0:
            own = max(own, math.ceil(self.widening * math.sqrt(forest.visits[node])))
        return forest.child_cap(node, own)

    def select(self, forest: SearchForest, prompt: int, generator: torch.Generator) -> int | None:
        """The node to add a child to (module doc), None when the prompt's tree is exhausted, `WAIT` when what is left
        waits on children that selections in flight will add."""
        node = prompt
        while prompt not in self.exhausted:
            if len(forest.children[node]) + forest.pending[node] < self.cap(forest, node):
                return node
            open_children = [c for c in forest.children[node] if c not in self.exhausted]
            if not open_children:
                if forest.pending[node] > 0:  # its last children are still to be added by selections in flight
                    return WAIT
                if self.widening > 0 and forest.child_cap(node, 2) > 1:  # widening: a node with nothing left below grows a child instead
                    return node
                self.exhausted.add(node)  # a full node (or a leaf) with nothing left below: never again
                node = prompt
                continue
            values = torch.tensor([forest.value[c] for c in open_children], dtype=torch.float64)  # (K,)
            in_flight = torch.tensor([forest.inflight[c] for c in open_children], dtype=torch.float64)  # (K,) selections in flight below
            if not self.guided:
                node = open_children[int(torch.randint(len(open_children), (), generator=generator))]
                continue
            if bool(in_flight.any()) or bool(values.isnan().any()):  # selections in flight: unvalued children take their parent's value, pending visits count
                guess = torch.tensor([forest.estimate[c] if self.x0_value and not math.isnan(forest.estimate[c]) else _known_value(forest, node)
                                      for c in open_children], dtype=torch.float64)  # (K,)
                values = torch.where(values.isnan(), guess, values) - torch.log1p(in_flight) / self.temperature
            if self.greedy and self.exploration > 0:
                visits = torch.tensor([max(forest.visits[c], 1) for c in open_children], dtype=torch.float64)  # (K,)
                node = open_children[int(torch.argmax(values + self.exploration * torch.sqrt(math.log(max(forest.visits[node], 1)) / visits)))]
            elif self.greedy:
                node = open_children[int(torch.argmax(values))]
            else:
                node = open_children[int(torch.multinomial(selection_weights(values, self.temperature), 1, generator=generator))]
        return None

    def branching(self, forest: SearchForest) -> list[int] | None:
        return None


def _known_value(forest: SearchForest, node: int) -> float:
    """The value of `node`, else of its nearest valued ancestor (0 where none has one): what a child whose
    rollout is still in flight is worth to a selection."""
    while node >= 0 and math.isnan(forest.value[node]):
        node = forest.parent[node]
    return 0.0 if node < 0 else forest.value[node]


def draw_leaf(forest: SearchForest, prompt: int, temperature: float, generator: torch.Generator) -> int:
    """One sample of DTS's target from the prompt's tree: descend from the virtual root, drawing each
    child with probability ∝ exp(λ·V(child)) (`selection_weights`) until a leaf. With the soft backup,
    V(n) = (1/λ)·log mean_c exp(λ·V(c)), the product of the choices telescopes: a leaf is drawn with
    probability ∝ exp(λ·r(leaf)) / Π K(n) over the nodes n above it (K: their children), its reward
    weight times its share of the tree's mass under p_θ, i.e. self-normalised importance resampling of
    the tree's leaves towards p_θ(x)·exp(λ·r(x))."""
    node = prompt
    while forest.children[node]:
        children = [c for c in forest.children[node] if not math.isnan(forest.value[c])]
        values = torch.tensor([forest.value[c] for c in children], dtype=torch.float64)  # (K,)
        node = children[int(torch.multinomial(selection_weights(values, temperature), 1, generator=generator))]
    return node


def selection_weights(values: torch.Tensor, temperature: float) -> torch.Tensor:
    """DTS's selection probabilities softmax(λ·v) over children values (K,); a child whose rewards were all
    non-finite has the value −inf (weight 0), and when every child has, they are drawn uniformly."""
    if not torch.isfinite(values).any():
        return torch.full_like(values, 1 / len(values))
    return torch.softmax(temperature * values, 0)
