"""How far a trained policy's sampler has moved from its initial model's: their KL, estimated on the policy's own chains.

Both samplers make the same Markov chain of Gaussian steps x_{k+1} ~ N(μ(x_k), σ_k² I): the SDE's std σ_k at step k
does not depend on the model, the mean μ does (through its velocity). By the chain rule of KL, the KL between the two
chains' path laws is the expected sum of the per-step KLs under the policy's own chains:

    KL(π_θ ‖ π_0) = E_{x ~ π_θ} Σ_k ‖μ_θ(x_k) − μ_0(x_k)‖² / (2 σ_k²)

in nats, summed over every dimension of the latent. It is estimated on K chains per prompt grown by the policy with
the SDE at every step (an ODE step, e.g. cps's last, has no density and is left out), averaged over the chains; each
chain's own sum is returned too. Gao, Schulman and Hilton ("Scaling Laws for Reward Model Overoptimization", 2023)
plot a reward against √KL of the policy from its initialisation; this is that KL for a denoising sampler (the KL of
the whole path, not of the final samples alone).

The initial model is held as a state dict of the denoiser (its weights at the start: LoRA's B = 0, or the full
weights); the policy's weights are swapped out for it while its velocities are computed, and back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from branchdiff.core.engine import NoiseAddress, SamplerSettings, predict, step_kind
from branchdiff.core.rollout import grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.models.base import ModelAdapter, encode_for, select_embeds
from branchdiff.schedulers.schedule import Schedule


def gaussian_step_kl(mean: torch.Tensor, reference_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std² I) ‖ N(reference_mean, std² I)) = Σ_d (mean − reference_mean)² / (2 std²), summed over every
    dimension, in float64. Shapes (E, ...), (E, ...), (E,) → (E,)."""
    difference = (mean.double() - reference_mean.double()).flatten(1)  # (E, D)
    return difference.pow(2).sum(dim=1) / (2 * std.double() ** 2)


@contextmanager
def weights_swapped(module: nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """`module` holding `state`'s weights inside the block, its own restored after (even on an error)."""
    own = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    module.load_state_dict(state)
    try:
        yield
    finally:
        module.load_state_dict(own)


def initial_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `module`'s weights now: the initial model `policy_kl` compares with."""
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


@torch.no_grad()
def policy_kl(adapter: ModelAdapter, initial: Mapping[str, torch.Tensor], prompts: list[str], schedule: Schedule, settings: SamplerSettings,
              chains_per_prompt: int, seed: int) -> torch.Tensor:
    """Each chain's Σ_k KL of the step (module doc), (P·K,) float64, prompt-major: `chains_per_prompt` SDE chains of each
    prompt grown by `adapter` (its sampler `settings`, on `schedule`) from the noise of run seed `seed`, against the
    denoiser weights `initial`. The estimate of KL(π_θ ‖ π_0) is their mean."""
    spec = TreeSpec(schedule.num_steps, roots=chains_per_prompt)  # every step with the SDE
    tree = build_tree(spec, len(prompts))
    embeds = encode_for(adapter, prompts, [{} for _ in prompts])
    rollout = grow(adapter, tree, embeds, schedule, settings, NoiseAddress(seed, -1, tuple(range(len(prompts)))))
    edges = torch.nonzero(rollout.std > 0).squeeze(1)  # (E,) nodes entered by a step with a density
    parents = tree.parent[edges]  # (E,)
    depths = tree.depth[parents]  # (E,) the step each edge takes
    latents, edge_embeds = rollout.latents[parents.to(rollout.latents.device)], select_embeds(embeds, tree.prompt[parents])
    velocity, _, _ = predict(adapter, latents, depths, edge_embeds, schedule, settings)
    with weights_swapped(adapter.denoiser, initial):
        initial_velocity, _, _ = predict(adapter, latents, depths, edge_embeds, schedule, settings)
    kl = torch.zeros(len(edges), dtype=torch.float64)
    for depth in depths.unique().tolist():
        rows = torch.nonzero(depths == depth).squeeze(1)  # (e,)
        kind, level = step_kind(spec, schedule, settings, depth), rollout.noise_level[edges[rows]]
        at = torch.full((len(rows),), depth, dtype=torch.long)
        x, on = latents[rows.to(latents.device)], rows.to(velocity.device)
        policy_step = schedule.step(kind, x, velocity[on], at, torch.zeros_like(x), level)
        initial_step = schedule.step(kind, x, initial_velocity[on], at, torch.zeros_like(x), level)
        kl[rows] = gaussian_step_kl(policy_step.mean, initial_step.mean, policy_step.std).cpu()
    chain = tree.prompt[edges] * chains_per_prompt + torch.tensor([tree.paths[e][0] for e in edges.tolist()])  # (E,) prompt-major
    return torch.zeros(len(prompts) * chains_per_prompt, dtype=torch.float64).index_add_(0, chain, kl)
