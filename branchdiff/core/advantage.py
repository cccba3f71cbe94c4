"""Reward fusion (leaves → every node) and depth-wise GRPO advantages on flat tree arrays.

Fusion, bottom-up over depths, for a node n with children C(n):
    mean             R(n) = mean of the rewards of n's leaf descendants
                          = Σ_c L(c)·R(c) / Σ_c L(c), L(c) = number of leaves below c
    logprob_softmax  R(n) = Σ_c softmax_c(α·logp(n→c))·R(c)       (BranchGRPO's option, α = 1)
    max              R(n) = max_c R(c)
A node with one child takes its child's reward in every mode.

Depth-wise advantages: nodes of one prompt at one depth form a group g (for a chain group of G
samples, the G nodes at each depth; for a tree, its nodes at that depth), r̄_g its mean reward.
    scope "tree":  A(n) = (R(n) - r̄_g) / (s_g + 1e-8), s_g the unbiased std of group g;
                   0 for a group of one node or with s_g < 1e-6. (BranchGRPO's rule: a depth
                   with exactly two nodes always gets ±1/√2, whatever the gap.)
    scope "batch": A(n) = (R(n) - r̄_g) / (s_d + 1e-8), s_d the pooled within-group std of all
                   groups at depth d across the batch, s_d² = Σ_n (R(n) - r̄_g)² / (N_d - G_d)
                   (N_d nodes, G_d groups); 0 where N_d = G_d or s_d < 1e-6. Advantages then
                   scale with the gap, and two-node depths carry information. The batch is every
                   process's trees: N_d, G_d and the squares are summed over processes.
The edge parent → n is trained with A(n), clipped to ±clip. Without splits, each depth of a
chain group holds the G samples, so both scopes reduce to flat group GRPO
(DanceGRPO's per-prompt z-score; Flow-GRPO-like batch std).

Baseline "median" (MC-GRPO): r̄_g is the group's median instead of its mean. With an odd count, one
node sits at the median, the group's pivot: its advantage is 0 and its edge is left out of the loss
(`median_pivots`), so a group of G + 1 samples trains G. With an even count the median is the mean
of the two middle rewards and no node is a pivot; baseline "median-lower" takes the lower of the two
instead, as MC-GRPO's public code does (torch.median), and that node is the pivot. (On a tree's depths
with two-way splits the two differ most: the mean's ±0.707 against the lower's 0 and one residual of the
whole gap.) Its scale (`scale`): "std" divides by the std as
above; "mad" is MC-GRPO's public code (`mad_advantages`): the median absolute deviation plus 1e-3,
then each group's non-zero advantages rescaled so that their count weighs as the group's,
    A(n) = (R(n) − med_g) / (MAD_g + 1e-3),  MAD_g = median_{m ∈ g} |R(m) − med_g|,
    A(n) ← A(n) · n_g / #{m ∈ g : A(m) ≠ 0}   for A(n) ≠ 0,
so a group of 9 scores trains its 8 non-pivots as 9 (the public code's (G + 1)/G). A group of one
node, or one whose advantages are all zero, gets 0.
"""

from __future__ import annotations

import torch

from branchdiff.core.tree import Tree
from branchdiff.runtime.distributed import LOCAL, Collective

FUSION_MODES = ("mean", "logprob_softmax", "max")
SCOPES = ("tree", "batch")
BASELINES = ("mean", "median", "median-lower")
SCALES = ("std", "mad")
MAD_FLOOR = 1e-3  # added to the median absolute deviation (MC-GRPO's public code)
EPS = 1e-8
MIN_STD = 1e-6


