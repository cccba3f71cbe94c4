"""The search loop shared by every search: select → add a child → roll it out to images → score →
back up, for every prompt, until each prompt's budget of network rows is spent (a prompt stops when
its next selection would pass its budget, or its tree is exhausted).

The loop is continuously batched: a prompt may have up to `parallel` selections in flight. Rollouts
that can step without a forward (from a new initial noise, or a node whose output is kept) step first;
a rollout that reaches the last depth is scored and backed up at once, and its prompt selects again;
only when every rollout waits on a prediction does a forward run, up to `max_batch` rows, whatever
their prompt and depth: the rollouts of the prompts that have spent least first, then those that waited
longest (so the prompts spend their budgets together and no laggard leaves a tail of part-empty
forwards). Selections made while others are in flight reserve what they take (`SearchForest.reserve`):
the child they will add counts against its node's cap (as does, at every node a rollout reaches, the
child it will add there), and the nodes above carry a pending visit that the selection rule may weigh
(DTS: each lowers a child's log-weight by log(1 + pending)). Every latent is the same whatever shares
its forward (the forest pads each forward), and each prompt draws its selections from its own
generator, so with one selection in flight per prompt every prompt's search is exactly the sequential
algorithm, image for image.

A search may stop its rollouts early (`rollout_depth` k > 0: DTS's lever): a selection's rollout goes at
most k steps below the node it was added to; where it stops before the last depth, the node is predicted
(one row, which its next step would need anyway), the reward of its predicted clean sample x̂0 is its
value, backed up as an image's would be, and later selections may grow it further. Such values are not
images: the result's leaves, rewards and trace count finished images only.

The budget is in network rows, or in row-equivalents of rows, decodes and reward calls (`prices`,
branchdiff/search/cost.py; every finished image and every scored x̂0 is one decode and one reward call).
A selection is made only if what its prompt has spent, plus what its rollouts in flight and the new one
still need (`_still_needed`: rows, a prediction two of them share counted once, and the samples they will
score), fit in the budget, so no prompt passes it; in rows alone and with nothing in flight that is the
selection's own cost (`SearchForest.cost_of_child`). The trace records, after every selection of a prompt
is finished, its network rows, decodes and reward calls spent, the best reward found, the mean reward of its images so far (over the finite ones)
and how many scored non-finite (NaN or infinite rewards count as −inf, the worst, and never stop a
search); the result names each prompt's best images by their noise paths (`SearchForest.path`), which
`regenerate_path` turns back into the same latents.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from branchdiff.search.backup import backup_path
from branchdiff.search.cost import ROWS, Prices
from branchdiff.search.forest import WAIT, SearchForest

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
    trace: list[list[dict]] = field(default_factory=list)  # per prompt, after each round: nfe, decodes, reward_calls, best, mean, images, nonfinite

    def best(self, prompt: int, count: int = 1) -> list[int]:
        """The prompt's `count` best leaves (first made first among equal rewards)."""
        order = sorted(range(len(self.rewards[prompt])), key=lambda i: (-self.rewards[prompt][i], i))
        return [self.leaves[prompt][i] for i in order[:count]]


def prompt_generators(seed: int, prompts: int) -> list[torch.Generator]:
    """One generator per prompt for the selections' draws, seeded from (seed, prompt)."""
    return [torch.Generator().manual_seed((seed + 0x9E3779B97F4A7C15 * (p + 1)) % 2**63) for p in range(prompts)]


@dataclass
class _Rollout:
    prompt: int
    selection: int  # the selection it grows (a fixed tree's branches share one)
    node: int  # the selected node until its child is added, then the newest node of its path
    fresh: bool  # `node` is the selected node: it gets one child (else the rollout's `branching`)
    since: int  # the forward count when it last stepped: who waited longest steps first
    stop: int  # the depth it stops at: the last, or k below the selected node (module doc, early stops)


