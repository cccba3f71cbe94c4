"""The reward-hacking watch: the training reward against a held-out "gold" score over time.

A policy can learn to please its reward without doing the task: a colour-only reward is won by
painting the whole image in the prompt's colour, while the objects the prompt asks for disappear.
A run guards against it by naming a gold score it does not train on (an `eval_rewards` score, e.g.
the strict verifier `tiny-geneval.strict`, or a preference model other than the trained one) and
evaluating it every `eval_every` iterations. An evaluation at iteration i measures the policy that
grows iteration i's rollouts, so evaluation k pairs its gold score with that iteration's training
reward, and the watch compares evaluation k with evaluation k − w (w = `watch.window`):

    train_k = the training reward (`reward_mean`) of the iteration evaluation k precedes
    diverging  ⇔  train_k > train_{k−w}  and  gold_k < gold_{k−w} − tolerance

(`watch.tolerance` keeps the evaluation's sampling noise from raising the flag). The metrics carry
`watch_reward`, `watch_gold` and `watch_diverging` at every evaluation, the report plots them, and
with `watch.stop` the run stops after a checkpoint when the flag rises. By then the policy has moved
past its best: with `watch.stop`, every evaluation whose gold beats all earlier ones exports the weights
it evaluated to RUN/best/ (as the run's final export, with best.json naming its iteration and gold), so
a stopped run keeps the weights of its best gold estimate, not its last. What the watch keeps
(`WatchState`) is part of the checkpoint, so a resumed run watches on unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

BEST = "best"  # RUN/best/: the weights of the best held-out gold so far (watch.stop)


def diverging(train: list[float], gold: list[float], window: int, tolerance: float) -> bool:
    """Whether, over the last `window` evaluations, the training reward rose while the gold score
    fell by more than `tolerance` (module doc). `train[k]`, `gold[k]`: the values at evaluation k."""
    if len(train) <= window or len(gold) <= window:
        return False
    return train[-1] > train[-1 - window] and gold[-1] < gold[-1 - window] - tolerance


@dataclass
class WatchState:
    """Every evaluation's pair of training reward and gold score so far."""

    train: list[float] = field(default_factory=list)  # train_k of each evaluation
    gold: list[float] = field(default_factory=list)  # gold_k of each evaluation

    def add_evaluation(self, reward: float, gold: float, window: int, tolerance: float) -> dict[str, float]:
        """Record evaluation k (its iteration's training reward and its gold score) and return its watch metrics."""
        self.train.append(reward)
        self.gold.append(gold)
        return {"watch_reward": reward, "watch_gold": gold, "watch_diverging": float(diverging(self.train, self.gold, window, tolerance))}

    def to_dict(self) -> dict:
        return {"train": list(self.train), "gold": list(self.gold)}


def is_new_best(state: WatchState, gold: float) -> bool:
    """Whether an evaluation's `gold`, before it joins `state`, beats every earlier one (a non-finite gold never does)."""
    return math.isfinite(gold) and all(gold > earlier for earlier in state.gold if math.isfinite(earlier))


def kept_best(run_dir: Path) -> dict | None:
    """RUN/best/best.json (the iteration, gold and score of the weights kept there), or None when nothing is kept."""
    path = run_dir / BEST / "best.json"
    return json.loads(path.read_text()) if path.is_file() else None


def stop_line(state: WatchState, window: int, gold_name: str, iteration: int, kept: dict | None = None, run_dir: Path | None = None) -> str:
    """Why a run stopped when the watch flagged divergence, and where the weights of its best gold are (`kept`, in
    run_dir/best/)."""
    where = (f"the weights of its best evaluation before the alarm (iteration {kept['iteration']}, held-out {gold_name} {kept['gold']:.4g}) "
             f"are in {run_dir / BEST}, the last iteration's in the checkpoint" if kept is not None and run_dir is not None else "the checkpoint is saved")
    return (f"the training reward rose from {state.train[-1 - window]:.4g} to {state.train[-1]:.4g} while held-out {gold_name} fell from "
            f"{state.gold[-1 - window]:.4g} to {state.gold[-1]:.4g} over the last {window} evaluations (up to iteration {iteration}): the "
            f"policy may be exploiting its reward (reward hacking); {where}; look at the samples in report.html, then "
            "change the reward (or train with a KL term), or continue with watch.stop=false")
