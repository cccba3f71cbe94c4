"""Several rewards as one training signal, with weights (docs/rewards.md).

For components r_1..r_n with weights w_i, scored on images that fall into groups g (a prompt's
images: the samples GRPO compares):

    sum_then_normalize (Flow-GRPO):  r = Σ_i w_i·r_i; the advantage's group normalisation then
                                     acts on r, so a component weighs by its weight times its spread.
    normalize_then_sum (MixGRPO):    z_i = (r_i - mean_g(r_i)) / (std_g(r_i) + 1e-8), std unbiased
                                     (0 for a group of one), then r = Σ_i w_i·z_i: every component
                                     weighs by its weight alone, whatever its scale.

A component that is missing for a group (an optional reward that failed, or any non-finite score
in the group) is left out of that group's sum, never counted as zero; a group left with no
component has r = NaN for all its images, and the trainer drops it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from branchdiff.core.advantage import group_moments, unbiased_std
from branchdiff.rewards.frames import FrameAggregation

COMBINE_MODES = ("sum_then_normalize", "normalize_then_sum")
EPS = 1e-8


@dataclass(frozen=True)
class RewardSpec:
    """One component of the training signal, as a config names it."""

    name: str | None = None  # registered name, entry point name or dotted path 'package.module:Name'
    remote: str | tuple[str, ...] | None = None  # or the URL of a reward server (`branchdiff serve-reward`), or the URLs of its replicas
    weight: float = 1.0
    required: bool = True  # False: a failure leaves the component out of that batch (counted), not the run
    kwargs: dict = field(default_factory=dict)  # keyword arguments of the class or factory
    frames: FrameAggregation | None = None  # how a reward of images scores videos (`frames: N`, `reduce: mean | min`)
    given_label: str | None = None  # `label: NAME`: the component's name in metrics and messages, telling two of one reward apart

    @property
    def label(self) -> str:
        if self.given_label is not None:
            return self.given_label
        if isinstance(self.remote, tuple):  # replicas: the first server's URL, and how many more
            return self.remote[0] + (f" (+{len(self.remote) - 1} replicas)" if len(self.remote) > 1 else "")
        return self.name or self.remote or "reward"


SPEC_KEYS = ("name", "remote", "weight", "required", "kwargs", "frames", "reduce", "label")
SPEC_FORM = ("a reward name or dotted path, a mapping {name: ..., weight: 1.0, required: true, kwargs: {...}, frames: N, reduce: mean, label: ...} "
             "or {remote: URL, ...} ({remote: [URL1, URL2, ...]} for replicas), or a list of these")


def parse_reward_specs(value: object, key: str = "reward") -> list[RewardSpec]:
    """The components named by a config's `key` (`reward`, `eval_rewards`; see SPEC_FORM); ValueError in one line naming the key."""
    entries = value if isinstance(value, list) else [value]
    if not entries:
        raise ValueError(f"'{key}' is an empty list; it must be {SPEC_FORM}")
    specs = []
    for entry in entries:
        if isinstance(entry, str) and entry:
            specs.append(RewardSpec(name=entry))
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"'{key}' entry {entry!r} must be {SPEC_FORM}")
        unknown = sorted(set(entry) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"'{key}' entry {entry!r}: unknown keys {unknown}; allowed: {', '.join(SPEC_KEYS)}")
        if ("name" in entry) == ("remote" in entry):
            raise ValueError(f"'{key}' entry {entry!r} needs exactly one of 'name' and 'remote'")
        given = "name" if "name" in entry else "remote"
        replicas = given == "remote" and isinstance(entry[given], list)
        if replicas and (not entry[given] or not all(isinstance(u, str) and u.strip() for u in entry[given]) or len(set(entry[given])) != len(entry[given])):
            raise ValueError(f"'{key}' entry {entry!r}: 'remote' must be a server's URL or a list of distinct URLs of its replicas")
        if not replicas and (not isinstance(entry[given], str) or not entry[given].strip()):
            raise ValueError(f"'{key}' entry {entry!r}: '{given}' must be a non-empty string (a reward's name or dotted path; a server's URL)")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"'{key}' entry {entry!r}: weight must be a finite number")
        if not isinstance(entry.get("required", True), bool) or not isinstance(entry.get("kwargs", {}), dict):
            raise ValueError(f"'{key}' entry {entry!r}: required must be true or false and kwargs a mapping")
        frames = None
        if "frames" in entry or "reduce" in entry:
            try:
                frames = FrameAggregation(entry.get("frames", 1), entry.get("reduce", "mean"))
            except ValueError as error:
                raise ValueError(f"'{key}' entry {entry!r}: {error}") from None
        label = entry.get("label")
        if label is not None and (not isinstance(label, str) or not label.strip()):
            raise ValueError(f"'{key}' entry {entry!r}: label must be a non-empty string (it names the component's metrics)")
        remote = tuple(entry["remote"]) if replicas else entry.get("remote")
        specs.append(RewardSpec(entry.get("name"), remote, float(weight), entry.get("required", True), dict(entry.get("kwargs", {})), frames, label))
    labels = [spec.label for spec in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"'{key}' names a component twice: {labels}; give each reward once, with its weight, or tell two of one reward "
                         "apart with label: NAME")
    return specs


def group_zscore(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(scores - mean_g) / (std_g + 1e-8) within each group (B,); unbiased std, 0 for a group of one."""
    count, residual, squares = group_moments(scores, groups, int(groups.max()) + 1 if len(groups) else 0)
    return (residual / (unbiased_std(count, squares)[groups] + EPS)).float()


def missing_groups(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(B,) True for the images of every group holding a non-finite score."""
    bad = torch.zeros(int(groups.max()) + 1 if len(groups) else 0, dtype=torch.bool)
    bad[groups[~torch.isfinite(scores)]] = True
    return bad[groups]


def combine(components: dict[str, torch.Tensor], weights: dict[str, float], groups: torch.Tensor, mode: str) -> torch.Tensor:
    """The combined signal (B,) of component scores (B,) each (NaN where missing); see the module doc."""
    if mode not in COMBINE_MODES:
        raise ValueError(f"unknown combine mode {mode!r}; allowed: {', '.join(COMBINE_MODES)}")
    total = torch.zeros(len(groups))
    present = torch.zeros(len(groups), dtype=torch.bool)
    for name, scores in components.items():
        usable = ~missing_groups(scores, groups)  # (B,)
        clean = torch.where(usable, scores.float(), torch.zeros_like(scores, dtype=torch.float32))
        if mode == "normalize_then_sum":
            clean = torch.where(usable, group_zscore(clean, groups), clean)
        total += weights[name] * clean
        present |= usable
    return torch.where(present, total, torch.full_like(total, float("nan")))
