"""The learning rate over a run: each schedule's rate at every iteration against its closed form."""

from __future__ import annotations

import math

import pytest
import torch

from branchdiff.errors import ConfigError
from branchdiff.settings.load import load_config
from branchdiff.training.lr_schedule import LearningRateSchedule


def _optimizer(rates: list[float]) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": rate} for rate in rates]
    return torch.optim.AdamW(groups)


def _expected(schedule: str, i: int, warmup: int, n: int) -> float:
    if i < warmup:
        return i / warmup
    progress = (i - warmup) / (n - warmup)
    return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[schedule]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_every_group_follows_the_closed_form_at_every_iteration(schedule, warmup):
    iterations = 12
    optimizer = _optimizer([2e-4, 5e-5])
    learning_rate = LearningRateSchedule(optimizer, schedule, warmup, iterations)
    for i in [*range(iterations), 5, 0]:  # out of order, as after a resume: a function of the iteration alone
        first = learning_rate.set(i)
        factor = _expected(schedule, i, warmup, iterations)
        assert first == pytest.approx(2e-4 * factor, rel=1e-12, abs=1e-18)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([2e-4 * factor, 5e-5 * factor], rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 2])
def test_a_decay_start_holds_the_rate_then_decays_to_zero_at_the_end(schedule, warmup):
    """decay_start D: the warm-up, the base rate exactly until D, then the curve over the N − D iterations left."""
    iterations, start = 12, 5
    optimizer = _optimizer([2e-4])
    learning_rate = LearningRateSchedule(optimizer, schedule, warmup, iterations, decay_start=start)
    for i in [*range(iterations), 7, 1]:
        factor = (i / warmup if i < warmup else 1.0) if i < start else _expected(schedule, i - start, 0, iterations - start)
        assert learning_rate.set(i) == pytest.approx(2e-4 * factor, rel=1e-12, abs=1e-18)
    short = LearningRateSchedule(_optimizer([2e-4]), schedule, 0, start, decay_start=start)  # a run no longer than D never decays
    assert [short.set(i) for i in range(start)] == [2e-4] * start


def test_a_decay_start_needs_a_decay_and_follows_the_warmup():
    with pytest.raises(ConfigError, match="'train.decay_start' = 600 needs a decaying train.lr_schedule"):
        load_config("tiny-mix", ["train.decay_start=600"])
    with pytest.raises(ConfigError, match=r"'train.decay_start' = 5 is inside the warm-up .*train.decay_start=10\)"):
        load_config("tiny-mix", ["iterations=100", "train.lr_schedule=cosine", "train.warmup_iterations=10", "train.decay_start=5"])


def test_constant_leaves_the_optimizer_as_built():
    optimizer = _optimizer([1e-3])
    before = optimizer.state_dict()["param_groups"]
    assert LearningRateSchedule(optimizer, "constant", 0, 10).set(7) == 1e-3
    assert optimizer.state_dict()["param_groups"] == before  # the configured rate exactly, no scheduler keys


def test_a_warmup_as_long_as_the_run_is_refused():
    with pytest.raises(ConfigError, match=r"'train.warmup_iterations' = 10 is not below iterations = 10; .*train.warmup_iterations=1\)"):
        load_config("tiny-mix", ["iterations=10", "train.warmup_iterations=10"])
    with pytest.raises(ConfigError, match="'train.lr_schedule' = 'step'"):
        load_config("tiny-mix", ["train.lr_schedule=step"])


def test_the_trainer_steps_with_the_scheduled_rate(tiny_model_dir, tmp_path):
    """The rate the prepared optimizer holds during an iteration's update is the schedule's."""
    from branchdiff.training.recipe import Trainer

    config = load_config("tiny-chain", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "iterations=4", "train.lr_schedule=linear",
                                        "prompts.per_iteration=1", "tree.roots=2", "sampling.num_steps=2", "final_eval=false",
                                        "logging.report_to=none", "reward=rewards_for_tests:Redness"])
    trainer = Trainer(config)
    seen = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    for iteration in range(2, 4):
        assert trainer.run_iteration(iteration).metrics["learning_rate"] == pytest.approx(3e-5 * (4 - iteration) / 4, rel=1e-12)
    assert seen == pytest.approx([3e-5 * 2 / 4, 3e-5 * 1 / 4], rel=1e-12)


@pytest.mark.parametrize("decay_start", [0, 6])
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_past_the_runs_end_the_rate_stays_at_its_final_zero(schedule, decay_start):
    """A loop that trains past `iterations` (bench curves trains for a time budget) keeps the final rate, 0: diffusers'
    cosine curve, read past its end, rises again (½(1 + cos(π·1.5)) = 0.5 at 1.5× its length)."""
    iterations = 12
    optimizer = _optimizer([1e-4])
    learning_rate = LearningRateSchedule(optimizer, schedule, 0, iterations, decay_start=decay_start)
    assert learning_rate.set(iterations) == 0.0
    for i in (iterations + 1, iterations + 3, 2 * iterations - decay_start, 3 * iterations):
        assert learning_rate.set(i) == 0.0
        assert optimizer.param_groups[0]["lr"] == 0.0
