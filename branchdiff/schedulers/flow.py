"""Rectified-flow sampling steps with Gaussian transition densities (DanceGRPO, arXiv 2505.07818; Flow-GRPO, arXiv 2505.05470).

Convention: `x_σ = (1 - σ)·x0 + σ·ε`, the model predicts the velocity `v ≈ ε - x0`, and sampling
walks σ from 1 down to 0. Every step maps `(x, v, σ, σ', noise)` to a `StepOutput(sample, mean, std)`
with `sample = mean + std·noise`; an ODE step has std 0. With Δ = σ' - σ < 0 and x̂0 = x - σ·v:

| kind    | mean μ                                                          | std              |
|---------|-----------------------------------------------------------------|------------------|
| `ode`   | x + Δ·v                                                          | 0                |
| `dance` | x + Δ·v - ½η²·ŝ·Δ,  ŝ = -(x - (1-σ)·x̂0)/σ²                      | η·√(σ - σ')      |
| `flow`  | x·(1 + s²Δ/(2σ)) + v·(1 + s²(1-σ)/(2σ))·Δ,  s = a·√(σ/(1-σ))    | s·√(-Δ)          |
| `cps`   | x̂0·(1 - σ') + x̂1·√(σ'² - std²),  x̂1 = x + (1-σ)·v               | σ'·sin(aπ/2)     |

In `flow`, σ = 1 makes s infinite; as in Flow-GRPO the denominator (only; the numerator keeps
σ = 1) then uses the next sigma of the schedule (`sigma_for_noise_level`), which callers pass
explicitly.
All functions are pure: no model, no state, no randomness except the `noise` they are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

StepKind = Literal["ode", "dance", "flow", "cps"]
STEP_KINDS: tuple[str, ...] = ("ode", "dance", "flow", "cps")


@dataclass
class StepOutput:
    sample: torch.Tensor  # (B, ...) x' = mean + std·noise
    mean: torch.Tensor  # (B, ...)
    std: torch.Tensor  # (B,) per-sample standard deviation (0 for an ODE step)


def sigma_schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """σ_i = shift(t_i) for t = linspace(1, 0, T+1), shift(t) = s·t / (1 + (s-1)·t). Shape (T+1,)."""
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def _per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar or (B,) tensor to (B, 1, 1, ...) for elementwise use with `like`."""
    value = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if value.dim() == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.dim() - 1)))


def step(
    kind: str,
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise: torch.Tensor | None,
    noise_level: torch.Tensor | float,
    sigma_for_noise_level: torch.Tensor | float | None = None,
) -> StepOutput:
    """One transition x_σ → x_σ' of kind `ode`, `dance` (η = noise_level), `flow` (a = noise_level)
    or `cps` (a = noise_level). `sigma`, `sigma_next` and `noise_level` are scalars or (B,)
    tensors (a tree's split edges carry their own level). `noise` (same
    shape as x) may be None only for `ode`. Computed in float32 whatever the input dtype.
    `sigma_for_noise_level` replaces the denominator's σ in `flow`'s s = a·√(σ/(1-σ)) where σ = 1
    (pass σ_1): s = a·√(1/(1-σ_1)) at the first step, so its std s·√(σ-σ_1) is exactly a."""
    x32, v32 = x.float(), velocity.float()
    s = _per_sample(sigma, x32)
    s_next = _per_sample(sigma_next, x32)
    delta = s_next - s  # (B, 1, ...) negative
    level = _per_sample(noise_level, x32)  # (B, 1, ...)
    if kind == "ode":
        mean, std = x32 + delta * v32, torch.zeros_like(s)
    elif kind == "dance":
        x0_hat = x32 - s * v32
        score = -(x32 - (1 - s) * x0_hat) / s**2
        mean = x32 + delta * v32 - 0.5 * level**2 * score * delta
        std = level * torch.sqrt(s - s_next)
    elif kind == "flow":
        if sigma_for_noise_level is None and bool((s >= 1).any()):
            raise ValueError("a 'flow' step at σ = 1 needs sigma_for_noise_level (σ_1 of the schedule)")
        # Only the denominator's σ is replaced at σ = 1 (Flow-GRPO: sqrt(σ / (1 - where(σ == 1, σ_1, σ)))).
        s_denom = s if sigma_for_noise_level is None else torch.where(s >= 1, _per_sample(sigma_for_noise_level, x32), s)
        diffusion = level * torch.sqrt(s / (1 - s_denom))
        mean = x32 * (1 + diffusion**2 * delta / (2 * s)) + v32 * (1 + diffusion**2 * (1 - s) / (2 * s)) * delta
        std = diffusion * torch.sqrt(-delta)
    elif kind == "cps":
        std = s_next * torch.sin(level * math.pi / 2)
        x0_hat = x32 - s * v32
        x1_hat = x32 + (1 - s) * v32
        mean = x0_hat * (1 - s_next) + x1_hat * torch.sqrt(s_next**2 - std**2)
    else:
        raise ValueError(f"unknown step kind {kind!r}; allowed: {STEP_KINDS}")
    std_flat = std.reshape(-1).expand(x.shape[0]).contiguous()  # (B,)
    if kind == "ode":
        return StepOutput(sample=mean, mean=mean, std=std_flat)
    if noise is None:
        raise ValueError(f"a {kind!r} step needs noise")
    return StepOutput(sample=mean + _per_sample(std_flat, x32) * noise.float(), mean=mean, std=std_flat)


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mean over dimensions of log N(sample; mean, std²), in float32. Shapes (B, ...), (B, ...), (B,).

    log N = -(x - μ)² / (2·std²) - log(std) - ½·log(2π), averaged (not summed) over every non-batch
    dimension, as the anchors do: it keeps probability ratios well scaled. Returns (B,).
    """
    sample, mean = sample.float(), mean.float()
    std = _per_sample(std.float(), sample)
    log_density = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.flatten(1).mean(dim=1)
