"""The policy update of an iteration: clipped GRPO (DanceGRPO, Flow-GRPO) over the trained edges of a rollout.

Siblings share their parent's forward: minibatches are made of parent nodes, and each parent's
velocity serves all its trained children. With several processes, every process takes the same
optimizer steps (`optimizer_groups` from the global edge count), and a step's loss is the sum over
its edges on all processes divided by their global count, so an edge weighs the same whichever
process holds it; a process with no edges in a step joins DDP's gradient sync with a zero loss.

A step whose gradient norm is not finite (a NaN or inf loss or gradient on any process: DDP's
all-reduce spreads it to every process, so all of them decide alike) is skipped: its gradients are
dropped and the weights and optimizer moments stay as they were (`steps_skipped`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from branchdiff.config import TrainConfig
from branchdiff.distributed import Collective
from branchdiff.ema import WeightAverage
from branchdiff.finetune import FullFinetune, LoraFinetune
from branchdiff.loss import clipped_surrogate, kl_to_reference
from branchdiff.models.base import ModelAdapter, select_embeds
from branchdiff.rollout import Rollout, SamplerSettings
from branchdiff.schedulers.flow import gaussian_log_prob
from branchdiff.schedulers.schedule import Schedule


@dataclass
class PolicyUpdate:
    config: TrainConfig
    accelerator: Accelerator
    collective: Collective
    finetune: LoraFinetune | FullFinetune  # what is trained: its parameters (gradient clipping) and the base model (the KL reference)
    train_policy: ModelAdapter  # the denoiser behind the (DDP-)wrapper: the training forward
    optimizer: torch.optim.Optimizer
    schedule: Schedule  # the rollouts' schedule
    settings: SamplerSettings  # the rollouts' sampler: SDE kind and guidance
    weight_average: WeightAverage | None = None  # the moving average of the trained weights, updated after every optimizer step

    def __call__(self, rollout: Rollout, embeds: dict, node_advantages: torch.Tensor, mask: torch.Tensor, iteration: int) -> dict[str, float]:
        """Train the edges into the nodes `mask` (N,) with their `node_advantages` (N,); returns this
        process's sums (loss, clipped edges, KL, parent forwards), the log-prob check, the gradient
        norm, the number of optimizer steps taken and skipped (non-finite gradients), and the skips
        after the last step taken (`trailing_skips`)."""
        config, tree, accelerator = self.config, rollout.tree, self.accelerator
        edges = torch.nonzero(mask).squeeze(1)  # (E,) child node of each trained edge
        stats = {"loss_sum": 0.0, "clipped": 0.0, "kl_sum": 0.0, "logprob_check": 0.0, "nfe_trained": 0, "optimizer_steps": 0,
                 "steps_skipped": 0, "trailing_skips": 0, "grad_norm": 0.0}
        global_edges = int(self.collective.sum(torch.tensor([float(len(edges))], dtype=torch.float64)).item())
        if global_edges == 0:
            return stats
        parents, edge_parent = torch.unique(tree.parent[edges], return_inverse=True)  # (U,), (E,)
        generator = torch.Generator().manual_seed(config.seed * 104_729 + iteration)
        order = torch.randperm(len(parents), generator=generator)
        # rows of `parents`; none on a process whose edges were all pruned (it joins every step idle)
        minibatches = [rows.sort().values for rows in order.split(config.train.minibatch)] if len(parents) else []
        minibatch_edges = [torch.nonzero(torch.isin(edge_parent, rows)).squeeze(1) for rows in minibatches]  # rows of `edges`
        groups = optimizer_groups([len(e) for e in minibatch_edges], global_edges, config.train.optimizer_every)
        local_group_edges = torch.tensor([float(sum(len(minibatch_edges[m]) for m in g)) for g in groups], dtype=torch.float64)
        group_edges = self.collective.sum(local_group_edges).tolist()  # edges of each optimizer step, all processes
        measured = False
        for group, step_edges in zip(groups, group_edges):
            if step_edges == 0:
                continue
            members = group or [None]  # a process without edges in this step still joins DDP's gradient sync
            for index, m in enumerate(members):
                sync = index == len(members) - 1
                with (nullcontext() if sync else accelerator.no_sync(self.train_policy.denoiser)), accelerator.autocast():
                    if m is None:
                        loss = self._idle_loss(rollout, embeds)
                    else:
                        parent_rows, edge_rows = minibatches[m], minibatch_edges[m]  # (u,), (e,)
                        local = torch.searchsorted(parent_rows, edge_parent[edge_rows])  # (e,) parent row of each edge
                        per_edge, ratio_gap, was_clipped, kl = self._edge_losses(
                            rollout, embeds, node_advantages, parents[parent_rows], edges[edge_rows], local)
                        if not measured:  # the ratio before any update: rollout and training must agree
                            stats["logprob_check"] = ratio_gap.abs().max().item()
                            measured = True
                        loss = per_edge.sum() * accelerator.num_processes / step_edges  # DDP averages over processes
                        stats["loss_sum"] += per_edge.sum().item()
                        stats["clipped"] += was_clipped.sum().item()
                        stats["kl_sum"] += kl.sum().item()
                        stats["nfe_trained"] += len(parent_rows)
                    accelerator.backward(loss)
            grad_norm = float(accelerator.clip_grad_norm_(self.finetune.params, config.train.max_grad_norm))
            stats["grad_norm"] = grad_norm
            if math.isfinite(grad_norm):
                self.optimizer.step()
                if self.weight_average is not None:
                    self.weight_average.update()
                stats["optimizer_steps"] += 1
                stats["trailing_skips"] = 0
            else:
                stats["steps_skipped"] += 1
                stats["trailing_skips"] += 1
            self.optimizer.zero_grad(set_to_none=True)
        return stats

    def _edge_losses(self, rollout: Rollout, embeds: dict, node_advantages: torch.Tensor, parent_nodes: torch.Tensor,
                     child_nodes: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-edge loss (e,), logp_train - logp_rollout (e,), clip flags (e,) and KL (e,) of the edges into
        `child_nodes`, whose parents are `parent_nodes[local]` (one forward per parent)."""
        config, tree = self.config, rollout.tree
        x = rollout.latents[parent_nodes]  # (u, ...)
        depth = tree.depth[parent_nodes]  # (u,) step index of each parent
        times = self.schedule.model_times[depth.to(self.schedule.model_times.device)]  # (u,)
        level = rollout.noise_level[child_nodes].to(x.device)  # (e,) each edge's own SDE level
        node_embeds = select_embeds(embeds, tree.prompt[parent_nodes])
        x_parent = x[local]
        guidance = self.settings.guidance  # the rollout's guided prediction, recomputed (Flow-GRPO)
        output = self.train_policy.predict(x, times, node_embeds, guidance)[local]
        out = self.schedule.step(self.settings.sde, x_parent, output, depth[local], torch.zeros_like(x_parent), level)
        log_prob = gaussian_log_prob(rollout.latents[child_nodes], out.mean, out.std)
        old = rollout.log_prob[child_nodes].to(log_prob.device)
        advantages = node_advantages[child_nodes].to(log_prob.device).float()
        per_edge, was_clipped = clipped_surrogate(log_prob, old, advantages, config.train.clip_range)
        kl = torch.zeros_like(per_edge)
        if config.train.kl_beta > 0:
            with torch.no_grad(), self.finetune.base() as base:
                ref_output = base.predict(x, times, node_embeds, guidance)[local]
            ref = self.schedule.step(self.settings.sde, x_parent, ref_output, depth[local], torch.zeros_like(x_parent), level)
            kl = kl_to_reference(out.mean, ref.mean, out.std)
            per_edge = per_edge + config.train.kl_beta * kl
        return per_edge, (log_prob - old).detach(), was_clipped, kl.detach()

    def _idle_loss(self, rollout: Rollout, embeds: dict) -> torch.Tensor:
        """A zero loss through the wrapped denoiser, for a process with no edges in an optimizer
        step: DDP's gradient sync needs every process's backward."""
        root = torch.tensor([0])
        output = self.train_policy.predict(rollout.latents[root], self.schedule.model_times[:1],
                                           select_embeds(embeds, rollout.tree.prompt[root]), self.settings.guidance)
        return output.sum() * 0.0


def optimizer_groups(edges_per_minibatch: list[int], global_edges: int, every: int) -> list[list[int]]:
    """Minibatch indices of each of n optimizer step slots, the same n on every process: one
    (every = 0) or n = max(1, ⌊global_edges / every⌋), so a step holds about global_edges / n ≥
    every edges and a remainder never takes a step of its own. A process assigns each minibatch to
    the slot its edge midpoint falls in, ⌊n·(start + e/2) / E⌋; a slot may be empty on a process,
    and a slot empty on every process is skipped (so fewer than n steps may be taken, the same
    number on every process)."""
    steps = 1 if every <= 0 else max(1, global_edges // every)
    total = sum(edges_per_minibatch)
    groups: list[list[int]] = [[] for _ in range(steps)]
    start = 0
    for index, edges in enumerate(edges_per_minibatch):
        groups[min(steps - 1, int(steps * (start + edges / 2) / total)) if total else 0].append(index)
        start += edges
    return groups
