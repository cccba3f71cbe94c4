"""A search forest: one tree of denoising states per prompt, grown a node at a time.

Node p (p < P) is prompt p's virtual root, above the initial noise (depth −1, path ()): its
children are initial noises (depth 0, path (r,)), drawn at their address, which costs no network
row. Every other node at depth d < T has children made by one step of the sampler from its latent
and its model output; the output is computed once per node, when its first child is made, and
kept, so a node's further children cost no forward (only fresh noise). A node's path is its
parent's path and its child index, the same addressing as a training tree (branchdiff/core/noise.py):
the search's winner regenerates from its path alone (`regenerate_path`).

Every forward is padded to `max_batch` rows (`SamplerSettings.exact`), so a node's latent does not
depend on which other nodes shared its forward: the path reproduces it bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from branchdiff.core.engine import NoiseAddress, SamplerSettings, expand, initial_noise, predict, rows_per_latent, step_kind
from branchdiff.core.noise import NodePath
from branchdiff.core.tree import TreeSpec
from branchdiff.models.base import ModelAdapter, PromptEmbeds, select_embeds
from branchdiff.schedulers.schedule import Schedule
from branchdiff.search.cost import Prices

WAIT = -1  # a selection rule's answer when every node it could pick waits on children still in flight (try again after a forward)


@dataclass
class SearchForest:
    adapter: ModelAdapter
    spec: TreeSpec  # T steps; which are SDE (all, unless a window is given)
    schedule: Schedule
    settings: SamplerSettings  # exact is forced on (module doc)
    address: NoiseAddress
    embeds: PromptEmbeds  # one row per prompt
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    path: list[NodePath] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)
    latent: list[torch.Tensor | None] = field(default_factory=list)  # (*latent_shape) per node; None for virtual roots
    output: list[torch.Tensor | None] = field(default_factory=list)  # the node's model output, once computed
    value: list[float] = field(default_factory=list)  # backed-up value (NaN: none yet)
    visits: list[int] = field(default_factory=list)  # images scored below the node (itself included, for a leaf)
    pending: list[int] = field(default_factory=list)  # children that rollouts in flight will add to the node (a selection's first, then each step's)
    inflight: list[int] = field(default_factory=list)  # selections in flight at or below the node
    estimate: list[float] = field(default_factory=list)  # the reward of the node's predicted clean sample, where a search asks for it (NaN: none)
    nfe: list[int] = field(default_factory=list)  # network rows spent per prompt
    decodes: list[int] = field(default_factory=list)  # samples decoded per prompt (images and scored x̂0)
    reward_calls: list[int] = field(default_factory=list)  # samples scored per prompt
    rows_computed: int = 0  # network rows the forwards computed, padding included (fill: sum(nfe) / rows_computed)
    forwards: int = 0  # forward calls made

    def __post_init__(self) -> None:
        self.settings = replace(self.settings, exact=True)
        self.schedule = self.schedule.to(self.adapter.device)
        for p in range(len(self.address.prompt_keys)):
            self._append(-1, -1, p, (), None)
        self.nfe = [0] * self.num_prompts
        self.decodes = [0] * self.num_prompts
        self.reward_calls = [0] * self.num_prompts

    @property
    def num_prompts(self) -> int:
        return len(self.address.prompt_keys)

    @property
    def num_steps(self) -> int:
        return self.spec.num_steps

    def _append(self, parent: int, depth: int, prompt: int, path: NodePath, latent: torch.Tensor | None) -> int:
        node = len(self.parent)
        self.parent.append(parent)
        self.depth.append(depth)
        self.prompt.append(prompt)
        self.path.append(path)
        self.children.append([])
        self.latent.append(latent)
        self.output.append(None)
        self.value.append(math.nan)
        self.visits.append(0)
        self.pending.append(0)
        self.inflight.append(0)
        self.estimate.append(math.nan)
        if parent >= 0:
            self.children[parent].append(node)
        return node

    def spent(self, prompt: int, prices: Prices) -> float:
        """The prompt's cost so far in row-equivalents (branchdiff/search/cost.py)."""
        return prices.cost(self.nfe[prompt], self.decodes[prompt], self.reward_calls[prompt])

    def evaluate(self, nodes: list[int]) -> None:
        """Charge each node's prompt one decode and one reward call (the node's latent or its x̂0, scored)."""
        for node in nodes:
            self.decodes[self.prompt[node]] += 1
            self.reward_calls[self.prompt[node]] += 1

    def rows_per_node(self) -> int:
        """Network rows of one node's prediction (2 under CFG)."""
        return rows_per_latent(self.adapter, self.settings)

    def child_cap(self, node: int, cap: int) -> int:
        """Children a node may have: none at the last depth, one where the step is deterministic, else `cap`."""
        depth = self.depth[node]
        if depth == self.num_steps:
            return 0
        if depth >= 0 and step_kind(self.spec, self.schedule, self.settings, depth) == "ode":
            return 1
        return cap

    def cost_of_child(self, node: int, branching: list[int] | None = None) -> int:
        """Network rows to add one child to `node` and complete it to the last depth with `branching`
        children per node at each depth (None: one, a roll-out): the node's own prediction unless
        kept (none for a virtual root), then one per node of each depth below it but the last."""
        rows = 0 if self.depth[node] < 0 or self.output[node] is not None else 1
        width = 1  # nodes of the new subtree at the depth being counted
        for depth in range(self.depth[node] + 1, self.num_steps):
            rows += width
            width *= 1 if branching is None else branching[depth]
        return rows * self.rows_per_node()

    def predict_nodes(self, nodes: list[int]) -> None:
        """Compute and keep the model output of the nodes that have none, charging their prompts."""
        todo = [n for n in dict.fromkeys(nodes) if self.output[n] is None]
        if not todo:
            return
        rows = torch.tensor([self.prompt[n] for n in todo])
        output, _, computed = predict(self.adapter, torch.stack([self.latent[n] for n in todo]), torch.tensor([self.depth[n] for n in todo]),
                                      select_embeds(self.embeds, rows), self.schedule, self.settings)
        self.rows_computed += computed
        self.forwards += -(-len(todo) // max(1, self.settings.max_batch // self.rows_per_node()))  # forward_chunked's chunks
        for row, node in enumerate(todo):
            self.output[node] = output[row]
            self.nfe[self.prompt[node]] += self.rows_per_node()

    def add_children(self, parents: list[int]) -> list[int]:
        """One new child of each of `parents` (a parent may repeat: one child per mention), in order:
        initial noise under a virtual root, else one step from the parent's (kept) model output."""
        self.predict_nodes([p for p in parents if self.depth[p] >= 0])
        paths, taken = [], {}
        for p in parents:  # the child index: the parent's children so far, and this call's earlier ones
            taken[p] = taken.get(p, len(self.children[p])) + 1
            paths.append(self.path[p] + (taken[p] - 1,))
        keys = [self.address.prompt_keys[self.prompt[p]] for p in parents]
        latents: list[torch.Tensor | None] = [None] * len(parents)
        for at_root in (True, False):
            rows = [i for i, p in enumerate(parents) if (self.depth[p] < 0) == at_root]
            if not rows:
                continue
            if at_root:
                made = initial_noise(self.address, [keys[i] for i in rows], [paths[i] for i in rows], self.adapter.latent_shape,
                                     self.adapter.device)  # (R, ...)
            else:
                made = expand(self.spec, self.schedule, self.settings, self.address, torch.tensor([self.depth[parents[i]] for i in rows]),
                              torch.stack([self.latent[parents[i]] for i in rows]), torch.stack([self.output[parents[i]] for i in rows]),
                              [keys[i] for i in rows], [paths[i] for i in rows]).latents  # (C, ...)
            for row, i in enumerate(rows):
                latents[i] = made[row]
        return [self._append(p, self.depth[p] + 1, self.prompt[p], paths[i], latents[i]) for i, p in enumerate(parents)]

    def reserve(self, node: int, count: int, child: bool = True) -> None:
        """Count `count` selections in flight at `node` (negative: finished): a pending visit on it and every
        node above it, and (`child`) a child it will get."""
        if child:
            self.pending[node] += count
        while node >= 0:
            self.inflight[node] += count
            node = self.parent[node]

    def leaf_latents(self, leaves: list[int]) -> torch.Tensor:
        return torch.stack([self.latent[n] for n in leaves])  # (L, *latent_shape)

    def predicted_x0(self, nodes: list[int]) -> torch.Tensor:
        """The clean samples the nodes' model outputs point to (N, *latent_shape), predicting the nodes that have none
        (charged as any prediction; a node's own step needs it anyway)."""
        self.predict_nodes(nodes)
        depths = torch.tensor([self.depth[n] for n in nodes])
        return self.schedule.predicted_x0(self.leaf_latents(nodes), torch.stack([self.output[n] for n in nodes]), depths)


@torch.no_grad()
def regenerate_path(adapter: ModelAdapter, spec: TreeSpec, schedule: Schedule, settings: SamplerSettings, run_seed: int,
                    iteration: int, prompt_key: int, embeds: PromptEmbeds, path: NodePath) -> torch.Tensor:
    """The latent at the end of `path` (its root's initial noise, then one step per child index),
    regrown alone with padded forwards (`exact`) and the addressable noise: the search's node, bit
    for bit. `embeds`: the prompt's own encoding (one row)."""
    settings = replace(settings, exact=True)
    schedule = schedule.to(adapter.device)
    address = NoiseAddress(run_seed, iteration, (prompt_key,))
    latent = initial_noise(address, [prompt_key], [path[:1]], adapter.latent_shape, adapter.device)  # (1, ...)
    for depth in range(len(path) - 1):
        output, _, _ = predict(adapter, latent, torch.tensor([depth]), embeds, schedule, settings)
        latent = expand(spec, schedule, settings, address, torch.tensor([depth]), latent, output, [prompt_key], [path[: depth + 2]]).latents
    return latent[0]