@torch.no_grad()
def run_search(forest: SearchForest, search: Search, budget: float, score: Score, seed: int = 0, parallel: int = 1,
               prices: Prices = ROWS) -> SearchResult:
    """Search every prompt of `forest` within `budget` each (module doc), in network rows or, with `prices`, in
    row-equivalents, with up to `parallel` selections in flight per prompt; `score` rewards decoded images; `seed`
    seeds the selections' draws."""
    if parallel < 1:
        raise ValueError(f"a search needs at least one selection in flight per prompt; got parallel={parallel}")
    generators = prompt_generators(seed, forest.num_prompts)
    branching = search.branching(forest)
    result = SearchResult(*([[] for _ in range(forest.num_prompts)] for _ in range(4)))
    in_flight = [0] * forest.num_prompts
    selecting = set(range(forest.num_prompts))
    selected: list[int] = []  # per selection: its node
    unfinished: list[int] = []  # per selection: its rollouts not yet at the last depth
    rollouts: list[_Rollout] = []  # oldest first
    per_forward = max(1, forest.settings.max_batch // forest.rows_per_node())  # latents per forward
    x0_value = bool(getattr(search, "x0_value", False))

    def finish(r: _Rollout) -> None:
        """One rollout of a selection done (an image, or an early stop); with its selection's last, the selection is finished."""
        unfinished[r.selection] -= 1
        if unfinished[r.selection] == 0:
            forest.reserve(selected[r.selection], -1, child=False)
            in_flight[r.prompt] -= 1
            _record(result, forest, r.prompt)

    while True:
        for prompt in sorted(selecting):
            while prompt in selecting and in_flight[prompt] < parallel:
                node = search.select(forest, prompt, generators[prompt])
                if node == WAIT:
                    break
                candidate = _Rollout(prompt, len(selected), node, True, forest.forwards, _stop_depth(forest, search, node)) if node is not None else None
                needed = _still_needed(forest, [r for r in rollouts if r.prompt == prompt] + [candidate], branching, x0_value) if candidate else None
                if needed is None or forest.spent(prompt, prices) + prices.cost(*needed) > budget:
                    selecting.discard(prompt)
                    break
                in_flight[prompt] += 1
                forest.reserve(node, +1)
                selected.append(node)
                unfinished.append(1)
                rollouts.append(candidate)
        if not rollouts:
            return result
        ready = [r for r in rollouts if forest.depth[r.node] < 0 or forest.output[r.node] is not None]
        if not ready:  # every rollout waits on a prediction: one forward, the prompts that spent least first
            first = sorted(range(len(rollouts)), key=lambda i: (forest.nfe[rollouts[i].prompt], rollouts[i].since, i))
            predicted = list(dict.fromkeys(rollouts[i].node for i in first))[:per_forward]
            forest.predict_nodes(predicted)
            if x0_value:
                _estimate(forest, score, predicted)
            ready = [r for r in rollouts if forest.output[r.node] is not None]
        stopped = [r for r in ready if not r.fresh and forest.depth[r.node] == r.stop < forest.num_steps]  # early stops, predicted
        if stopped:
            _value_early_stops(forest, search, score, [r.node for r in stopped])
            for r in stopped:
                finish(r)
            done = {id(r) for r in stopped}
            rollouts = [r for r in rollouts if id(r) not in done]
            ready = [r for r in ready if id(r) not in done]
        widths = [1 if r.fresh or branching is None else branching[forest.depth[r.node]] for r in ready]
        children = iter(forest.add_children([r.node for r, width in zip(ready, widths) for _ in range(width)]))
        grown = {id(r): [_Rollout(r.prompt, r.selection, next(children), False, forest.forwards, r.stop) for _ in range(width)]
                 for r, width in zip(ready, widths)}
        for r, width in zip(ready, widths):
            forest.pending[r.node] -= width  # the children it was to add are there
            for new in grown[id(r)]:
                if forest.depth[new.node] < new.stop:  # and each new node above its rollout's stop waits for the children it will add
                    forest.pending[new.node] += 1 if branching is None else branching[forest.depth[new.node]]
            unfinished[r.selection] += width - 1
        rollouts = [new for r in rollouts for new in grown.get(id(r), [r])]
        leaves = [r for r in rollouts if forest.depth[r.node] == forest.num_steps]
        if leaves:
            rollouts = [r for r in rollouts if forest.depth[r.node] < forest.num_steps]
            _score_and_back_up(forest, search, score, [r.node for r in leaves], result)
            for r in leaves:
                finish(r)


def _still_needed(forest: SearchForest, rollouts: list[_Rollout], branching: list[int] | None, x0_value: bool) -> tuple[int, int, int]:
    """(rows, decodes, reward calls) the rollouts still need to reach their stops: the prediction of every node they
    will step from that has none (once, however many share it) and one per node they will make below it but the
    last; one sample scored per image they will finish or per early stop (at most: a stop whose x̂0 is scored already
    is not scored again), and with `x0_value` one per prediction."""
    to_predict, rows, scored = set(), 0, 0
    for r in rollouts:
        depth = forest.depth[r.node]
        if depth >= 0 and forest.output[r.node] is None:
            to_predict.add(r.node)
        width = 1 if r.fresh or branching is None else branching[depth]
        for below in range(depth + 1, min(r.stop, forest.num_steps - 1) + 1):  # each node it makes is predicted but one at the last depth
            rows += width
            width *= 1 if branching is None else branching[below]
        scored += width if r.stop >= forest.num_steps else 1  # its images, or its early stop's x̂0
    predictions = rows + len(to_predict)
    scored += predictions if x0_value else 0
    return predictions * forest.rows_per_node(), scored, scored


def _stop_depth(forest: SearchForest, search: Search, node: int) -> int:
    """The depth a rollout from the selected `node` stops at: the last, or `rollout_depth` below the node (module doc)."""
    below = getattr(search, "rollout_depth", 0)
    return forest.num_steps if below == 0 else min(forest.num_steps, forest.depth[node] + below)


def _value_early_stops(forest: SearchForest, search: Search, score: Score, nodes: list[int]) -> None:
    """Each node where a rollout stopped early (predicted) valued by the reward of its predicted clean sample (its
    `estimate` where `x0_value` has scored it already), backed up."""
    unscored = [n for n in nodes if math.isnan(forest.estimate[n])]
    for node, reward in zip(unscored, _x0_rewards(forest, score, unscored)):
        forest.estimate[node] = reward
    for node in nodes:
        forest.value[node] = forest.estimate[node]
        for above in backup_path(forest.parent, forest.children, forest.value, node, search.backup, search.temperature):
            forest.visits[above] += 1


def _estimate(forest: SearchForest, score: Score, nodes: list[int]) -> None:
    """Each node's `estimate`: the reward of the clean sample its (just computed) output predicts, no network row spent."""
    for node, reward in zip(nodes, _x0_rewards(forest, score, nodes)):
        forest.estimate[node] = reward


def _x0_rewards(forest: SearchForest, score: Score, nodes: list[int]) -> list[float]:
    """The rewards of the nodes' predicted clean samples (a non-finite one counts as −inf, the worst)."""
    if not nodes:
        return []
    forest.evaluate(nodes)
    rewards, _ = score(forest.adapter.decode(forest.predicted_x0(nodes)), [forest.prompt[n] for n in nodes])
    return [reward if math.isfinite(reward) else -math.inf for reward in rewards.tolist()]


def _score_and_back_up(forest: SearchForest, search: Search, score: Score, leaves: list[int], result: SearchResult) -> None:
    forest.evaluate(leaves)
    rewards, extras = score(forest.adapter.decode(forest.leaf_latents(leaves)), [forest.prompt[n] for n in leaves])  # (L,), {name: (L,)}
    for row, (leaf, reward) in enumerate(zip(leaves, rewards.tolist())):
        prompt = forest.prompt[leaf]
        forest.value[leaf] = reward if math.isfinite(reward) else -math.inf  # a NaN or infinite reward is the worst
        for node in backup_path(forest.parent, forest.children, forest.value, leaf, search.backup, search.temperature):
            forest.visits[node] += 1
        result.leaves[prompt].append(leaf)
        result.rewards[prompt].append(forest.value[leaf])
        result.extras[prompt].append({name: float(values[row]) for name, values in extras.items()})


def _record(result: SearchResult, forest: SearchForest, prompt: int) -> None:
    seen = result.rewards[prompt]
    finite = [reward for reward in seen if math.isfinite(reward)]
    result.trace[prompt].append({"nfe": forest.nfe[prompt], "decodes": forest.decodes[prompt], "reward_calls": forest.reward_calls[prompt],
                                 "best": max(seen, default=-math.inf), "mean": sum(finite) / len(finite) if finite else -math.inf,
                                 "images": len(seen), "nonfinite": len(seen) - len(finite)})
