"""The training signal of a run: its configured rewards, scored together and combined.

`MultiReward` builds every component (`registry.build_reward`, or a `RemoteReward` for
`{remote: URL}`), scores a batch with each, checks what came back at this boundary (shape, finite
values), and combines the components (`combine.combine`). A required component that raises stops
the run with one line naming the reward and the first prompt; an optional one (`required: false`)
is missing for that batch, with a warning and a counter. Non-finite scores are counted and leave
their component out of the groups holding them. A reward whose `higher_is_better` is False enters
the signal with its weight negated.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass
from functools import partial

import torch

from branchdiff.data.sources import source_tensors
from branchdiff.errors import one_line, quote
from branchdiff.rewards.base import check_scores
from branchdiff.rewards.combine import RewardSpec, combine
from branchdiff.rewards.frames import FrameAggregation
from branchdiff.rewards.group import assemble, group_answers, is_group_reward
from branchdiff.rewards.registry import build_reward, check_reward_kwargs, reward_key


class RewardError(RuntimeError):
    """A required reward failed; the message is one line naming it and the prompt."""


def extra_keys(reward: object) -> tuple[str, ...]:
    """The other per-image scores a reward reports beside its own (declared by `score_keys`)."""
    key = reward_key(reward)
    return tuple(k for k in getattr(reward, "score_keys", ()) if k != key)


def takes_metadata(score: object) -> bool:
    """Whether a reward's `score` takes the prompts' metadata as a third argument (geneval: each prompt's objects)."""
    try:
        return len(inspect.signature(score).parameters) >= 3  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def takes_sources(reward: object) -> bool:
    """Whether a reward's call takes `sources=`: each image's source images (editing; docs/editing.md)."""
    try:
        return "sources" in inspect.signature(reward).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a callable without a signature
        return False


def score_component(reward: object, label: str, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                    required: bool = True, frames: FrameAggregation | None = None,
                    groups: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], bool]:
    """The boundary every reward call goes through (training, evaluation, `rewards check`): the
    reward's scores (B,) and its declared extra scores, each a float CPU tensor, and whether it
    failed. A raising reward stops with a one-line `RewardError` when required, else is NaN for
    this batch (with a warning); a wrong shape always stops (it is a bug in the reward, not a bad
    batch); non-finite scores are returned as they are, for the caller to count. Videos
    (B, F, 3, H, W) go whole to a reward that declares `video = True`; a reward of images scores
    them through `frames` (every N-th frame, reduced per video), and without it stops with one line.
    A reward whose call takes `sources=` also receives each image's source images (tensors (3, h, w)
    in [0, 1]; None when the prompts have none). A group reward (`score_group`) is called once per
    group: `groups` (B,) each image's group index, or None for the images sharing a prompt
    (branchdiff/rewards/group.py)."""
    count, kind = len(prompts), "videos" if images.dim() == 5 else "images"
    videos, grouped = images.dim() == 5 and not getattr(reward, "video", False), is_group_reward(reward)
    if videos:
        if grouped:
            raise RewardError(f"reward {label!r} ranks whole groups and scores images, and the model makes videos: a group reward of "
                              "videos must score them whole (video = True); rank a reward of videos instead")
        if frames is None:
            raise RewardError(f"reward {label!r} scores images and the model makes videos (B, F, 3, H, W): give it frames: N (score "
                              "every N-th frame) and reduce: mean or min, e.g. {name: " + label + ", frames: 4, reduce: mean}")
        images, prompts, metadata = frames.frames_of(images, prompts, metadata)
    try:
        if grouped:  # a reward that sees the group: one call per group, the answers checked below
            raw, more = group_answers(reward, images, prompts, metadata, groups), {}
        elif hasattr(reward, "score"):  # a reward that reports more than its score (tiny-geneval; geneval reads the metadata too)
            every = reward.score(images, prompts, metadata) if takes_metadata(reward.score) else reward.score(images, prompts)
            raw, more = every[reward_key(reward)], {k: every[k] for k in extra_keys(reward)}
        elif takes_sources(reward):  # an editing reward: each image's source images as well
            raw, more = reward(images, prompts, metadata, sources=source_tensors(metadata, tuple(images.shape[-2:]))), {}  # as the model saw them
        else:
            raw, more = reward(images, prompts, metadata), {}
    except Exception as error:  # a reward is user code: any failure is reported at this boundary
        message = (f"reward {label!r} failed on a batch of {count} {kind} (first prompt {quote(prompts[0])}): "
                   f"{one_line(f'{type(error).__name__}: {error}')}")
        if required:
            raise RewardError(message + " (mark it required: false to train without it when it fails)") from error
        warnings.warn(message + "; it is missing for this batch", RuntimeWarning, stacklevel=2)
        nan = torch.full((count,), float("nan"))
        return nan, {k: nan.clone() for k in extra_keys(reward)}, True
    try:
        scores = assemble(raw, len(prompts), label) if grouped else check_scores(raw, len(prompts), label)
        more = {k: check_scores(v, len(prompts), label) for k, v in more.items()}
    except ValueError as error:
        raise RewardError(str(error)) from None
    if videos:
        return frames.reduce_scores(scores, count), {k: frames.reduce_scores(v, count) for k, v in more.items()}, False
    return scores, more, False


