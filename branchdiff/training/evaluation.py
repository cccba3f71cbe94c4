"""A run's evaluations (docs/evaluation.md): the held-out scores every `eval_every` iterations (which the
reward-hacking watch follows), the grid of fixed samples beside them, and the final comparison of the
base model with the trained one (RUN/eval.json). The evaluation rewards are built before the model
loads, and every evaluation samples the same addressable noise, so the numbers compare across
iterations, processes and a later `branchdiff eval --weights RUN`."""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator

from branchdiff.data.prompts import load_prompt_set
from branchdiff.errors import ConfigError
from branchdiff.evaluation.evaluate import (
    ALONE,
    EvalResult,
    OdeSampling,
    ProcessShare,
    beside_sources,
    evaluate,
    gather_results,
    sample_ode,
    score_names,
    summarize,
)
from branchdiff.models.base import ModelAdapter
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.models.registry import FAMILIES, image_size
from branchdiff.rewards.combine import RewardSpec, parse_reward_specs
from branchdiff.rewards.group import refuse_in_evaluation
from branchdiff.rewards.multi import MultiReward, build_component
from branchdiff.runtime import storage
from branchdiff.runtime.distributed import Collective
from branchdiff.runtime.memory import PhaseMemory
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.evaluation import eval_keys


@dataclass
class RunEvaluation:
    config: TrainConfig
    accelerator: Accelerator
    collective: Collective
    memory: PhaseMemory
    rewards: dict[str, object]  # the evaluation rewards by label (empty when the run never evaluates)
    gold_score: str | None  # the held-out score the reward-hacking watch follows; None without evaluations during training
    lockstep: bool  # a sharded denoiser: every process samples as many prompts

    @classmethod
    def build(cls, config: TrainConfig, accelerator: Accelerator, collective: Collective, memory: PhaseMemory, training_reward: MultiReward,
              lockstep: bool) -> RunEvaluation:
        """The evaluation rewards resolved and loaded (a component the training reward already built, the same spec, is shared,
        not loaded twice) and the gold score checked: before the model loads, so a wrong name costs nothing."""
        def component(spec: RewardSpec) -> object:
            for trained, reward in zip(training_reward.specs, training_reward.rewards):
                if (trained.name, trained.remote, trained.kwargs) == (spec.name, spec.remote, spec.kwargs):
                    return reward
            return build_component(spec, str(accelerator.device))

        evaluates = config.final_eval or config.eval_every
        rewards = {spec.label: component(spec) for spec in parse_reward_specs(config.eval_rewards)} if evaluates else {}
        refuse_in_evaluation(rewards, "'eval_rewards'")
        return cls(config, accelerator, collective, memory, rewards, gold_score(config, rewards), lockstep)

    def sampling(self) -> OdeSampling:
        config = self.config
        return OdeSampling(config.prompts.eval_seeds, config.sampling.num_steps, config.sampling.shift, config.prompts.eval_guidance)

    def sized(self, model: ModelAdapter) -> AbstractContextManager:
        """`model` making the evaluations' size (`eval.resolution`, `eval.frames`; unset: the training's) within the block."""
        config = self.config
        trained = image_size(config.model.resolution, FAMILIES[config.model.family].resolution)
        return model.sized(image_size(config.eval.resolution, trained), config.eval.frames)

    def check_size(self, model: ModelAdapter) -> None:
        """Refuse, as soon as the model has loaded, an evaluation size it cannot make (a hub id's configs are read only then),
        naming the eval.* key: not at the first evaluation, after hours of training."""
        if not (self.config.final_eval or self.config.eval_every):
            return
        try:
            with self.sized(model):
                pass
        except ValueError as error:
            raise ValueError(eval_keys(str(error))) from None

    def evaluate(self, model: ModelAdapter, share: ProcessShare = ALONE) -> EvalResult:
        """`model` on the eval prompts with the eval rewards (this process's `share` of them), at the evaluations' size."""
        config = self.config
        with self.sized(model):
            return evaluate(model, load_prompt_set(config.prompts.eval, config.sources.fit), self.rewards, self.sampling(), share,
                            frames={spec.label: spec.frames for spec in parse_reward_specs(config.eval_rewards)})

    def shared(self, model: ModelAdapter) -> EvalResult:
        """`model` on the eval prompts, each process sampling its share, gathered on every process."""
        accelerator = self.accelerator
        share = ProcessShare(accelerator.process_index, accelerator.num_processes, self.lockstep)
        return gather_results(self.evaluate(model, share), accelerator)

    def heldout_metrics(self, policy: ModelAdapter, weights: AbstractContextManager) -> dict[str, float]:
        """The policy's mean score on the eval prompts (in `weights`: the moving average or the live ones), `eval_<score>` for
        each eval reward and its extras, each process sampling its share; `eval_seconds` and the phase's peak memory."""
        start = time.perf_counter()
        memory: dict[str, float] = {}
        with self.memory.phase("eval", memory), weights:
            summary = summarize(self.shared(policy))["all"]
        memory = {key: self.collective.max(torch.tensor([value], dtype=torch.float64)).item() for key, value in memory.items()}
        return {**{f"eval_{name}": row["mean"] for name, row in summary.items()}, "eval_seconds": time.perf_counter() - start, **memory}

    def fixed_samples(self, policy: ModelAdapter, weights: AbstractContextManager, prompts: int = 4,
                      images_per_prompt: int = 4) -> tuple[torch.Tensor, list[str]]:
        """The policy's ODE samples (prompts · images_per_prompt, 3, H, W) of the first eval prompts
        with fixed seeds, and those prompts: the same noise at every call, so grids compare across
        iterations; an editing set's rows start with their source image. On a sharded denoiser every process calls it."""
        config = self.config
        prompt_set = load_prompt_set(config.prompts.eval, config.sources.fit)
        chosen, metadata = prompt_set.prompts[:prompts], prompt_set.metadata[:prompts]
        with weights, self.sized(policy):
            images = sample_ode(policy, chosen, replace(self.sampling(), images_per_prompt=images_per_prompt), metadata=metadata)[0]
        return beside_sources(images, metadata, images_per_prompt), chosen

    def final(self, finetune: LoraFinetune | FullFinetune, policy: ModelAdapter, weights: AbstractContextManager,
              run_dir: Path) -> dict[str, dict[str, float]]:
        """Base (adapter disabled) vs trained (in `weights`) on the eval prompts with the eval rewards and the same
        fixed noise: mean scores by model; the full summaries go to RUN/eval.json (written by the main process).
        Every process calls it and samples its share of the prompts."""
        config = self.config
        with finetune.base() as base:
            summaries = {"base": summarize(self.shared(base))}
        with weights:
            summaries["trained"] = summarize(self.shared(policy))
        scales = {label: getattr(reward, "scale", "unspecified") for label, reward in self.rewards.items()}
        size: dict[str, object] = {}  # where the evaluations have their own size (eval.resolution, eval.frames)
        if config.eval.resolution is not None:
            size["resolution"] = list(image_size(config.eval.resolution, (policy.height, policy.width)))
        if config.eval.frames is not None:
            size["frames"] = config.eval.frames
        report = {"prompts": config.prompts.eval, "images_per_prompt": config.prompts.eval_seeds, "scales": scales,
                  "after_iteration": config.iterations - 1, **size, **summaries}
        if self.accelerator.is_main_process:
            storage.write_text(run_dir / "eval.json", json.dumps(report, indent=1))
        return {model: {name: row["mean"] for name, row in summary["all"].items()} for model, summary in summaries.items()}


def gold_score(config: TrainConfig, rewards: dict[str, object]) -> str | None:
    """The held-out score the reward-hacking watch follows: `watch.gold`, else the first eval
    reward's own score; None when the run never evaluates during training."""
    if not config.eval_every:
        return None
    names = score_names(rewards)
    gold = config.watch.gold or names[0]
    if gold not in names:
        raise ConfigError(f"'watch.gold' = {gold!r} is not a score of eval_rewards; allowed: {', '.join(names)}")
    return gold
