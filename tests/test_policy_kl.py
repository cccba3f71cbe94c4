"""The KL of a policy's sampler from its initial model's (branchdiff/evaluation/policy_kl.py), against its closed form
in float64 where the answer is known: an initial model whose clean-sample prediction is the policy's plus a constant
pattern (its output layer's bias shifted) moves every step's mean by a known amount, whatever the chain's state."""

import math

import torch

from branchdiff.core.engine import SamplerSettings
from branchdiff.evaluation.policy_kl import gaussian_step_kl, initial_state, policy_kl

PROMPTS = ["two red circles on the left", "one blue square at the top"]


def flow_step_kl_of_a_shift(sigmas: list[float], level: float, shift_norm2: list[float]) -> float:
    """Σ_k KL of one flow-SDE step (Flow-GRPO's) when the velocity moves by a vector of squared norm shift_norm2[k]:
    mean = x·(1 + g²δ/(2σ)) + v·(1 + g²(1 − σ)/(2σ))·δ, std = g·√(−δ), g = a·√(σ / (1 − σ')) with σ' = σ_1 at σ = 1."""
    total = 0.0
    for k in range(len(sigmas) - 1):
        s, s_next = sigmas[k], sigmas[k + 1]
        delta = s_next - s
        g = level * math.sqrt(s / (1 - (sigmas[1] if s >= 1 else s)))
        coefficient = (1 + g * g * (1 - s) / (2 * s)) * delta
        total += coefficient**2 * shift_norm2[k] / (2 * g * g * -delta)
    return total


def test_the_kl_of_a_constant_shift_is_its_closed_form_on_every_chain(tiny_adapter):
    adapter = tiny_adapter
    schedule = adapter.schedule(6, None)
    before = initial_state(adapter.denoiser)
    initial = dict(before)
    bias = 0.02 * torch.randn(before["proj_out.bias"].shape, generator=torch.Generator().manual_seed(0))
    initial["proj_out.bias"] = before["proj_out.bias"] + bias
    kl = policy_kl(adapter, initial, PROMPTS, schedule, SamplerSettings(sde="flow", noise_level=0.7), chains_per_prompt=3, seed=5)
    # x̂0 moves by the bias in every 8×8 patch of the 32×32 image (16 patches); v = (x − x̂0)/σ moves by −Δx̂0/σ
    sigmas = schedule.sigmas.double().tolist()
    expected = flow_step_kl_of_a_shift(sigmas, 0.7, [16 * float(bias.double().pow(2).sum()) / s**2 for s in sigmas[:-1]])
    assert kl.dtype == torch.float64 and kl.shape == (6,)
    torch.testing.assert_close(kl, torch.full((6,), expected, dtype=torch.float64), rtol=2e-4, atol=0)
    assert all(torch.equal(tensor, adapter.denoiser.state_dict()[name]) for name, tensor in before.items())  # the policy's weights are back


def test_a_policy_at_its_initial_weights_has_no_kl(tiny_adapter):
    schedule = tiny_adapter.schedule(4, None)
    kl = policy_kl(tiny_adapter, initial_state(tiny_adapter.denoiser), PROMPTS, schedule, SamplerSettings(sde="flow"), chains_per_prompt=2, seed=1)
    assert torch.equal(kl, torch.zeros(4, dtype=torch.float64))


def test_the_step_kl_sums_over_dimensions():
    mean, reference = torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [0.0, 3.0]])
    # (1 + 4) / (2·0.5²) = 10; 9 / (2·2²) = 1.125
    torch.testing.assert_close(gaussian_step_kl(mean, reference, torch.tensor([0.5, 2.0])), torch.tensor([10.0, 1.125], dtype=torch.float64))
