"""Exact one-step marginal variance of the sampling steps on Gaussian data (the SDEs of branchdiff/schedulers/flow.py; split noise levels as in docs/trees.md).

With data x0 ~ N(0, 1) per dimension, `x_σ = (1-σ)·x0 + σ·ε` is N(0, V(σ)) with
V(σ) = (1-σ)² + σ², and the exact velocity E[ε - x0 | x_σ] is linear: v = c(σ)·x with
c(σ) = (2σ - 1)/V(σ). Every step of `branchdiff/schedulers/flow.py` then has a mean linear in x, μ = α·x,
so one step x_σ → x' = μ + m·std·ε' (m: a multiplier of the noise only, the BranchGRPO release's
kick, `tree.anchor_noise_multiplier`; ε' independent of x) has, in closed form,

    Var(x') = α²·V(σ) + (m·std)²,    to compare with the target V(σ').

Per kind, with Δ = σ' - σ and the level L (η for `dance`, a for `flow` and `cps`):

| kind    | α                                                                    | std            |
|---------|----------------------------------------------------------------------|----------------|
| `ode`   | 1 + Δ·c                                                              | 0              |
| `dance` | 1 + Δ·c + ½L²·Δ·(1 - (1-σ)(1-σc))/σ²     (from ŝ = -(x - (1-σ)·x̂0)/σ²) | L·√(σ - σ')    |
| `flow`  | 1 + s²Δ/(2σ) + c·(1 + s²(1-σ)/(2σ))·Δ,   s² = L²·σ/(1-σ_d)            | s·√(-Δ)        |
| `cps`   | (1-σc)(1-σ') + (1 + (1-σ)c)·√(σ'² - std²)                             | σ'·sin(Lπ/2)   |

σ_d is σ, or `sigma_for_noise_level` (σ_1 of the schedule) when σ = 1, as in `flow.step`.
Everything is float64 Python arithmetic: no tensors, no sampling.
"""

from __future__ import annotations

import math

from branchdiff.schedulers.flow import STEP_KINDS


def marginal_variance(sigma: float) -> float:
    """V(σ) = (1-σ)² + σ²: variance of x_σ = (1-σ)·x0 + σ·ε for x0, ε ~ N(0, 1)."""
    return (1 - sigma) ** 2 + sigma**2


def exact_velocity_gain(sigma: float) -> float:
    """c(σ) = (2σ - 1)/V(σ), so that E[ε - x0 | x_σ] = c(σ)·x_σ for x0 ~ N(0, 1).

    Cov(ε - x0, x_σ) = σ - (1-σ) = 2σ - 1 and Var(x_σ) = V(σ); jointly Gaussian, so the
    conditional mean is the regression Cov/Var·x_σ."""
    return (2 * sigma - 1) / marginal_variance(sigma)


def step_gain_and_std(
    kind: str,
    sigma: float,
    sigma_next: float,
    noise_level: float,
    sigma_for_noise_level: float | None = None,
) -> tuple[float, float]:
    """(α, std) of one step of `kind` under the exact velocity: mean = α·x, x' = α·x + std·ε'.

    Formulas in the module docstring. `std` is returned as the formula gives it (for `cps` with
    a level outside (0, 1], σ'·sin(Lπ/2) can repeat a smaller level's value or be negative)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; allowed: {STEP_KINDS}")
    if not 0 <= sigma_next < sigma <= 1:
        raise ValueError(f"need 0 <= sigma_next < sigma <= 1, got sigma={sigma}, sigma_next={sigma_next}")
    c = exact_velocity_gain(sigma)
    delta = sigma_next - sigma  # negative
    if kind == "ode":
        return 1 + delta * c, 0.0
    if kind == "dance":
        # ŝ = -(x - (1-σ)·x̂0)/σ² with x̂0 = (1 - σc)·x, so ŝ = -x·(1 - (1-σ)(1-σc))/σ².
        score_gain = -(1 - (1 - sigma) * (1 - sigma * c)) / sigma**2
        return 1 + delta * c - 0.5 * noise_level**2 * score_gain * delta, noise_level * math.sqrt(-delta)
    if kind == "flow":
        if sigma >= 1 and sigma_for_noise_level is None:
            raise ValueError("a 'flow' step at σ = 1 needs sigma_for_noise_level (σ_1 of the schedule)")
        denom_sigma = sigma_for_noise_level if sigma_for_noise_level is not None and sigma >= 1 else sigma  # only the denominator's σ is replaced
        diffusion_sq = noise_level**2 * sigma / (1 - denom_sigma)  # s²
        alpha = 1 + diffusion_sq * delta / (2 * sigma) + c * (1 + diffusion_sq * (1 - sigma) / (2 * sigma)) * delta
        return alpha, math.sqrt(diffusion_sq) * math.sqrt(-delta)
    # cps: x̂0 = (1 - σc)·x, x̂1 = (1 + (1-σ)c)·x
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    alpha = (1 - sigma * c) * (1 - sigma_next) + (1 + (1 - sigma) * c) * math.sqrt(sigma_next**2 - std**2)
    return alpha, std


def one_step_variance(
    kind: str,
    sigma: float,
    sigma_next: float,
    noise_level: float,
    noise_multiplier: float = 1.0,
    sigma_for_noise_level: float | None = None,
) -> tuple[float, float]:
    """(Var(x'), V(σ')) for one step σ → σ' from x_σ ~ N(0, V(σ)) with the exact velocity.

    Var(x') = α²·V(σ) + (noise_multiplier·std)², with α and std of `step_gain_and_std` at
    `noise_level` (η for `dance`, a for `flow` and `cps`). The target V(σ') = (1-σ')² + σ'² is the
    true marginal at σ'. `noise_multiplier` scales the noise only, keeping the mean of the
    unscaled level (the release's kick, `tree.anchor_noise_multiplier`); to change the level itself, change
    `noise_level`. `sigma_for_noise_level` is σ_1 of the schedule, needed by `flow` at σ = 1."""
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    alpha, std = step_gain_and_std(kind, sigma, sigma_next, noise_level, sigma_for_noise_level)
    return alpha**2 * marginal_variance(sigma) + (noise_multiplier * std) ** 2, marginal_variance(sigma_next)
