"""An iteration's metrics, reduced over every process: what one process would log on all prompts.

Counts (NFE, edges, explore NFE) are summed; per-edge means (loss, clip fraction, KL) are global
sums over the global edge count; times and `logprob_check` (max |logp_train − logp_rollout| at
the first inner step) are maxima (`grad_norm` is the last optimizer step's); rewards, each reward component and per-attribute accuracies
are means over every process's leaves (finite scores only); the explorer's ranking agreement is
computed on every process's candidates.

Per depth d (the depth of an edge's child, 1..T), over the edges with a density (SDE edges):
`advantage_std/depth_d` and `advantage_abs_mean/depth_d` of the clipped advantages, and
`edges_trained/depth_d`. `steps_skipped` counts optimizer steps skipped for a non-finite gradient.

Signal diagnostics (a group is one prompt's leaves, the samples GRPO compares):
`reward_zero_spread_fraction`, the fraction of groups whose combined rewards have (near) zero
spread, std < 1e-6 (they train nothing), and `reward_group_std`, the mean within-group std.
"""

from __future__ import annotations

import torch

from branchdiff.core.advantage import group_moments, unbiased_std
from branchdiff.core.rollout import Rollout
from branchdiff.explore.pool import ranking_agreement
from branchdiff.objectives.base import MetricKind
from branchdiff.rewards.multi import RewardBatch
from branchdiff.runtime.distributed import Collective

ZERO_SPREAD = 1e-6  # a group whose rewards spread less than this trains nothing


def group_spread(total: torch.Tensor, groups: torch.Tensor) -> tuple[int, int, float]:
    """(groups, groups with std < 1e-6, sum of their unbiased stds) of the finite scores (B,) by
    group (B,); a group of one has std 0."""
    finite = torch.isfinite(total)
    values, members = total[finite], groups[finite]
    if not len(values):
        return 0, 0, 0.0
    count, _, squares = group_moments(values, members, int(members.max()) + 1)
    std = unbiased_std(count, squares)[count > 0]  # (groups present,)
    return len(std), int((std < ZERO_SPREAD).sum()), std.sum().item()


def depth_advantage_sums(depth: torch.Tensor, advantages: torch.Tensor, has_density: torch.Tensor, trained: torch.Tensor,
                         num_steps: int) -> torch.Tensor:
    """(T, 5) float64 per child depth 1..T: edges with a density n, Σ A, Σ A², Σ |A|, edges trained,
    from each node's depth (N,), advantage (N,) and the masks (N,); sums add up over processes."""
    rows = torch.zeros(num_steps + 1, 5, dtype=torch.float64)
    a = advantages.double()
    values = torch.stack([torch.ones_like(a), a, a**2, a.abs(), trained.double()], dim=1)  # (N, 5)
    rows.index_add_(0, depth[has_density], values[has_density])
    return rows[1:]


def depth_advantage_metrics(sums: torch.Tensor) -> dict[str, float]:
    """The per-depth metrics of `depth_advantage_sums` (summed over processes): unbiased std and
    mean |A| of the depth's advantages, edges trained; depths without SDE edges are left out."""
    metrics = {}
    for index, (n, total, squares, absolute, trained) in enumerate(sums.tolist()):
        if n == 0:
            continue
        d = index + 1
        variance = (squares - total * total / n) / max(n - 1, 1)
        metrics[f"advantage_std/depth_{d}"] = max(variance, 0.0) ** 0.5
        metrics[f"advantage_abs_mean/depth_{d}"] = absolute / n
        metrics[f"edges_trained/depth_{d}"] = int(trained)
    return metrics


def _mean_finite(values: torch.Tensor) -> float:
    finite = values[torch.isfinite(values)]
    return finite.mean().item() if len(finite) else float("nan")


