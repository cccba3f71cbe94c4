"""Build a reward from a registered name or a dotted import path (`my_pkg.rewards:Sharpness`).

A reward is a callable `(images (B, 3, H, W) in [0, 1], prompts, metadata) -> tensor[B]` with a
`name` and a `scale` note. It may also offer `score(images, prompts) -> dict[str, tensor[B]]` with
extra per-image metrics, the reward itself under its `reward_key`.
"""

from __future__ import annotations

import difflib
import importlib

import torch
from collections.abc import Callable

from branchdiff.rewards.tiny_geneval import TinyGenEval

REGISTRY: dict[str, Callable[..., object]] = {"tiny-geneval": TinyGenEval}


def build_reward(name: str, device: str = "cpu") -> object:
    if name in REGISTRY:
        return REGISTRY[name](device=device)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"reward {name!r} could not be imported ({error}); expected 'package.module:Name'") from None
        return factory()
    close = difflib.get_close_matches(name, REGISTRY, n=2)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ValueError(f"unknown reward {name!r}{hint}; registered: {', '.join(REGISTRY)}, or a dotted path 'package.module:Name'")


def reward_key(reward: object) -> str:
    """The key under which `score_batch` returns the reward itself."""
    return getattr(reward, "reward_key", "reward")


def score_batch(reward: object, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Every per-image score a reward offers; the reward itself under `reward_key(reward)`."""
    if hasattr(reward, "score"):
        return reward.score(images, prompts)
    return {"reward": torch.as_tensor(reward(images, prompts, {})).float().cpu()}
