"""Offline Diffusion-DPO (Wallace et al., arXiv 2311.12908) on a preference dataset, `train.loss:
dpo-offline` with the keys `dpo_offline.*`.

Each iteration trains this process's rows of the preference set (`dpo_offline.data`: JSONL rows
{"prompt", "chosen", "rejected"}, or `tiny:preferences`; branchdiff/data/demonstrations.py), drawn
as prompts are, each at `dpo_offline.timesteps` noise levels (uniform in t by default, as the paper
draws its timesteps; branchdiff/objectives/dataset.py), both images of a pair at the same (σ, ε).
A term is a (pair, noise level) with online DPO's loss (branchdiff/objectives/dpo.py,
`loss.diffusion_dpo_loss`): −log σ(−(β/2)·[(ℓ_θ(w) − ℓ_ref(w)) − (ℓ_θ(l) − ℓ_ref(l))]), ℓ_ref the
frozen base model's denoising error, β = `dpo_offline.beta` in the units of `dpo_offline.error` (velocity errors by
default, or the paper's ε errors, as for online DPO: branchdiff/objectives/dpo.py); + `train.kl_beta`·mean((v_θ − v_ref)²).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from branchdiff.core.loss import diffusion_dpo_loss, epsilon_error, flow_matching_error
from branchdiff.core.rollout import NoiseAddress, SamplerSettings
from branchdiff.models.base import ModelAdapter
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.objectives.base import MetricKind
from branchdiff.objectives.dataset import DatasetObjective, dataset_terms, draw_levels, encode_rows
from branchdiff.objectives.forward_process import ForwardTerms
from branchdiff.runtime.distributed import Collective
from branchdiff.schedulers.schedule import Schedule
from branchdiff.settings.config import TrainConfig


@dataclass
class OfflineDPO(DatasetObjective):
    config: TrainConfig
    collective: Collective
    finetune: LoraFinetune | FullFinetune  # the trained parameters and the frozen reference (the base model)
    train_policy: ModelAdapter  # the denoiser behind the (DDP-)wrapper: the training forward
    schedule: Schedule  # the rollouts' schedule (evaluation); training reads the family's fine schedule
    settings: SamplerSettings  # guidance of the training forward
    dataset: ClassVar[str] = "preferences"
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        "loss": "per_term", "preference_accuracy": "per_term", "kl": "per_term",  # means over the (pair, noise level) terms
        "nfe_trained": "count",  # training forwards (two per term)
    }

    def plan_rows(self, rows: list[int], embeds: dict, address: NoiseAddress) -> OfflineDPOPlan:
        return OfflineDPOPlan(self, rows, embeds, address)


class OfflineDPOPlan:
    """This process's (pair, noise level) terms, about `train.minibatch` forwards a minibatch."""

    def __init__(self, objective: OfflineDPO, rows: list[int], embeds: dict, address: NoiseAddress) -> None:
        self.objective, self.embeds = objective, embeds
        keys = objective.config.dpo_offline
        latents = encode_rows(objective.finetune.adapter, objective.rows, rows)  # (R, 2, ...)
        steps, noise = draw_levels(address, latents.shape[2:], keys.timesteps, keys.sigma_sampling, keys.logit_mean, keys.logit_std,
                                   "dpo-offline", objective.fine_schedule)
        chosen, rejected = dataset_terms(latents, steps, noise, objective.fine_schedule)
        self.pair_terms: tuple[ForwardTerms, ForwardTerms] = (chosen, rejected)
        self.minibatches = list(torch.arange(len(chosen.nodes)).split(max(1, objective.config.train.minibatch // 2)))
        self.terms = [len(b) for b in self.minibatches]
        guidance = objective.settings.guidance
        with torch.no_grad(), objective.finetune.base() as base:
            self.v_ref = [torch.cat([terms.predict(base, b, embeds, guidance) for b in self.minibatches]) for terms in self.pair_terms]
        self.reference_error = [flow_matching_error(v, terms.x0, terms.noise) for v, terms in zip(self.v_ref, self.pair_terms)]
        self.stats = {"loss": 0.0, "preference_accuracy": 0.0, "kl": 0.0, "nfe_trained": 0}

    def _predict(self, rows: torch.Tensor) -> torch.Tensor:
        """(2e, ...) the trained velocities at the chosen images' terms `rows`, then the rejected ones', in one forward."""
        chosen, rejected = self.pair_terms
        x_t = torch.cat([chosen.x_t[rows], rejected.x_t[rows]])
        times = torch.cat([chosen.times[rows], chosen.times[rows]])
        embeds = {k: v[torch.cat([chosen.prompt[rows], chosen.prompt[rows]]).to(v.device)] for k, v in self.embeds.items()}
        return self.objective.train_policy.predict(x_t, times, embeds, self.objective.settings.guidance)

    def loss(self, index: int) -> torch.Tensor:
        objective, rows = self.objective, self.minibatches[index]
        config = objective.config
        chosen, rejected = self.pair_terms
        v_theta = self._predict(rows)
        e = len(rows)
        error_w = flow_matching_error(v_theta[:e], chosen.x0[rows], chosen.noise[rows])
        error_l = flow_matching_error(v_theta[e:], rejected.x0[rows], rejected.noise[rows])
        ref_w, ref_l = self.reference_error[0][rows], self.reference_error[1][rows]
        if config.dpo_offline.error == "epsilon":  # β in the paper's units (a pair shares its σ)
            sigma = chosen.sigma[rows]
            error_w, error_l, ref_w, ref_l = (epsilon_error(error, sigma) for error in (error_w, error_l, ref_w, ref_l))
        per_term = diffusion_dpo_loss(error_w, ref_w, error_l, ref_l, config.dpo_offline.beta)
        kl = torch.zeros_like(per_term)
        if config.train.kl_beta > 0:
            kl_rows = (v_theta.float() - torch.cat([self.v_ref[0][rows], self.v_ref[1][rows]]).float()).pow(2).flatten(1).mean(dim=1)
            kl = (kl_rows[:e] + kl_rows[e:]) / 2
            per_term = per_term + config.train.kl_beta * kl
        self.stats["loss"] += per_term.detach().sum().item()
        self.stats["preference_accuracy"] += (((error_w - ref_w) - (error_l - ref_l)) < 0).sum().item()
        self.stats["kl"] += kl.detach().sum().item()
        self.stats["nfe_trained"] += 2 * e
        return per_term

    def idle_loss(self) -> torch.Tensor:
        """Zero through the trained forward of the first minibatch."""
        return self._predict(self.minibatches[0]).sum() * 0.0
