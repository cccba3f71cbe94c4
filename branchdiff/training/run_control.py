"""What the training loop (branchdiff/training/recipe.py) decides between iterations: Ctrl-C's request to
stop after the iteration under way, when the run report is rewritten, the progress bar's fields, and why a run cannot go on."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from branchdiff.runtime.abort import abort_now
from branchdiff.settings.config import TrainConfig
from branchdiff.training.hacking import WatchState, kept_best, stop_line

WEAK_SIGNAL = 0.25  # the progress bar warns when more than this fraction of groups has no reward spread


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after a checkpoint (exit 130)."""


class InterruptRequest:
    """While active, a first SIGINT only sets `requested` (the loop stops at the end of the
    iteration); a second one ends the process at once (`abort_now`)."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            abort_now("aborted by a second Ctrl-C; checkpoints already saved are intact (continue from one with --resume latest)")
        self.requested = True
        print("\nbranchdiff: stopping after this iteration with a checkpoint (Ctrl-C again to abort now)", file=sys.stderr)

    def __enter__(self) -> InterruptRequest:
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)


class ReportSchedule:
    """When a checkpoint rewrites the run report: once the run has trained `first_after` seconds, then when the
    time since the last write ended is at least `ratio` times that write's own duration, so drawing the report
    takes at most 1 / (1 + ratio) of the run's time (its figures take seconds: on the built-in model, longer
    than an iteration). A run whose iterations take minutes rewrites it at every checkpoint; a run shorter
    than `first_after`, when it ends."""

    def __init__(self, ratio: float = 9.0, first_after: float = 20.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ratio, self.clock = ratio, clock
        self.next = clock() + first_after  # the earliest time of the next write

    def due(self) -> bool:
        return self.clock() >= self.next

    def write(self, write_report: Callable[[], object]) -> None:
        start = self.clock()
        write_report()
        end = self.clock()
        self.next = end + self.ratio * (end - start)


def progress_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's fields: reward, tiny-task accuracy when scored, and a warning when many
    groups carry no signal (all their samples scored alike) or were dropped."""
    if "reward_mean" not in metrics:  # a dataset objective's iteration: no reward, its loss instead
        fields = {"loss": f"{metrics['loss']:.4f}"} if "loss" in metrics else {}
        held_out = next((key for key in metrics if key.startswith("eval_") and key.endswith(".strict")), None)
        if held_out:
            fields["held-out strict"] = f"{metrics[held_out]:.2f}"
        return fields
    fields = {"reward": f"{metrics['reward_mean']:.3f}"}
    if "accuracy_strict" in metrics:
        fields["strict"] = f"{metrics['accuracy_strict']:.2f}"
    held_out = next((key for key in metrics if key.startswith("eval_") and key.endswith(".strict")), None)  # a verifier's held-out accuracy
    if held_out:
        fields["held-out strict"] = f"{metrics[held_out]:.2f}"
    if metrics["reward_zero_spread_fraction"] > WEAK_SIGNAL:
        fields["no-spread groups"] = f"{metrics['reward_zero_spread_fraction']:.0%}"
    if metrics["groups_dropped"]:
        fields["dropped groups"] = str(metrics["groups_dropped"])
    if metrics["steps_skipped"]:
        fields["skipped steps"] = str(metrics["steps_skipped"])
    return fields


def stop_reason(config: TrainConfig, metrics: dict[str, float], skipped_in_a_row: int, processes: int, watch_state: WatchState,
                gold_score: str | None, run_dir: Path | None = None) -> str | None:
    """Why the run cannot go on after this iteration's `metrics`, or None: every group dropped, `skipped_in_a_row`
    optimizer steps skipped, or the reward-hacking watch's stop (`watch.stop`; the weights of its best gold are in
    run_dir/best/)."""
    iteration = cast(int, metrics["iteration"])  # an int among the floats
    if metrics.get("groups_dropped") == config.prompts.per_iteration * processes:  # (none for a dataset objective)
        nonfinite = [k.removesuffix("_nonfinite") for k, v in metrics.items() if k.endswith("_nonfinite") and v]
        failed = [k.removesuffix("_failed") for k, v in metrics.items() if k.endswith("_failed") and v]
        culprits = ", ".join([*(f"{n} (non-finite scores)" for n in nonfinite), *(f"{n} (failed)" for n in failed)]) or "the reward"
        return (f"every group of iteration {iteration} had a non-finite reward ({culprits}), so nothing can be trained; "
                "check the reward on a few images (branchdiff rewards check NAME) and continue with --resume latest")
    if skipped_in_a_row >= config.train.max_skipped_steps:
        return (f"{skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient (up to iteration {iteration}); "
                "the weights before them are saved; lower train.learning_rate or check the reward's scale, then start a new run")
    if config.watch.stop and metrics.get("watch_diverging"):
        assert gold_score is not None  # the watch flags only after an evaluation, which follows the gold score
        return stop_line(watch_state, config.watch.window, gold_score, iteration, kept_best(run_dir) if run_dir else None, run_dir)
    return None