def fuse_rewards(
    tree: Tree, leaf_rewards: torch.Tensor, edge_log_prob: torch.Tensor, mode: str = "mean", alpha: float = 1.0
) -> torch.Tensor:
    """Reward of every node (N,) from leaf rewards (L,) in `tree.leaf_index` order.
    `edge_log_prob` (N,) is the log-prob of the edge into each node (used by logprob_softmax)."""
    if mode not in FUSION_MODES:
        raise ValueError(f"unknown fusion mode {mode!r}; allowed: {FUSION_MODES}")
    n = tree.num_nodes
    rewards = torch.zeros(n, dtype=torch.float64)
    leaf_count = torch.zeros(n, dtype=torch.float64)
    rewards[tree.leaf_index] = leaf_rewards.double()
    leaf_count[tree.leaf_index] = 1.0
    log_prob = edge_log_prob.double()
    for depth in reversed(range(tree.spec.num_steps)):
        children = torch.arange(tree.level_start[depth + 1], tree.level_start[depth + 2])
        parents = tree.parent[children]  # (C,)
        level = slice(tree.level_start[depth], tree.level_start[depth + 1])
        leaf_count.index_add_(0, parents, leaf_count[children])
        if mode == "mean":
            weights = leaf_count[children]
        elif mode == "logprob_softmax":
            logits = alpha * log_prob[children]
            parent_max = torch.full((n,), -torch.inf, dtype=torch.float64).index_reduce_(0, parents, logits, "amax")
            weights = torch.exp(logits - parent_max[parents])
        if mode == "max":
            rewards.index_reduce_(0, parents, rewards[children], "amax", include_self=False)
        else:
            total = torch.zeros(n, dtype=torch.float64).index_add_(0, parents, weights)
            weighted = torch.zeros(n, dtype=torch.float64).index_add_(0, parents, weights * rewards[children])
            rewards[level] = weighted[level] / total[level]
    return rewards.to(leaf_rewards.dtype)


def group_moments(values: torch.Tensor, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For values (N,) in groups (N,) of 0..num_groups-1, in float64: the count n_g (G,), each
    value's residual r - mean_g (N,), and the sum of squared residuals S_g (G,)."""
    values = values.double()
    count = torch.bincount(groups, minlength=num_groups).double()
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, values) / count.clamp(min=1)
    residual = values - mean[groups]
    return count, residual, torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, residual**2)


