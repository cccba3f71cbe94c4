"""LayerTuning-RL (Dynamic-TreeRPO, Fu et al., arXiv 2509.23352): tree GRPO with a supervised term
toward each group's best sample and clip bounds that open with the reward, `train.loss:
grpo-layertuning` with the keys `layertuning.*`.

The paper states the mechanism without formulas or code: supervised fine-tuning folded into tree
GRPO as a dynamically weighted process reward, with reward-dependent clipping bounds so that the
supervised pull does not stop exploration. Each choice below is an interpretation
(docs/objectives.md):
- **SFT term.** In each group (prompt) the leaf with the highest reward is the target x0*. Every
  trained edge on the path from its root to x0* adds λ·max(A, 0)·mean((v_θ(x) − v*)²), with x the
  edge's parent latent at σ and v* = (x − x0*)/σ the velocity that carries x straight to x0*
  (`loss.sft_velocity_loss`): supervised flow matching toward the best sample, computed on the
  prediction the edge's surrogate already makes (no extra forward).
- **Dynamic weight.** A is the edge's own depth-wise advantage (the fused reward of its subtree,
  normalised among its depth, branchdiff/core/advantage.py): a process reward. A group whose leaves tie
  has A = 0 everywhere and adds nothing.
- **Reward-conditioned clip.** ρ ∈ [1 − ε·(1 + η·max(−A, 0)), 1 + ε·(1 + η·max(A, 0))] with
  ε = `train.clip_range` and η = `layertuning.clip_sensitivity` (`loss.reward_clipped_surrogate`).
Flow-matching families only: the SFT target is a flow-matching velocity (the settings refuse a DDIM family: `flow_only` in branchdiff/objectives/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from branchdiff.core.loss import reward_clipped_surrogate, sft_velocity_loss
from branchdiff.core.rollout import NoiseAddress, Rollout
from branchdiff.core.tree import Tree
from branchdiff.objectives.base import MetricKind, Signal
from branchdiff.objectives.grpo import ClippedGRPO, GRPOPlan
from branchdiff.schedulers.flow import StepOutput
from branchdiff.schedulers.schedule import FlowSchedule


@dataclass
class LayerTuningGRPO(ClippedGRPO):
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        **ClippedGRPO.metric_kinds,
        "sft": "per_term",  # mean weighted SFT term over the edges trained (0 off the best paths)
        "sft_edges": "count",  # trained edges on a best path with a positive advantage
    }

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> LayerTuningPlan:
        return LayerTuningPlan(self, rollout, embeds, signal, address.iteration)


def best_paths(tree: Tree, node_rewards: torch.Tensor) -> torch.Tensor:
    """(N,) for every node on the path from a root to its group's highest-reward leaf (the first on
    ties), that leaf's node index; −1 elsewhere."""
    leaves = tree.leaf_index  # (L,) prompt-major
    target = torch.full((tree.num_nodes,), -1, dtype=torch.long)
    per_prompt = node_rewards[leaves].reshape(tree.num_prompts, -1)  # (P, L/P)
    for best in (leaves.reshape(tree.num_prompts, -1).gather(1, per_prompt.argmax(dim=1, keepdim=True)).squeeze(1)).tolist():
        node = best
        while node >= 0:
            target[node] = best
            node = int(tree.parent[node])
    return target


class LayerTuningPlan(GRPOPlan):
    """Clipped GRPO's minibatches with the reward-conditioned clip and the SFT term on the best paths."""

    def __init__(self, objective: LayerTuningGRPO, rollout: Rollout, embeds: dict, signal: Signal, iteration: int) -> None:
        super().__init__(objective, rollout, embeds, signal.node_advantages, signal.trained, iteration)
        self.best_leaf = best_paths(rollout.tree, signal.node_rewards)  # (N,)
        self.stats.update(sft=0.0, sft_edges=0)

    def surrogate(self, child_nodes: torch.Tensor, depth: torch.Tensor, x_parent: torch.Tensor, output: torch.Tensor, step: StepOutput,
                  log_prob: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.objective.config
        settings = config.layertuning
        per_edge, was_clipped = reward_clipped_surrogate(log_prob, old, advantages, config.train.clip_range, settings.clip_sensitivity)
        weight = settings.sft_weight * advantages.clamp(min=0) * (self.best_leaf[child_nodes] >= 0).to(advantages)  # (e,)
        rows = torch.nonzero(weight > 0).squeeze(1)  # edges on a best path with a positive advantage (on the loss's device)
        if len(rows):
            sigmas, rows_cpu = cast(FlowSchedule, self.objective.schedule).sigmas, rows.cpu()  # flow families only; depth and the node indices live on the CPU
            sigma = sigmas[depth[rows_cpu].to(sigmas.device)].to(x_parent.device)  # (r,) the parents' σ
            target = self.rollout.latents[self.best_leaf[child_nodes[rows_cpu]].to(self.rollout.latents.device)].to(x_parent.device)  # (r, ...)
            rows_out = rows.to(output.device)
            sft = weight[rows] * sft_velocity_loss(output[rows_out], x_parent[rows_out], target, sigma).to(weight.device)  # (r,)
            per_edge = per_edge.index_add(0, rows.to(per_edge.device), sft.to(per_edge.dtype))
            self.stats["sft"] += sft.detach().sum().item()
            self.stats["sft_edges"] += len(rows)
        return per_edge, was_clipped
