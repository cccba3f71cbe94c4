"""The clipped GRPO surrogate and the KL penalty to the adapter-free base (DanceGRPO, arXiv 2505.07818; Flow-GRPO, arXiv 2505.05470)."""

from __future__ import annotations

import torch


def clipped_surrogate(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-edge loss L = max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε)), ρ = exp(logp_θ - logp_old), and a (E,)
    bool of whether the clip was active. All inputs (E,)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return torch.maximum(unclipped, clipped), (ratio - 1).abs() > clip_range


def kl_to_reference(mean: torch.Tensor, reference_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between the policy's and the reference's Gaussian transitions with a shared std, averaged
    over dimensions like the log-probs: mean((μ_θ - μ_ref)²) / (2·std²). Shapes (E, ...), (E, ...), (E,) → (E,)."""
    return (mean.float() - reference_mean.float()).pow(2).flatten(1).mean(dim=1) / (2 * std.float() ** 2)
