"""The objectives' losses as pure tensor functions: the clipped GRPO surrogate and the KL penalty to the adapter-free base
(DanceGRPO, arXiv 2505.07818; Flow-GRPO, arXiv 2505.05470), GRPO-Guard's regulated clipping, LayerTuning-RL's
reward-conditioned clipping and SFT term, and DiffusionNFT's loss."""

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


def reward_clipped_surrogate(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float, sensitivity: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate with bounds that open with the advantage (LayerTuning-RL's reward-conditioned
    clipping, Dynamic-TreeRPO, arXiv 2509.23352; this form is an interpretation, docs/objectives.md):
        ρ ∈ [1 − ε·(1 + η·max(−A, 0)),  1 + ε·(1 + η·max(A, 0))],
    L = max(−A·ρ, −A·clip(ρ, low, high)): a clearly better edge may raise its probability further
    than ε, a clearly worse one lower it further; η = 0 is `clipped_surrogate`. All (E,); returns the
    per-edge loss and whether the clip was active."""
    ratio = torch.exp(log_prob - old_log_prob)
    low = 1 - clip_range * (1 + sensitivity * (-advantages).clamp(min=0))
    high = 1 + clip_range * (1 + sensitivity * advantages.clamp(min=0))
    clipped = -advantages * torch.minimum(torch.maximum(ratio, low), high)
    return torch.maximum(-advantages * ratio, clipped), (ratio < low) | (ratio > high)


def sft_velocity_loss(velocity: torch.Tensor, x: torch.Tensor, x0_target: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Supervised flow matching toward a chosen clean sample: the velocity that carries x_σ straight to
    x0* is v* = (x − x0*)/σ (x_σ = (1 − σ)·x0 + σ·ε, v = ε − x0), and the loss is mean((v − v*)²) over
    the latent's elements. Shapes (E, ...), (E, ...), (E, ...), (E,) → (E,)."""
    shape = (-1,) + (1,) * (x.dim() - 1)
    target = (x.float() - x0_target.float()) / sigma.float().reshape(shape)
    return (velocity.float() - target).pow(2).flatten(1).mean(dim=1)


def guard_surrogate(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor,
    step_size: torch.Tensor, advantages: torch.Tensor, clip_range: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO-Guard's regulated clipping (Wang et al., arXiv 2510.22319) of a Gaussian step x' ~ N(μ, s²).

    On the rollout's own samples the log-ratio logp_θ − logp_old (means over the latent's D
    elements) has expectation −b ≤ 0, b = mean((μ_θ − μ_old)²) / (2·s²): ratios sit below 1 and
    the clip stops bounding positive-advantage updates. GRPO-Guard adds b back and rescales by s,
        log ρ̃ = s·(logp_θ − logp_old + b) = mean(ε·(μ_θ − μ_old)),   x' = μ_old + s·ε,
    which is centred at 0 and on the same scale at every step, and divides each step's loss by its
    step size −dt = σ_t − σ_{t+1}, so no range of noise levels dominates the gradient:
        L = max(−A·ρ̃, −A·clip(ρ̃, 1 − ε, 1 + ε)) / (−dt).
    Shapes: log-probs, std, step_size, advantages (E,); means (E, ...). Returns the per-edge loss,
    whether the clip was active, and log ρ̃ (E,)."""
    std = std.float()
    bias = (mean.float() - old_mean.float()).pow(2).flatten(1).mean(dim=1) / (2 * std**2)  # (E,)
    log_ratio = std * (log_prob - old_log_prob + bias)  # (E,)
    per_edge, was_clipped = clipped_surrogate(log_ratio, torch.zeros_like(log_ratio), advantages, clip_range)
    return per_edge / step_size.float(), was_clipped, log_ratio


def kl_to_reference(mean: torch.Tensor, reference_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between the policy's and the reference's Gaussian transitions with a shared std, averaged
    over dimensions like the log-probs: mean((μ_θ - μ_ref)²) / (2·std²). Shapes (E, ...), (E, ...), (E,) → (E,)."""
    return (mean.float() - reference_mean.float()).pow(2).flatten(1).mean(dim=1) / (2 * std.float() ** 2)


def nft_optimality(advantages: torch.Tensor, advantage_clip: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = clip(A / A_max, −1, 1) / 2 + 1/2 ∈ [0, 1] of each sample (E,)."""
    return (advantages / advantage_clip).clamp(-1.0, 1.0) / 2 + 0.5


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor,
             optimality: torch.Tensor, beta: float, advantage_clip: float) -> torch.Tensor:
    """DiffusionNFT's per-term loss (Zheng et al., arXiv 2509.16117) on the forward process
    x_t = (1 − σ)·x0 + σ·ε. The implicit positive and negative policies
        v⁺ = (1 − β)·v_old + β·v_θ,   v⁻ = (1 + β)·v_old − β·v_θ
    predict x̂± = x_t − σ·v±; each squared error is divided by its own mean absolute error (no
    gradient through it, floored at 1e-5: the adaptive weight), and
        L = (A_max/β)·( r·‖x̂⁺ − x0‖²/w⁺ + (1 − r)·‖x̂⁻ − x0‖²/w⁻ )        (means over the latent's elements),
    A_max = `advantage_clip`, the paper's scale: with it a KL weight and a gradient-clipping norm mean
    what they mean in the paper's settings. Minimising L pulls v⁺ toward the flow-matching target on
    well-rewarded samples (r → 1) and v⁻ toward it on poorly rewarded ones, which pushes v_θ away.
    Shapes: v_theta, v_old, x0, x_t (E, ...); sigma, optimality (E,) → (E,)."""
    shape = (-1,) + (1,) * (x0.dim() - 1)
    sigma = sigma.reshape(shape).to(x0.dtype)
    terms = []
    for v in ((1 - beta) * v_old + beta * v_theta, (1 + beta) * v_old - beta * v_theta):
        error = (x_t - sigma * v - x0).float().flatten(1)  # (E, D)
        weight = error.abs().mean(dim=1).detach().clamp(min=1e-5)  # (E,)
        terms.append(error.pow(2).mean(dim=1) / weight)
    positive, negative = terms
    return (advantage_clip / beta) * (optimality * positive + (1 - optimality) * negative)


def flow_matching_error(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The denoising (flow-matching) error of a prediction at x_σ = (1 − σ)·x0 + σ·ε:
        ℓ = mean((v − (ε − x0))²)        (mean over the latent's elements, float32).
    Shapes (E, ...) × 3 → (E,)."""
    return (velocity.float() - (noise.float() - x0.float())).pow(2).flatten(1).mean(dim=1)


AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")


def awm_weighted_error(error: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float = 0.25) -> torch.Tensor:
    """Advantage Weighted Matching's per-sample matching loss w(ℓ, σ) (Xue et al., arXiv 2509.25050)
    of the denoising error ℓ at noise level σ:
        uniform  ℓ            t  σ·ℓ            t2  σ²·ℓ
        huber    σ·(√(ℓ + c) − 10⁻⁵)            ghuber  σ·((ℓ + c)^p − c^p)/p,   c = 10⁻¹⁰, p = `power`.
    −w plays the role of the sample's log-likelihood. Shapes (E,), (E,) → (E,)."""
    error, sigma = error.double(), sigma.double()
    if weighting == "uniform":
        weighted = error
    elif weighting == "t":
        weighted = sigma * error
    elif weighting == "t2":
        weighted = sigma**2 * error
    elif weighting == "huber":
        weighted = sigma * (torch.sqrt(error + 1e-10) - 1e-5)
    elif weighting == "ghuber":
        weighted = sigma * ((error + 1e-10).pow(power) - 1e-10**power) / power
    else:
        raise ValueError(f"unknown AWM weighting {weighting!r}; allowed: {', '.join(AWM_WEIGHTINGS)}")
    return weighted.float()


def awm_surrogate(weighted: torch.Tensor, old_weighted: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """AWM's policy term: the clipped surrogate on the matching likelihood ratio
        ρ = exp(w_old − w_θ),   L = max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)),
    whose gradient at ρ = 1 (the first step of an iteration) is A·∇w_θ: the flow-matching loss of
    the policy's own sample weighted by its advantage. Shapes (E,) → per-term loss and clip flags (E,)."""
    return clipped_surrogate(-weighted, -old_weighted, advantages, clip_range)


def dgpo_group_weights(error: torch.Tensor, reference_error: torch.Tensor, advantages: torch.Tensor, groups: torch.Tensor,
                       beta: float, group_size: torch.Tensor) -> torch.Tensor:
    """DGPO's per-group weight (Luo et al., arXiv 2510.08425) in its gradient-equivalent form.

    A group's preference of its well-rewarded samples over its poorly rewarded ones is
    log σ(z_g),  z_g = (β/G)·Σ_{i∈g} A_i·(ℓ_ref,i − ℓ_θ,i), whose gradient is that of
    σ(−z_g)·(β/G)·Σ_i A_i·ℓ_θ,i with σ(−z_g) held fixed. This returns σ(−z_g) for each term's group
    (no gradient): the loss of term i is then weight·A_i·ℓ_θ,i (β/G is a constant scale, left to the
    learning rate, as the public implementation does). Shapes: error, reference_error, advantages,
    groups (E,) (group index of each term, 0..K−1), group_size (K,) → (E,)."""
    contribution = advantages.double() * beta * (error.detach().double() - reference_error.double()) / group_size.double()[groups]
    sums = torch.zeros(len(group_size), dtype=torch.float64, device=error.device).index_add_(0, groups, contribution)  # (K,) −z_g
    return torch.sigmoid(sums)[groups].float()


def epsilon_error(velocity_error: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The ε-prediction error of a velocity error at noise level σ (E,): with x_σ = (1 − σ)·x0 + σ·ε and
    ε̂ = x_σ + (1 − σ)·v̂, ε̂ − ε = (1 − σ)·(v̂ − v), so mean((ε̂ − ε)²) = (1 − σ)²·mean((v̂ − v)²); Diffusion-DPO's β on
    these errors is the paper's (ε-prediction) β, and β_v = β_ε·(1 − σ)² on velocity errors."""
    return velocity_error * (1 - sigma.to(velocity_error)) ** 2


def diffusion_dpo_loss(error_chosen: torch.Tensor, reference_chosen: torch.Tensor, error_rejected: torch.Tensor,
                       reference_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """Diffusion-DPO's Bradley–Terry loss of a (chosen, rejected) pair at a shared (σ, ε) (Wallace et
    al., arXiv 2311.12908, eq. 14 with T·ω(λ_t) folded into β, and the ½ of its public code):
        L = −log σ(−(β/2)·[(ℓ_θ(w) − ℓ_ref(w)) − (ℓ_θ(l) − ℓ_ref(l))])
    ℓ the denoising errors (means over elements): the policy gains when it improves on the reference
    more for the chosen sample than for the rejected one. Shapes (E,) × 4 → (E,)."""
    inside = -(beta / 2) * ((error_chosen.float() - reference_chosen.float()) - (error_rejected.float() - reference_rejected.float()))
    return -torch.nn.functional.logsigmoid(inside)


def dppo_surrogate(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor,
                   advantages: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-DPPO's divergence-proximal surrogate of a Gaussian step x' ~ N(μ, s²): clipped GRPO's
    ratio clip replaced by a trust region on the exact KL between the current and the rollout's step
    distributions (equal variances, averaged over elements like the log-probs):
        KL = mean((μ_θ − μ_old)²)/(2s²),   ρ = exp(logp_θ − logp_old),
        L = −A·ρ, with no gradient where KL > `threshold` and the update pushes further the wrong
        way (A > 0 and ρ > 1, or A < 0 and ρ < 1).
    Shapes: log-probs, std, advantages (E,); means (E, ...). Returns the per-edge loss, the mask of
    edges held (E,) bool, and the KL (E,)."""
    kl = (mean.float() - old_mean.float()).pow(2).flatten(1).mean(dim=1) / (2 * std.float() ** 2)
    ratio = torch.exp(log_prob - old_log_prob)
    held = (kl > threshold) & (((advantages > 0) & (ratio > 1)) | ((advantages < 0) & (ratio < 1)))
    ratio = torch.where(held, ratio.detach(), ratio)
    return -advantages * ratio, held, kl.detach()
