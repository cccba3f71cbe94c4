"""DiffusionNFT (Zheng et al., arXiv 2509.16117): online RL on the forward (noising) process,
`train.loss: nft` with the keys `nft.*`.

Rollouts need no log-probs, so any sampler and any tree serve (the leaves are the samples; the
paper's setting is a deterministic ODE sampler). Signal: each leaf's advantage is its reward minus
its group's (prompt's) mean over the group's std (unbiased, + 1e-4), clipped to ±A_max, and its
optimality r = clip(A/A_max, −1, 1)/2 + 1/2. With `nft.advantage: depthwise` (trees; this
project's option, no published system has it) the leaf rewards are fused up the tree and normalised
depth by depth as clipped GRPO does (`advantage.*`), and a term at step k takes the advantage of the
edge into the leaf's ancestor at depth k + 1: the choice made at the noise level it is trained at.
Plan: every kept leaf x0 is trained at `nft.timesteps`
of the sampler's steps (σ of the rollout's schedule; steps a frozen expert predicts left out), with fresh noise ε, on x_t = (1 − σ)·x0 + σ·ε;
a term is (leaf, step) with the loss of `loss.nft_loss` between the trained prediction v_θ and the
sampling policy's v_old, plus train.kl_beta · mean((v_θ − v_ref)²) to the base model.

The sampling policy θ_old is a soft copy of the trained weights (kept as an `ema.WeightAverage`):
rollouts and v_old use it; after each iteration's optimizer steps, θ_old ← d·θ_old + (1 − d)·θ with
d = min(nft.old_decay_rate·n, nft.old_decay_max), n the optimizer steps the run has taken so far (as
the paper's public script counts its global step; θ_old starts at θ). It is saved in checkpoints
(`sampling_policy.safetensors`). A leaf's steps and noise are drawn at its address
(branchdiff/core/noise.py: run seed, iteration, prompt key, node path), so one process and several
draw the same terms. The loss is the paper's, A_max/β factor included, so `train.kl_beta` (the KL on
the velocity) and `train.max_grad_norm` weigh against the policy term as the paper's settings do.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from branchdiff.core.advantage import depthwise_advantages, fuse_rewards, is_median, median_pivots, resolve_scale
from branchdiff.core.loss import nft_loss, nft_optimality
from branchdiff.core.rollout import NoiseAddress, Rollout, SamplerSettings
from branchdiff.core.tree import Tree
from branchdiff.models.base import ModelAdapter
from branchdiff.models.ema import WeightAverage
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.objectives.base import MetricKind, Objective, Signal, drop_nonfinite_groups
from branchdiff.objectives.forward_process import draw_terms, idle_forward, leaf_signal, predict_all, training_steps
from branchdiff.runtime.distributed import Collective
from branchdiff.schedulers.schedule import FlowSchedule
from branchdiff.settings.config import TrainConfig

SAMPLING_POLICY_FILE = "sampling_policy.safetensors"


@dataclass
class DiffusionNFT(Objective):
    config: TrainConfig
    collective: Collective
    finetune: LoraFinetune | FullFinetune  # the trained parameters (the sampling policy copies them) and the base model (KL)
    train_policy: ModelAdapter  # the denoiser behind the (DDP-)wrapper: the training forward
    schedule: FlowSchedule  # the rollouts' schedule: the σ the samples are noised to (flow families only: `flow_only`)
    settings: SamplerSettings  # guidance of the training forward
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        "loss": "per_term", "kl": "per_term", "optimality": "per_term",  # means over the (leaf, step) terms trained
        "nfe_trained": "count",  # training forwards
    }

    def __post_init__(self) -> None:
        self.sampling_policy = WeightAverage(self.finetune.params, decay=0.0)
        self.sampling_policy.update(0.0)  # θ_old = θ before the first rollout

    def signal(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> Signal:
        tree, config = rollout.tree, self.config
        if config.nft.advantage == "leaf":
            return leaf_signal(rollout, rewards, config.nft.advantage_clip, config.advantage.baseline,
                               resolve_scale(config.advantage.scale, config.advantage.baseline))
        # depthwise: every node's advantage, as clipped GRPO's signal has it
        leaf_rewards, dropped = drop_nonfinite_groups(tree, rewards)
        groups = tree.prompt[tree.leaf_index]  # (L,)
        trained = torch.zeros(tree.num_nodes, dtype=torch.bool)
        trained[tree.leaf_index] = ~dropped[groups]
        node_rewards = fuse_rewards(tree, leaf_rewards, rollout.log_prob, config.advantage.fusion, config.advantage.alpha)
        node_advantages = depthwise_advantages(tree, node_rewards, config.advantage.scope, self.collective, config.advantage.baseline,
                                               resolve_scale(config.advantage.scale, config.advantage.baseline, config.advantage.scope))
        if is_median(config.advantage.baseline):
            trained &= ~median_pivots(tree, node_rewards, config.advantage.baseline == "median-lower")
        return Signal(node_rewards, node_advantages.clamp(-config.advantage.clip, config.advantage.clip).float(), trained, int(dropped.sum()))

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> NFTPlan:
        return NFTPlan(self, rollout, embeds, signal, address)

    def sampling_weights(self) -> AbstractContextManager:
        return self.sampling_policy.swapped_in()

    def after_update(self, optimizer_steps: int) -> None:
        nft = self.config.nft
        self.sampling_policy.update(min(nft.old_decay_rate * optimizer_steps, nft.old_decay_max))

    def save_state(self, folder: Path, write: bool) -> None:
        self.sampling_policy.save(folder, SAMPLING_POLICY_FILE, write)

    def load_state(self, folder: Path) -> None:
        self.sampling_policy.load(folder, SAMPLING_POLICY_FILE)


def ancestors_at(tree: Tree, nodes: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """(E,) the ancestor of each node (E,) at the depth given for it (E,; a node is its own ancestor at its depth)."""
    out = nodes.clone()
    while True:
        deeper = tree.depth[out] > depths
        if not deeper.any():
            return out
        out[deeper] = tree.parent[out[deeper]]


class NFTPlan:
    """The (leaf, step) terms of this process's kept leaves, in minibatches of `train.minibatch` terms."""

    def __init__(self, objective: DiffusionNFT, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> None:
        self.objective, self.embeds, self.rollout = objective, embeds, rollout
        config, tree, schedule = objective.config, rollout.tree, objective.schedule
        leaves = torch.nonzero(signal.trained).squeeze(1)  # (K,) leaf nodes trained
        learnable = training_steps(objective.train_policy, schedule, config.nft.skip_pure_noise)  # (T,)
        self.terms_drawn = terms = draw_terms(rollout, leaves, address, schedule, learnable, config.nft.timesteps, "nft")
        self.nodes, self.steps = terms.nodes, terms.steps  # (E,) the leaf and the step of each term
        credited = self.nodes if config.nft.advantage == "leaf" else ancestors_at(tree, self.nodes, self.steps + 1)  # (E,) whose advantage each term takes
        self.optimality = nft_optimality(signal.node_advantages[credited].to(terms.x0.device), config.nft.advantage_clip)  # (E,)
        self.minibatches = list(torch.arange(len(self.nodes)).split(config.train.minibatch)) if len(self.nodes) else []
        self.terms = [len(b) for b in self.minibatches]
        with objective.sampling_weights():  # the sampling policy's prediction (the plain denoiser), fixed for the iteration
            self.v_old = predict_all(objective.finetune.adapter, terms, self.minibatches, embeds, objective.settings.guidance, rollout, schedule)
        self.stats = {"loss": 0.0, "kl": 0.0, "optimality": self.optimality.sum().item(), "nfe_trained": 0}

    def loss(self, index: int) -> torch.Tensor:
        objective, rows, terms = self.objective, self.minibatches[index], self.terms_drawn
        guidance = objective.settings.guidance
        assert self.v_old is not None  # predicted for every minibatch
        v_theta = terms.predict(objective.train_policy, rows, self.embeds, guidance)  # (e, ...)
        per_term = nft_loss(v_theta, self.v_old[rows], terms.x0[rows], terms.x_t[rows], terms.sigma[rows], self.optimality[rows],
                            objective.config.nft.beta, objective.config.nft.advantage_clip)
        kl = torch.zeros_like(per_term)
        if objective.config.train.kl_beta > 0:
            with torch.no_grad(), objective.finetune.base() as base:
                v_ref = terms.predict(base, rows, self.embeds, guidance)
            kl = (v_theta.float() - v_ref.float()).pow(2).flatten(1).mean(dim=1)
            per_term = per_term + objective.config.train.kl_beta * kl
        self.stats["loss"] += per_term.sum().item()
        self.stats["kl"] += kl.detach().sum().item()
        self.stats["nfe_trained"] += len(rows)
        return per_term

    def idle_loss(self) -> torch.Tensor:
        """Zero, through the network calls of a minibatch's loss (the trained forward, and the base
        model's under a KL) on the first minibatch, or on a root when this process trains nothing."""
        objective = self.objective
        reference = objective.finetune.base() if objective.config.train.kl_beta > 0 else nullcontext()
        return idle_forward(objective.train_policy, self.terms_drawn, self.minibatches, self.embeds, objective.settings.guidance,
                            self.rollout, objective.schedule, reference)
