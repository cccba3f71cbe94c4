"""Clipped GRPO (DanceGRPO, arXiv 2505.07818; Flow-GRPO, arXiv 2505.05470) over the SDE edges of
trees or chains (BranchGRPO, arXiv 2509.06040): `train.loss: grpo`.

Signal: leaf rewards are fused up each tree (`advantage.fuse_rewards`), normalised depth by depth
(`advantage.depthwise_advantages`) and clipped to ±`advantage.clip`; an edge trains when it is an
SDE edge with a density in a trainable step, after step subsampling and (while active) depth and
width pruning (branchdiff/core/prune.py), and its group was not dropped.

Plan: siblings share their parent's forward, so minibatches are made of parent nodes (a random
order from the seed and iteration) and each parent's velocity serves all its trained children. A
term is an edge: L = max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) + β_KL·KL, ρ = exp(logp_θ − logp_rollout),
with the rollout's guided prediction and each edge's own noise level recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from branchdiff.core import prune
from branchdiff.core.advantage import depthwise_advantages, fuse_rewards, is_median, median_pivots, resolve_scale
from branchdiff.core.loss import clipped_surrogate, kl_to_reference
from branchdiff.core.rollout import NoiseAddress, Rollout, SamplerSettings
from branchdiff.models.base import ModelAdapter, select_embeds
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.objectives.base import MetricKind, Objective, Signal, drop_nonfinite_groups
from branchdiff.runtime.distributed import Collective
from branchdiff.schedulers.flow import StepOutput, gaussian_log_prob
from branchdiff.schedulers.schedule import Schedule
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.trees import trainable_steps


@dataclass
class ClippedGRPO(Objective):
    config: TrainConfig
    collective: Collective
    finetune: LoraFinetune | FullFinetune  # the base model (the KL reference)
    train_policy: ModelAdapter  # the denoiser behind the (DDP-)wrapper: the training forward
    schedule: Schedule  # the rollouts' schedule
    settings: SamplerSettings  # the rollouts' sampler: SDE kind and guidance
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        "logprob_check": "max",  # max |logp_train − logp_rollout| at the first minibatch, before any update: 0 up to rounding
        "loss": "per_term", "clip_fraction": "per_term", "kl": "per_term",  # means over the edges trained
        "nfe_trained": "count",  # parent forwards of the update
    }

    def signal(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> Signal:
        config, tree = self.config, rollout.tree
        leaf_rewards, dropped = drop_nonfinite_groups(tree, rewards)
        node_rewards = fuse_rewards(tree, leaf_rewards, rollout.log_prob, config.advantage.fusion, config.advantage.alpha)
        node_advantages = depthwise_advantages(tree, node_rewards, config.advantage.scope, self.collective, config.advantage.baseline,
                                               resolve_scale(config.advantage.scale, config.advantage.baseline, config.advantage.scope))
        node_advantages = node_advantages.clamp(-config.advantage.clip, config.advantage.clip)
        trained = self.trainable_mask(rollout, node_advantages, iteration) & ~dropped[tree.prompt]
        if is_median(config.advantage.baseline):  # each (prompt, depth) group's pivot trains nothing (MC-GRPO)
            trained &= ~median_pivots(tree, node_rewards, config.advantage.baseline == "median-lower")
        return Signal(node_rewards, node_advantages, trained, int(dropped.sum()))

    def trainable_mask(self, rollout: Rollout, node_advantages: torch.Tensor, iteration: int) -> torch.Tensor:
        """(N,) edges that get gradients: SDE edges with a density, from a step the trained denoiser
        predicts (`ModelAdapter.trains_at`), in the trainable steps, after step subsampling and (while
        active) depth and width pruning."""
        config, tree = self.config, rollout.tree
        steps = trainable_steps(config, iteration)
        generator = torch.Generator().manual_seed(config.seed * 7_919 + iteration)
        mask = self.learnable_edges(rollout)
        mask &= prune.step_mask(tree, prune.subsample_steps(steps, config.train.step_fraction, generator))
        p = config.prune
        if iteration < p.active_fraction * config.iterations:
            mask &= prune.depth_mask(tree, prune.sliding_depths(frozenset(p.depths), iteration, p.slide_every, p.stop_depth))
            mask &= prune.width_mask(tree, node_advantages, p.width, p.width_ratio, self.collective)
        return mask

    def learnable_edges(self, rollout: Rollout) -> torch.Tensor:
        """(N,) SDE edges with a density stepped from a time the trained denoiser predicts."""
        tree, times = rollout.tree, self.schedule.model_times
        parent_times = times[tree.depth[tree.parent.clamp(min=0)].to(times.device)]  # (N,)
        return tree.is_sde_edge & (rollout.std > 0) & self.train_policy.trains_at(parent_times).cpu()

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> GRPOPlan:
        return GRPOPlan(self, rollout, embeds, signal.node_advantages, signal.trained, address.iteration)


class GRPOPlan:
    """This process's parent minibatches of an iteration and their edges' losses."""

    def __init__(self, objective: ClippedGRPO, rollout: Rollout, embeds: dict, node_advantages: torch.Tensor, trained: torch.Tensor,
                 iteration: int) -> None:
        self.objective, self.rollout, self.embeds, self.node_advantages = objective, rollout, embeds, node_advantages
        self.edges = torch.nonzero(trained).squeeze(1)  # (E,) child node of each trained edge
        self.parents, self.edge_parent = torch.unique(rollout.tree.parent[self.edges], return_inverse=True)  # (U,), (E,)
        generator = torch.Generator().manual_seed(objective.config.seed * 104_729 + iteration)
        order = torch.randperm(len(self.parents), generator=generator)
        # rows of `parents`; none on a process whose edges were all pruned (it joins every step idle)
        self.minibatches = [rows.sort().values for rows in order.split(objective.config.train.minibatch)] if len(self.parents) else []
        self.minibatch_edges = [torch.nonzero(torch.isin(self.edge_parent, rows)).squeeze(1) for rows in self.minibatches]  # rows of `edges`
        self.terms = [len(e) for e in self.minibatch_edges]
        self.stats = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "logprob_check": 0.0, "nfe_trained": 0}
        self.measured = False

    def loss(self, index: int) -> torch.Tensor:
        parent_rows, edge_rows = self.minibatches[index], self.minibatch_edges[index]  # (u,), (e,)
        local = torch.searchsorted(parent_rows, self.edge_parent[edge_rows])  # (e,) parent row of each edge
        per_edge, ratio_gap, was_clipped, kl = self.edge_losses(self.parents[parent_rows], self.edges[edge_rows], local)
        if not self.measured:  # the ratio before any update: rollout and training must agree
            self.stats["logprob_check"] = ratio_gap.abs().max().item()
            self.measured = True
        self.stats["loss"] += per_edge.sum().item()
        self.stats["clip_fraction"] += was_clipped.sum().item()
        self.stats["kl"] += kl.sum().item()
        self.stats["nfe_trained"] += len(parent_rows)
        return per_edge

    def edge_losses(self, parent_nodes: torch.Tensor, child_nodes: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-edge loss (e,), logp_train − logp_rollout (e,), clip flags (e,) and KL (e,) of the edges into
        `child_nodes`, whose parents are `parent_nodes[local]` (one forward per parent)."""
        objective, rollout = self.objective, self.rollout
        config, tree, schedule, settings = objective.config, rollout.tree, objective.schedule, objective.settings
        x = rollout.latents[parent_nodes]  # (u, ...)
        depth = tree.depth[parent_nodes]  # (u,) step index of each parent
        times = schedule.model_times[depth.to(schedule.model_times.device)]  # (u,)
        level = rollout.noise_level[child_nodes].to(x.device)  # (e,) each edge's own SDE level
        node_embeds = select_embeds(self.embeds, tree.prompt[parent_nodes])
        x_parent = x[local]
        guidance = settings.guidance  # the rollout's guided prediction, recomputed (Flow-GRPO)
        output = objective.train_policy.predict(x, times, node_embeds, guidance)[local]
        out = schedule.step(settings.sde, x_parent, output, depth[local], torch.zeros_like(x_parent), level)
        log_prob = gaussian_log_prob(rollout.latents[child_nodes], out.mean, out.std)
        old = rollout.log_prob[child_nodes].to(log_prob.device)
        advantages = self.node_advantages[child_nodes].to(log_prob.device).float()
        per_edge, was_clipped = self.surrogate(child_nodes, depth[local], x_parent, output, out, log_prob, old, advantages)
        kl = torch.zeros_like(per_edge)
        if config.train.kl_beta > 0:
            with torch.no_grad(), objective.finetune.base() as base:
                ref_output = base.predict(x, times, node_embeds, guidance)[local]
            ref = schedule.step(settings.sde, x_parent, ref_output, depth[local], torch.zeros_like(x_parent), level)
            kl = kl_to_reference(out.mean, ref.mean, out.std)
            per_edge = per_edge + config.train.kl_beta * kl
        return per_edge, (log_prob - old).detach(), was_clipped, kl.detach()

    def surrogate(self, child_nodes: torch.Tensor, depth: torch.Tensor, x_parent: torch.Tensor, output: torch.Tensor, step: StepOutput,
                  log_prob: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-edge policy loss (e,) and clip flags (e,) of the edges into `child_nodes`, stepped from depth `depth`
        (e,) and latents `x_parent` (e, ...) with the trained prediction `output` (e, ...) and its `step`; `log_prob`
        and `old` are the edges' trained and rollout log-probs."""
        return clipped_surrogate(log_prob, old, advantages, self.objective.config.train.clip_range)

    def idle_loss(self) -> torch.Tensor:
        """Zero, through the network calls of a minibatch's loss: the first minibatch's edges, or (every
        edge of this process pruned) its trees' first learnable edge; the statistics are left as they were."""
        if self.minibatches:
            parent_rows, edge_rows = self.minibatches[0], self.minibatch_edges[0]  # (u,), (e,)
            parents, children = self.parents[parent_rows], self.edges[edge_rows]
            local = torch.searchsorted(parent_rows, self.edge_parent[edge_rows])
        else:
            tree = self.rollout.tree
            children = torch.nonzero(self.objective.learnable_edges(self.rollout)).squeeze(1)[:1]  # (1,)
            parents, local = tree.parent[children], torch.zeros(1, dtype=torch.long)
        stats = dict(self.stats)
        per_edge = self.edge_losses(parents, children, local)[0]
        self.stats.update(stats)
        return per_edge.sum() * 0.0
