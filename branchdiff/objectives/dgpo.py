"""DGPO, Direct Group Preference Optimization (Luo et al., arXiv 2510.08425), `train.loss: dgpo` with the
keys `dgpo.*`: DPO over a prompt's whole group of samples instead of pairs, on the forward process.

Signal: each leaf's group-normalised reward, clipped to ±`dgpo.advantage_clip`
(branchdiff/objectives/forward_process.py). Terms: every kept leaf at `dgpo.timesteps` of the
sampler's steps, with the same steps and the same noise ε for every leaf of a group (its address
without the node path, tag "dgpo"), x_σ = (1 − σ)·x0 + σ·ε.

Loss of a term i of group g at step k: σ(−z_{g,k})·A_i·ℓ_θ,i (`loss.dgpo_group_weights`), with
ℓ the denoising error mean((v − (ε − x0))²), −z_{g,k} = (β/G)·Σ_{j∈g} A_j·(ℓ_θ,j − ℓ_ref,j) over the
group's terms at step k, ℓ_ref the frozen base model's error (the paper's frozen reference) and
β = `dgpo.dpo_beta`: the gradient of the group preference −log σ(z) up to the constant β/G. The
statistic needs every sample of a group at once, so a minibatch holds whole groups (one or more,
about `train.minibatch` terms): a group is never split between optimizer steps, and, since each
process grows whole prompts, never between processes. ℓ_θ is held (no gradient) where the ratio
exp(ℓ_old − ℓ_θ) to the rollout weights' error has left [1 − ε, 1 + ε] on the side the advantage
pushes (ε = `dgpo.clip_range`, the public recipe's stabiliser; 0: off); + `train.kl_beta`·
mean((v_θ − v_ref)²) toward the frozen base.

`dgpo.reference: ema` is the public code's dynamic reference: ℓ_ref and the clip's ℓ_old are both the error of a
fast-moving average of the policy, θ_ref ← d·θ_ref + (1 − d)·θ after every optimizer step with d = min(
`dgpo.ema_decay_rate`·n, `dgpo.ema_decay_max`) (n the optimizer steps before this one, so the first step copies θ, as
the public code's min(0.3, 0.001·global_step) does: min(0.001·n, 0.3) by default), computed
with the average's weights at each minibatch (saved in checkpoints as `dgpo_reference.safetensors`). `base` (the
default) keeps the paper's frozen reference and clips against the rollout's weights. `dgpo.skip_pure_noise` leaves
out the step at σ = 1, where every sample of a group sees one input (x_σ = ε).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from branchdiff.core.advantage import resolve_scale
from branchdiff.core.loss import dgpo_group_weights, flow_matching_error
from branchdiff.core.rollout import NoiseAddress, Rollout, SamplerSettings
from branchdiff.models.base import ModelAdapter
from branchdiff.models.ema import WeightAverage
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.objectives.base import MetricKind, Objective, Signal
from branchdiff.objectives.forward_process import draw_terms, idle_forward, leaf_signal, predict_all, training_steps
from branchdiff.runtime.distributed import Collective
from branchdiff.schedulers.schedule import FlowSchedule
from branchdiff.settings.config import TrainConfig

REFERENCE_FILE = "dgpo_reference.safetensors"


@dataclass
class DGPO(Objective):
    config: TrainConfig
    collective: Collective
    finetune: LoraFinetune | FullFinetune  # the trained parameters and the frozen reference (the base model)
    train_policy: ModelAdapter  # the denoiser behind the (DDP-)wrapper: the training forward
    schedule: FlowSchedule  # the rollouts' schedule: the σ the samples are noised to (flow families only: `flow_only`)
    settings: SamplerSettings  # guidance of the training forward
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        "loss": "per_term", "group_weight": "per_term", "error_gap": "per_term", "clip_fraction": "per_term",  # means over the terms
        "kl": "per_term",
        "nfe_trained": "count",  # training forwards
    }

    def __post_init__(self) -> None:
        self.reference_average = None
        if self.config.dgpo.reference == "ema":
            self.reference_average = WeightAverage(self.finetune.params, decay=0.0)
            self.reference_average.update(0.0)  # θ_ref = θ before the first update

    def after_step(self) -> None:
        """After each optimizer step (ema reference): the average moves toward the policy at d = min(rate·n, max)."""
        if self.reference_average is not None:
            keys = self.config.dgpo
            # n counts the optimizer steps before this one (the average's first update, at construction, copied θ): the public
            # code's decay at its first step is min(rate·0, max) = 0
            self.reference_average.update(min(keys.ema_decay_rate * (self.reference_average.steps - 1), keys.ema_decay_max))

    @contextmanager
    def reference_weights(self) -> Iterator[ModelAdapter | None]:
        """The model with the reference average's weights (ema reference), or None (the base reference)."""
        if self.reference_average is None:
            yield None
            return
        with self.reference_average.swapped_in():
            yield self.finetune.adapter

    def save_state(self, folder: Path, write: bool) -> None:
        if self.reference_average is not None:
            self.reference_average.save(folder, REFERENCE_FILE, write)

    def load_state(self, folder: Path) -> None:
        if self.reference_average is not None:
            self.reference_average.load(folder, REFERENCE_FILE)

    def signal(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> Signal:
        advantage = self.config.advantage
        return leaf_signal(rollout, rewards, self.config.dgpo.advantage_clip, advantage.baseline, resolve_scale(advantage.scale, advantage.baseline))

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> DGPOPlan:
        return DGPOPlan(self, rollout, embeds, signal, address)


def whole_group_batches(prompt: torch.Tensor, minibatch: int) -> list[torch.Tensor]:
    """Rows (E,) of terms grouped into minibatches of whole groups: consecutive prompts are added to a
    minibatch until it holds at least `minibatch` terms (terms of one prompt are never split)."""
    batches, current = [], []
    for p in torch.unique(prompt).tolist():
        current.append(torch.nonzero(prompt == p).squeeze(1))
        if sum(len(r) for r in current) >= minibatch:
            batches.append(torch.cat(current))
            current = []
    if current:
        batches.append(torch.cat(current))
    return batches


class DGPOPlan:
    """The (leaf, step) terms of this process's kept leaves, in minibatches of whole groups."""

    def __init__(self, objective: DGPO, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> None:
        self.objective, self.rollout, self.embeds = objective, rollout, embeds
        config, schedule, guidance = objective.config, objective.schedule, objective.settings.guidance
        learnable = training_steps(objective.train_policy, schedule, config.dgpo.skip_pure_noise)  # (T,)
        leaves = torch.nonzero(signal.trained).squeeze(1)
        self.terms_drawn = terms = draw_terms(rollout, leaves, address, schedule, learnable, config.dgpo.timesteps, "dgpo", per_group=True)
        self.advantages = signal.node_advantages[terms.nodes].to(terms.x0.device)  # (E,)
        self.minibatches = whole_group_batches(terms.prompt, config.train.minibatch) if len(terms.nodes) else []
        self.terms = [len(b) for b in self.minibatches]
        self.dynamic = objective.reference_average is not None  # ℓ_ref and ℓ_old from the moving average, minibatch by minibatch
        v_ref = None
        if not self.dynamic or config.train.kl_beta > 0:
            with objective.finetune.base() as base:
                v_ref = predict_all(base, terms, self.minibatches, embeds, guidance, rollout, schedule)
        self.v_ref = v_ref if config.train.kl_beta > 0 else None
        self.reference_error = flow_matching_error(v_ref, terms.x0, terms.noise) if v_ref is not None and not self.dynamic else None
        self.old_error = None
        if config.dgpo.clip_range > 0 and len(terms.nodes) and not self.dynamic:
            v_old = predict_all(objective.finetune.adapter, terms, self.minibatches, embeds, guidance, rollout, schedule)
            assert v_old is not None  # there are terms, so minibatches
            self.old_error = flow_matching_error(v_old, terms.x0, terms.noise)
        self.stats = {"loss": 0.0, "group_weight": 0.0, "error_gap": 0.0, "clip_fraction": 0.0, "kl": 0.0, "nfe_trained": 0}

    def loss(self, index: int) -> torch.Tensor:
        objective, rows = self.objective, self.minibatches[index]
        config, guidance, terms = objective.config, objective.settings.guidance, self.terms_drawn
        if self.dynamic:  # the average as it is now (it moved with every optimizer step), before the trained forward
            with torch.no_grad(), objective.reference_weights() as average:
                assert average is not None  # the ema reference
                reference = flow_matching_error(terms.predict(average, rows, self.embeds, guidance), terms.x0[rows], terms.noise[rows])
            old = reference if config.dgpo.clip_range > 0 else None
        else:
            assert self.reference_error is not None  # predicted for every minibatch
            reference, old = self.reference_error[rows], None if self.old_error is None else self.old_error[rows]
        v_theta = terms.predict(objective.train_policy, rows, self.embeds, guidance)  # (e, ...)
        error = flow_matching_error(v_theta, terms.x0[rows], terms.noise[rows])  # (e,)
        advantages = self.advantages[rows]
        _, groups = torch.unique(terms.prompt[rows] * terms.steps.max().add(1) + terms.steps[rows], return_inverse=True)  # (e,) (prompt, step)
        group_size = torch.bincount(groups).to(error.device)
        weight = dgpo_group_weights(error, reference, advantages, groups.to(error.device), config.dgpo.dpo_beta, group_size)
        held = torch.zeros_like(error, dtype=torch.bool)
        if old is not None:
            ratio = torch.exp(old - error.detach())
            eps = config.dgpo.clip_range
            held = torch.where(advantages > 0, ratio > 1 + eps, ratio < 1 - eps)
            error = torch.where(held, error.detach(), error)
        per_term = weight * advantages * error
        kl = torch.zeros_like(per_term)
        if self.v_ref is not None:
            kl = (v_theta.float() - self.v_ref[rows].float()).pow(2).flatten(1).mean(dim=1)
            per_term = per_term + config.train.kl_beta * kl
        self.stats["loss"] += per_term.detach().sum().item()
        self.stats["group_weight"] += weight.sum().item()
        self.stats["error_gap"] += (error.detach() - reference).sum().item()
        self.stats["clip_fraction"] += held.sum().item()
        self.stats["kl"] += kl.detach().sum().item()
        self.stats["nfe_trained"] += len(rows)
        return per_term

    def idle_loss(self) -> torch.Tensor:
        """Zero, through the trained forward of the first minibatch (a root when there is none): the
        reference's and the old weights' forwards are made when the plan is built, not per minibatch."""
        objective = self.objective
        return idle_forward(objective.train_policy, self.terms_drawn, self.minibatches, self.embeds, objective.settings.guidance,
                            self.rollout, objective.schedule, objective.reference_weights() if self.dynamic else nullcontext())

    def after_step(self) -> None:
        self.objective.after_step()
