"""A ground truth for samplers: a flow model whose data distribution is a known Gaussian mixture.

Data x0 ~ p = Σ_k π_k·N(μ_k, s_k²·I) in D dimensions, interpolated as every flow family is,
x_σ = (1 − σ)·x0 + σ·ε (branchdiff/schedulers/flow.py). Given component k, x_σ and x0 are jointly
Gaussian: x_σ ~ N(m_k, V_k·I) with m_k = (1 − σ)·μ_k, V_k = (1 − σ)²·s_k² + σ², and

    E[x0 | x_σ, k] = μ_k + (1 − σ)·s_k²/V_k · (x_σ − m_k),    E[ε | x_σ, k] = σ/V_k · (x_σ − m_k),

so the exact velocity E[ε − x0 | x_σ] is their difference averaged over the posterior
responsibilities w_k(x_σ) ∝ π_k·N(x_σ; m_k, V_k·I). `GaussianMixtureAdapter` serves that field through
the model-adapter contract, so searches, trees and the sampler benchmark run it with the same engine
as every family; only the SDE's discretisation stands between its samples and p.

Rewards r(x) with known reward-tilted targets p*(x) ∝ p(x)·exp(λ·r(x)) (`REWARDS`): `mode` (the
posterior probability of one chosen component: a mode preference), `smooth` (a sine ridge across
the plane of the first two coordinates) and `sharp` (the indicator of a half-space). The target is
computed exactly: on a grid in 2-D (`grid_target_samples`), by importance weights exp(λ·r) on exact
draws of p in higher dimensions (`weighted_target_samples`). Distances: the unbiased squared MMD
(`mmd2`), and the total variation between a histogram and the grid's cell masses (`grid_tv`).
Test and benchmark code only; not a family users train (`branchdiff families` does not list it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from branchdiff.models.base import ModelAdapter, PromptEmbeds
from branchdiff.schedulers.schedule import FlowSchedule

Reward = Callable[[torch.Tensor], torch.Tensor]  # points (N, D) → rewards (N,)


@dataclass(frozen=True)
class GaussianMixture:
    weights: torch.Tensor  # (K,) π_k, summing to 1
    means: torch.Tensor  # (K, D) μ_k
    scales: torch.Tensor  # (K,) s_k, isotropic standard deviations

    @property
    def dims(self) -> int:
        return self.means.shape[1]

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """log p(x) for points (N, D), in float64: logsumexp_k [log π_k + log N(x; μ_k, s_k²·I)]."""
        return self._component_log_joint(x.double(), torch.zeros(len(x), dtype=torch.float64)).logsumexp(1)

    def _component_log_joint(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """log π_k + log N(x; (1−σ)·μ_k, V_k·I) for points (N, D) at σ (N,): (N, K)."""
        keep = (1 - sigma)[:, None]  # (N, 1)
        variance = keep**2 * self.scales.double() ** 2 + sigma[:, None] ** 2  # (N, K)
        squared = ((x[:, None, :] - keep[:, :, None] * self.means.double()) ** 2).sum(-1)  # (N, K)
        return self.weights.double().log() - 0.5 * self.dims * torch.log(2 * math.pi * variance) - squared / (2 * variance)

    def responsibilities(self, x: torch.Tensor, sigma: torch.Tensor | float = 0.0) -> torch.Tensor:
        """w_k(x_σ) = P(component k | x_σ) for points (N, D) at σ (scalar or (N,)): (N, K)."""
        sigma = torch.as_tensor(sigma, dtype=torch.float64).expand(len(x))
        return torch.softmax(self._component_log_joint(x.double(), sigma), 1)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The exact velocity E[ε − x0 | x_σ] (module doc) for points (N, D) at σ (N,), in x's dtype."""
        x64, sigma64 = x.double(), sigma.double().reshape(-1)
        weights = torch.softmax(self._component_log_joint(x64, sigma64), 1)  # (N, K)
        keep = (1 - sigma64)[:, None, None]  # (N, 1, 1)
        means = self.means.double()[None]  # (1, K, D)
        variance = (keep[..., 0] ** 2 * self.scales.double() ** 2 + sigma64[:, None] ** 2)[..., None]  # (N, K, 1)
        offset = x64[:, None, :] - keep * means  # (N, K, D)
        x0 = means + keep * self.scales.double()[None, :, None] ** 2 / variance * offset
        noise = sigma64[:, None, None] / variance * offset
        return (weights[..., None] * (noise - x0)).sum(1).to(x.dtype)

    def sample(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """`count` exact draws of p (N, D), in float64."""
        component = torch.multinomial(self.weights.double(), count, replacement=True, generator=generator)
        noise = torch.randn(count, self.dims, generator=generator, dtype=torch.float64)
        return self.means.double()[component] + self.scales.double()[component, None] * noise


def ring_mixture() -> GaussianMixture:
    """The 2-D testbed: six components on a circle of radius 2.5, unequal weights, s = 0.35."""
    angles = torch.arange(6, dtype=torch.float64) * (2 * math.pi / 6)
    means = 2.5 * torch.stack([angles.cos(), angles.sin()], 1)
    weights = torch.tensor([0.3, 0.25, 0.15, 0.12, 0.1, 0.08], dtype=torch.float64)
    return GaussianMixture(weights, means, torch.full((6,), 0.35, dtype=torch.float64))


def random_mixture(dims: int = 16, components: int = 8, seed: int = 0) -> GaussianMixture:
    """The high-dimensional testbed: `components` means drawn N(0, 1.5²·I), Dirichlet-like weights, s = 0.5."""
    generator = torch.Generator().manual_seed(seed)
    means = 1.5 * torch.randn(components, dims, generator=generator, dtype=torch.float64)
    weights = torch.rand(components, generator=generator, dtype=torch.float64) + 0.5
    return GaussianMixture(weights / weights.sum(), means, torch.full((components,), 0.5, dtype=torch.float64))


MIXTURES = {2: ring_mixture, 16: random_mixture}  # dimension → its testbed


def make_reward(name: str, mixture: GaussianMixture) -> Reward:
    """One of `REWARDS` for `mixture` (module doc); rewards lie in [0, 1] (`smooth`: [−1, 1])."""
    if name == "mode":
        preferred = int(torch.argmin(mixture.weights))  # the rarest component
        return lambda x: mixture.responsibilities(x)[:, preferred].float()
    if name == "smooth":
        return lambda x: torch.sin(x[:, 0].double() + 0.5 * x[:, 1].double()).float()
    if name == "sharp":
        return lambda x: (x[:, 1] > 1.0).float()
    raise ValueError(f"unknown GMM reward {name!r}; allowed: {', '.join(REWARDS)}")


REWARDS = ("mode", "smooth", "sharp")


def target_reward(targets: torch.Tensor, width: float) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    """A search reward per prompt: r(x) = exp(−‖x − x*_p‖² / (2·D·w²)) for prompt p's target x*_p, a row of `targets`
    (P, D); points (N, D) and their prompts' indices (N) → rewards (N,) in (0, 1]. A draw of p near its own target's
    component scores about exp(−1) at w equal to the components' scale; the nearest of N draws closes in slowly."""
    if width <= 0:
        raise ValueError(f"target_reward needs a width w > 0, got {width}")

    def reward(points: torch.Tensor, prompt_index: list[int]) -> torch.Tensor:
        squared = ((points.double() - targets.double()[prompt_index]) ** 2).sum(1)  # (N,)
        return torch.exp(-squared / (2 * targets.shape[1] * width**2)).float()

    return reward


def grid_points(extent: float, cells: int) -> tuple[torch.Tensor, float]:
    """Centres of a cells × cells grid over [−extent, extent]² (cells², 2), and the cell side."""
    side = 2 * extent / cells
    axis = -extent + side * (torch.arange(cells, dtype=torch.float64) + 0.5)
    return torch.cartesian_prod(axis, axis), side


def grid_target(mixture: GaussianMixture, reward: Reward, temperature: float, extent: float = 4.5,
                cells: int = 300) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The 2-D target on a grid: cell centres (G, 2), each cell's probability under
    p*(x) ∝ p(x)·exp(λ·r(x)) (G,) (the density at the centre times the cell area, normalised), the cell side."""
    centres, side = grid_points(extent, cells)
    log_mass = mixture.log_prob(centres) + temperature * reward(centres).double()
    return centres, torch.softmax(log_mass, 0), side


def grid_target_samples(mixture: GaussianMixture, reward: Reward, temperature: float, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` draws of the 2-D target (N, 2): a cell by its probability, then uniformly inside it."""
    centres, mass, side = grid_target(mixture, reward, temperature)
    cell = torch.multinomial(mass, count, replacement=True, generator=generator)
    return centres[cell] + side * (torch.rand(count, 2, generator=generator, dtype=torch.float64) - 0.5)


def weighted_target_samples(mixture: GaussianMixture, reward: Reward, temperature: float, count: int, generator: torch.Generator,
                            proposals: int = 400_000) -> tuple[torch.Tensor, float]:
    """`count` draws of the target (N, D) in any dimension: `proposals` exact draws of p resampled by
    their importance weights ∝ exp(λ·r(x)); and the weights' effective sample size (1/Σw²), which
    says how exact the resampling is."""
    draws = mixture.sample(proposals, generator)
    weights = torch.softmax(temperature * reward(draws).double(), 0)
    chosen = torch.multinomial(weights, count, replacement=True, generator=generator)
    return draws[chosen], float(1 / (weights**2).sum())


def target_samples(mixture: GaussianMixture, reward: Reward, temperature: float, count: int, seed: int) -> torch.Tensor:
    """Draws of the target: on the grid in 2-D, by exact importance weights otherwise."""
    generator = torch.Generator().manual_seed(seed)
    if mixture.dims == 2:
        return grid_target_samples(mixture, reward, temperature, count, generator)
    return weighted_target_samples(mixture, reward, temperature, count, generator)[0]


def _kernel(a: torch.Tensor, b: torch.Tensor, bandwidths: tuple[float, ...]) -> torch.Tensor:
    squared = torch.cdist(a.double(), b.double()) ** 2
    return sum(torch.exp(-squared / (2 * h**2)) for h in bandwidths)


def _within(a: torch.Tensor, bandwidths: tuple[float, ...]) -> float:
    """Mean of k(a_i, a_j) over pairs i ≠ j."""
    k = _kernel(a, a, bandwidths)
    return float((k.sum() - k.diagonal().sum()) / (len(a) * (len(a) - 1)))


def mmd2_to(reference: torch.Tensor, bandwidths: tuple[float, ...]) -> Callable[[torch.Tensor], float]:
    """`mmd2(x, reference, bandwidths)` as a function of x, the reference's own term computed once."""
    reference_term = _within(reference, bandwidths)
    return lambda x: _within(x, bandwidths) + reference_term - 2 * float(_kernel(x, reference, bandwidths).mean())


def mmd2(x: torch.Tensor, y: torch.Tensor, bandwidths: tuple[float, ...]) -> float:
    """Unbiased squared maximum mean discrepancy between samples x (N, D) and y (M, D) under the sum
    of Gaussian kernels exp(−|a − b|²/(2h²)) over `bandwidths`: mean over pairs i ≠ j of k(x_i, x_j),
    plus the same for y, minus twice the mean of k(x_i, y_j). Zero in expectation when x and y come
    from the same distribution (it can then be slightly negative)."""
    return mmd2_to(y, bandwidths)(x)


def grid_tv(samples: torch.Tensor, mixture: GaussianMixture, extent: float = 4.5, cells: int = 12, refine: int = 25) -> float:
    """Total variation ½·Σ|q_c − p_c| between the histogram of 2-D `samples` (N, 2) on a cells × cells
    grid over [−extent, extent]² (samples outside fall in the nearest edge cell) and p's cell masses,
    each integrated on a `refine`-times finer grid."""
    centres, _ = grid_points(extent, cells * refine)
    fine = torch.softmax(mixture.log_prob(centres), 0).reshape(cells * refine, cells * refine)  # (x, y)
    p = fine.reshape(cells, refine, cells, refine).sum((1, 3)).reshape(-1)  # (cells², )
    index = ((samples.double() + extent) / (2 * extent) * cells).floor().long().clamp(0, cells - 1)  # (N, 2)
    q = torch.bincount(index[:, 0] * cells + index[:, 1], minlength=cells * cells).double() / len(samples)
    return float(0.5 * (q - p).abs().sum())


class MixtureField(torch.nn.Module):
    """The exact velocity of a Gaussian mixture as a module without parameters (the adapter's denoiser)."""

    def __init__(self, mixture: GaussianMixture) -> None:
        super().__init__()
        self.mixture = mixture

    def forward(self, latents: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        return self.mixture.velocity(latents, sigmas)


class GaussianMixtureAdapter(ModelAdapter):
    """The mixture's flow through the model-adapter contract: latents are points (D,), the denoiser is
    conditioned on σ itself, prompts condition nothing (every prompt is an independent draw), and
    `decode` returns the points (N, D) for rewards of points (`make_reward`)."""

    family = "gmm"
    lora_target_sets: dict[str, list[str] | str] = {}
    pipeline_class_name = ""
    height = width = 1

    def __init__(self, mixture: GaussianMixture, device: str | torch.device = "cpu") -> None:
        self.mixture = mixture
        self.device = torch.device(device)
        self.denoiser = MixtureField(mixture)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.mixture.dims,)

    def schedule(self, num_steps: int, shift: float | None = None) -> FlowSchedule:
        return FlowSchedule.shifted(num_steps, 1.0 if shift is None else shift, time_scale=1.0)

    def encode_prompts(self, prompts: list[str], sources: list[list] | None = None, negatives: list[str | None] | None = None) -> PromptEmbeds:
        self.check_sources(prompts, sources)
        return {"prompt": torch.zeros(len(prompts), 1, device=self.device)}

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: PromptEmbeds, guidance: float = 1.0) -> torch.Tensor:
        return self.denoiser(latents, times)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.double()
