"""The published conventions, each a setting with its alternative (docs/objectives.md), against float64 computations
written from the papers and their public code: Diffusion-DPO's β on velocity or ε errors, MC-GRPO's median absolute
deviation with its rescaling, AWM's warm-up of its average's decay, DGPO's fast-moving average as its reference, and
leaving σ = 1 out of the forward-process objectives' steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from branchdiff.core.advantage import depthwise_advantages, mad_advantages, resolve_scale
from branchdiff.core.loss import diffusion_dpo_loss, epsilon_error
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.errors import ConfigError
from branchdiff.objectives.awm import average_decay
from branchdiff.settings.load import load_config

SMALL = ["prompts.per_iteration=2", "final_eval=false", "logging.report_to=none", "logging.sample_every=0"]


def test_dpo_on_velocity_errors_at_beta_is_the_epsilon_form_at_beta_over_one_minus_sigma_squared():
    """x_σ = (1 − σ)·x0 + σ·ε; the ε a velocity v̂ predicts, ε̂ = (x_σ − (1 − σ)·x̂0)/σ with x̂0 = x_σ − σ·v̂, is written
    out here in float64: the ε error is (1 − σ)² times the velocity error, and DPO at β on velocity errors equals
    the paper's ε form at β/(1 − σ)²."""
    generator = torch.Generator().manual_seed(0)
    shape = (4, 3, 8, 8)
    x0_w, x0_l, eps = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(3))
    for sigma in (0.1, 0.45, 0.9):
        v_errors, e_errors = [], []
        for x0 in (x0_w, x0_l):
            x_t = (1 - sigma) * x0 + sigma * eps
            for offset in (0.0, 0.3):  # the policy's and the reference's predictions
                v_hat = (eps - x0) + offset * torch.randn(shape, generator=generator, dtype=torch.float64)
                x0_hat = x_t - sigma * v_hat
                eps_hat = (x_t - (1 - sigma) * x0_hat) / sigma
                v_errors.append((v_hat - (eps - x0)).pow(2).flatten(1).mean(1))
                e_errors.append((eps_hat - eps).pow(2).flatten(1).mean(1))
        sigmas = torch.full((4,), sigma, dtype=torch.float64)
        assert torch.allclose(epsilon_error(v_errors[0], sigmas), e_errors[0], rtol=1e-12)
        beta = 100.0

        def paper(errors, b):  # −log σ(−(β/2)·[(ℓθ(w) − ℓref(w)) − (ℓθ(l) − ℓref(l))]) in float64
            inside = -(b / 2) * ((errors[0] - errors[1]) - (errors[2] - errors[3]))
            return torch.log1p(torch.exp(-inside))

        velocity = diffusion_dpo_loss(v_errors[0], v_errors[1], v_errors[2], v_errors[3], beta).double()
        assert torch.allclose(velocity, paper(e_errors, beta / (1 - sigma) ** 2), rtol=1e-6)
        in_epsilon = diffusion_dpo_loss(*(epsilon_error(e, sigmas) for e in v_errors), beta).double()
        assert torch.allclose(in_epsilon, paper(e_errors, beta), rtol=1e-6)


def test_the_dpo_plans_loss_in_epsilon_units_equals_an_independent_computation(tmp_path):
    """Online DPO with `dpo.error: epsilon`, after the weights moved: each pair term's loss from the ε errors of an
    independent forward (the ε form at β)."""
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config("tiny-dpo", [f"output_dir={tmp_path}", "dpo.error=epsilon", "dpo.beta=3000", *SMALL]))
    rollout, _, rewards, info = trainer.rollout_and_score(0)
    signal = trainer.objective.signal(rollout, rewards.total, 0)
    plan = trainer.objective.plan(rollout, info["embeds"], signal, info["address"])
    with torch.no_grad():
        for p in trainer.finetune.params:
            p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    terms, rows = plan.terms_drawn, plan.forward_batches[0]
    loss = plan.loss(0).double()
    embeds = {k: v[terms.prompt[rows]] for k, v in info["embeds"].items()}
    with torch.no_grad():
        v_theta = trainer.adapter.predict(terms.x_t[rows], terms.times[rows], embeds, None).double()
        with trainer.finetune.base() as base:
            v_ref = base.predict(terms.x_t[rows], terms.times[rows], embeds, None).double()
    sigma = terms.sigma[rows].double().view(-1, 1, 1, 1)
    x_t, eps = terms.x_t[rows].double(), terms.noise[rows].double()

    def eps_error(v):
        x0_hat = x_t - sigma * v
        return ((x_t - (1 - sigma) * x0_hat) / sigma - eps).pow(2).flatten(1).mean(1)

    theta, ref = eps_error(v_theta), eps_error(v_ref)
    e = len(rows) // 2
    inside = -(3000 / 2) * ((theta[:e] - ref[:e]) - (theta[e:] - ref[e:]))
    assert e > 0 and torch.allclose(loss, torch.log1p(torch.exp(-inside)), rtol=1e-4, atol=1e-6)


