"""Rewards that see the whole group: a reward may score a prompt's group at once instead of image by
image, by providing

    reward.score_group(images, prompts, metadata) -> scores

with `images` (G, 3, H, W) in [0, 1] (or videos (G, F, 3, H, W) for a reward that declares
`video = True`), the G samples of one prompt, and `scores` (G,). Every caller of a reward
(training, evaluation, `rewards check`, the reward server) then splits its batch into groups and
calls `score_group` once per group, in order of each group's first image. A group is:

- in training, the samples GRPO compares: a chain group's G samples, or every leaf of a prompt's
  tree (the leaves the last depth's advantage compares; inner nodes' rewards are fused from them);
- elsewhere (`rewards check`, search), the images that share a prompt. Evaluation refuses a group reward
  (`refuse_in_evaluation`): its mean is ½ for any model.

The scores of a group reward depend on the other members of its group, so they are relative: a
rank or a win rate says how a sample compares with its siblings, not how good it is. Two kinds:

    rank within the group:   r_i = (#{j : s_j < s_i} + ½·#{j ≠ i : s_j = s_i}) / (G − 1)
    pairwise tournament:     r_i = Σ_{j ≠ i} q_ij / (G − 1),  q_ij = (p_ij + 1 − p_ji) / 2

with s the scores of an image reward (higher better), p_ij the probability that i is preferred to j
when i is shown first, so q_ij averages both orders and cancels a judge's position bias. Both are in
[0, 1]; a group of one scores ½ (nothing to compare with). The rank is the tournament whose
preference is the hard comparison of scores (p_ij = 1, ½ or 0).
"""

from __future__ import annotations

import torch

from branchdiff.rewards.base import check_scores


def is_group_reward(reward: object) -> bool:
    """Whether `reward` scores whole groups (it provides `score_group`)."""
    return callable(getattr(reward, "score_group", None))


def refuse_in_evaluation(rewards: dict[str, object], key: str) -> None:
    """An evaluation compares models by a reward's mean; a group reward's mean is ½ for any model (ranks and win rates
    within a group average ½), so one among `rewards` (by label) is refused in one line naming `key`."""
    for label, reward in rewards.items():
        if is_group_reward(reward):
            raise ValueError(f"{key}: {label!r} scores each sample against its group's others, so its mean is ½ for any model and "
                             "cannot compare models; evaluate with the reward it ranks (e.g. pickscore), or vlm-judge pointwise")


def group_rows(prompts: list[str], groups: torch.Tensor | None) -> list[list[int]]:
    """The rows of each group, in order of each group's first row: by the group index `groups` (B,)
    when given, else by equal prompt."""
    keys = prompts if groups is None else groups.tolist()
    rows: dict[object, list[int]] = {}
    for row, key in enumerate(keys):
        rows.setdefault(key, []).append(row)
    return list(rows.values())


GroupAnswers = list[tuple[list[int], object]]  # each group's rows and what `score_group` returned for them


def group_answers(reward: object, images: torch.Tensor, prompts: list[str], metadata: list[dict], groups: torch.Tensor | None) -> GroupAnswers:
    """`score_group` called once per group (`group_rows`): each group's rows and the reward's answer, unchecked; as many
    groups at once as the reward's `parallel_calls` (a reward served by replicas), else one after another."""
    every = group_rows(prompts, groups)

    def answer(rows: list[int]) -> object:
        index = torch.tensor(rows)
        return reward.score_group(images[index], [prompts[r] for r in rows], [metadata[r] for r in rows])  # type: ignore[attr-defined]

    parallel = int(getattr(reward, "parallel_calls", 1))
    if parallel > 1 and len(every) > 1:
        from branchdiff.runtime.threads import DaemonPool

        with DaemonPool(parallel, "group-reward") as pool:
            return list(zip(every, pool.map(answer, every)))
    return [(rows, answer(rows)) for rows in every]


def assemble(answers: GroupAnswers, count: int, label: str) -> torch.Tensor:
    """The scores (B,) of `count` images from their groups' answers, each checked for its shape (`check_scores`)."""
    scores = torch.empty(count)
    for rows, answer in answers:
        scores[torch.tensor(rows)] = check_scores(answer, len(rows), label)
    return scores


def score_by_group(reward: object, label: str, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                   groups: torch.Tensor | None) -> torch.Tensor:
    """Scores (B,) of a group reward: its answers for every group, checked and written back at their rows."""
    return assemble(group_answers(reward, images, prompts, metadata, groups), len(prompts), label)


def tournament(preferred_first: torch.Tensor) -> torch.Tensor:
    """Win rates (G,) from `preferred_first` (G, G): entry [i, j] the probability that i is preferred to
    j when i is shown first (the diagonal is not read). q_ij = (p_ij + 1 − p_ji) / 2, r_i = Σ_{j≠i} q_ij / (G − 1);
    ½ for a group of one."""
    count = preferred_first.shape[0]
    if count == 1:
        return torch.full((1,), 0.5)
    both_orders = (preferred_first + 1 - preferred_first.T) / 2  # (G, G)
    off_diagonal = ~torch.eye(count, dtype=torch.bool)
    return (both_orders * off_diagonal).sum(dim=1) / (count - 1)


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """Normalised ranks (G,) of scores (G,), higher better, ties sharing: the tournament of hard
    comparisons, r_i = (#{j : s_j < s_i} + ½·#{j ≠ i : s_j = s_i}) / (G − 1); ½ for a group of one; all
    NaN when a score is not finite (the group has no order; training then drops it)."""
    if not torch.isfinite(scores).all():
        return torch.full(scores.shape, float("nan"))
    wins = (scores[:, None] > scores[None, :]).double() + 0.5 * (scores[:, None] == scores[None, :]).double()  # (G, G)
    return tournament(wins).float()
