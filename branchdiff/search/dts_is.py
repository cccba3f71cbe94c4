"""Importance-corrected DTS (`dts-is`): the tree grows as DTS grows it (branchdiff/search/dts.py), guided by the soft
values, and the leaves are drawn with weights that are right for the growth that actually happened, so the draws
approach the reward-tilted target p*(x) ∝ p(x)·exp(λ·r(x)) as the rows grow (docs/search.md, "A guided tree sampler
that converges").

Why DTS's own draw (`draw_leaf`) falls behind: it trusts each node's soft value as an estimate of its subtree's
share of p*; but the values steer where children are added, so a node whose first image missed keeps one child and a
value of that one image, never corrected, and the tree's estimate of that region stays low.

What stays true under any growth: a child added to node n is a fresh draw of p(·|x_n), and its rollout a fresh draw
of p(x₀|x_n), whatever made the descent stop at n. Before expansion e, the nodes a descent can stop at (nodes below
their cap whose ancestors are all full) and the closed subtrees (full down to the leaves) hanging below full nodes
cut the tree; a node n of the cut carries ω(n) = Π 1/K(a) of p's mass, over its ancestors a with K(a) children (all
there, being full). The descent stops at n_e with the probability q_e it had (the product of its choices, recorded),
so with the closed leaves counted exactly,

    Ê_e[f] = Σ_{closed leaves ℓ} ω(ℓ)·f(ℓ) + ω(n_e)/q_e · f(ℓ_e)

is an unbiased estimate of Σ_cut ω(n)·E_p[f | x_n] given the tree before e: importance sampling over the cut. That sum
is E_p[f] when the cut's shape does not depend on the values below it; here it does (a node fills up because its first
children scored well, and then its children stand for it), which could bias it. Against the law the leaves are drawn
from (the SDE sampler's own), docs/search.md resolves no bias up to 640 rows, where DTS's estimate is far below it.
For f = 1 the cut's masses sum to 1 whatever its shape, so the weights' sum is unbiased. Averaging over the E
expansions with f = exp(λ·r)·[x = ℓ] gives each leaf the weight

    W(ℓ) = exp(λ·r(ℓ))·( ω(n_e)/q_e  [its own expansion e]  +  ω(ℓ)·#{expansions after every ancestor of ℓ was full} )

and `draw_leaf_is` resamples one leaf ∝ W (`mass_weights` are the bracket, over E): self-normalised importance sampling
of p*, which no longer trusts the values that guide the growth. Two choices make it so: a subtree full to its leaves is closed as soon as it is (DTS closes it
when a descent first runs into it, which would make q depend on descents that were abandoned), and a share `mix` of
each choice is uniform over the open children (defensive importance sampling: q_e ≥ mix^d·Π 1/K, so no weight
explodes). Needs one selection in flight per prompt (`--parallel 1`: each expansion's leaf is known by its order)
and fixed caps (no widening); the descent is Boltzmann (DTS*'s argmax has q ∈ {0, 1}).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from branchdiff.search.dts import DTS, selection_weights
from branchdiff.search.forest import SearchForest


@dataclass
class DTSIS(DTS):
    mix: float = 0.2  # share of each choice drawn uniformly over the open children (defensive importance sampling)
    records: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # per prompt: (node expanded, q) per selection, in order
    seen: int = 0  # nodes already looked at for closing (`close_new_leaves`)

    one_selection_in_flight: ClassVar[bool] = True  # each selection's weight follows it to its leaf

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.x0_value:
            raise ValueError("x0_value values the children whose first image is still in flight, and dts-is keeps one selection in flight, "
                             "so none is: leave x0_value out")
        if self.greedy or self.widening > 0 or self.rollout_depth or not 0 <= self.mix <= 1 or (not self.guided and self.mix != 1):
            raise ValueError(f"dts-is draws with the probabilities its descent had: it needs the Boltzmann descent (not greedy), fixed caps "
                             f"(widening 0), rollouts to the last depth (rollout_depth 0) and a uniform share mix in [0, 1] (1 when unguided); "
                             f"got greedy={self.greedy}, widening={self.widening}, rollout_depth={self.rollout_depth}, mix={self.mix}, guided={self.guided}")

    def close_new_leaves(self, forest: SearchForest) -> None:
        """Close each leaf made since the last call, and every ancestor that it leaves full down to its leaves."""
        for node in range(self.seen, len(forest.parent)):
            if forest.depth[node] != forest.num_steps:
                continue
            while node >= 0 and node not in self.exhausted and len(forest.children[node]) == self.cap(forest, node) and all(
                    child in self.exhausted for child in forest.children[node]):
                self.exhausted.add(node)
                node = forest.parent[node]
        self.seen = len(forest.parent)

    def select(self, forest: SearchForest, prompt: int, generator: torch.Generator) -> int | None:
        """DTS's descent (module doc) over the open children, recording the probability q of the node it stops at."""
        if forest.inflight[prompt]:
            raise ValueError("dts-is needs one selection in flight per prompt (--parallel 1): its weights follow each selection to its leaf")
        self.close_new_leaves(forest)
        node, q = prompt, 1.0
        while prompt not in self.exhausted:
            if len(forest.children[node]) < self.cap(forest, node):
                self.records.setdefault(prompt, []).append((node, q))
                return node
            open_children = [c for c in forest.children[node] if c not in self.exhausted]  # non-empty: a full node with none is closed
            values = torch.tensor([forest.value[c] for c in open_children], dtype=torch.float64)  # (K,) every child is valued
            uniform = torch.full_like(values, 1 / len(open_children))
            chances = uniform if not self.guided else (1 - self.mix) * selection_weights(values, self.temperature) + self.mix * uniform
            pick = int(torch.multinomial(chances, 1, generator=generator))
            q *= float(chances[pick])
            node = open_children[pick]
        return None


