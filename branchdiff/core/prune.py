"""Which transitions get gradients (pruning), and which steps are stochastic (Mix).

Pruning never changes sampling or rewards: it returns a mask over nodes, True where the edge
parent → node is trained. Depths below are node depths (the edge into a node at depth d is the
transition at step d - 1), as in the BranchGRPO release.

- Depth pruning drops edges whose child depth is in a set D. Sliding: every `interval`
  iterations the set moves one depth shallower, D_t = {d - s_t}, s_t = min(⌊t / interval⌋, min(D) - stop).
- Width pruning acts after the last split step ℓ (ℓ = -1 without splits, where the roots start
  the branches). A branch is the single-child chain below a node at depth ℓ + 1 (its head); its
  edges beyond the head share the head's reward and advantage. Edges into depths ≤ ℓ + 1 are kept.
    `per_branch`: among the siblings created by the last split (for chains: a prompt's samples),
                  keep the max(1, round(ratio·k)) branches with the largest |advantage|;
    `global`:     over the whole batch (every process's trees, ranked as if concatenated in rank
                  order), keep the max(1, round(ratio·n/2)) best and as many worst branches by
                  advantage.
  (The release's mode 1 ranks edges inside one branch, where all advantages tie, so it in
  effect keeps the first steps after the split; ranking whole branches by |A| keeps the most
  informative ones instead.)
- Mix (BranchGRPO-Mix, MixGRPO): the SDE runs on split steps and on a window of `size` steps that
  starts at `start` and moves `stride` steps later every `slide_every` iterations; ODE elsewhere.
- Step subsampling (DanceGRPO): a random fraction of the SDE steps is trained each iteration.
"""

from __future__ import annotations

import torch

from branchdiff.core.tree import Tree
from branchdiff.runtime.distributed import LOCAL, Collective

WIDTH_MODES = ("none", "per_branch", "global")


def sliding_depths(depths: frozenset[int], iteration: int, interval: int, stop_depth: int) -> frozenset[int]:
    """The pruned depth set at `iteration` (0-based): D shifted shallower by s_t (see module doc)."""
    if interval <= 0 or not depths:
        return depths
    shift = max(0, min(iteration // interval, min(depths) - stop_depth))
    return frozenset(d - shift for d in depths)


def depth_mask(tree: Tree, pruned_depths: frozenset[int]) -> torch.Tensor:
    """(N,) True where the node's depth is not pruned."""
    return ~torch.isin(tree.depth, torch.tensor(sorted(pruned_depths), dtype=torch.long))


def branch_heads(tree: Tree) -> tuple[torch.Tensor, int]:
    """(N,) index of each node's ancestor at depth ℓ + 1 (-1 above it), and ℓ + 1."""
    head_depth = max(tree.spec.split_steps, default=-1) + 1
    heads = torch.full((tree.num_nodes,), -1, dtype=torch.long)
    level = slice(tree.level_start[head_depth], tree.level_start[head_depth + 1])
    heads[level] = torch.arange(level.start, level.stop)
    for depth in range(head_depth + 1, tree.spec.num_steps + 1):
        level = slice(tree.level_start[depth], tree.level_start[depth + 1])
        heads[level] = heads[tree.parent[level]]
    return heads, head_depth


def width_mask(tree: Tree, node_advantages: torch.Tensor, mode: str, ratio: float, collective: Collective = LOCAL) -> torch.Tensor:
    """(N,) True where the edge survives width pruning (see module doc); `global` ranks the branches
    of every process of `collective`."""
    if mode not in WIDTH_MODES:
        raise ValueError(f"unknown width pruning mode {mode!r}; allowed: {WIDTH_MODES}")
    keep = torch.ones(tree.num_nodes, dtype=torch.bool)
    if mode == "none":
        return keep
    heads, head_depth = branch_heads(tree)
    head_nodes = torch.arange(tree.level_start[head_depth], tree.level_start[head_depth + 1])
    head_adv = node_advantages[head_nodes].double()  # (H,)
    kept_heads = torch.zeros(tree.num_nodes, dtype=torch.bool)
    if mode == "per_branch":
        # siblings of the last split share a parent; roots (no split) are grouped by prompt
        family = tree.parent[head_nodes] if head_depth > 0 else tree.prompt[head_nodes]
        for member in torch.unique(family):
            group = head_nodes[family == member]
            n_keep = max(1, round(ratio * len(group)))
            order = torch.sort(-head_adv[family == member].abs(), stable=True).indices
            kept_heads[group[order[:n_keep]]] = True
    else:
        all_adv, offset = collective.cat(head_adv)  # (H_all,) every process's heads in rank order
        n_side = max(1, round(ratio * len(all_adv) / 2))
        order = torch.sort(-all_adv, stable=True).indices  # best first
        kept_all = torch.zeros(len(all_adv), dtype=torch.bool)
        kept_all[order[:n_side]] = True
        kept_all[order.flip(0)[:n_side]] = True
        kept_heads[head_nodes] = kept_all[offset : offset + len(head_nodes)]
    beyond_head = tree.depth > head_depth
    keep[beyond_head] = kept_heads[heads[beyond_head]]
    return keep


def mix_sde_steps(num_steps: int, size: int, iteration: int, start: int = 0, slide_every: int = 0, stride: int = 1) -> frozenset[int]:
    """Steps of the Mix SDE window at `iteration` (split steps are added by TreeSpec.is_sde)."""
    if size <= 0:
        raise ValueError(f"mix window size must be ≥ 1, got {size}")
    offset = (iteration // slide_every) * stride if slide_every > 0 else 0
    first = min(start + offset, num_steps - size)
    return frozenset(range(max(first, 0), min(first + size, num_steps)))


def subsample_steps(sde_steps: list[int], fraction: float, generator: torch.Generator) -> frozenset[int]:
    """A random max(1, round(fraction·n)) of the given steps (DanceGRPO's timestep fraction)."""
    if fraction >= 1.0 or not sde_steps:
        return frozenset(sde_steps)
    n_keep = max(1, round(fraction * len(sde_steps)))
    chosen = torch.randperm(len(sde_steps), generator=generator)[:n_keep]
    return frozenset(sde_steps[i] for i in chosen.tolist())


def step_mask(tree: Tree, steps: frozenset[int]) -> torch.Tensor:
    """(N,) True where the edge into the node is the transition at one of `steps`."""
    return (tree.depth > 0) & torch.isin(tree.depth - 1, torch.tensor(sorted(steps), dtype=torch.long))