def unbiased_std(count: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
    """√(S_g / (n_g - 1)) per group (G,); 0 for a group of one."""
    return torch.sqrt(squares / (count - 1).clamp(min=1))


def depth_groups(tree: Tree) -> tuple[torch.Tensor, int]:
    """The (prompt, depth) group of every node (N,), and the number of groups P·(T + 1)."""
    num_depths = tree.spec.num_steps + 1
    return tree.prompt * num_depths + tree.depth, tree.num_prompts * num_depths


def depthwise_advantages(tree: Tree, node_rewards: torch.Tensor, scope: str = "tree", collective: Collective = LOCAL,
                         baseline: str = "mean", scale: str = "std") -> torch.Tensor:
    """Advantage of every node (N,) from its reward (N,), normalised per (prompt, depth) group;
    scope "batch" pools the std over the trees of every process of `collective`; baseline "median"
    centres each group on its median, and scale "mad" divides by its median absolute deviation (module doc)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown advantage scope {scope!r}; allowed: {SCOPES}")
    if baseline not in BASELINES:
        raise ValueError(f"unknown advantage baseline {baseline!r}; allowed: {BASELINES}")
    if scale not in SCALES or (scale == "mad" and (not is_median(baseline) or scope != "tree")):
        raise ValueError(f"advantage scale {scale!r} with baseline {baseline!r} and scope {scope!r}; allowed: std, or mad with the median "
                         "baseline within each tree")
    group, num_groups = depth_groups(tree)
    if scale == "mad":
        return mad_advantages(node_rewards, group, num_groups, baseline == "median-lower").to(node_rewards.dtype)
    num_depths = tree.spec.num_steps + 1
    count, residual, squares = group_moments(node_rewards, group, num_groups)  # (P·(T+1),), (N,), (P·(T+1),)
    if scope == "tree":
        std = unbiased_std(count, squares)[group]  # (N,)
        valid = (count[group] > 1) & (std >= MIN_STD)
    else:
        nodes_at = torch.bincount(tree.depth, minlength=num_depths).double()  # N_d
        groups_at = (count.reshape(tree.num_prompts, num_depths) > 0).sum(0).double()  # G_d
        pooled = squares.reshape(tree.num_prompts, num_depths).sum(0)  # (T+1,)
        nodes_at, groups_at, pooled = collective.sum(torch.stack([nodes_at, groups_at, pooled])).unbind(0)
        std = torch.sqrt(pooled / (nodes_at - groups_at).clamp(min=1))[tree.depth]  # (N,)
        valid = (nodes_at > groups_at)[tree.depth] & (std >= MIN_STD)
    if is_median(baseline):
        residual = node_rewards.double() - group_medians(node_rewards, group, num_groups, baseline == "median-lower")[0][group]
    advantages = torch.where(valid, residual / (std + EPS), torch.zeros_like(residual))
    return advantages.to(node_rewards.dtype)


def is_median(baseline: str) -> bool:
    """Whether an `advantage.baseline` centres on the group's median (MC-GRPO's, either rule for an even group)."""
    return baseline in ("median", "median-lower")


def group_medians(values: torch.Tensor, groups: torch.Tensor, num_groups: int, lower: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's median (G,; float64; 0 for an empty group) of values (N,) in groups (N,) of
    0..num_groups−1, and the pivots (N,) bool: in a group of odd count n > 1, one node whose value is the
    median (on ties, one of them); a group of even count has the mean of its two
    middle values and no pivot, or with `lower` the lower of the two (torch.median's rule), whose node is the pivot."""
    values = values.double()
    by_value = torch.argsort(values, stable=True)
    order = by_value[torch.argsort(groups[by_value], stable=True)]  # (N,) grouped, ascending values in each group
    count = torch.bincount(groups, minlength=num_groups)  # (G,)
    start = torch.cumsum(count, 0) - count  # (G,)
    present = count > 0
    low = order[(start + (count - 1) // 2)[present]]  # (G',) node at the lower middle of each non-empty group
    high = order[(start + count // 2)[present]]  # (G',) at the upper middle (the same node when the count is odd)
    medians = torch.zeros(num_groups, dtype=torch.float64)
    medians[present] = values[low] if lower else (values[low] + values[high]) / 2
    pivots = torch.zeros(len(values), dtype=torch.bool)
    sits_at_median = ((count[present] % 2 == 1) | lower) & (count[present] > 1)
    pivots[low[sits_at_median]] = True
    return medians, pivots


def resolve_scale(scale: str, baseline: str, scope: str = "tree") -> str:
    """`advantage.scale`: "auto" is MC-GRPO's MAD under the median baseline within each tree, else the std; else as given."""
    return ("mad" if is_median(baseline) and scope == "tree" else "std") if scale == "auto" else scale


def mad_advantages(values: torch.Tensor, groups: torch.Tensor, num_groups: int, lower: bool = False) -> torch.Tensor:
    """MC-GRPO's advantages (N,; float64) of values (N,) in groups (N,) of 0..num_groups−1: each value's distance from
    its group's median over the group's median absolute deviation + `MAD_FLOOR`, the non-zero ones rescaled by
    n_g / #non-zero (module doc); 0 in a group of one."""
    values = values.double()
    medians, _ = group_medians(values, groups, num_groups, lower)
    residual = values - medians[groups]  # (N,)
    deviations, _ = group_medians(residual.abs(), groups, num_groups, lower)  # (G,) MAD_g
    advantages = residual / (deviations[groups] + MAD_FLOOR)
    count = torch.bincount(groups, minlength=num_groups).double()  # (G,)
    advantages = torch.where(count[groups] > 1, advantages, torch.zeros_like(advantages))
    nonzero = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, (advantages != 0).double())  # (G,)
    return advantages * (count / nonzero.clamp(min=1))[groups]


def median_pivots(tree: Tree, node_rewards: torch.Tensor, lower: bool = False) -> torch.Tensor:
    """(N,) bool: the pivot of each (prompt, depth) group under the median baseline (`group_medians`)."""
    group, num_groups = depth_groups(tree)
    return group_medians(node_rewards, group, num_groups, lower)[1]

