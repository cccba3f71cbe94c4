"""Sequential Monte Carlo towards the reward-tilted target p_θ(x)·exp(λ·r(x)): the population
baseline DTS is compared with as a sampler (`branchdiff bench search --sampler`).

A population of N particles per prompt walks the T steps together. At every depth d each particle
x_d gets its model output (one prediction, which its step needs anyway), and with it a value
estimate: the reward of its predicted clean sample, G_d = r(x̂0(x_d)) (`Schedule.predicted_x0`;
G_T = r(x_T)). A particle's log-weight grows by λ·(G_d − G_{d−1}) (G_{−1} = 0), so the weights of a
whole path telescope to λ·r(x_T): the intermediate potentials only steer, the target stays exact.
Before each step the population is resampled multinomially by its weights (the weights then reset),
and each chosen particle takes one SDE step (a particle chosen twice gets two children with
independent noise); after the last step one particle is drawn by its weights. This is the
Feynman-Kac steering scheme with the difference potential (Singhal et al., arXiv 2501.06848) and
the twisted-SMC family (Wu et al., arXiv 2306.17775) with the x̂0 reward as its twist.

Particles are nodes of a `SearchForest`, so the noise of every step is addressed like a search's and
the rows spent are counted the same way: N·T predictions per prompt (2 rows each under CFG).
"""

from __future__ import annotations

import torch

from branchdiff.search.forest import SearchForest
from branchdiff.search.run import Score


@torch.no_grad()
def run_smc(forest: SearchForest, particles: int, score: Score, temperature: float, seed: int = 0) -> list[int]:
    """Run SMC (module doc) with `particles` per prompt on every prompt of `forest`; returns the leaf
    drawn for each prompt (node indices, one per prompt)."""
    if particles < 1 or temperature <= 0:
        raise ValueError(f"SMC needs particles ≥ 1 and a temperature λ > 0; got {particles} and {temperature}")
    generator = torch.Generator().manual_seed(seed)
    prompts = list(range(forest.num_prompts))
    population = forest.add_children([p for p in prompts for _ in range(particles)])  # (P·N,) initial noises, prompt-major
    potential = torch.zeros(len(population), dtype=torch.float64)  # G_{d−1} per particle
    log_weight = torch.zeros(len(population), dtype=torch.float64)
    for depth in range(forest.num_steps + 1):
        if depth < forest.num_steps:
            clean = forest.predicted_x0(population)  # (P·N, ...)
        else:
            clean = forest.leaf_latents(population)
        forest.evaluate(population)
        rewards, _ = score(forest.adapter.decode(clean), [forest.prompt[n] for n in population])
        current = torch.where(torch.isfinite(rewards.double()), rewards.double(), -torch.inf)  # a non-finite value estimate is the worst
        log_weight += torch.nan_to_num(temperature * (current - potential), nan=-torch.inf)  # −inf − (−inf): stays the worst
        potential = current
        if depth == forest.num_steps:
            break
        chosen = resample(log_weight.view(len(prompts), particles), particles, generator)  # (P, N) indices into each prompt's particles
        rows = (chosen + torch.arange(len(prompts))[:, None] * particles).reshape(-1)  # (P·N,)
        population = forest.add_children([population[int(r)] for r in rows])
        potential, log_weight = potential[rows], torch.zeros(len(population), dtype=torch.float64)
    final = resample(log_weight.view(len(prompts), particles), 1, generator)[:, 0]  # (P,)
    return [population[p * particles + int(final[p])] for p in prompts]


def resample(log_weight: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` multinomial draws per row of log-weights (P, N), with replacement: (P, count) indices.
    A row whose weights are all −inf (every value estimate non-finite) draws uniformly."""
    finite = torch.isfinite(log_weight).any(1, keepdim=True)  # (P, 1)
    safe = torch.where(finite, log_weight, torch.zeros_like(log_weight))
    return torch.multinomial(torch.softmax(safe, 1), count, replacement=True, generator=generator)
