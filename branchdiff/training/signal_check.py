"""Can a reward drive GRPO? Sample groups from the model and measure the reward's spread.

GRPO learns from differences between the samples of one prompt (a group), so a reward carries
signal only if it spreads within groups. `check_reward` samples `group_size` images for each of a
few prompts with the training SDE (so the samples of a group differ as they do in training),
scores them, and reports:
- the scale: min, mean, max of the scores;
- `within_group_std`: the mean over prompts of the std of a prompt's scores (the signal);
- `between_prompt_std`: the std of the prompts' mean scores (what GRPO removes);
- `zero_spread_fraction`: the fraction of groups whose scores have std < 1e-6 (they train nothing);
- `seconds_per_image` of the reward alone;
- `nonfinite` scores and the `groups_dropped` for them.
"""

from __future__ import annotations

import time

import torch

from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.models.base import ModelAdapter, encode_for
from branchdiff.rewards.frames import FrameAggregation
from branchdiff.rewards.multi import RewardError, score_component
from branchdiff.training.metrics import ZERO_SPREAD

CHECK_RUN_SEED = 4321  # sampling noise of the check, apart from training and evaluation noise


def spread_statistics(scores: torch.Tensor) -> dict[str, float]:
    """The statistics of the module doc for finite scores (P, G): P prompts, G samples each."""
    within = scores.double().std(dim=1) if scores.shape[1] > 1 else torch.zeros(scores.shape[0], dtype=torch.float64)
    means = scores.double().mean(dim=1)
    return {
        "min": scores.min().item(), "mean": scores.mean().item(), "max": scores.max().item(),
        "within_group_std": within.mean().item(),
        "between_prompt_std": means.std().item() if len(means) > 1 else 0.0,
        "zero_spread_fraction": (within < ZERO_SPREAD).double().mean().item(),
    }


@torch.no_grad()
def check_reward(
    adapter: ModelAdapter, reward, prompts: list[str], metadata: list[dict], label: str, group_size: int = 8, num_steps: int = 10,
    shift: float | None = None, sde: str = "flow", noise_level: float = 0.7, guidance: float | None = None,
    frames: FrameAggregation | None = None,
) -> dict[str, float]:
    """Sample `group_size` SDE samples per prompt and report the reward's spread (module doc),
    scored through the same boundary as training (`score_component`, with `frames` for a video
    family's videos); non-finite scores are counted and their groups left out, as training drops them."""
    tree = build_tree(TreeSpec(num_steps, roots=group_size), len(prompts))
    settings = SamplerSettings(sde=sde, noise_level=noise_level, guidance=guidance)
    address = NoiseAddress(CHECK_RUN_SEED, 0, tuple(range(len(prompts))))
    rollout = grow(adapter, tree, encode_for(adapter, prompts, metadata), adapter.schedule(num_steps, shift), settings, address)
    images = adapter.decode(rollout.leaf_latents)  # (P·G, 3, H, W) or videos (P·G, F, 3, H, W), prompt-major
    image_prompts = [prompts[p] for p in tree.prompt[tree.leaf_index].tolist()]
    start = time.perf_counter()
    leaf_prompts = tree.prompt[tree.leaf_index]  # (P·G,) each image's group, as in training
    scores, _, _ = score_component(reward, label, images, image_prompts, [metadata[p] for p in leaf_prompts.tolist()], frames=frames,
                                   groups=leaf_prompts)
    seconds = time.perf_counter() - start
    nonfinite = int((~torch.isfinite(scores)).sum())
    if nonfinite == len(scores):
        raise RewardError(f"reward {label!r} returned no finite score for {len(scores)} images: it cannot drive training")
    grouped = scores.reshape(len(prompts), group_size)
    usable = torch.isfinite(grouped).all(dim=1)  # groups with a non-finite score are dropped in training too
    return {**spread_statistics(grouped[usable]), "seconds_per_image": seconds / len(image_prompts), "images": len(image_prompts),
            "nonfinite": nonfinite, "groups_dropped": int((~usable).sum())}
