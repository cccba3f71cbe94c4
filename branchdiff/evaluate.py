"""Generate on a prompt set with fixed seeds and score: the tiny-geneval table (strict and
per-attribute accuracy) that `branchdiff eval` and the end of `branchdiff train` print.

Samples are deterministic (ODE) chains grown by the rollout engine: image s of prompt p starts
from the addressable initial noise (EVAL_RUN_SEED, iteration -1, prompt p, root s), so base and
trained models are compared on exactly the same noise.
"""

from __future__ import annotations

import torch

from branchdiff.models.base import ModelAdapter
from branchdiff.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.tree import TreeSpec, build_tree
from branchdiff.rewards.tiny_geneval import TinyGenEval
from branchdiff.schedulers.flow import sigma_schedule

EVAL_RUN_SEED = 1234  # evaluation noise never coincides with training noise (iteration -1)


@torch.no_grad()
def sample_ode(
    adapter: ModelAdapter, prompts: list[str], num_seeds: int, num_steps: int, shift: float = 1.0, max_batch: int = 64
) -> tuple[torch.Tensor, list[str]]:
    """ODE samples of every prompt × seed: images (P·S, 3, H, W) in [0, 1], prompt-major, and the
    prompt of each image."""
    tree = build_tree(TreeSpec(num_steps, roots=num_seeds, sde_steps=frozenset()), len(prompts))
    address = NoiseAddress(EVAL_RUN_SEED, -1, tuple(range(len(prompts))))
    settings = SamplerSettings(max_batch=max_batch, exact=False)
    rollout = grow(adapter, tree, adapter.encode_prompts(prompts), sigma_schedule(num_steps, shift), settings, address)
    return adapter.decode(rollout.leaf_latents), [prompts[p] for p in tree.prompt[tree.leaf_index].tolist()]


def evaluate_tiny(
    adapter: ModelAdapter, prompts: list[str], num_seeds: int, num_steps: int, shift: float = 1.0
) -> dict[str, float]:
    """Mean tiny-geneval scores (strict, partial, count, color, shape, position) over prompts × seeds."""
    images, image_prompts = sample_ode(adapter, prompts, num_seeds, num_steps, shift)
    scores = TinyGenEval().score(images, image_prompts)
    return {key: round(value.mean().item(), 4) for key, value in scores.items()} | {"images": len(image_prompts)}


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """A fixed-width table: one row per model, one column per score."""
    columns = ["strict", "count", "color", "shape", "position", "partial", "images"]
    lines = [f"{'model':<10}" + "".join(f"{c:>10}" for c in columns)]
    for name, scores in rows.items():
        lines.append(f"{name:<10}" + "".join(f"{scores[c]:>10.3f}" if c != "images" else f"{scores[c]:>10d}" for c in columns))
    return "\n".join(lines)
