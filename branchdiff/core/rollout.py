"""Grow trees of SDE/ODE transitions with a model adapter, level by level (a loop around the
engine's `predict` and `transition`, branchdiff/core/engine.py).

At every step all nodes of the current depth, across all prompts, go through the model in
batched forwards of at most `max_batch` rows; each node's k children share that forward and differ
only in their step noise. A row's output depends on the batch size (kernels pick their blocking by
shape) but not on the other rows' contents, so a node regrown in a batch of another size may
differ in the last bits. `exact=True` pads every forward to exactly `max_batch` rows, which makes
any node regenerable alone bit for bit (see `regenerate`) at the price of computing the padding:
narrow tree levels then cost as much as full ones. The default (`exact=False`) computes only the
real rows; `Rollout.nfe` counts real rows and `Rollout.nfe_computed` the rows computed.

Noise at split steps (`TreeSpec.noise_level`, `TreeSpec.noise_multiplier`): a split's noise level
enters the SDE step whole (drift correction and noise), and the stored log-prob is the density
sampled. Under the BranchGRPO release's convention (`anchor_noise_multiplier` m ≠ 1) the children
are drawn as `mean + m·std·ε` while the log-prob keeps N(mean, std²), as the release computes it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from branchdiff.core.engine import NoiseAddress, SamplerSettings, initial_noise, predict, transition
from branchdiff.core.tree import Tree
from branchdiff.models.base import ModelAdapter, PromptEmbeds, select_embeds
from branchdiff.models.block_cache import BlockCache
from branchdiff.schedulers.schedule import Schedule


@dataclass
class Rollout:
    tree: Tree
    schedule: Schedule
    latents: torch.Tensor  # (N, *latent_shape) every node's latent
    log_prob: torch.Tensor  # (N,) log-prob of the edge into each node (0 for roots and ODE edges)
    std: torch.Tensor  # (N,) std the edge's log-prob is evaluated with (0 for roots and ODE edges)
    noise_level: torch.Tensor  # (N,) SDE noise level of the edge into each node (0 for roots and ODE edges)
    nfe: int  # network rows of real nodes (2 per node under CFG)
    nfe_computed: int  # network rows computed, padding included (= nfe unless exact)
    forwards: int = 0  # forwards made under a block cache (`SamplerSettings.block_cache`; 0 without one)
    forwards_cached: int = 0  # of those, forwards that skipped every block after the first (branchdiff/models/block_cache.py)

    @property
    def leaf_latents(self) -> torch.Tensor:
        return self.latents[self.tree.leaf_index]


def empty_rollout(adapter: ModelAdapter, tree: Tree, schedule: Schedule) -> Rollout:
    """A rollout of `tree` with nothing sampled yet, for `grow_prompts` to fill."""
    n = tree.num_nodes
    latents = torch.empty((n, *adapter.latent_shape), device=adapter.device)
    return Rollout(tree, schedule.to(adapter.device), latents, torch.zeros(n), torch.zeros(n), torch.zeros(n), 0, 0)


@torch.no_grad()
def grow(
    adapter: ModelAdapter,
    tree: Tree,
    embeds: PromptEmbeds,
    schedule: Schedule,
    settings: SamplerSettings,
    address: NoiseAddress,
    per_node: bool = False,
) -> Rollout:
    """Sample every node of `tree` (embeds: one row per prompt of the batch) on the adapter's
    `schedule`. With `per_node`, every node is expanded by its own forward, as the BranchGRPO
    release does (for benchmarks)."""
    rollout = empty_rollout(adapter, tree, schedule)
    grow_prompts(rollout, adapter, embeds, settings, address, list(range(tree.num_prompts)), per_node)
    return rollout


@torch.no_grad()
def grow_prompts(
    rollout: Rollout,
    adapter: ModelAdapter,
    embeds: PromptEmbeds,
    settings: SamplerSettings,
    address: NoiseAddress,
    prompts: list[int],
    per_node: bool = False,
) -> None:
    """Sample the nodes of the trees of `prompts` (indices into the rollout's tree) into `rollout`, in
    place, and add their forwards to its counts. Each node's noise comes from its address, so the
    trees of a part of the prompts are the trees they are in the whole; only the forwards' batches
    are narrower (bit for bit the same under `exact`)."""
    tree, schedule = rollout.tree, rollout.schedule
    if per_node:
        settings = replace(settings, max_batch=1, exact=False)  # one latent per forward (its CFG pair included)
    chosen = torch.zeros(tree.num_prompts, dtype=torch.bool)
    chosen[prompts] = True
    mine = chosen[tree.prompt]  # (N,) the node belongs to one of `prompts`

    def nodes_at(depth: int) -> torch.Tensor:
        level = torch.arange(tree.level_start[depth], tree.level_start[depth + 1])
        return level[mine[level]]

    keys = [address.prompt_keys[p] for p in tree.prompt.tolist()]  # (N,) each node's prompt key
    roots = nodes_at(0)
    rollout.latents[roots] = initial_noise(address, [keys[r] for r in roots.tolist()], [tree.paths[r] for r in roots.tolist()],
                                           adapter.latent_shape, adapter.device)
    cache = BlockCache(adapter.denoiser, settings.block_cache) if settings.block_cache > 0 else None
    with nullcontext() if cache is None else cache:
        for depth in range(tree.spec.num_steps):
            level = nodes_at(depth)  # ascending node indices
            if len(level) == 0:  # a sub-tree that ends above the leaves
                break
            x = rollout.latents[level]  # (n_level, *shape)
            output, rows, computed = predict(adapter, x, tree.depth[level], select_embeds(embeds, tree.prompt[level]), schedule, settings,
                                             cache)
            rollout.nfe += rows
            rollout.nfe_computed += computed
            children = nodes_at(depth + 1)
            parent_row = torch.searchsorted(level, tree.parent[children])  # each child's parent's row in `level`
            if cache is not None and depth + 1 < tree.spec.num_steps:  # (the leaves make no forward)
                cache.next_level(parent_row)
            made = transition(tree.spec, schedule, settings, address, depth, x[parent_row], output[parent_row],
                              [keys[c] for c in children.tolist()], [tree.paths[c] for c in children.tolist()])
            rollout.latents[children], rollout.log_prob[children] = made.latents, made.log_prob
            rollout.std[children], rollout.noise_level[children] = made.std, made.noise_level
    if cache is not None:
        rollout.forwards_cached += cache.skipped
        rollout.forwards += cache.forwards


@torch.no_grad()
def regenerate(
    adapter: ModelAdapter,
    tree: Tree,
    nodes: torch.Tensor,
    embeds: PromptEmbeds,
    schedule: Schedule,
    settings: SamplerSettings,
    address: NoiseAddress,
) -> Rollout:
    """Grow only `nodes` (indices into `tree`) and their ancestors, with the same addressable noise:
    the sub-tree made of the union of their root paths. Returns a Rollout over that sub-tree whose
    tree keeps the original paths and prompts (so its noise addresses are the original ones)."""
    keep = torch.zeros(tree.num_nodes, dtype=torch.bool)
    frontier = nodes.clone()
    while len(frontier):
        keep[frontier] = True
        frontier = tree.parent[frontier]
        frontier = frontier[(frontier >= 0) & ~keep[frontier.clamp(min=0)]].unique()
    return grow(adapter, subtree(tree, keep), embeds, schedule, settings, address)


def subtree(tree: Tree, keep: torch.Tensor) -> Tree:
    """The nodes `keep` (N,) bool of `tree`, closed under taking parents, as a Tree in level order.
    Paths and prompt indices are the original ones."""
    old_index = torch.nonzero(keep).squeeze(1)  # level order is preserved by sorting
    new_of_old = torch.full((tree.num_nodes,), -1, dtype=torch.long)
    new_of_old[old_index] = torch.arange(len(old_index))
    parent = tree.parent[old_index]
    depth = tree.depth[old_index]
    counts = torch.bincount(depth, minlength=tree.spec.num_steps + 1)
    return Tree(
        spec=tree.spec,
        num_prompts=tree.num_prompts,
        parent=torch.where(parent >= 0, new_of_old[parent.clamp(min=0)], parent),
        depth=depth,
        prompt=tree.prompt[old_index],
        paths=[tree.paths[i] for i in old_index.tolist()],
        level_start=[0, *torch.cumsum(counts, 0).tolist()],
    )
