"""Supervised fine-tuning on demonstrations, `train.loss: sft` with the keys `sft.*`: the warm start run
before RL, and the pre-training loss itself.

Each iteration trains this process's rows of the demonstration set (`sft.data`: JSONL rows
{"prompt", "image"}, or `tiny:demonstrations`; branchdiff/data/demonstrations.py), drawn as prompts
are (`prompts.per_iteration` a process), each at `sft.timesteps` noise levels from
`sft.sigma_sampling` (branchdiff/objectives/dataset.py): x_σ = (1 − σ)·x0 + σ·ε with x0 the image's
latent, and the term's loss is the flow-matching error mean((v_θ(x_σ) − (ε − x0))²), plus
`train.kl_beta`·mean((v_θ − v_ref)²) toward the base model.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch

from branchdiff.core.loss import flow_matching_error
from branchdiff.core.rollout import NoiseAddress, SamplerSettings
from branchdiff.models.base import ModelAdapter
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.objectives.base import MetricKind
from branchdiff.objectives.dataset import DatasetObjective, dataset_terms, draw_levels, encode_rows
from branchdiff.runtime.distributed import Collective
from branchdiff.schedulers.schedule import Schedule
from branchdiff.settings.config import TrainConfig


@dataclass
class SupervisedFineTuning(DatasetObjective):
    config: TrainConfig
    collective: Collective
    finetune: LoraFinetune | FullFinetune  # the trained parameters and the base model (KL)
    train_policy: ModelAdapter  # the denoiser behind the (DDP-)wrapper: the training forward
    schedule: Schedule  # the rollouts' schedule (evaluation); training reads the family's fine schedule
    settings: SamplerSettings  # guidance of the training forward
    dataset: ClassVar[str] = "demonstrations"
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        "loss": "per_term", "matching": "per_term", "kl": "per_term",  # means over the (row, noise level) terms
        "nfe_trained": "count",  # training forwards
    }

    def plan_rows(self, rows: list[int], embeds: dict, address: NoiseAddress) -> SFTPlan:
        return SFTPlan(self, rows, embeds, address)


class SFTPlan:
    """This process's (row, noise level) terms in minibatches of `train.minibatch`."""

    def __init__(self, objective: SupervisedFineTuning, rows: list[int], embeds: dict, address: NoiseAddress) -> None:
        self.objective, self.embeds = objective, embeds
        sft = objective.config.sft
        latents = encode_rows(objective.finetune.adapter, objective.rows, rows)  # (R, 1, ...)
        steps, noise = draw_levels(address, latents.shape[2:], sft.timesteps, sft.sigma_sampling, sft.logit_mean, sft.logit_std, "sft",
                                   objective.fine_schedule)
        self.terms_drawn = dataset_terms(latents, steps, noise, objective.fine_schedule)[0]
        self.minibatches = list(torch.arange(len(self.terms_drawn.nodes)).split(objective.config.train.minibatch))
        self.terms = [len(b) for b in self.minibatches]
        self.stats = {"loss": 0.0, "matching": 0.0, "kl": 0.0, "nfe_trained": 0}

    def loss(self, index: int) -> torch.Tensor:
        objective, rows, terms = self.objective, self.minibatches[index], self.terms_drawn
        config, guidance = objective.config, objective.settings.guidance
        v_theta = terms.predict(objective.train_policy, rows, self.embeds, guidance)
        matching = flow_matching_error(v_theta, terms.x0[rows], terms.noise[rows])
        per_term, kl = matching, torch.zeros_like(matching)
        if config.train.kl_beta > 0:
            with torch.no_grad(), objective.finetune.base() as base:
                v_ref = terms.predict(base, rows, self.embeds, guidance)
            kl = (v_theta.float() - v_ref.float()).pow(2).flatten(1).mean(dim=1)
            per_term = per_term + config.train.kl_beta * kl
        self.stats["loss"] += per_term.detach().sum().item()
        self.stats["matching"] += matching.detach().sum().item()
        self.stats["kl"] += kl.detach().sum().item()
        self.stats["nfe_trained"] += len(rows)
        return per_term

    def idle_loss(self) -> torch.Tensor:
        """Zero through the trained forward (and the base model's under a KL) of the first minibatch."""
        objective, terms = self.objective, self.terms_drawn
        rows = self.minibatches[0]
        v_theta = terms.predict(objective.train_policy, rows, self.embeds, objective.settings.guidance)
        reference = objective.finetune.base() if objective.config.train.kl_beta > 0 else nullcontext()
        with torch.no_grad(), reference as base:
            if base is not None:
                terms.predict(base, rows, self.embeds, objective.settings.guidance)
        return v_theta.sum() * 0.0
