"""The contract of a training objective (docs/objectives.md), and what every objective shares.

An objective turns an iteration's rollout and rewards into a `Signal` (what each node's sample
earned and which transitions train) and the signal into an `UpdatePlan`: this process's minibatches,
each with its number of loss terms and a function computing their per-term losses. The update loop
(branchdiff/training/update.py) runs the plan: it groups minibatches into optimizer steps, syncs gradients,
clips, skips non-finite steps and keeps the weight average; it knows no objective. The plan's
named statistics become metrics by the kind each objective declares (`MetricKind`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch

from branchdiff.models.base import ModelAdapter, select_embeds

if TYPE_CHECKING:
    from branchdiff.core.rollout import NoiseAddress, Rollout
    from branchdiff.core.tree import Tree
    from branchdiff.schedulers.schedule import Schedule

MetricKind = Literal["per_term", "count", "max"]  # summed over processes then divided by the terms trained; summed; maximum
UPDATE_LOOP_METRICS = ("grad_norm", "optimizer_steps", "steps_skipped")  # what the update loop logs for every objective


@dataclass
class Signal:
    """What an objective made of an iteration's rewards, per node of the rollout's trees."""
    node_rewards: torch.Tensor  # (N,) the reward credited to each node's sample
    node_advantages: torch.Tensor  # (N,) the advantage of the edge into each node
    trained: torch.Tensor  # (N,) bool: the edge into the node gets a loss term
    groups_dropped: int  # groups (prompts) left out for a non-finite reward


class UpdatePlan(Protocol):
    """One iteration's update on this process, as the update loop runs it. A plan may also define `after_step()`, which the
    update loop calls after each optimizer step taken (DGPO's moving reference follows every step)."""
    terms: list[int]  # loss terms of each of this process's minibatches, in the order they are run
    stats: dict[str, float]  # named statistics, added to by `loss` (this process's sums; kinds in the objective's `metric_kinds`)

    def loss(self, index: int) -> torch.Tensor:
        """(terms[index],) per-term losses of minibatch `index`, through the trained (wrapped) denoiser."""

    def idle_loss(self) -> torch.Tensor:
        """A zero loss through the same network calls as a minibatch's loss, for an optimizer step in
        which this process has no minibatch (DDP's gradient sync needs every process's backward) or
        fewer than another process (a sharded denoiser's forwards are collectives, matched one for one)."""


class Objective:
    """What every objective provides; the hooks below default to doing nothing (an objective whose
    rollouts come from the trained weights themselves and that keeps no state of its own)."""
    metric_kinds: ClassVar[dict[str, MetricKind]]  # every statistic its plans report, in the order the report draws them

    def signal(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> Signal:
        """From the leaf rewards (L,) of this process's trees."""
        raise NotImplementedError

    def plan(self, rollout: Rollout, embeds: dict, signal: Signal, address: NoiseAddress) -> UpdatePlan:
        """This process's minibatches of the iteration (`address`: the run seed, the iteration and the
        global keys of this process's prompts, for randomness that is the same on any process count)."""
        raise NotImplementedError

    def sampling_weights(self) -> AbstractContextManager:
        """The weights the rollouts sample with, in the model for the block (default: the trained ones)."""
        return nullcontext()

    def after_update(self, optimizer_steps: int) -> None:
        """Called once the iteration's optimizer steps are taken; `optimizer_steps`: the run's steps taken
        so far, this iteration's included (skipped steps not counted; kept across a resume)."""

    def save_state(self, folder: Path, write: bool) -> None:
        """The objective's own state into a checkpoint folder; every process calls it (sharded tensors
        are gathered), the one with `write` (the main process) writes."""

    def load_state(self, folder: Path) -> None:
        """The state `save_state` wrote (every process)."""


def drop_nonfinite_groups(tree: Tree, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A group (prompt) with a non-finite reward on any leaf is dropped: its leaves score 0 alike, so
    it carries no signal. Returns the leaf rewards (L,) with dropped groups zeroed, and the dropped
    groups (P,) bool."""
    leaf_groups = tree.prompt[tree.leaf_index]  # (L,)
    dropped = torch.zeros(tree.num_prompts, dtype=torch.bool)  # (P,)
    dropped[leaf_groups[~torch.isfinite(rewards)]] = True
    return torch.where(dropped[leaf_groups], torch.zeros_like(rewards), rewards), dropped


def zero_loss(train_policy: ModelAdapter, rollout: Rollout, embeds: dict, schedule: Schedule, guidance: float | None,
              reference: ModelAdapter | None = None) -> torch.Tensor:
    """A zero loss through the trained (wrapped) denoiser on the rollout's first node at the first step
    it predicts (`ModelAdapter.trains_at`), and a forward of `reference` on it when given
    (`UpdatePlan.idle_loss` of a process that holds no minibatch)."""
    root = torch.tensor([0])
    step = int(torch.nonzero(train_policy.trains_at(schedule.model_times))[0])
    inputs = (rollout.latents[root], schedule.model_times[step : step + 1], select_embeds(embeds, rollout.tree.prompt[root]), guidance)
    output = train_policy.predict(*inputs)
    if reference is not None:
        with torch.no_grad():
            reference.predict(*inputs)
    return output.sum() * 0.0
