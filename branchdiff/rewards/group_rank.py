"""`group-rank`: another reward's rank within the group (e.g. PickScore's rank among a prompt's samples),
a group reward (branchdiff/rewards/group.py):

    group-rank_i = (#{j : s_j < s_i} + ½·#{j ≠ i : s_j = s_i}) / (G − 1)   in [0, 1]

with s the inner reward's scores, negated first when it is lower-is-better. Only the order of the
scores reaches training, so a reward whose scale drifts, or whose outliers dominate a group's std, gives
the same signal as long as it orders the samples the same way. A group whose inner scores are not all
finite has no order and scores NaN (training drops it).
"""

from __future__ import annotations

import torch

from branchdiff.rewards.combine import RewardSpec
from branchdiff.rewards.group import ranks
from branchdiff.rewards.multi import build_component, score_component


class GroupRank:
    name = "group-rank"
    scale = "rank within the group in [0, 1]: 1 the group's best, 0 its worst, ½ for a group of one"
    higher_is_better = True

    def __init__(self, reward: str, kwargs: dict | None = None, device: str = "cpu") -> None:
        if not isinstance(reward, str) or not reward or reward == self.name:
            raise ValueError(f"reward 'group-rank': reward={reward!r} must name the reward whose rank it gives (e.g. pickscore)")
        if not isinstance(kwargs, (dict, type(None))):
            raise ValueError(f"reward 'group-rank': kwargs={kwargs!r} must be a mapping (the inner reward's keyword arguments)")
        self.inner_spec = RewardSpec(name=reward, kwargs=dict(kwargs or {}))
        self.inner = build_component(self.inner_spec, device)
        self.video = bool(getattr(self.inner, "video", False))
        self.device = getattr(self.inner, "device", torch.device(device))
        self.sign = 1.0 if getattr(self.inner, "higher_is_better", True) else -1.0

    @staticmethod
    def scores_videos(reward: str = "", kwargs: dict | None = None, **settings: object) -> bool:
        """Whether group-rank with these settings scores videos whole: its inner reward's `video`, read before anything is built."""
        from branchdiff.rewards.registry import resolve_reward

        return isinstance(reward, str) and bool(reward) and reward != GroupRank.name and bool(getattr(resolve_reward(reward), "video", False))

    def score_group(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Ranks (G,) of one group's images (G, 3, H, W) by the inner reward."""
        scores, _, _ = score_component(self.inner, self.inner_spec.label, images, prompts, metadata)
        return ranks(self.sign * scores)
