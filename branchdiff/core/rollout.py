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

from dataclasses import dataclass, replace

import torch

from branchdiff.core.engine import NoiseAddress, SamplerSettings, initial_noise, predict, transition
from branchdiff.core.tree import Tree
from branchdiff.models.base import ModelAdapter, PromptEmbeds, select_embeds
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

    @property
    def leaf_latents(self) -> torch.Tensor:
        return self.latents[self.tree.leaf_index]


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
    schedule = schedule.to(adapter.device)
    if per_node:
        settings = replace(settings, max_batch=1, exact=False)  # one latent per forward (its CFG pair included)
    shape = adapter.latent_shape
    latents = torch.empty((tree.num_nodes, *shape), device=adapter.device)
    log_prob = torch.zeros(tree.num_nodes)
    std = torch.zeros(tree.num_nodes)
    noise_level = torch.zeros(tree.num_nodes)
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    keys = [address.prompt_keys[p] for p in tree.prompt.tolist()]  # (N,) each node's prompt key
    latents[roots] = initial_noise(address, [keys[r] for r in roots.tolist()], [tree.paths[r] for r in roots.tolist()], shape, adapter.device)
    nfe = nfe_computed = 0
    for depth in range(tree.spec.num_steps):
        level = torch.arange(tree.level_start[depth], tree.level_start[depth + 1])
        if len(level) == 0:  # a sub-tree that ends above the leaves
            break
        x = latents[level]  # (n_level, *shape)
        output, rows, computed = predict(adapter, x, tree.depth[level], select_embeds(embeds, tree.prompt[level]), schedule, settings)
        nfe += rows
        nfe_computed += computed
        children = torch.arange(tree.level_start[depth + 1], tree.level_start[depth + 2])
        parent_row = tree.parent[children] - tree.level_start[depth]
        made = transition(tree.spec, schedule, settings, address, depth, x[parent_row], output[parent_row],
                          [keys[c] for c in children.tolist()], [tree.paths[c] for c in children.tolist()])
        latents[children], log_prob[children], std[children], noise_level[children] = made.latents, made.log_prob, made.std, made.noise_level
    return Rollout(tree, schedule, latents, log_prob, std, noise_level, nfe, nfe_computed)


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