@dataclass
class RewardBatch:
    total: torch.Tensor  # (B,) the combined training signal (NaN for a group with no component left)
    components: dict[str, torch.Tensor]  # (B,) each component's scores by metric name, NaN where missing
    extras: dict[str, torch.Tensor]  # (B,) other per-image scores the rewards declare (tiny-geneval's attributes)
    counts: dict[str, int]  # failures and non-finite scores per component, by metric name


def join_batches(batches: list[RewardBatch], order: torch.Tensor) -> RewardBatch:
    """The rewards of several calls as those of one: every per-image tensor concatenated and put in `order`
    (indices into the concatenation, (B,)), the counts summed (failures count the calls that failed)."""
    def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors)[order]

    first = batches[0]
    return RewardBatch(joined([b.total for b in batches]), {k: joined([b.components[k] for b in batches]) for k in first.components},
                       {k: joined([b.extras[k] for b in batches]) for k in first.extras},
                       {k: sum(b.counts[k] for b in batches) for k in first.counts})


def metric_name(label: str) -> str:
    """A component's label as a metric key: `reward_<label>` with characters other than letters,
    digits, '.', '-' and '_' replaced by '_' (URLs and dotted paths become tag-safe)."""
    return "reward_" + re.sub(r"[^A-Za-z0-9._-]", "_", label)


def check_remote_kwargs(spec: RewardSpec) -> None:
    """Refuse keyword arguments a reward server's client (`RemoteReward`, its URL the spec's `remote`)
    does not take, naming those it does, before anything is built."""
    from branchdiff.rewards.remote import RemoteReward

    if isinstance(spec.remote, tuple):  # replicas: the client's keywords and `in_flight` (ReplicaReward)
        takes = [name for name in inspect.signature(RemoteReward).parameters if name not in ("url", "device")] + ["in_flight"]
        unknown = sorted(set(spec.kwargs) - set(takes))
        if unknown:
            raise ValueError(f"reward {spec.label!r} takes no keyword argument {unknown[0]!r}; it takes: {', '.join(takes)}")
        return
    check_reward_kwargs(spec.label, partial(RemoteReward, spec.remote), spec.kwargs)


def remote_client(spec: RewardSpec) -> object:
    """The client of a spec's `remote`: a `RemoteReward` for one URL, a `ReplicaReward` for a list (its /health read now)."""
    check_remote_kwargs(spec)
    if isinstance(spec.remote, tuple):
        from branchdiff.rewards.replicas import ReplicaReward

        return ReplicaReward(spec.remote, **spec.kwargs)
    from branchdiff.rewards.remote import RemoteReward

    return RemoteReward(spec.remote, **spec.kwargs)


def build_component(spec: RewardSpec, device: str) -> object:
    """The reward a spec names: a reward server's client for `remote` (`remote_client`), else `registry.build_reward`."""
    if spec.remote is not None:
        return remote_client(spec)
    return build_reward(spec.name, device, spec.kwargs)


class MultiReward:
    def __init__(self, specs: list[RewardSpec], combine_mode: str, device: str | torch.device = "cpu") -> None:
        self.specs = specs
        self.combine_mode = combine_mode
        self.rewards = [build_component(spec, str(device)) for spec in specs]
        self.names = [metric_name(spec.label) for spec in specs]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], groups: torch.Tensor) -> RewardBatch:
        """Score images (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1]; `groups` (B,) the group (prompt) of each."""
        components, extras, counts = {}, {}, {}
        for spec, reward, name in zip(self.specs, self.rewards, self.names):
            scores, more, failed = score_component(reward, spec.label, images, prompts, metadata, spec.required, spec.frames, groups)
            counts[f"{name}_failed"] = int(failed)
            counts[f"{name}_nonfinite"] = 0 if failed else int((~torch.isfinite(scores)).sum())
            components[name] = scores
            extras.update(more)
        # a lower-is-better reward enters the signal negated; its logged scores stay as it returns them
        signs = {name: 1.0 if getattr(reward, "higher_is_better", True) else -1.0 for name, reward in zip(self.names, self.rewards)}
        weights = {name: spec.weight * signs[name] for name, spec in zip(self.names, self.specs)}
        return RewardBatch(combine(components, weights, groups, self.combine_mode), components, extras, counts)

    @property
    def parallel_calls(self) -> int:
        """Calls that may score at once: the least of the components' `parallel_calls` (a reward served by replicas: one
        a live replica); 1 where a component does not say (a reward in this process is called one batch at a time)."""
        return min(int(getattr(reward, "parallel_calls", 1)) for reward in self.rewards) if self.rewards else 1

    @property
    def scale(self) -> str:
        parts = [f"{spec.weight:g}·{spec.label} ({getattr(reward, 'scale', 'unspecified')})" for spec, reward in zip(self.specs, self.rewards)]
        return f"{self.combine_mode}: " + " + ".join(parts)