def _mad_reference(values: np.ndarray) -> np.ndarray:
    """MC-GRPO's public scaling of one group, written from its description: (r − median)/(MAD + 1e-3), then the non-zero
    advantages times the group's count over their number."""
    median = np.median(values)
    mad = np.median(np.abs(values - median))
    advantages = (values - median) / (mad + 1e-3)
    nonzero = np.count_nonzero(advantages)
    return advantages * (len(values) / nonzero if nonzero else 1.0)


def test_median_lower_takes_an_even_groups_lower_middle_as_torch_median_does():
    """`advantage.baseline: median-lower`, MC-GRPO's public code: an even group's median is torch.median's (the lower of the
    two middle values), the node there is the pivot, and the MAD uses it too; against torch.median per group. On a tree depth
    of two nodes the mean-of-two rule gave ±0.707 for any gap; the lower rule 0 and one full-gap residual."""
    from branchdiff.core.advantage import group_medians

    rng = np.random.default_rng(1)
    values = torch.from_numpy(rng.normal(size=24))
    groups = torch.tensor([0] * 4 + [1] * 6 + [2] * 2 + [3] * 5 + [4] * 7)
    medians, pivots = group_medians(values, groups, 5, lower=True)
    expected = torch.stack([values[groups == g].median() for g in range(5)])
    assert torch.equal(medians, expected)
    assert pivots.sum() == 5 and all(values[pivots][g] == expected[g] for g in range(5))
    ours = mad_advantages(values, groups, 5, lower=True)
    for g in range(5):  # the public code's MAD: torch.median both times
        row = values[groups == g]
        residual = row - row.median()
        advantages = residual / ((residual.abs()).median() + 1e-3)
        nonzero = int((advantages != 0).sum())
        assert torch.allclose(ours[groups == g], advantages * len(row) / nonzero, rtol=1e-12)
    two = torch.tensor([0.2, 0.9], dtype=torch.float64)
    assert group_medians(two, torch.tensor([0, 0]), 1)[0].tolist() == [pytest.approx(0.55)]
    assert group_medians(two, torch.tensor([0, 0]), 1, lower=True)[0].tolist() == [0.2]
    assert load_config("tiny-mc-grpo", ["advantage.baseline=median-lower"]).advantage.baseline == "median-lower"


def test_mc_grpos_mad_scaling_against_numpy_and_how_far_it_is_from_the_std():
    """4 groups of 9 normal rewards (the outside check's case): the MAD advantages equal numpy's computation, and their
    ratio to the std advantages differs from group to group (the step each prompt takes changes)."""
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(4, 9))
    groups = torch.arange(4).repeat_interleave(9)
    ours = mad_advantages(torch.from_numpy(rewards.flatten()), groups, 4).numpy().reshape(4, 9)
    assert np.allclose(ours, np.stack([_mad_reference(row) for row in rewards]), rtol=1e-12)
    tree = build_tree(TreeSpec(num_steps=2, roots=9), 4)  # chains: each depth of a prompt holds its 9 samples
    node_rewards = torch.zeros(tree.num_nodes, dtype=torch.float64)
    for depth in range(3):
        for prompt in range(4):
            level = torch.arange(tree.level_start[depth], tree.level_start[depth + 1])
            nodes = level[tree.prompt[level] == prompt]  # (9,) the prompt's chains at this depth
            node_rewards[nodes] = torch.from_numpy(rewards[prompt])
    mad = depthwise_advantages(tree, node_rewards, baseline="median", scale="mad")
    std = depthwise_advantages(tree, node_rewards, baseline="median", scale="std")
    last = torch.arange(tree.level_start[2], tree.level_start[3])
    expected = np.stack([_mad_reference(row) for row in rewards])
    assert np.allclose(torch.stack([mad[last][tree.prompt[last] == g] for g in range(4)]).numpy(), expected, rtol=1e-12)
    ratios = [float(mad[last][tree.prompt[last] == g].abs().sum() / std[last][tree.prompt[last] == g].abs().sum()) for g in range(4)]
    assert max(ratios) - min(ratios) > 0.2 and all(r > 1 for r in ratios), ratios
    assert resolve_scale("auto", "median") == "mad" and resolve_scale("auto", "mean") == "std" and resolve_scale("auto", "median", "batch") == "std"
    assert load_config("tiny-mc-grpo").advantage.scale == "auto"
    with pytest.raises(ConfigError, match=r"'advantage.scale' = 'mad' divides each group's distances from its median by their median"):
        load_config("tiny-chain", ["advantage.scale=mad"])


