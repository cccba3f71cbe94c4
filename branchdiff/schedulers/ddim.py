"""The DDIM step with η > 0 as a Gaussian policy, for ε-prediction diffusion models (SD 1.5; DDPO).

Convention: `x_t = √ᾱ_t·x0 + √(1-ᾱ_t)·ε`, the model predicts ε, and sampling walks from a large t
to t' < t (ᾱ_t < ᾱ_t'). With x̂0 = (x_t - √(1-ᾱ_t)·ε̂) / √ᾱ_t (DDIM, Song et al. eq. 12 and 16):

    std  σ_t = η·√((1-ᾱ_t')/(1-ᾱ_t))·√(1 - ᾱ_t/ᾱ_t')
    mean μ   = √ᾱ_t'·x̂0 + √(1 - ᾱ_t' - σ_t²)·ε̂
    x_t'     = μ + σ_t·z,  z ~ N(0, I)

η = 0 is deterministic DDIM; η = 1 is DDPM's posterior variance. The transition's log-prob is
`branchdiff.schedulers.flow.gaussian_log_prob` (the mean over dimensions of log N(x_t'; μ, σ_t²)),
the same convention as the flow steps, so trees, advantages and the loss treat both alike. As in
DDPO and diffusers' DDIM with `clip_sample=False` (SD 1.5's configuration), x̂0 is not clipped.
Pure functions: ᾱ values come from the caller (the adapter's scheduler), no model, no state.
"""

from __future__ import annotations

import torch

from branchdiff.schedulers.flow import StepOutput, _per_sample


def ddim_std(alpha_bar: torch.Tensor | float, alpha_bar_next: torch.Tensor | float, eta: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """σ_t = η·√((1-ᾱ_t')/(1-ᾱ_t))·√(1 - ᾱ_t/ᾱ_t') per sample, shaped (B, 1, ...) like `like`;
    computed in float64 (near the end of sampling 1 - ᾱ_t' is ~1e-3 and cancels in float32)."""
    wide = like.double()
    a, a_next = _per_sample(alpha_bar, wide), _per_sample(alpha_bar_next, wide)
    return (_per_sample(eta, wide) * torch.sqrt((1 - a_next) / (1 - a) * (1 - a / a_next))).to(like.dtype)


def ddim_step(
    x: torch.Tensor,
    eps: torch.Tensor,
    alpha_bar: torch.Tensor | float,
    alpha_bar_next: torch.Tensor | float,
    noise: torch.Tensor | None,
    eta: torch.Tensor | float,
) -> StepOutput:
    """One DDIM transition x_t → x_t' (module doc) for latents x (B, ...) and the predicted noise
    eps (B, ...); ᾱ_t, ᾱ_t' and η are scalars or (B,) tensors. `noise` z (same shape as x) may be
    None only when η = 0. Computed in float32 whatever the input dtype."""
    x32, eps32 = x.float(), eps.float()
    wide = x32.double()  # per-sample coefficients in float64: near the end 1 - ᾱ' - σ² cancels in float32
    a, a_next = _per_sample(alpha_bar, wide), _per_sample(alpha_bar_next, wide)
    std64 = ddim_std(alpha_bar, alpha_bar_next, eta, wide)  # (B, 1, ...)
    x0_from_x, x0_from_eps = 1 / torch.sqrt(a), torch.sqrt(1 - a) / torch.sqrt(a)
    direction = torch.sqrt((1 - a_next - std64**2).clamp(min=0))
    x0_hat = x0_from_x.float() * x32 - x0_from_eps.float() * eps32
    mean = torch.sqrt(a_next).float() * x0_hat + direction.float() * eps32
    std = std64.float()
    std_flat = std.reshape(-1).expand(x.shape[0]).contiguous()  # (B,)
    if bool((std_flat == 0).all()):
        return StepOutput(sample=mean, mean=mean, std=std_flat)
    if noise is None:
        raise ValueError("a DDIM step with η > 0 needs noise")
    return StepOutput(sample=mean + std * noise.float(), mean=mean, std=std_flat)
