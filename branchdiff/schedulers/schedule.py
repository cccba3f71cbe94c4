"""A family's discretisation: the T steps a sampler walks, and the transition of each step.

An adapter builds one `Schedule` per step count (`ModelAdapter.schedule`); the rollout, the
training recomputation, explore and evaluation only ever ask it two things: what the denoiser is
conditioned on at step i (`model_times[i]`) and the transition x_i → x_{i+1} given the model's
output there (`step`); searches also ask the clean sample that output points to (`predicted_x0`).
Step i is always the edge from depth i to depth i + 1 of a tree.

- `FlowSchedule` (rectified flow; the model output is a velocity): σ_0 = 1 > … > σ_T = 0 and the
  steps of `schedulers.flow` (`ode`, `dance`, `flow`, `cps`).
- `DDIMSchedule` (ε-prediction diffusion; the output is ε): ᾱ_0 < … < ᾱ_T and the DDIM η-step of
  `schedulers.ddim` (`ddim`, with η the noise level; `ode` is η = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchdiff.schedulers.ddim import ddim_step
from branchdiff.schedulers.flow import StepOutput, sigma_schedule, step


@dataclass(frozen=True)
class FlowSchedule:
    sigmas: torch.Tensor  # (T+1,) σ_0 = 1 (or near) down to σ_T = 0
    model_times: torch.Tensor  # (T,) what the denoiser is conditioned on at each step (σ, or σ·1000, ...)

    @classmethod
    def shifted(cls, num_steps: int, shift: float, time_scale: float) -> FlowSchedule:
        """The anchors' schedule σ = s·t / (1 + (s-1)·t) on t = linspace(1, 0, T+1) (`sigma_schedule`),
        the denoiser conditioned on σ·time_scale."""
        sigmas = sigma_schedule(num_steps, shift)
        return cls(sigmas, sigmas[:-1] * time_scale)

    @property
    def num_steps(self) -> int:
        return len(self.model_times)

    def to(self, device: torch.device | str) -> FlowSchedule:
        return FlowSchedule(self.sigmas.to(device), self.model_times.to(device))

    def kind_at(self, kind: str, index: int) -> str:
        """The step kind actually taken at step `index`: cps has std σ'·sin(aπ/2) = 0 at the last
        step (σ' = 0), so no density there; it is deterministic."""
        return "ode" if kind == "cps" and float(self.sigmas[index + 1]) == 0 else kind

    def step(self, kind: str, x: torch.Tensor, output: torch.Tensor, index: torch.Tensor, noise: torch.Tensor | None,
             noise_level: torch.Tensor | float) -> StepOutput:
        """x (B, ...) at steps `index` (B,) → step index + 1, with the velocity `output` (B, ...)."""
        index = index.to(self.sigmas.device)
        return step(kind, x, output, self.sigmas[index], self.sigmas[index + 1], noise, noise_level, self.sigmas[1])

    def predicted_x0(self, x: torch.Tensor, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The clean sample the velocity `output` (B, ...) points to from x (B, ...) at steps `index` (B,): x̂0 = x − σ·v."""
        sigma = self.sigmas[index.to(self.sigmas.device)].reshape(-1, *[1] * (x.dim() - 1))
        return x.float() - sigma * output.float()


@dataclass(frozen=True)
class DDIMSchedule:
    alpha_bars: torch.Tensor  # (T+1,) float64 ᾱ at each step, increasing; ᾱ_T is the final (set_alpha_to_one) value
    model_times: torch.Tensor  # (T,) the integer timesteps the denoiser is conditioned on
    step_kinds = ("ode", "ddim")

    @property
    def num_steps(self) -> int:
        return len(self.model_times)

    def to(self, device: torch.device | str) -> DDIMSchedule:
        return DDIMSchedule(self.alpha_bars.to(device), self.model_times.to(device))

    def kind_at(self, kind: str, index: int) -> str:
        return kind

    def step(self, kind: str, x: torch.Tensor, output: torch.Tensor, index: torch.Tensor, noise: torch.Tensor | None,
             noise_level: torch.Tensor | float) -> StepOutput:
        """x (B, ...) at steps `index` (B,) → step index + 1 with the predicted noise `output`:
        `ddim` with η = noise_level, `ode` with η = 0."""
        if kind not in self.step_kinds:
            raise ValueError(f"step kind {kind!r} is not a DDIM step; allowed: {self.step_kinds} (sampling.sde=ddim)")
        index = index.to(self.alpha_bars.device)
        eta = 0.0 if kind == "ode" else noise_level
        return ddim_step(x, output, self.alpha_bars[index], self.alpha_bars[index + 1], noise, eta)

    def predicted_x0(self, x: torch.Tensor, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The clean sample the predicted noise `output` (B, ...) points to from x (B, ...) at steps `index` (B,):
        x̂0 = (x − √(1−ᾱ)·ε̂) / √ᾱ."""
        alpha_bar = self.alpha_bars[index.to(self.alpha_bars.device)].reshape(-1, *[1] * (x.dim() - 1))
        return ((x.double() - torch.sqrt(1 - alpha_bar) * output.double()) / torch.sqrt(alpha_bar)).float()


Schedule = FlowSchedule | DDIMSchedule