def test_awms_average_warms_up_as_the_public_recipes_do(tmp_path):
    """d = min(0.3, 0.001·n) with n the optimizer steps so far (it was 0.3 from the first iteration); the average after
    two iterations against the float64 recursion of the weights after each."""
    assert [average_decay(0.3, 0.001, n) for n in (0, 4, 299, 300, 5000)] == [0.0, 0.004, 0.299, 0.3, 0.3]
    assert average_decay(0.3, 0.0, 4) == 0.3
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config("tiny-awm", [f"output_dir={tmp_path}", "awm.average_decay_rate=0.05", "train.learning_rate=1e-3", *SMALL]))
    params = trainer.finetune.params
    average = [p.detach().double().clone() for p in params]
    for iteration in range(2):
        trainer.run_iteration(iteration)
        d = min(0.3, 0.05 * trainer.run_state["optimizer_steps"])
        average = [d * a + (1 - d) * p.detach().double() for a, p in zip(average, params)]
    with trainer.objective.policy_average.swapped_in():
        assert all(torch.allclose(p.double(), a, atol=1e-6) for p, a in zip(params, average))


def test_dgpos_ema_reference_follows_every_optimizer_step(tmp_path):
    """`dgpo.reference: ema`: after each optimizer step θ_ref ← d·θ_ref + (1 − d)·θ with d = min(0.001·n, 0.3), n the steps
    before this one, as the public code's min(0.3, 0.001·global_step) (its first step copies θ; the average was one step
    ahead: d = 0.001 at the first), here a rate of 0.2 so that the cap is reached, against the float64 recursion of the
    weights after each step; the plan's reference error is the average's at the minibatch (ℓ_ref of the moving policy)."""
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config("tiny-dgpo", [f"output_dir={tmp_path}", "dgpo.reference=ema", "dgpo.ema_decay_rate=0.2",
                                                "train.learning_rate=1e-3", *SMALL]))
    params, objective = trainer.finetune.params, trainer.objective
    expected = [p.detach().double().clone() for p in params]
    steps = 0
    original = type(objective).after_step

    def recording(self):
        nonlocal steps, expected
        d = min(0.2 * steps, 0.3)  # the public code's global_step before its increment: 0 at the first step
        steps += 1
        expected = [d * a + (1 - d) * p.detach().double() for a, p in zip(expected, params)]
        original(self)

    type(objective).after_step = recording
    try:
        for iteration in range(2):
            trainer.run_iteration(iteration)
    finally:
        type(objective).after_step = original
    assert steps == trainer.run_state["optimizer_steps"] >= 2
    with objective.reference_weights():
        assert all(torch.allclose(p.double(), a, atol=1e-6) for p, a in zip(params, expected))
    assert trainer.objective.reference_average is not None and load_config("tiny-dgpo").dgpo.reference == "base"


@pytest.mark.parametrize("preset, key", [("tiny-awm", "awm"), ("tiny-dgpo", "dgpo"), ("tiny-dpo", "dpo"), ("tiny-nft", "nft")])
def test_pure_noise_can_be_left_out_of_the_forward_process_steps(preset, key, tmp_path):
    """`skip_pure_noise`: no term at the step where σ = 1 (x_σ = ε); by default that step is drawn like the others."""
    from branchdiff.training.recipe import Trainer

    overrides = ["train.loss=nft"] if preset == "tiny-nft" else []
    preset = "tiny-mix" if preset == "tiny-nft" else preset
    seen = {}
    for skip in (False, True):
        trainer = Trainer(load_config(preset, [f"output_dir={tmp_path / str(skip)}", f"{key}.skip_pure_noise={str(skip).lower()}",
                                               f"{key}.timesteps=10", *overrides, *SMALL]))
        assert float(trainer.schedule.sigmas[0]) == 1.0
        rollout, _, rewards, info = trainer.rollout_and_score(0)
        plan = trainer.objective.plan(rollout, info["embeds"], trainer.objective.signal(rollout, rewards.total, 0), info["address"])
        seen[skip] = set(plan.terms_drawn.steps.tolist())
    assert 0 in seen[False] and 0 not in seen[True] and len(seen[True]) > 1
