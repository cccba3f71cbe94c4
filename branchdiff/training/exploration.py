"""A run's exploration (`explore.mode`, docs/explore.md): the model that grows the candidate pool (the
policy itself, or a 4-bit copy of it that follows the policy after every update), the kept subset
regrown by the policy, and, every `explore.fidelity_every` iterations, the whole pool's rewards under
the policy (how well the explorer's ranking matches the policy's)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from branchdiff.explore.pool import (
    ExploreResult,
    RolloutContext,
    Selection,
    explore_search,
    explore_seeds,
    explore_tree,
    pool_under_policy,
    selection_generators,
)
from branchdiff.explore.quant import QuantConfig, make_quantized_copy, refresh_quantized_copy
from branchdiff.models.base import ModelAdapter
from branchdiff.rewards.multi import MultiReward
from branchdiff.search.registry import make_search
from branchdiff.settings.config import TrainConfig


@dataclass
class Exploration:
    config: TrainConfig
    policy: ModelAdapter
    explorer: ModelAdapter  # the policy itself (backend none) or its 4-bit copy
    quant_config: QuantConfig | None  # how the copy is quantised; None: the policy explores
    reward: MultiReward  # the training reward, which ranks the pool
    autocast: Callable[[], AbstractContextManager]  # the run's mixed precision (the accelerator's), for the policy's regrowth of the pool

    @classmethod
    def build(cls, config: TrainConfig, policy: ModelAdapter, reward: MultiReward, device: torch.device,
              autocast: Callable[[], AbstractContextManager]) -> Exploration | None:
        """None when the run does not explore (`explore.mode=off`); made before the policy is sharded (the copy is whole)."""
        explore = config.explore
        if explore.mode == "off":
            return None
        if explore.backend == "none":
            return cls(config, policy, policy, None, reward, autocast)
        quant_config = QuantConfig(explore.backend, policy.quant_skip_modules, explore.min_features)
        explorer = copy.copy(policy)
        explorer.denoiser = make_quantized_copy(policy.denoiser, quant_config, device)
        return cls(config, policy, explorer, quant_config, reward, autocast)

    def refresh(self) -> None:
        """Re-derive the quantised copy from the policy (its weights, LoRA merged), so exploration follows it."""
        if self.quant_config is not None:
            refresh_quantized_copy(self.explorer.denoiser, self.policy.denoiser, self.quant_config)

    def explore(self, context: RolloutContext, prompts: list[str], metadata: list[dict]) -> ExploreResult:
        """The pool of `context`'s prompts grown by the explorer, ranked by the reward, its kept subset regrown by the policy."""
        explore, address = self.config.explore, context.address
        selection = Selection(explore.keep, explore.selection, selection_generators(self.config.seed, address.iteration, address.prompt_keys))
        if explore.mode == "search":
            return explore_search(context, self.explorer, make_search(explore.search), explore.search_budget, selection,
                                  self._score_images(prompts, metadata))
        score = self._score_latents(prompts, metadata)
        if explore.mode == "tree":
            return explore_tree(context, self.explorer, selection, score)
        preview_steps = explore.preview_steps or self.config.sampling.num_steps
        preview_schedule = self.policy.schedule(preview_steps, self.config.sampling.shift).to(self.policy.device)
        return explore_seeds(context, self.explorer, preview_schedule, explore.preview_sampler == "sde", explore.pool, selection, score)

    def pool_rewards_under_policy(self, context: RolloutContext, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(P, N) the policy's reward of every pool candidate (the explorer's ranking is judged on these)."""
        explore = self.config.explore
        with self.autocast():
            latents, per_candidate = pool_under_policy(context, explore.mode, explore.pool)
        prompt_index = torch.arange(len(prompts)).repeat_interleave(len(latents) // len(prompts))
        return self._score_latents(prompts, metadata)(latents, prompt_index).reshape(len(prompts), -1, per_candidate).mean(-1)

    def _score_images(self, prompts: list[str], metadata: list[dict]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Scores (B,) of images (B, ...) whose prompts are `prompt_index` (B,) into `prompts`."""
        def score(images: torch.Tensor, prompt_index: torch.Tensor) -> torch.Tensor:
            rows = prompt_index.tolist()
            return self.reward(images, [prompts[p] for p in rows], [metadata[p] for p in rows], prompt_index).total

        return score

    def _score_latents(self, prompts: list[str], metadata: list[dict]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        score_images = self._score_images(prompts, metadata)
        return lambda latents, prompt_index: score_images(self.policy.decode(latents), prompt_index)
