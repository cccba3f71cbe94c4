"""The DDIM η-step as a Gaussian policy (branchdiff/schedulers/ddim.py): float64 formulas, diffusers' own DDIM
step with the same noise, η → 0, and the log-prob of the density sampled."""

import math

import pytest
import torch
from diffusers import DDIMScheduler

from branchdiff.schedulers.ddim import ddim_step
from branchdiff.schedulers.flow import gaussian_log_prob

SD15 = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False,
            steps_offset=1, num_train_timesteps=1000)


def _float64(x, eps, a, a_next, eta):
    """Song et al. eq. 12 and 16, written out in float64."""
    x, eps = x.double(), eps.double()
    std = eta * math.sqrt((1 - a_next) / (1 - a)) * math.sqrt(1 - a / a_next)
    x0 = (x - math.sqrt(1 - a) * eps) / math.sqrt(a)
    return math.sqrt(a_next) * x0 + math.sqrt(1 - a_next - std**2) * eps, std


@pytest.mark.parametrize("a, a_next", [(0.05, 0.2), (0.3, 0.31), (0.9, 0.99), (0.0047, 0.9991)])
@pytest.mark.parametrize("eta", [0.3, 1.0])
def test_mean_std_and_log_prob_against_float64(a, a_next, eta):
    generator = torch.Generator().manual_seed(0)
    x, eps, z = (torch.randn(3, 4, 8, 8, generator=generator) for _ in range(3))
    out = ddim_step(x, eps, a, a_next, z, eta)
    mean, std = _float64(x, eps, a, a_next, eta)
    assert torch.allclose(out.mean.double(), mean, atol=1e-5, rtol=1e-5) and out.std.tolist() == pytest.approx([std] * 3, rel=1e-5)
    assert torch.allclose(out.sample.double(), mean + std * z.double(), atol=1e-5, rtol=1e-5)
    # the stored log-prob is the density sampled: log N(x'; μ, σ²) averaged over dimensions
    density = (-(z.double() ** 2) / 2).flatten(1).mean(1) - math.log(std) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(gaussian_log_prob(out.sample, out.mean, out.std).double(), density, atol=1e-4)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
def test_equals_the_diffusers_ddim_step_with_the_same_noise(eta):
    """SD 1.5's scheduler configuration, every step of a 10-step schedule, the last one included
    (ᾱ' = ᾱ_0 there, set_alpha_to_one=False)."""
    scheduler = DDIMScheduler(**SD15)
    scheduler.set_timesteps(10)
    generator = torch.Generator().manual_seed(1)
    for t in scheduler.timesteps.tolist():
        x, eps, z = (torch.randn(2, 4, 8, 8, generator=generator) for _ in range(3))
        previous = t - 1000 // 10
        a, a_next = scheduler.alphas_cumprod[t].item(), (scheduler.alphas_cumprod[previous] if previous >= 0 else scheduler.final_alpha_cumprod).item()
        expected = scheduler.step(eps, t, x, eta=eta, variance_noise=z).prev_sample
        ours = ddim_step(x, eps, a, a_next, z if eta > 0 else None, eta)
        assert torch.allclose(ours.sample, expected, atol=1e-5), t


def test_eta_zero_is_deterministic_ddim_and_per_sample_levels():
    x, eps = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    deterministic = ddim_step(x, eps, 0.4, 0.6, None, 0.0)
    assert (deterministic.std == 0).all() and torch.equal(deterministic.sample, deterministic.mean)
    mixed = ddim_step(x, eps, 0.4, 0.6, torch.randn(2, 3, 4, 4), torch.tensor([0.0, 1.0]))
    assert mixed.std[0] == 0 and mixed.std[1] > 0
    with pytest.raises(ValueError, match="needs noise"):
        ddim_step(x, eps, 0.4, 0.6, None, 0.5)
