"""The learning rate over a run: `train.lr_schedule` (constant, linear or cosine decay) after
`train.warmup_iterations` of linear warm-up, a function of the iteration alone.

The multiplier is diffusers' `get_scheduler` curve evaluated at the iteration, with the run's
`iterations` as its length: for linear, lr_i = lr·(N − i)/(N − w); for cosine,
lr_i = lr·½(1 + cos(π·(i − w)/(N − w))); during warm-up (i < w), lr_i = lr·i/w. Because it depends
on the iteration only, a resumed run continues on the same curve with nothing extra in its
checkpoint; a run resumed with a larger `iterations` stretches the rest of the curve to the new end. Past
`iterations` (a loop with a time budget, as `bench curves`) the rate stays at the curve's end: diffusers' cosine,
read beyond its length, would rise again.

`train.decay_start` = D > 0 holds the rate (after any warm-up) until iteration D and decays it from
there to 0 at the run's end: lr_i = lr·c((i − D)/(N − D)) for i ≥ D, with c the linear or cosine
curve above ("warm-up, stable, decay"). A run of at most D iterations never decays, so a preset's
result at its own length stays what it was, and a longer run settles instead of drifting
(docs/sweep.md, round 17).
"""

from __future__ import annotations

import torch


class LearningRateSchedule:
    """Sets every parameter group's learning rate for an iteration: base × multiplier(iteration)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: str, warmup_iterations: int, iterations: int,
                 decay_start: int = 0) -> None:
        self.optimizer = optimizer
        self.base_rates = [group["lr"] for group in optimizer.param_groups]
        name = "constant_with_warmup" if schedule == "constant" and warmup_iterations else schedule
        self.iterations = iterations
        self.multiplier = None  # constant: the optimizer keeps the configured rate, untouched
        if name != "constant":
            from diffusers.optimization import get_scheduler  # diffusers loads with the model, not with the config

            if decay_start:  # warm-up and hold, then the decay over the iterations after decay_start
                hold = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup_iterations).lr_lambdas[0]
                decay = get_scheduler(name, optimizer, num_warmup_steps=0, num_training_steps=max(1, iterations - decay_start)).lr_lambdas[0]
                self.multiplier = lambda i: hold(i) if i < decay_start else decay(i - decay_start)
            else:
                curve = get_scheduler(name, optimizer, num_warmup_steps=warmup_iterations, num_training_steps=iterations)
                self.multiplier = curve.lr_lambdas[0]  # the curve only: its own step counter is never used

    def set(self, iteration: int) -> float:
        """Apply iteration's rates; returns the first group's."""
        if self.multiplier is None:
            return self.base_rates[0]
        factor = self.multiplier(min(iteration, self.iterations))
        for group, rate in zip(self.optimizer.param_groups, self.base_rates):
            group["lr"] = rate * factor
        return self.base_rates[0] * factor
