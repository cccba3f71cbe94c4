"""GRPO-Guard (Wang et al., arXiv 2510.22319): clipped GRPO with a re-centred, step-consistent
importance ratio, `train.loss: grpo-guard` with the keys `guard.*`.

The signal, the trained edges and the minibatches are clipped GRPO's (branchdiff/objectives/grpo.py:
trees, fusion, depth-wise advantages, pruning). Only an edge's surrogate changes
(`loss.guard_surrogate`): for a step x' = μ_old + s·ε of the rollout, the plain log-ratio
logp_θ − logp_old has expectation −mean((μ_θ − μ_old)²)/(2s²) < 0 once the weights move, so
ratios drift below 1 and the clip no longer bounds updates of positive-advantage edges. The guard
adds that bias back and multiplies by s, giving log ρ̃ = mean(ε·(μ_θ − μ_old)), centred at 0, and
divides each edge's loss by its step size σ_t − σ_{t+1} (`guard.reweight`). Its ratios are of the
order of the per-step change of the mean, so its clip range is its own (`guard.clip_range`, 2e-6
as in the verl-omni recipe; `train.clip_range` is plain GRPO's).

μ_old is the rollout's step mean: recovered exactly from the stored sample and the step noise,
which is addressable (branchdiff/core/noise.py), as x' − m·s·ε (m: the split's noise multiplier).
Flow-matching families only: the step size is a difference of σ (the settings refuse a DDIM family: `flow_only` in branchdiff/objectives/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from branchdiff.core import noise
from branchdiff.core.loss import guard_surrogate
from branchdiff.core.rollout import NoiseAddress, Rollout
from branchdiff.objectives.base import MetricKind, Signal
from branchdiff.objectives.grpo import ClippedGRPO, GRPOPlan
from branchdiff.schedulers.flow import StepOutput
from branchdiff.schedulers.schedule import FlowSchedule


@dataclass
class GRPOGuard(ClippedGRPO):
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        **ClippedGRPO.metric_kinds,
        "log_ratio": "per_term",  # mean plain logp_θ − logp_rollout of the edges trained: below 0 once the weights move
        "log_ratio_guard": "per_term",  # mean re-centred log ρ̃: about 0
    }

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> GuardPlan:
        return GuardPlan(self, rollout, embeds, signal.node_advantages, signal.trained, address)


class GuardPlan(GRPOPlan):
    """Clipped GRPO's minibatches with GRPO-Guard's surrogate."""

    def __init__(self, objective: GRPOGuard, rollout: Rollout, embeds: dict, node_advantages: torch.Tensor, trained: torch.Tensor,
                 address: NoiseAddress) -> None:
        super().__init__(objective, rollout, embeds, node_advantages, trained, address.iteration)
        self.address = address
        self.stats.update(log_ratio=0.0, log_ratio_guard=0.0)

    def rollout_means(self, child_nodes: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """(e, ...) the rollout's step means of the edges into `child_nodes` (from depths `depth`): x' − m·s·ε."""
        rollout, address = self.rollout, self.address
        tree = rollout.tree
        sample = rollout.latents[child_nodes]  # (e, ...)
        keys = [address.prompt_keys[p] for p in tree.prompt[child_nodes].tolist()]
        eps = noise.draw("step", address.run_seed, address.iteration, keys, [tree.paths[c] for c in child_nodes.tolist()],
                         sample.shape[1:], sample.device)  # (e, ...) the noise each edge was drawn with
        multiplier = torch.tensor([tree.spec.noise_multiplier(d) for d in depth.tolist()])  # (e,)
        scale = (multiplier * rollout.std[child_nodes]).to(sample.device, sample.dtype)  # (e,)
        return sample - scale.reshape((-1,) + (1,) * (sample.dim() - 1)) * eps

    def surrogate(self, child_nodes: torch.Tensor, depth: torch.Tensor, x_parent: torch.Tensor, output: torch.Tensor, step: StepOutput,
                  log_prob: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        guard = self.objective.config.guard
        sigmas = cast(FlowSchedule, self.objective.schedule).sigmas  # flow families only (module doc)
        index = depth.to(sigmas.device)
        step_size = (sigmas[index] - sigmas[index + 1]).to(log_prob.device) if guard.reweight else torch.ones_like(log_prob)  # (e,)
        old_mean = self.rollout_means(child_nodes, depth).to(step.mean.device)
        per_edge, was_clipped, log_ratio = guard_surrogate(log_prob, old, step.mean, old_mean, step.std.to(log_prob.device), step_size,
                                                           advantages, guard.clip_range)
        self.stats["log_ratio"] += (log_prob - old).detach().sum().item()
        self.stats["log_ratio_guard"] += log_ratio.detach().sum().item()
        return per_edge, was_clipped
