"""An iteration's metrics, reduced over every process: what one process would log on all prompts.

Counts (NFE, edges, explore NFE) are summed; per-edge means (loss, clip fraction, KL) are global
sums over the global edge count; times and `logprob_check` (max |logp_train − logp_rollout| at
the first inner step) are maxima; rewards and per-attribute accuracies are means over every
process's leaves; the explorer's ranking agreement is computed on every process's candidates.
"""

from __future__ import annotations

import torch

from branchdiff.distributed import Collective
from branchdiff.explore import ranking_agreement
from branchdiff.rollout import Rollout


def iteration_metrics(
    collective: Collective,
    rollout: Rollout,
    scores: dict[str, torch.Tensor],
    reward_key: str,
    trained: torch.Tensor,
    update: dict[str, float],
    info: dict,
) -> dict[str, float]:
    """`scores`: per-leaf scores of this process (L,) by name, the reward under `reward_key`;
    `trained` (N,) bool; `update`: this process's sums from `Trainer.update`; `info`: timings
    and explore results of `Trainer.rollout_and_score`."""
    gathered = {name: collective.cat(values.float())[0] for name, values in scores.items()}
    rewards = gathered[reward_key]
    explore_stats = info.get("explore_stats", {})
    counts = {
        "nfe_rollout": rollout.nfe, "nfe_rollout_computed": rollout.nfe_computed, "nfe_trained": update["nfe_trained"],
        "edges_trained": int(trained.sum()), **{f"explore_{k}": v for k, v in explore_stats.items() if k.endswith("_nfe")},
    }
    edge_sums = {"loss": update["loss_sum"], "clip_fraction": update["clipped"], "kl": update["kl_sum"]}
    maxima = {
        "logprob_check": update["logprob_check"], "rollout_seconds": info["rollout_seconds"],
        "reward_seconds": info["reward_seconds"], "train_seconds": info["train_seconds"],
        **{f"explore_{k}": v for k, v in explore_stats.items() if not k.endswith("_nfe")},
    }
    summed = collective.sum(torch.tensor([*counts.values(), *edge_sums.values()], dtype=torch.float64)).tolist()
    counts = {name: int(value) for name, value in zip(counts, summed)}
    edges = max(counts["edges_trained"], 1)
    edge_means = {name: value / edges for name, value in zip(edge_sums, summed[len(counts):])}
    maxima = dict(zip(maxima, collective.max(torch.tensor(list(maxima.values()), dtype=torch.float64)).tolist()))
    metrics = {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        **{f"accuracy_{name}": values.mean().item() for name, values in gathered.items() if name != reward_key},
        **counts, **edge_means, **maxima,
        "grad_norm": update["grad_norm"],  # identical on every process after DDP's gradient sync
        "optimizer_steps": update["optimizer_steps"],
    }
    for subset in ("kept", "pool"):  # explorer vs policy rewards (P, K) of the kept subset, (P, N) of the whole pool
        if f"explore_{subset}" in info:
            pool, policy = (collective.cat(values)[0] for values in info[f"explore_{subset}"])
            metrics.update({f"explore_{name}_{subset}": value for name, value in ranking_agreement(pool, policy).items()})
    return metrics
