"""GRPO-Guard (`train.loss=grpo-guard`): its surrogate against an independent float64 computation
on hand-made Gaussian steps, the rollout's step means recovered from the addressable noise, and on
the tiny model after an update: plain GRPO's log-ratios biased below 0, the guard's centred at 0.
(Two processes: tests/test_multiprocess.py; every flow family: tests/test_model_families.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from branchdiff.core.loss import guard_surrogate
from branchdiff.errors import ConfigError
from branchdiff.schedulers.flow import gaussian_log_prob
from branchdiff.settings.load import load_config


def _reference(sample, old_mean, mean, std, step_size, advantage, clip):
    """One edge in float64: the log-densities summed element by element, the bias, the ratio, the loss."""
    d = sample.numel()
    log_p = sum(-(float(x) - float(m)) ** 2 / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi) for x, m in
                zip(sample.flatten(), mean.flatten())) / d
    log_old = sum(-(float(x) - float(m)) ** 2 / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi) for x, m in
                  zip(sample.flatten(), old_mean.flatten())) / d
    bias = sum((float(a) - float(b)) ** 2 for a, b in zip(mean.flatten(), old_mean.flatten())) / d / (2 * std**2)
    log_ratio = std * (log_p - log_old + bias)
    ratio = math.exp(log_ratio)
    loss = max(-advantage * ratio, -advantage * min(max(ratio, 1 - clip), 1 + clip)) / step_size
    return loss, log_ratio


def test_the_surrogate_equals_the_formula_and_its_log_ratio_is_the_noise_against_the_change_of_the_mean():
    g = torch.Generator().manual_seed(0)
    old_mean = torch.randn(6, 2, 3, 3, generator=g, dtype=torch.float64)
    eps = torch.randn(6, 2, 3, 3, generator=g, dtype=torch.float64)
    std = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.4, 0.6], dtype=torch.float64)
    shift = torch.tensor([1e-6, 1e-5, 3e-4, 1e-3, 2e-2, 0.1], dtype=torch.float64).view(-1, 1, 1, 1)
    mean = old_mean + shift * torch.randn(6, 2, 3, 3, generator=g, dtype=torch.float64)
    sample = old_mean + std.view(-1, 1, 1, 1) * eps
    step_size = torch.tensor([0.1, 0.12, 0.09, 0.1, 0.11, 0.08], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 2.0, -0.5, 0.7, -2.0], dtype=torch.float64)
    clip = 1e-4
    log_p, log_old = gaussian_log_prob(sample, mean, std).double(), gaussian_log_prob(sample, old_mean, std).double()
    loss, clipped, log_ratio = guard_surrogate(log_p, log_old, mean, old_mean, std, step_size, advantages, clip)
    for e in range(6):
        expected_loss, expected_log_ratio = _reference(sample[e], old_mean[e], mean[e], float(std[e]), float(step_size[e]),
                                                       float(advantages[e]), clip)
        assert loss[e].item() == pytest.approx(expected_loss, rel=1e-4, abs=1e-7)
        assert log_ratio[e].item() == pytest.approx(expected_log_ratio, rel=1e-3, abs=1e-7)
        assert clipped[e].item() == (abs(math.exp(expected_log_ratio) - 1) > clip)
    # the identity behind the guard: s·(logp_θ − logp_old + b) = mean(ε·(μ_θ − μ_old)), whatever s
    # (up to the float32 log-probs' rounding, a few 1e-8 here: far below the clip range of 2e-6)
    identity = (eps * (mean - old_mean)).flatten(1).mean(dim=1)
    assert torch.allclose(log_ratio.double(), identity, rtol=1e-3, atol=1e-7)
    assert clipped.tolist() == [False, False, False, True, True, True]  # |log ρ̃| above 1e-4 from the fourth on


def _trainer(tmp_path, *extra):
    from branchdiff.training.recipe import Trainer

    return Trainer(load_config("tiny-chain", [f"output_dir={tmp_path}", "iterations=2", "prompts.per_iteration=4", "tree.roots=8",
                                              "train.loss=grpo-guard", "sampling.num_steps=4", "final_eval=false", "logging.report_to=none",
                                              "logging.sample_every=0", "train.learning_rate=1e-3", "train.minibatch=8", *extra]))


def test_after_an_update_plain_log_ratios_sit_below_zero_and_the_guards_are_centred(tmp_path, monkeypatch):
    """The iteration's rollout is kept; the trainer then runs the same iteration (the same rollout,
    then an update); the edges' ratios are measured on the kept rollout with the updated weights, as
    a later minibatch of the iteration sees them."""
    import branchdiff.objectives.grpo_guard as guard_module

    trainer = _trainer(tmp_path)
    rollout, _, rewards, info = trainer.rollout_and_score(0)
    plan_before = trainer.objective.plan(rollout, info["embeds"], trainer.objective.signal(rollout, rewards.total, 0), info["address"])
    guard_ratios = []
    original = guard_module.guard_surrogate

    def recording(*args):
        out = original(*args)
        guard_ratios.append(out[2].detach())
        return out

    monkeypatch.setattr(guard_module, "guard_surrogate", recording)
    plan_before.loss(0)  # before any update: the rollout's means are recovered, every ratio is 1
    assert plan_before.stats["logprob_check"] < 1e-5 and guard_ratios[0].abs().max() < 1e-6
    assert trainer.run_iteration(0).metrics["optimizer_steps"] == 1
    guard_ratios.clear()
    signal = trainer.objective.signal(rollout, rewards.total, 0)
    plan = trainer.objective.plan(rollout, info["embeds"], signal, info["address"])
    plain = []
    for index in range(len(plan.terms)):
        parent_rows, edge_rows = plan.minibatches[index], plan.minibatch_edges[index]
        local = torch.searchsorted(parent_rows, plan.edge_parent[edge_rows])
        with torch.no_grad():
            plain.append(plan.edge_losses(plan.parents[parent_rows], plan.edges[edge_rows], local)[1])
    plain, guarded = torch.cat(plain), torch.cat(guard_ratios)
    assert len(plain) == len(guarded) == int(signal.trained.sum()) >= 64

    def standard_error(x):
        return x.std().item() / math.sqrt(len(x))

    assert plain.mean().item() < -5 * standard_error(plain)  # biased below 0: ratios below 1
    assert abs(guarded.mean().item()) < 3 * standard_error(guarded)  # centred
    assert (guarded.exp().mean() - 1).abs().item() < (plain.exp().mean() - 1).abs().item()


def test_a_ddim_family_is_refused_by_the_settings():
    with pytest.raises(ConfigError, match="'train.loss' = 'grpo-guard' weighs each step by its σ step size; model.family=sd15 is an "
                                          "ε-prediction \\(DDIM\\) family: use train.loss=grpo"):
        load_config("sd15-hps", ["train.loss=grpo-guard"])


def test_a_run_resumed_from_its_checkpoint_ends_like_an_unstopped_one(tmp_path):
    """Two optimizer steps per iteration, so the second sees moved weights and the guard's clip acts."""
    from resumed_runs import assert_resumed_run_equals_straight  # tests/ is on sys.path

    def args(run, iterations):
        return ["train", "tiny-chain", f"output_dir={run}", f"iterations={iterations}", "prompts.per_iteration=2", "tree.roots=2",
                "train.loss=grpo-guard", "sampling.num_steps=4", "final_eval=false", "logging.report_to=none", "logging.sample_every=0",
                "logging.checkpoint_every=1", "train.learning_rate=1e-3", "train.minibatch=2", "train.optimizer_every=8"]

    lines = assert_resumed_run_equals_straight(args, tmp_path, 1, 2)
    assert lines[1]["optimizer_steps"] == 2 and lines[1]["clip_fraction"] > 0
