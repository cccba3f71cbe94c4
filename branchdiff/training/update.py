"""The update of an iteration, for any objective: run an `UpdatePlan` (branchdiff/objectives/base.py)
as optimizer steps.

With several processes, every process takes the same optimizer steps (`optimizer_groups` from the
global term count), and a step's loss is the sum of its terms on all processes divided by their
global count, so a term weighs the same whichever process holds it; a process with no minibatch in
a step joins DDP's gradient sync with the plan's zero loss. A sharded denoiser (FSDP2) reduces its
gradients at every backward, and every process makes as many forwards and backwards in a step as the
busiest one (zero losses pad the others).

A step whose gradient norm is not finite (a NaN or inf loss or gradient on any process: DDP's
all-reduce spreads it to every process, so all of them decide alike) is skipped: its gradients are
dropped and the weights and optimizer moments stay as they were (`steps_skipped`). After every step
taken, the weights' moving average moves (`train.ema_decay`, branchdiff/models/ema.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from branchdiff.models.ema import WeightAverage
from branchdiff.objectives.base import UpdatePlan
from branchdiff.runtime.distributed import Collective
from branchdiff.runtime.sharding import full_tensor
from branchdiff.settings.config import OptimConfig


@dataclass
class UpdateLoop:
    train: OptimConfig  # minibatch grouping (optimizer_every) and gradient clipping
    accelerator: Accelerator
    collective: Collective
    params: list[torch.nn.Parameter]  # what is trained (gradient clipping)
    denoiser: torch.nn.Module  # the (DDP-)wrapped denoiser: its gradient sync waits for a step's last backward
    optimizer: torch.optim.Optimizer
    weight_average: WeightAverage | None = None  # the moving average of the trained weights, updated after every optimizer step
    sharded: bool = False  # the denoiser is sharded (FSDP2): every forward and backward is a collective

    def __call__(self, plan: UpdatePlan) -> dict[str, float]:
        """Run `plan`; returns its statistics with the gradient norm, the number of optimizer steps
        taken and skipped (non-finite gradients), the skips after the last step taken (`trailing_skips`)
        and this process's loss terms (`terms`: the denominator of the per-term means)."""
        accelerator = self.accelerator
        local_terms = sum(plan.terms)
        stats = {"optimizer_steps": 0, "steps_skipped": 0, "trailing_skips": 0, "grad_norm": 0.0, "terms": local_terms,
                 "forward_backward_seconds": 0.0, "optimizer_seconds": 0.0}
        global_terms = int(self.collective.sum(torch.tensor([float(local_terms)], dtype=torch.float64)).item())
        if global_terms == 0:
            return {**plan.stats, **stats}
        groups = optimizer_groups(plan.terms, global_terms, self.train.optimizer_every)
        local_group_terms = torch.tensor([float(sum(plan.terms[m] for m in g)) for g in groups], dtype=torch.float64)
        group_terms = self.collective.sum(local_group_terms).tolist()  # terms of each optimizer step, all processes
        for group, step_terms in zip(groups, group_terms):
            if step_terms == 0:
                continue
            members: Sequence[int | None] = group or [None]  # a process without terms in this step still joins DDP's gradient sync
            if self.sharded:  # every process makes as many forwards and backwards as the busiest one, each reducing its gradients
                busiest = int(self.collective.max(torch.tensor([len(group)])).item())
                members = group + [None] * (busiest - len(group))
            start = time.perf_counter()
            for index, m in enumerate(members):
                sync = index == len(members) - 1 or self.sharded
                with (nullcontext() if sync else accelerator.no_sync(self.denoiser)), accelerator.autocast():
                    if m is None:
                        loss = plan.idle_loss()
                    else:
                        loss = plan.loss(m).sum() * accelerator.num_processes / step_terms  # DDP averages over processes
                    accelerator.backward(loss)
            stats["forward_backward_seconds"] += time.perf_counter() - start
            start = time.perf_counter()
            grad_norm = float(full_tensor(accelerator.clip_grad_norm_(self.params, self.train.max_grad_norm)))
            stats["grad_norm"] = grad_norm
            if math.isfinite(grad_norm):
                self.optimizer.step()
                if self.weight_average is not None:
                    self.weight_average.update()
                after_step = getattr(plan, "after_step", None)  # a plan whose objective follows every step (DGPO's moving reference)
                if after_step is not None:
                    after_step()
                stats["optimizer_steps"] += 1
                stats["trailing_skips"] = 0
            else:
                stats["steps_skipped"] += 1
                stats["trailing_skips"] += 1
            self.optimizer.zero_grad(set_to_none=True)
            stats["optimizer_seconds"] += time.perf_counter() - start
        return {**plan.stats, **stats}


def optimizer_groups(terms_per_minibatch: list[int], global_terms: int, every: int) -> list[list[int]]:
    """Minibatch indices of each of n optimizer step slots, the same n on every process: one
    (every = 0) or n = max(1, ⌊global_terms / every⌋), so a step holds about global_terms / n ≥
    every terms (edges, for GRPO) and a remainder never takes a step of its own. A process assigns
    each minibatch to the slot its term midpoint falls in, ⌊n·(start + e/2) / E⌋; a slot may be empty
    on a process, and a slot empty on every process is skipped (so fewer than n steps may be taken,
    the same number on every process)."""
    steps = 1 if every <= 0 else max(1, global_terms // every)
    total = sum(terms_per_minibatch)
    groups: list[list[int]] = [[] for _ in range(steps)]
    start = 0
    for index, terms in enumerate(terms_per_minibatch):
        groups[min(steps - 1, int(steps * (start + terms / 2) / total)) if total else 0].append(index)
        start += terms
    return groups
