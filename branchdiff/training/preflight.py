"""What `branchdiff train` checks before it claims a run directory, loads a model, a reward or a
checkpoint, or writes anything: beyond the config itself (branchdiff/settings/config.py), every training
and evaluation reward resolves (its name imported, its keyword arguments accepted) and every prompt
source the run reads decodes (a problem is named with its file and line). The run directory is then
claimed (branchdiff/runs/run_dir.py) and the checkpoint to resume chosen (`Trainer.select_checkpoint`),
still before the model loads.
"""

from __future__ import annotations

from branchdiff.settings.config import TrainConfig
from branchdiff.data.prompts import load_prompt_set
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.registry import check_reward_kwargs, resolve_reward


def check_inputs(config: TrainConfig) -> None:
    """Raise a one-line error for a reward that does not resolve or a prompt source that does not read
    (evaluation rewards and prompts only when the run evaluates)."""
    evaluates = config.final_eval or config.eval_every
    for value in (config.reward, *([config.eval_rewards] if evaluates else [])):
        for spec in parse_reward_specs(value):
            if spec.remote is None:
                check_reward_kwargs(spec.name, resolve_reward(spec.name), spec.kwargs)
    load_prompt_set(config.prompts.train)
    if evaluates:
        load_prompt_set(config.prompts.eval)