def iteration_metrics(
    collective: Collective,
    rollout: Rollout,
    rewards: RewardBatch,
    node_advantages: torch.Tensor,
    trained: torch.Tensor,
    update: dict[str, float],
    kinds: dict[str, MetricKind],
    info: dict,
) -> dict[str, float]:
    """`rewards`: this process's leaf rewards; `node_advantages` (N,) clipped; `trained` (N,) bool;
    `update`: this process's statistics from the update loop (the objective's, reduced by their
    `kinds`: per-term sums become means over the terms trained, counts sums, the rest maxima);
    `info`: timings, dropped groups and explore results of the iteration."""
    tree = rollout.tree
    scores = {**rewards.components, **rewards.extras}  # every per-leaf score, gathered at once with the total
    gathered = collective.cat(torch.stack([rewards.total, *scores.values()], dim=1).float())[0]  # (L_all, 1 + K)
    totals, *columns = gathered.unbind(1)
    per_leaf = dict(zip(scores, columns))
    finite_totals = totals[torch.isfinite(totals)]
    groups, flat_groups, std_sum = group_spread(rewards.total, tree.prompt[tree.leaf_index])
    explore_stats = info.get("explore_stats", {})
    counts = {
        "nfe_rollout": rollout.nfe, "nfe_rollout_computed": rollout.nfe_computed,
        **({"rollout_forwards": rollout.forwards, "rollout_forwards_cached": rollout.forwards_cached} if info.get("block_cache") else {}),
        **{name: update[name] for name, kind in kinds.items() if kind == "count"},
        "edges_trained": int(trained.sum()), "terms": update["terms"], "groups_dropped": info["groups_dropped"], "groups": groups,
        "zero_spread_groups": flat_groups, **rewards.counts,
        **{f"explore_{k}": v for k, v in explore_stats.items() if k.endswith("_nfe")},
    }
    sums = {"group_std_sum": std_sum}
    edge_sums = {name: update[name] for name, kind in kinds.items() if kind == "per_term"}
    maxima = {
        **{name: update[name] for name, kind in kinds.items() if kind == "max"}, "rollout_seconds": info["rollout_seconds"],
        "reward_seconds": info["reward_seconds"], "train_seconds": info["train_seconds"], **info.get("memory", {}),
        "decode_seconds": info.get("decode_seconds", 0.0), "forward_backward_seconds": update.get("forward_backward_seconds", 0.0),
        "optimizer_seconds": update.get("optimizer_seconds", 0.0),
        **{f"explore_{k}": v for k, v in explore_stats.items() if not k.endswith(("_nfe", "_mean_abs_diff"))},
        **{key: info[key] for key in ("reward_overlapped_seconds",) if key in info},  # reward_overlap: scoring hidden behind the rollout
    }
    # every process holds the same number of kept candidates, so the mean of the processes' means is the global mean
    means = {f"explore_{k}": v for k, v in explore_stats.items() if k.endswith("_mean_abs_diff")}
    summed = collective.sum(torch.tensor([*counts.values(), *edge_sums.values(), *sums.values()], dtype=torch.float64)).tolist()
    per_term_sums = summed[len(counts):len(counts) + len(edge_sums)]
    counts = {name: int(value) for name, value in zip(counts, summed)}
    terms = max(counts.pop("terms"), 1)  # loss terms trained on every process (GRPO: the edges trained)
    edge_means = {name: value / terms for name, value in zip(edge_sums, per_term_sums)}
    groups, std_sum = max(counts.pop("groups"), 1), summed[-1]
    maxima = dict(zip(maxima, collective.max(torch.tensor(list(maxima.values()), dtype=torch.float64)).tolist()))
    if means:
        totals = collective.sum(torch.tensor(list(means.values()), dtype=torch.float64)) / collective.num_processes
        maxima.update(zip(means, totals.tolist()))
    metrics = {
        "reward_mean": finite_totals.mean().item() if len(finite_totals) else float("nan"),
        "reward_std": finite_totals.std().item() if len(finite_totals) > 1 else 0.0,
        "reward_zero_spread_fraction": counts.pop("zero_spread_groups") / groups,
        "reward_group_std": std_sum / groups,
        **{name: _mean_finite(per_leaf[name]) for name in rewards.components},
        **{f"accuracy_{name}": _mean_finite(per_leaf[name]) for name in rewards.extras},
        **counts, **edge_means, **maxima,
        "grad_norm": update["grad_norm"],  # identical on every process after DDP's gradient sync
        "optimizer_steps": update["optimizer_steps"], "steps_skipped": update["steps_skipped"],  # the same on every process
    }
    has_density = tree.is_sde_edge & (rollout.std > 0)
    depth_sums = depth_advantage_sums(tree.depth, node_advantages, has_density, trained, tree.spec.num_steps)
    metrics.update(depth_advantage_metrics(collective.sum(depth_sums)))
    for subset in ("kept", "pool"):  # explorer vs policy rewards (P, K) of the kept subset, (P, N) of the whole pool
        if f"explore_{subset}" in info:
            pool, policy = (collective.cat(values)[0] for values in info[f"explore_{subset}"])
            metrics.update({f"explore_{name}_{subset}": value for name, value in ranking_agreement(pool, policy).items()})
    return metrics


def dataset_iteration_metrics(collective: Collective, rows: int, update: dict[str, float], kinds: dict[str, MetricKind],
                              info: dict) -> dict[str, float]:
    """The metrics of an iteration of a dataset objective (SFT, offline DPO: no rollout, no reward):
    `rows` this process trained, its update statistics reduced by their `kinds` as `iteration_metrics`
    reduces them, and the timings and peak memory in `info`."""
    counts = {**{name: update[name] for name, kind in kinds.items() if kind == "count"}, "rows": rows, "terms": update["terms"]}
    per_term = {name: update[name] for name, kind in kinds.items() if kind == "per_term"}
    maxima = {**{name: update[name] for name, kind in kinds.items() if kind == "max"}, "train_seconds": info["train_seconds"],
              "encode_seconds": info["encode_seconds"], **info.get("memory", {}),
              "forward_backward_seconds": update.get("forward_backward_seconds", 0.0), "optimizer_seconds": update.get("optimizer_seconds", 0.0)}
    summed = collective.sum(torch.tensor([*counts.values(), *per_term.values()], dtype=torch.float64)).tolist()
    counts = {name: int(value) for name, value in zip(counts, summed)}
    terms = max(counts.pop("terms"), 1)
    means = {name: value / terms for name, value in zip(per_term, summed[len(counts) + 1:])}
    maxima = dict(zip(maxima, collective.max(torch.tensor(list(maxima.values()), dtype=torch.float64)).tolist()))
    return {**counts, **means, **maxima, "grad_norm": update["grad_norm"], "optimizer_steps": update["optimizer_steps"],
            "steps_skipped": update["steps_skipped"]}
