"""The losses of AWM, DGPO, Flow-DPPO and Diffusion-DPO, and MC-GRPO's median baseline, each against a
float64 computation written from the paper's formula on hand-made tensors: a term, a sign or a
scale off fails here. (Their runs, resumes and two processes: tests/test_objectives_runs.py,
tests/test_multiprocess.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from branchdiff.core.advantage import depthwise_advantages, group_medians, median_pivots
from branchdiff.core.loss import (
    AWM_WEIGHTINGS,
    awm_surrogate,
    awm_weighted_error,
    dgpo_group_weights,
    diffusion_dpo_loss,
    dppo_surrogate,
    flow_matching_error,
)
from branchdiff.core.tree import Split, TreeSpec, build_tree


def _errors(n: int = 6, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    v, x0, noise = (torch.randn(n, 2, 3, 3, generator=g) for _ in range(3))
    return v, x0, noise


def test_the_denoising_error_is_the_mean_squared_distance_to_the_flow_matching_velocity():
    v, x0, noise = _errors()
    expected = [sum((float(a) - (float(e) - float(x))) ** 2 for a, e, x in zip(v[i].flatten(), noise[i].flatten(), x0[i].flatten())) / 18
                for i in range(6)]
    assert torch.allclose(flow_matching_error(v, x0, noise).double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6)


@pytest.mark.parametrize("weighting", AWM_WEIGHTINGS)
def test_awm_weightings_are_the_public_implementations_forms(weighting):
    error = torch.tensor([0.0, 0.01, 0.3, 1.7, 4.0])
    sigma = torch.tensor([0.9, 0.5, 0.25, 0.1, 1.0])
    c, p = 1e-10, 0.4
    forms = {"uniform": lambda e, s: e, "t": lambda e, s: s * e, "t2": lambda e, s: s * s * e,
             "huber": lambda e, s: s * (math.sqrt(e + c) - 1e-5), "ghuber": lambda e, s: s * ((e + c) ** p - c**p) / p}
    expected = torch.tensor([forms[weighting](float(e), float(s)) for e, s in zip(error, sigma)], dtype=torch.float64)
    assert torch.allclose(awm_weighted_error(error, sigma, weighting, p).double(), expected, rtol=1e-6, atol=1e-9)


def test_awm_first_step_gradient_is_the_advantage_weighted_matching_gradient_and_the_clip_holds_far_ratios():
    """At ρ = exp(w_old − w_θ) = 1 the surrogate's gradient in w_θ is A: minimising it lowers the matching
    loss of positive-advantage samples and raises that of negative ones; past 1 ± ε the clipped side has none."""
    weighted = torch.tensor([0.5, 0.5, 0.5, 0.5], requires_grad=True)
    advantages = torch.tensor([1.0, -2.0, 1.0, -1.0])
    old = torch.tensor([0.5, 0.5, 0.9, 0.1])  # rows 2, 3: ρ = e^0.4 > 1 + ε (A > 0), e^−0.4 < 1 − ε (A < 0)
    loss, clipped = awm_surrogate(weighted, old, advantages, clip_range=0.2)
    loss.sum().backward()
    ratio = torch.exp(old.double() - 0.5)
    expected = torch.maximum(-advantages.double() * ratio, -advantages.double() * ratio.clamp(0.8, 1.2))
    assert torch.allclose(loss.double(), expected, atol=1e-6)
    assert torch.allclose(weighted.grad[:2], advantages[:2]) and weighted.grad[2:].abs().max() == 0
    assert clipped.tolist() == [False, False, True, True]


def test_dgpo_weights_give_the_gradient_of_the_group_preference_loss():
    """Σ_i σ(−z_g)·A_i·ℓ_θ,i (weights held) has the gradient of −log σ(z_g), z_g = (β/G)·Σ A_i·(ℓ_ref,i − ℓ_θ,i),
    divided by β/G, for every group; and the weight itself is σ(−z_g) computed term by term."""
    g = torch.Generator().manual_seed(1)
    error = (torch.rand(7, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True)
    reference = torch.rand(7, generator=g, dtype=torch.float64) + 0.5
    advantages = torch.tensor([1.2, -0.3, -0.9, 0.8, -0.8, 0.5, -0.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    size = torch.tensor([3, 2, 2])
    beta = 7.0
    weight = dgpo_group_weights(error, reference, advantages, groups, beta, size).double()
    for k in range(3):
        rows = groups == k
        z = beta / int(size[k]) * float((advantages[rows] * (reference[rows] - error.detach()[rows])).sum())
        assert torch.allclose(weight[rows], torch.full((int(rows.sum()),), 1 / (1 + math.exp(z)), dtype=torch.float64), atol=1e-6)
    (weight * advantages * error).sum().backward()
    surrogate = error.grad.clone()
    error.grad = None
    paper = sum(-torch.nn.functional.logsigmoid(beta / int(size[k]) * (advantages[groups == k] * (reference[groups == k] - error[groups == k])).sum())
                for k in range(3))
    paper.backward()
    assert torch.allclose(surrogate * beta / size[groups].double(), error.grad, rtol=1e-5)


def test_diffusion_dpo_loss_is_the_bradley_terry_loss_of_the_improvements_with_half_beta():
    chosen, ref_chosen = torch.tensor([0.40, 0.50, 0.30]), torch.tensor([0.50, 0.50, 0.30])
    rejected, ref_rejected = torch.tensor([0.60, 0.50, 0.20]), torch.tensor([0.50, 0.50, 0.30])
    beta = 30.0
    expected = [math.log(1 + math.exp(beta / 2 * ((c - rc) - (r - rr))))
                for c, rc, r, rr in zip(chosen.tolist(), ref_chosen.tolist(), rejected.tolist(), ref_rejected.tolist())]
    loss = diffusion_dpo_loss(chosen, ref_chosen, rejected, ref_rejected, beta)
    assert torch.allclose(loss.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5)
    assert loss[0] < math.log(2) < loss[2] and abs(float(loss[1]) - math.log(2)) < 1e-6  # better on the chosen: below log 2
    error = chosen.clone().requires_grad_(True)
    diffusion_dpo_loss(error, ref_chosen, rejected, ref_rejected, beta).sum().backward()
    assert (error.grad > 0).all()  # lowering the chosen sample's error lowers the loss


def test_dppo_holds_only_edges_outside_the_trust_region_that_push_the_wrong_way():
    s = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5])
    old_mean = torch.zeros(5, 2, 2)
    mean = torch.zeros(5, 2, 2)
    mean[1:] = 0.1  # KL = 0.01/(2·0.25) = 0.02 on edges 1..4
    log_prob = torch.tensor([0.0, 0.3, -0.3, 0.3, -0.3], requires_grad=True)
    old = torch.zeros(5)
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    loss, held, kl = dppo_surrogate(log_prob, old, mean, old_mean, s, advantages, threshold=0.01)
    assert torch.allclose(kl.double(), torch.tensor([0.0, 0.02, 0.02, 0.02, 0.02], dtype=torch.float64), atol=1e-7)
    # edge 1: A > 0 and ρ > 1 beyond the region: held; edge 2: A > 0, ρ < 1 (back toward it): trains; 3: trains; 4: A < 0, ρ < 1: held
    assert held.tolist() == [False, True, False, False, True]
    assert torch.allclose(loss.double(), (-advantages * torch.exp(log_prob)).double().detach(), atol=1e-6)
    loss.sum().backward()
    expected_grad = torch.where(held, torch.zeros(5), -advantages * torch.exp(log_prob.detach()))
    assert torch.allclose(log_prob.grad, expected_grad, atol=1e-6)
    looser = dppo_surrogate(log_prob.detach(), old, mean, old_mean, s, advantages, threshold=0.05)[1]
    assert not looser.any()  # every edge inside the trust region trains


def test_group_medians_pivots_and_median_centred_advantages():
    values = torch.tensor([3.0, 1.0, 2.0, 5.0, 5.0, 4.0, 0.5, 7.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 3])
    medians, pivots = group_medians(values, groups, 5)
    assert medians.tolist() == [2.0, 4.5, 7.0, 1.0, 0.0]  # odd; even (mean of the middle two); one value; ties; empty
    assert pivots.tolist() == [False, False, True, False, False, False, False, False, False, True, False]
    # a chain group of 5 samples: every depth holds the 5 nodes, the chain at the median is the pivot at every depth
    tree = build_tree(TreeSpec(num_steps=3, roots=5), 1)
    leaf_rewards = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.2])
    node_rewards = leaf_rewards[torch.arange(tree.num_nodes) % 5]  # nodes level by level, roots in order
    advantages = depthwise_advantages(tree, node_rewards, baseline="median").double()
    std = leaf_rewards.double().std()
    expected = ((leaf_rewards.double() - 0.5) / (std + 1e-8)).repeat(tree.spec.num_steps + 1)
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.nonzero(median_pivots(tree, node_rewards)).squeeze(1).tolist() == [2, 7, 12, 17]
    mean_centred = depthwise_advantages(tree, node_rewards).double()
    assert torch.allclose(mean_centred, ((leaf_rewards.double() - leaf_rewards.double().mean()) / (std + 1e-8)).repeat(4), atol=1e-6)


def test_median_groups_of_a_tree_are_its_prompt_depths():
    """On a tree the median's group is a prompt's nodes at one depth: 3 after the first split (a pivot),
    9 leaves (a pivot), the root alone (none)."""
    tree = build_tree(TreeSpec(num_steps=2, splits=(Split(0, 3), Split(1, 3))), 2)
    node_rewards = torch.arange(tree.num_nodes, dtype=torch.float32).flip(0)
    pivots = median_pivots(tree, node_rewards)
    for prompt in range(2):
        for depth, count in ((0, 0), (1, 1), (2, 1)):
            assert int(pivots[(tree.prompt == prompt) & (tree.depth == depth)].sum()) == count
