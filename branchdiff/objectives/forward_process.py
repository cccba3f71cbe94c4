"""What the objectives that train on the forward process share (DiffusionNFT, AWM, DGPO, online DPO):
each trained sample x0 (a leaf) is noised afresh, x_σ = (1 − σ)·x0 + σ·ε, at some of the sampler's
steps, and the loss compares predictions at x_σ. Rollouts need no log-probs, so any sampler and any
tree serves.

A term is (leaf, step). Its steps and noise are drawn at an address (branchdiff/core/noise.py: run
seed, iteration, the prompt's global key and the leaf's node path, under the objective's own tag),
so one process and several draw the same terms and a resumed run repeats them. With `per_group`
every leaf of a prompt takes the same steps and the same ε (the path left out of the address):
DGPO and Diffusion-DPO compare a group's samples at one (σ, ε).

Leaf advantages (`leaf_signal`): a leaf's reward minus its group's mean (or median,
`advantage.baseline`) over the group's unbiased std + 1e-4, clipped; under the median baseline the
pivot leaf (the one at the median of an odd group) trains nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from branchdiff.core.advantage import fuse_rewards, group_medians, group_moments, is_median, mad_advantages, unbiased_std
from branchdiff.core.noise import address_seed
from branchdiff.core.rollout import NoiseAddress, Rollout
from branchdiff.models.base import ModelAdapter, select_embeds
from branchdiff.objectives.base import Signal, drop_nonfinite_groups, zero_loss
from branchdiff.schedulers.schedule import FlowSchedule, Schedule


def leaf_signal(rollout: Rollout, rewards: torch.Tensor, clip: float, baseline: str = "mean", scale: str = "std") -> Signal:
    """Each leaf's group-normalised advantage (module doc), clipped to ±clip; the leaves of groups
    with a finite reward on every leaf train, pivots excepted (scale "mad": MC-GRPO's, `advantage.mad_advantages`).
    Node rewards: the leaves' means below each node."""
    tree = rollout.tree
    leaf_rewards, dropped = drop_nonfinite_groups(tree, rewards)
    groups = tree.prompt[tree.leaf_index]  # (L,)
    count, residual, squares = group_moments(leaf_rewards, groups, tree.num_prompts)
    trained = torch.zeros(tree.num_nodes, dtype=torch.bool)
    trained[tree.leaf_index] = ~dropped[groups]
    if is_median(baseline):
        medians, pivots = group_medians(leaf_rewards, groups, tree.num_prompts, baseline == "median-lower")
        residual = leaf_rewards.double() - medians[groups]
        trained[tree.leaf_index[pivots]] = False
    if scale == "mad":
        advantages = mad_advantages(leaf_rewards, groups, tree.num_prompts, baseline == "median-lower").clamp(-clip, clip).float()  # (L,)
    else:
        advantages = (residual / (unbiased_std(count, squares)[groups] + 1e-4)).clamp(-clip, clip).float()  # (L,)
    node_advantages = torch.zeros(tree.num_nodes)
    node_advantages[tree.leaf_index] = advantages
    node_rewards = fuse_rewards(tree, leaf_rewards, rollout.log_prob, "mean", 1.0)
    return Signal(node_rewards, node_advantages, trained, int(dropped.sum()))


@dataclass
class ForwardTerms:
    """Noised copies of trained samples, one row per term (leaf, step)."""
    nodes: torch.Tensor  # (E,) the leaf of each term
    steps: torch.Tensor  # (E,) the sampler step whose σ it is noised to
    x0: torch.Tensor  # (E, ...) the clean sample
    noise: torch.Tensor  # (E, ...) ε
    x_t: torch.Tensor  # (E, ...) (1 − σ)·x0 + σ·ε
    sigma: torch.Tensor  # (E,)
    times: torch.Tensor  # (E,) the denoiser's time input at σ
    prompt: torch.Tensor  # (E,) the prompt (tree) of each term

    def predict(self, model: ModelAdapter, rows: torch.Tensor, embeds: dict, guidance: float | None) -> torch.Tensor:
        """(e, ...) `model`'s velocities at the terms `rows`."""
        return model.predict(self.x_t[rows], self.times[rows], select_embeds(embeds, self.prompt[rows]), guidance)


PURE_NOISE = 1 - 1e-6  # a σ at or above this is the step at σ = 1, where x_t = ε


def training_steps(train_policy: ModelAdapter, schedule: FlowSchedule, skip_pure_noise: bool) -> torch.Tensor:
    """(T,) bool: the sampler steps a forward-process objective may train at: those the trained denoiser predicts
    (`trains_at`), without the step at σ = 1 (x_t = ε whatever the sample) when `skip_pure_noise`."""
    learnable = train_policy.trains_at(schedule.model_times).cpu()  # (T,)
    if skip_pure_noise:
        learnable = learnable & (schedule.sigmas[:-1].cpu() < PURE_NOISE)
    return learnable


def draw_terms(rollout: Rollout, leaves: torch.Tensor, address: NoiseAddress, schedule: FlowSchedule, learnable: torch.Tensor,
               timesteps: int, tag: str, per_group: bool = False) -> ForwardTerms:
    """The terms of `leaves` (K,): each at `timesteps` of the steps `learnable` (T,) allows, drawn
    without replacement with fresh noise at the leaf's address (its group's with `per_group`)."""
    tree = rollout.tree
    rows, steps, noises = [], [], []
    generator = torch.Generator()
    shape = rollout.latents.shape[1:]
    drawn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for leaf in leaves.tolist():
        prompt = int(tree.prompt[leaf])
        if per_group and prompt in drawn:
            chosen, noise = drawn[prompt]
        else:
            generator.manual_seed(address_seed(tag, address.run_seed, address.iteration, address.prompt_keys[prompt],
                                               () if per_group else tree.paths[leaf]))
            order = torch.randperm(schedule.num_steps, generator=generator)
            chosen = order[learnable[order]][:timesteps]
            noise = torch.randn((len(chosen), *shape), generator=generator)
            drawn[prompt] = chosen, noise
        rows += [leaf] * len(chosen)
        steps.append(chosen)
        noises.append(noise)
    device = rollout.latents.device
    nodes = torch.tensor(rows, dtype=torch.long)
    step_index = torch.cat(steps) if steps else torch.zeros(0, dtype=torch.long)
    x0 = rollout.latents[nodes]  # (E, ...)
    noise = torch.cat(noises).to(device, x0.dtype) if noises else torch.zeros_like(x0)
    sigma = schedule.sigmas[step_index.to(schedule.sigmas.device)].to(device)  # (E,)
    scale = sigma.reshape((-1,) + (1,) * (x0.dim() - 1))
    return ForwardTerms(nodes, step_index, x0, noise, (1 - scale) * x0 + scale * noise, sigma,
                        schedule.model_times[step_index.to(schedule.model_times.device)], tree.prompt[nodes])


def predict_all(model: ModelAdapter, terms: ForwardTerms, batches: list[torch.Tensor], embeds: dict, guidance: float | None,
                rollout: Rollout, schedule: Schedule) -> torch.Tensor | None:
    """`model`'s velocities (E, ...) at every term, a batch at a time, without gradient (None when there are no
    terms); on a sharded denoiser, zero forwards pad this process to the busiest one's count."""
    with torch.no_grad():
        out = torch.cat([terms.predict(model, rows, embeds, guidance) for rows in batches]) if batches else None
        lockstep = model.lockstep
        for _ in range(lockstep(len(batches)) - len(batches) if lockstep else 0):
            zero_loss(model, rollout, embeds, schedule, guidance)
    return out


def idle_forward(train_policy: ModelAdapter, terms: ForwardTerms, minibatches: list[torch.Tensor], embeds: dict, guidance: float | None,
                 rollout: Rollout, schedule: Schedule, reference: AbstractContextManager) -> torch.Tensor:
    """A zero loss through the trained forward of the first minibatch (a root when there is none) and, when
    `reference` yields a model, its forward on the same rows: the calls of a forward-process objective's loss."""
    if not minibatches:
        with reference as base:
            return zero_loss(train_policy, rollout, embeds, schedule, guidance, base)
    rows = minibatches[0]
    v_theta = terms.predict(train_policy, rows, embeds, guidance)
    with torch.no_grad(), reference as base:
        if base is not None:
            terms.predict(base, rows, embeds, guidance)
    return v_theta.sum() * 0.0
