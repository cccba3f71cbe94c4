"""Tests for branchdiff/schedulers/marginals.py: closed-form one-step variance on N(0, 1) data.

Independent checks: the published numbers (docs/trees.md), a Monte-Carlo estimate through
`flow.step` itself, the gain α read off `flow.step` at x = 1, and the fine-step behaviour:
Euler-type steps (ode, dance, flow) miss the target by O(Δ²), cps by an amount that does not
vanish with the step (its std σ'·sin(aπ/2) does not shrink with Δ).
"""

from __future__ import annotations

import math

import pytest
import torch

from branchdiff.schedulers.flow import step
from branchdiff.schedulers.marginals import one_step_variance, step_gain_and_std

torch.set_num_threads(1)


def velocity_gain(sigma: float) -> float:
    """E[ε - x0 | x_σ] / x_σ for x0 ~ N(0, 1), written from Cov(ε - x0, x_σ) / Var(x_σ)."""
    return (sigma - (1 - sigma)) / ((1 - sigma) ** 2 + sigma**2)


@pytest.mark.parametrize("multiplier, variance", [(1.0, 0.92), (2.0, 2.39), (4.0, 8.27)])
def test_flow_first_step_matches_the_measured_numbers(multiplier, variance):
    """docs/trees.md: flow a = 0.7, σ 1 → 0.9 (T = 10, shift 1), noise ×1/×2/×4 → 0.92/2.39/8.27, target 0.82."""
    got, target = one_step_variance("flow", 1.0, 0.9, 0.7, noise_multiplier=multiplier, sigma_for_noise_level=0.9)
    assert round(target, 2) == 0.82
    assert round(got, 2) == variance


MC_CASES = [  # (kind, σ, σ', level, noise multiplier, σ_1): levels large enough that every term matters
    ("dance", 0.6, 0.5, 1.2, 1.0, None),
    ("dance", 1.0, 0.9, 0.3, 4.0, None),
    ("flow", 1.0, 0.9, 0.7, 2.0, 0.9),
    ("flow", 0.6, 0.5, 1.4, 1.0, None),
    ("cps", 0.6, 0.5, 0.8, 2.0, None),
    ("cps", 0.8, 0.6, 0.5, 1.0, None),
]


@pytest.mark.parametrize("kind, sigma, sigma_next, level, multiplier, sigma_1", MC_CASES)
def test_closed_form_matches_monte_carlo_through_step(kind, sigma, sigma_next, level, multiplier, sigma_1):
    """Sample x0, ε, ε' (N = 2^20), step with the exact velocity and the noise scaled by m.

    x' is a linear combination of independent Gaussians, so its mean of squares estimates Var(x')
    with relative standard error √(2/N) ≈ 1.4e-3; the tolerance is 5 standard errors (0.7%)."""
    g = torch.Generator().manual_seed(1234)
    shape = (256, 4096)  # (B, D): N = 2^20 scalar samples
    x0, eps, noise = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    x = (1 - sigma) * x0 + sigma * eps
    out = step(kind, x, velocity_gain(sigma) * x, sigma, sigma_next, noise, level, sigma_1)
    sample = out.mean.double() + multiplier * out.std.double()[:, None] * noise  # the noise-only multiplier
    estimate = sample.pow(2).mean().item()
    variance, _ = one_step_variance(kind, sigma, sigma_next, level, multiplier, sigma_1)
    assert abs(estimate / variance - 1) < 5 * math.sqrt(2 / sample.numel())


@pytest.mark.parametrize("kind", ["ode", "dance", "flow", "cps"])
@pytest.mark.parametrize("sigma, sigma_next", [(1.0, 0.9), (0.9, 0.5), (0.6, 0.5), (0.3, 0.05), (0.2, 0.0)])
@pytest.mark.parametrize("level", [0.3, 0.8, 1.6, 3.2])
def test_gain_and_std_match_step_at_x_equal_one(kind, sigma, sigma_next, level):
    """flow.step on x = 1 with v = c(σ) has mean α and std `std` (float32 step vs float64 closed form)."""
    ones = torch.ones(1, 1)
    out = step(kind, ones, velocity_gain(sigma) * ones, sigma, sigma_next, torch.zeros(1, 1), level, 0.9)
    alpha, std = step_gain_and_std(kind, sigma, sigma_next, level, 0.9)
    assert out.mean.item() == pytest.approx(alpha, rel=1e-5, abs=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-5, abs=1e-6)


def test_ode_preserves_the_marginal_only_up_to_o_delta_squared():
    """Euler ODE: Var = (1 + Δc)²·V(σ); it misses V(σ') by Δ²·(c²V - 2) (σ 1 → 0.9: 0.81 vs 0.82)."""
    variance, target = one_step_variance("ode", 1.0, 0.9, 0.0)
    assert variance == pytest.approx(0.81, abs=1e-12) and target == pytest.approx(0.82, abs=1e-12)
    errors = [abs(one_step_variance("ode", 0.6, 0.6 - delta, 0.0)[0] - (0.4 + delta) ** 2 - (0.6 - delta) ** 2)
              for delta in (1e-2, 1e-3)]
    assert errors[0] > 1e-5
    assert errors[1] / errors[0] == pytest.approx(1e-2, rel=0.02)  # error ∝ Δ²


@pytest.mark.parametrize("kind, level", [("dance", 0.3), ("flow", 0.7)])
def test_sde_steps_reach_the_target_at_a_fine_step(kind, level):
    """σ 0.6 → 0.599 at the default level: |Var - V(σ')| < 1e-5 (measured ≈ 2e-6, i.e. Δ² = 1e-6
    times an O(1) constant; a missing or wrong drift correction leaves an O(Δ) = 1e-3 error)."""
    variance, target = one_step_variance(kind, 0.6, 0.599, level)
    assert abs(variance - target) < 1e-5
    coarse_variance, coarse_target = one_step_variance(kind, 0.6, 0.59, level)
    assert abs(variance - target) / abs(coarse_variance - coarse_target) == pytest.approx(1e-2, rel=0.02)


def test_cps_misses_the_target_at_any_step_size():
    """cps re-noises a fixed fraction sin²(aπ/2) of σ'² whatever Δ, replacing part of the posterior
    mean x̂1 = σ·x/V by fresh noise. As σ' → σ its variance tends to
    ((1-σ)² + σ²·cos θ)²/V(σ) + σ²·sin²θ, θ = aπ/2, not V(σ): at σ = 0.6, a = 0.8, 0.4671 vs 0.52."""
    theta = 0.8 * math.pi / 2
    v_sigma = 0.4**2 + 0.6**2
    limit = (0.4**2 + 0.6**2 * math.cos(theta)) ** 2 / v_sigma + 0.6**2 * math.sin(theta) ** 2
    variance, target = one_step_variance("cps", 0.6, 0.6 - 1e-7, 0.8)
    assert variance == pytest.approx(limit, abs=1e-5)
    assert target - variance > 0.05


def test_flow_at_sigma_one_needs_sigma_1_and_bad_arguments_fail():
    with pytest.raises(ValueError, match="sigma_for_noise_level"):
        one_step_variance("flow", 1.0, 0.9, 0.7)
    with pytest.raises(ValueError, match="unknown step kind"):
        one_step_variance("ddim", 0.6, 0.5, 0.3)
    with pytest.raises(ValueError, match="sigma_next"):
        one_step_variance("dance", 0.5, 0.6, 0.3)
    with pytest.raises(ValueError, match="noise_multiplier"):
        one_step_variance("dance", 0.6, 0.5, 0.3, noise_multiplier=-1.0)
