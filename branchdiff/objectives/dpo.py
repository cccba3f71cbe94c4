"""Online Diffusion-DPO (Wallace et al., arXiv 2311.12908) on the policy's own groups, `train.loss: dpo`
with the keys `dpo.*`.

Pairs (`preference_pairs`): within each prompt's kept leaves ranked by reward, the best is chosen
over the worst, the second best over the second worst, and so on (a leaf left in the middle of an
odd group and a pair of equal rewards train nothing); with `dpo.pairs: siblings` the same ranking
runs among the leaves that share their last split (the node the deepest split branched from), so
a pair differs only after that split. Every leaf of a prompt is noised at the same steps with the
same ε (its address without the node path, tag "dpo"), so a pair's two samples share (σ, ε).

Loss of a pair at a step: −log σ(−(β/2)·[(ℓ_θ(w) − ℓ_ref(w)) − (ℓ_θ(l) − ℓ_ref(l))])
(`loss.diffusion_dpo_loss`), ℓ the denoising error mean((v − (ε − x0))²) and ℓ_ref the frozen base
model's, β = `dpo.beta` with the paper's T·ω(λ_t) folded in and the ½ of its public code. β is in the units of
`dpo.error`: `velocity` (the default; ℓ the velocity error, the flow-matching recipes' β = 100 for SD3.5) or
`epsilon` (ℓ_ε = (1 − σ)²·ℓ_v, `loss.epsilon_error`: the paper's units, β = 2000–5000 in its SD 1.5 and SDXL runs;
β_v = β_ε·(1 − σ)², so the paper's 2000 on velocity errors is 2000–200 000 in its own units). + `train.kl_beta`·
mean((v_θ − v_ref)²) over both samples. `dpo.skip_pure_noise` leaves out the step at σ = 1, where a pair's two
samples see one input (x_σ = ε).
A term is a (pair, step); statistics: the loss, `preference_accuracy` (pairs whose chosen sample
the policy improved on the reference more than the rejected one) and the KL.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch

from branchdiff.core.loss import diffusion_dpo_loss, epsilon_error, flow_matching_error
from branchdiff.core.rollout import NoiseAddress, Rollout, SamplerSettings
from branchdiff.core.tree import Tree
from branchdiff.models.base import ModelAdapter
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.objectives.base import MetricKind, Objective, Signal
from branchdiff.objectives.forward_process import draw_terms, idle_forward, leaf_signal, predict_all, training_steps
from branchdiff.objectives.nft import ancestors_at
from branchdiff.runtime.distributed import Collective
from branchdiff.schedulers.schedule import FlowSchedule
from branchdiff.settings.config import TrainConfig


def preference_pairs(tree: Tree, node_rewards: torch.Tensor, kept: torch.Tensor, siblings: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen (M,), rejected (M,)) leaf nodes: in each set of kept leaves (a prompt's, or with
    `siblings` those sharing the node of the deepest split), ranked by reward (ties in node order),
    the i-th best over the i-th worst for i < n/2, where their rewards differ."""
    leaves = tree.leaf_index[kept[tree.leaf_index]]  # (K,)
    if siblings:
        last_split = max(split.step for split in tree.spec.splits)
        sets = ancestors_at(tree, leaves, torch.full_like(leaves, last_split))
    else:
        sets = tree.prompt[leaves]
    chosen, rejected = [], []
    for key in torch.unique(sets).tolist():
        members = leaves[sets == key]
        ranked = members[torch.argsort(node_rewards[members].double(), descending=True, stable=True)]
        for i in range(len(ranked) // 2):
            best, worst = int(ranked[i]), int(ranked[len(ranked) - 1 - i])
            if node_rewards[best] > node_rewards[worst]:
                chosen.append(best)
                rejected.append(worst)
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


@dataclass
class OnlineDPO(Objective):
    config: TrainConfig
    collective: Collective
    finetune: LoraFinetune | FullFinetune  # the trained parameters and the frozen reference (the base model)
    train_policy: ModelAdapter  # the denoiser behind the (DDP-)wrapper: the training forward
    schedule: FlowSchedule  # the rollouts' schedule: the σ the samples are noised to (flow families only: `flow_only`)
    settings: SamplerSettings  # guidance of the training forward
    metric_kinds: ClassVar[dict[str, MetricKind]] = {
        "loss": "per_term", "preference_accuracy": "per_term", "kl": "per_term",  # means over the (pair, step) terms
        "pairs": "count",  # pairs formed
        "nfe_trained": "count",  # training forwards (two per term)
    }

    def signal(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> Signal:
        """The leaves' group-normalised advantages (for the report); the edges into the leaves that are in a pair train."""
        signal = leaf_signal(rollout, rewards, self.config.advantage.clip)
        chosen, rejected = preference_pairs(rollout.tree, signal.node_rewards, signal.trained, self.config.dpo.pairs == "siblings")
        trained = torch.zeros_like(signal.trained)
        trained[chosen], trained[rejected] = True, True
        return Signal(signal.node_rewards, signal.node_advantages, trained, signal.groups_dropped)

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> DPOPlan:
        return DPOPlan(self, rollout, embeds, signal, address)


class DPOPlan:
    """This process's (pair, step) terms in minibatches of about `train.minibatch` forwards."""

    def __init__(self, objective: OnlineDPO, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> None:
        self.objective, self.rollout, self.embeds = objective, rollout, embeds
        config, schedule, guidance = objective.config, objective.schedule, objective.settings.guidance
        chosen, rejected = preference_pairs(rollout.tree, signal.node_rewards, signal.trained, config.dpo.pairs == "siblings")
        learnable = training_steps(objective.train_policy, schedule, config.dpo.skip_pure_noise)  # (T,)
        leaves = torch.nonzero(signal.trained).squeeze(1)
        self.terms_drawn = terms = draw_terms(rollout, leaves, address, schedule, learnable, config.dpo.timesteps, "dpo", per_group=True)
        rows_of = {int(leaf): torch.nonzero(terms.nodes == leaf).squeeze(1) for leaf in leaves.tolist()}  # a leaf's term rows, step order shared in its group
        self.chosen_rows = torch.cat([rows_of[int(winner)] for winner in chosen]) if len(chosen) else torch.zeros(0, dtype=torch.long)  # (M·k,)
        self.rejected_rows = torch.cat([rows_of[int(loser)] for loser in rejected]) if len(rejected) else torch.zeros(0, dtype=torch.long)
        pair_terms = torch.arange(len(self.chosen_rows))
        self.minibatches = list(pair_terms.split(max(1, config.train.minibatch // 2))) if len(pair_terms) else []
        self.terms = [len(b) for b in self.minibatches]
        forward_batches = [torch.cat([self.chosen_rows[b], self.rejected_rows[b]]) for b in self.minibatches]
        with objective.finetune.base() as base:
            v_ref = predict_all(base, terms, forward_batches, embeds, guidance, rollout, schedule)
        self.reference_error = torch.zeros(len(terms.nodes))
        self.v_ref = None
        if v_ref is not None:
            order = torch.cat(forward_batches)
            self.reference_error = torch.zeros(len(terms.nodes), device=v_ref.device)
            self.reference_error[order] = flow_matching_error(v_ref, terms.x0[order], terms.noise[order])
            if config.train.kl_beta > 0:
                self.v_ref = torch.zeros_like(terms.x_t)
                self.v_ref[order] = v_ref.to(terms.x_t.dtype)
        self.forward_batches = forward_batches
        self.stats = {"loss": 0.0, "preference_accuracy": 0.0, "kl": 0.0, "pairs": len(chosen), "nfe_trained": 0}

    def loss(self, index: int) -> torch.Tensor:
        objective, batch = self.objective, self.minibatches[index]
        config, guidance, terms = objective.config, objective.settings.guidance, self.terms_drawn
        rows = self.forward_batches[index]  # (2e,) the chosen rows, then the rejected
        v_theta = terms.predict(objective.train_policy, rows, self.embeds, guidance)
        error = flow_matching_error(v_theta, terms.x0[rows], terms.noise[rows])
        reference = self.reference_error[rows]
        if config.dpo.error == "epsilon":  # β in the paper's units
            error, reference = epsilon_error(error, terms.sigma[rows]), epsilon_error(reference, terms.sigma[rows])
        e = len(batch)
        per_term = diffusion_dpo_loss(error[:e], reference[:e], error[e:], reference[e:], config.dpo.beta)
        kl = torch.zeros_like(per_term)
        if self.v_ref is not None:
            kl_rows = (v_theta.float() - self.v_ref[rows].float()).pow(2).flatten(1).mean(dim=1)  # (2e,)
            kl = (kl_rows[:e] + kl_rows[e:]) / 2
            per_term = per_term + config.train.kl_beta * kl
        improvement = (error[:e] - reference[:e]) - (error[e:] - reference[e:])
        self.stats["loss"] += per_term.detach().sum().item()
        self.stats["preference_accuracy"] += (improvement < 0).sum().item()
        self.stats["kl"] += kl.detach().sum().item()
        self.stats["nfe_trained"] += len(rows)
        return per_term

    def idle_loss(self) -> torch.Tensor:
        """Zero, through the trained forward of the first minibatch (a root when there is none)."""
        objective = self.objective
        return idle_forward(objective.train_policy, self.terms_drawn, self.forward_batches, self.embeds, objective.settings.guidance,
                            self.rollout, objective.schedule, nullcontext())
