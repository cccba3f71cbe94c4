"""Advantage Weighted Matching (Xue et al., arXiv 2509.25050): the pre-training flow-matching loss on
the policy's own samples, weighted by their advantages, `train.loss: awm` with the keys `awm.*`.

Signal: each leaf's group-normalised reward, clipped to ±`awm.advantage_clip`
(branchdiff/objectives/forward_process.py). Terms: every kept leaf x0 at `awm.timesteps` of the
sampler's steps with fresh noise ε (its address, tag "awm"), x_σ = (1 − σ)·x0 + σ·ε. A term's
matching loss is w(ℓ, σ) of its denoising error ℓ = mean((v_θ − (ε − x0))²) (`awm.weighting`,
`loss.awm_weighted_error`), and its policy loss the clipped surrogate on ρ = exp(w_old − w_θ), w_old
the rollout weights' matching loss at the same (σ, ε) (`loss.awm_surrogate`; `awm.clip_range`):
at the first step of an iteration ρ = 1 and the gradient is A·∇w_θ, advantage-weighted matching.

Stabilisers (the public implementation's): + `awm.average_kl`·mean((v_θ − v_avg)²) toward a slowly
moving average of the policy (θ_avg ← d·θ_avg + (1 − d)·θ after each iteration, d = min(`awm.average_decay`,
`awm.average_decay_rate`·n) with n the optimizer steps so far: the public recipes' warm-up, min(0.3, 0.001·n);
saved in checkpoints as `policy_average.safetensors`), and
+ `train.kl_beta`·mean((v_θ − v_ref)²) toward the base model. w_old and v_avg are computed before the
iteration's first update, so every optimizer step compares with the same old policy. `awm.skip_pure_noise` leaves
the step at σ = 1 (x_t = ε) out of the steps drawn, as one public recipe does.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from branchdiff.core.advantage import resolve_scale
from branchdiff.core.loss import awm_surrogate, awm_weighted_error, flow_matching_error
from branchdiff.core.rollout import NoiseAddress, Rollout, SamplerSettings
from branchdiff.models.base import ModelAdapter
from branchdiff.models.ema import WeightAverage
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.objectives.base import MetricKind, Objective, Signal
from branchdiff.objectives.forward_process import ForwardTerms, draw_terms, idle_forward, leaf_signal, predict_all, training_steps
from branchdiff.runtime.distributed import Collective
from branchdiff.schedulers.schedule import FlowSchedule
from branchdiff.settings.config import TrainConfig

POLICY_AVERAGE_FILE = "policy_average.safetensors"


def average_decay(decay: float, rate: float, optimizer_steps: int) -> float:
    """The decay d of the policy's average after `optimizer_steps` steps: min(decay, rate·n), the public AWM recipes' warm-up
    (rate 0: `decay` from the start)."""
    return decay if rate == 0 else min(decay, rate * optimizer_steps)


@dataclass
class AdvantageWeightedMatching(Objective):
    config: TrainConfig
    collective: Collective
    finetune: LoraFinetune | FullFinetune  # the trained parameters (averaged) and the base model (KL)
    train_policy: ModelAdapter  # the denoiser behind the (DDP-)wrapper: the training forward
    schedule: FlowSchedule  # the rollouts' schedule: the σ the samples are noised to (flow families only: `flow_only`)
    settings: SamplerSettings  # guidance of the training forward
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        "loss": "per_term", "matching": "per_term", "clip_fraction": "per_term",  # means over the (leaf, step) terms trained
        "kl": "per_term", "average_kl": "per_term",
        "nfe_trained": "count",  # training forwards
    }

    def __post_init__(self) -> None:
        self.policy_average = WeightAverage(self.finetune.params, decay=0.0)
        self.policy_average.update(0.0)  # θ_avg = θ before the first update

    def signal(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> Signal:
        advantage = self.config.advantage
        return leaf_signal(rollout, rewards, self.config.awm.advantage_clip, advantage.baseline, resolve_scale(advantage.scale, advantage.baseline))

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> AWMPlan:
        return AWMPlan(self, rollout, embeds, signal, address)

    def after_update(self, optimizer_steps: int) -> None:
        self.policy_average.update(average_decay(self.config.awm.average_decay, self.config.awm.average_decay_rate, optimizer_steps))

    def save_state(self, folder: Path, write: bool) -> None:
        self.policy_average.save(folder, POLICY_AVERAGE_FILE, write)

    def load_state(self, folder: Path) -> None:
        self.policy_average.load(folder, POLICY_AVERAGE_FILE)


class AWMPlan:
    """The (leaf, step) terms of this process's kept leaves, in minibatches of `train.minibatch` terms."""

    def __init__(self, objective: AdvantageWeightedMatching, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> None:
        self.objective, self.rollout, self.embeds = objective, rollout, embeds
        config, schedule, guidance = objective.config, objective.schedule, objective.settings.guidance
        learnable = training_steps(objective.train_policy, schedule, config.awm.skip_pure_noise)  # (T,)
        leaves = torch.nonzero(signal.trained).squeeze(1)
        self.terms_drawn: ForwardTerms = draw_terms(rollout, leaves, address, schedule, learnable, config.awm.timesteps, "awm")
        terms = self.terms_drawn
        self.advantages = signal.node_advantages[terms.nodes].to(terms.x0.device)  # (E,)
        self.minibatches = list(torch.arange(len(terms.nodes)).split(config.train.minibatch)) if len(terms.nodes) else []
        self.terms = [len(b) for b in self.minibatches]
        model = objective.finetune.adapter
        v_old = predict_all(model, terms, self.minibatches, embeds, guidance, rollout, schedule)  # the rollout's weights, before any update
        self.old_weighted = self._weighted(v_old, torch.arange(len(terms.nodes))) if v_old is not None else None
        self.v_average = None
        if config.awm.average_kl > 0:
            with objective.policy_average.swapped_in():
                self.v_average = predict_all(model, terms, self.minibatches, embeds, guidance, rollout, schedule)
        self.stats = {"loss": 0.0, "matching": 0.0, "clip_fraction": 0.0, "kl": 0.0, "average_kl": 0.0, "nfe_trained": 0}

    def _weighted(self, velocity: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(e,) w(ℓ, σ) of velocities (e, ...) at the terms `rows`."""
        terms, awm = self.terms_drawn, self.objective.config.awm
        error = flow_matching_error(velocity, terms.x0[rows], terms.noise[rows])
        return awm_weighted_error(error, terms.sigma[rows], awm.weighting, awm.power)

    def loss(self, index: int) -> torch.Tensor:
        objective, rows = self.objective, self.minibatches[index]
        config, guidance = objective.config, objective.settings.guidance
        assert self.old_weighted is not None  # predicted for every minibatch
        v_theta = self.terms_drawn.predict(objective.train_policy, rows, self.embeds, guidance)  # (e, ...)
        weighted = self._weighted(v_theta, rows)
        per_term, clipped = awm_surrogate(weighted, self.old_weighted[rows], self.advantages[rows], config.awm.clip_range)
        average_kl = torch.zeros_like(per_term)
        if self.v_average is not None:
            average_kl = (v_theta.float() - self.v_average[rows].float()).pow(2).flatten(1).mean(dim=1)
            per_term = per_term + config.awm.average_kl * average_kl
        kl = torch.zeros_like(per_term)
        if config.train.kl_beta > 0:
            with torch.no_grad(), objective.finetune.base() as base:
                v_ref = self.terms_drawn.predict(base, rows, self.embeds, guidance)
            kl = (v_theta.float() - v_ref.float()).pow(2).flatten(1).mean(dim=1)
            per_term = per_term + config.train.kl_beta * kl
        self.stats["loss"] += per_term.detach().sum().item()
        self.stats["matching"] += weighted.detach().sum().item()
        self.stats["clip_fraction"] += clipped.sum().item()
        self.stats["kl"] += kl.detach().sum().item()
        self.stats["average_kl"] += average_kl.detach().sum().item()
        self.stats["nfe_trained"] += len(rows)
        return per_term

    def idle_loss(self) -> torch.Tensor:
        """Zero, through the network calls of a minibatch's loss (the trained forward, and the base
        model's under a KL) on the first minibatch, or on a root when this process trains nothing."""
        objective = self.objective
        reference = objective.finetune.base() if objective.config.train.kl_beta > 0 else nullcontext()
        return idle_forward(objective.train_policy, self.terms_drawn, self.minibatches, self.embeds, objective.settings.guidance,
                            self.rollout, objective.schedule, reference)

