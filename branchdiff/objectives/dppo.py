"""Flow-DPPO, divergence-proximal GRPO, `train.loss: dppo` with the key `dppo.kl_mask_threshold`.

Clipped GRPO's signal, trained edges and minibatches (branchdiff/objectives/grpo.py: trees,
fusion, depth-wise advantages, pruning) with the ratio clip replaced by a trust region on the exact
divergence of each step: the rollout's step is Gaussian, x' ~ N(μ_old, s²), and the current
weights' is N(μ_θ, s²) with the same s, so KL = mean((μ_θ − μ_old)²)/(2s²) (averaged over the
latent's elements like the log-probs). An edge's loss is −A·ρ, ρ = exp(logp_θ − logp_old), and its
gradient is held when KL > `dppo.kl_mask_threshold` and the update pushes further the wrong way
(A > 0 with ρ > 1, or A < 0 with ρ < 1): inside the trust region, or moving back toward it, an
edge trains unclipped (`loss.dppo_surrogate`). μ_old is recovered exactly from the stored sample
and its addressable step noise, as GRPO-Guard does (branchdiff/objectives/grpo_guard.py).

SDE edges only (an ODE-only rollout has no step density; the settings refuse it), flow-matching
families (μ_old's recovery follows the flow step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from branchdiff.core.loss import dppo_surrogate
from branchdiff.core.rollout import NoiseAddress, Rollout
from branchdiff.objectives.base import MetricKind, Signal
from branchdiff.objectives.grpo import ClippedGRPO
from branchdiff.objectives.grpo_guard import GuardPlan
from branchdiff.schedulers.flow import StepOutput


@dataclass
class DPPO(ClippedGRPO):
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        "logprob_check": "max",  # max |logp_train − logp_rollout| at the first minibatch, before any update: 0 up to rounding
        "loss": "per_term", "kl": "per_term",  # means over the edges trained
        "clip_fraction": "per_term",  # edges whose gradient the trust region held
        "step_kl": "per_term",  # KL(current ‖ rollout step) of the edges trained
        "nfe_trained": "count",  # parent forwards of the update
    }

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> DPPOPlan:
        return DPPOPlan(self, rollout, embeds, signal.node_advantages, signal.trained, address)


class DPPOPlan(GuardPlan):
    """Clipped GRPO's minibatches with DPPO's trust-region mask (the rollout means as GRPO-Guard recovers them)."""

    def __init__(self, objective: DPPO, rollout: Rollout, embeds: dict, node_advantages: torch.Tensor, trained: torch.Tensor,
                 address: NoiseAddress) -> None:
        super().__init__(objective, rollout, embeds, node_advantages, trained, address)  # type: ignore[arg-type]
        self.stats = {"loss": 0.0, "clip_fraction": 0.0, "step_kl": 0.0, "kl": 0.0, "logprob_check": 0.0, "nfe_trained": 0}

    def surrogate(self, child_nodes: torch.Tensor, depth: torch.Tensor, x_parent: torch.Tensor, output: torch.Tensor, step: StepOutput,
                  log_prob: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_mean = self.rollout_means(child_nodes, depth).to(step.mean.device)
        per_edge, held, kl = dppo_surrogate(log_prob, old, step.mean, old_mean, step.std.to(log_prob.device), advantages,
                                            self.objective.config.dppo.kl_mask_threshold)
        self.stats["step_kl"] += kl.sum().item()
        return per_edge, held