def mass_weights(forest: SearchForest, search: DTSIS, prompt: int, leaves: list[int]) -> torch.Tensor:
    """Each of the prompt's `leaves` (in the order made, one per selection) with its weight w in the unbiased estimate
    Σ w(ℓ)·f(ℓ) of E_p[f] (module doc: Ê_e averaged over the expansions): (L,) float64."""
    records = search.records[prompt][: len(leaves)]  # a last selection the budget refused made no leaf
    made = {}  # node → the expansion that made it
    for expansion, (leaf, (start, _)) in enumerate(zip(leaves, records)):
        node = leaf
        while node != start:
            made[node] = expansion
            node = forest.parent[node]
    full_at: dict[int, int] = {}  # node → the expansion whose child filled it
    for node, expansion in made.items():
        parent = forest.parent[node]
        if len(forest.children[parent]) == search.cap(forest, parent):
            full_at[parent] = max(full_at.get(parent, -1), expansion)
    weights = []
    for leaf, (start, q) in zip(leaves, records):
        above = _ancestors(forest, leaf)
        closed_after = max(full_at.get(a, len(leaves) - 1) for a in above)  # the last of its ancestors to fill (one that never did: the last)
        weights.append(_mass(forest, start) / q + _mass(forest, leaf) * (len(leaves) - 1 - closed_after))
    return torch.tensor(weights, dtype=torch.float64) / len(leaves)


def draw_leaf_is(forest: SearchForest, search: DTSIS, prompt: int, leaves: list[int], rewards: list[float], generator: torch.Generator) -> int:
    """One sample of p* from the prompt's tree: a leaf resampled ∝ exp(λ·r)·`mass_weights` (a non-finite reward: weight 0)."""
    scores = torch.tensor(rewards, dtype=torch.float64)  # (L,)
    finite = torch.isfinite(scores)
    tilt = torch.where(finite, torch.exp(search.temperature * (scores - scores[finite].max())), 0.0) if bool(finite.any()) else torch.ones_like(scores)
    weights = tilt * mass_weights(forest, search, prompt, leaves)
    return leaves[int(torch.multinomial(weights / weights.sum(), 1, generator=generator))]


def _mass(forest: SearchForest, node: int) -> float:
    """ω(node) = Π 1/K(a) over its ancestors a, K their children (all there: they are full wherever ω is asked)."""
    share = 1.0
    for above in _ancestors(forest, node):
        share /= len(forest.children[above])
    return share


def _ancestors(forest: SearchForest, node: int) -> list[int]:
    """The nodes above `node`, its parent first, the virtual root last."""
    found = []
    while (node := forest.parent[node]) >= 0:
        found.append(node)
    return found
