"""A hand-worked tree (T = 3, splits (0, 2) and (1, 3)) checked to exact numbers: counts, NFE,
fusion in every mode, depth-wise advantages in both scopes, every pruning mask and Mix.

Node numbering (level order, one prompt):
    depth 0: r=0      depth 1: a=1, b=2      depth 2: c,d,e=3,4,5 (of a)  f,g,h=6,7,8 (of b)
    depth 3: c'..h' = 9..14 (one child each)
"""

import math

import pytest
import torch

from branchdiff.core import prune
from branchdiff.core.advantage import depthwise_advantages, fuse_rewards
from branchdiff.core.tree import Split, TreeSpec, build_tree

SPEC = TreeSpec(num_steps=3, splits=(Split(0, 2), Split(1, 3)))
LEAVES_1 = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 9.0])
LEAVES_2 = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 4.0])


def test_topology_and_counts():
    tree = build_tree(SPEC, 1)
    assert SPEC.level_sizes() == [1, 2, 6, 6]
    assert (SPEC.nodes, SPEC.leaves, SPEC.rollout_nfe, SPEC.sde_edges()) == (15, 6, 9, 14)
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 5, 6, 7, 8]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    assert tree.paths[4] == (0, 0, 1) and tree.paths[14] == (0, 1, 2, 0)
    assert tree.leaf_index.tolist() == list(range(9, 15))


def test_anchor_counts():
    """BranchGRPO's anchor: T = 20, splits 0,3,6,9 with k = 2 → 16 leaves and 203 forwards per tree."""
    anchor = TreeSpec(20, tuple(Split(s, 2) for s in (0, 3, 6, 9)))
    assert anchor.leaves == 16 and anchor.rollout_nfe == 203
    chain = TreeSpec(20, roots=16)
    assert chain.rollout_nfe == 320 and chain.leaves == 16


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(num_steps=3, splits=(Split(3, 2),)), "outside 0..2"),
        (dict(num_steps=3, splits=(Split(1, 1),)), "k ≥ 2"),
        (dict(num_steps=3, splits=(Split(1, 2), Split(1, 3))), "twice"),
        (dict(num_steps=0), "num_steps"),
    ],
)
def test_invalid_specs(bad, message):
    with pytest.raises(ValueError, match=message):
        TreeSpec(**bad)


def test_fusion_mean_and_max():
    tree = build_tree(SPEC, 1)
    lp = torch.zeros(15)
    mean = fuse_rewards(tree, LEAVES_1, lp, "mean")
    assert mean.tolist() == [4.0, 2.0, 6.0, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9]
    maximum = fuse_rewards(tree, LEAVES_1, lp, "max")
    assert maximum[:3].tolist() == [9.0, 3.0, 9.0]


def test_fusion_logprob_softmax():
    tree = build_tree(SPEC, 1)
    lp = torch.zeros(15)
    lp[3] = math.log(3)  # children of a: weights 3:1:1
    lp[8] = math.log(2)  # children of b: weights 1:1:2
    lp[2] = math.log(3)  # children of r: weights 1:3
    fused = fuse_rewards(tree, LEAVES_1, lp, "logprob_softmax", alpha=1.0)
    a = (3 * 1 + 2 + 3) / 5
    b = (4 + 5 + 2 * 9) / 4
    assert fused[1].item() == pytest.approx(a)
    assert fused[2].item() == pytest.approx(b)
    assert fused[0].item() == pytest.approx((a + 3 * b) / 4)
    # α = 0 is a plain mean over children
    flat = fuse_rewards(tree, LEAVES_1, lp, "logprob_softmax", alpha=0.0)
    assert flat[1].item() == pytest.approx(2.0) and flat[0].item() == pytest.approx(4.0)


def test_depthwise_tree_scope():
    tree = build_tree(SPEC, 1)
    adv = depthwise_advantages(tree, fuse_rewards(tree, LEAVES_1, torch.zeros(15)), "tree")
    assert adv[0].item() == 0.0  # a depth with one node
    assert adv[1:3].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])  # the ±0.707 flaw
    deviations = torch.tensor([-3.0, -2, -1, 0, 1, 5])
    std = math.sqrt(40 / 5)
    assert adv[3:9].tolist() == pytest.approx((deviations / std).tolist())
    assert adv[9:15].tolist() == pytest.approx((deviations / std).tolist())


def test_depthwise_batch_scope():
    tree = build_tree(SPEC, 2)
    leaf_rewards = torch.cat([LEAVES_1, LEAVES_2])  # leaf_index is prompt-major
    adv = depthwise_advantages(tree, fuse_rewards(tree, leaf_rewards, torch.zeros(tree.num_nodes)), "batch")
    depth1 = adv[tree.level(1)]  # nodes a1, b1, a2, b2
    pooled_std = math.sqrt((2**2 + 2**2 + (2 / 3) ** 2 + (2 / 3) ** 2) / (4 - 2))
    expected = [-2 / pooled_std, 2 / pooled_std, -(2 / 3) / pooled_std, (2 / 3) / pooled_std]
    assert depth1.tolist() == pytest.approx(expected)
    assert adv[tree.level(0)].tolist() == [0.0, 0.0]
    # the bigger gap gets the bigger advantage, unlike the tree scope's ±0.707 for both
    tree_scope = depthwise_advantages(tree, fuse_rewards(tree, leaf_rewards, torch.zeros(tree.num_nodes)), "tree")
    assert tree_scope[tree.level(1)].abs().tolist() == pytest.approx([1 / math.sqrt(2)] * 4)


def flat_group_advantages(rewards: torch.Tensor, scope: str) -> torch.Tensor:
    """Independent reference: flat GRPO on a (P, G) matrix, written out with plain loops."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    residuals = [[r - sum(row) / len(row) for r in row] for row in rewards.double().tolist()]
    if scope == "tree":
        for p, row in enumerate(residuals):
            std = math.sqrt(sum(x * x for x in row) / (len(row) - 1))
            out[p] = torch.tensor([x / (std + 1e-8) for x in row]) if std >= 1e-6 else 0.0
    else:
        dof = rewards.numel() - rewards.shape[0]
        std = math.sqrt(sum(x * x for row in residuals for x in row) / dof)
        out = torch.tensor([[x / (std + 1e-8) for x in row] for row in residuals])
    return out


@pytest.mark.parametrize("scope", ["tree", "batch"])
def test_chain_spec_equals_flat_grpo(scope):
    torch.manual_seed(0)
    rewards = torch.rand(3, 5)
    rewards[2] = 0.5  # a prompt whose samples all tie gets zero advantages
    spec = TreeSpec(num_steps=4, roots=5)
    tree = build_tree(spec, 3)
    adv = depthwise_advantages(tree, fuse_rewards(tree, rewards.flatten(), torch.zeros(tree.num_nodes)), scope)
    expected = flat_group_advantages(rewards, scope).flatten().float()
    for depth in range(5):  # every depth of every chain carries its leaf's advantage
        assert torch.allclose(adv[tree.level(depth)], expected, atol=1e-6)
    if scope == "tree":
        assert adv[tree.level(4)][10:].abs().max() == 0


def test_depth_pruning_static_and_sliding():
    tree = build_tree(SPEC, 1)
    assert prune.depth_mask(tree, frozenset({3})).tolist() == [True] * 9 + [False] * 6
    assert prune.depth_mask(tree, frozenset({1, 2})).tolist() == [True] + [False] * 8 + [True] * 6
    slide = [prune.sliding_depths(frozenset({3}), it, interval=2, stop_depth=1) for it in (0, 1, 2, 3, 4, 100)]
    assert slide == [frozenset({3})] * 2 + [frozenset({2})] * 2 + [frozenset({1})] * 2
    assert prune.sliding_depths(frozenset({3}), 50, interval=0, stop_depth=1) == frozenset({3})


def test_width_pruning_modes():
    tree = build_tree(SPEC, 1)
    adv = depthwise_advantages(tree, fuse_rewards(tree, LEAVES_1, torch.zeros(15)), "tree")
    # heads are depth 2 (after the last split, step 1); A there: c -1.06, d -.71, e -.35, f 0, g .35, h 1.77
    per_branch = prune.width_mask(tree, adv, "per_branch", 0.34)  # 1 of 3 siblings by |A|: c of a, h of b
    assert per_branch.tolist() == [True] * 9 + [True, False, False, False, False, True]
    global_mask = prune.width_mask(tree, adv, "global", 0.67)  # 2 best (h, g) and 2 worst (c, d)
    assert global_mask.tolist() == [True] * 9 + [True, True, False, False, True, True]
    assert prune.width_mask(tree, adv, "none", 0.5).all()


def test_width_pruning_ties_are_stable():
    tree = build_tree(TreeSpec(num_steps=2, roots=4), 1)  # chains: the roots start the branches
    adv = torch.ones(tree.num_nodes)  # all tied: the lowest index wins
    mask = prune.width_mask(tree, adv, "per_branch", 0.5)
    assert mask[tree.level(2)].tolist() == [True, True, False, False]
    assert mask[tree.level(1)].tolist() == [True, True, False, False]


def test_mix_trained_edges():
    spec = TreeSpec(3, SPEC.splits, sde_steps=prune.mix_sde_steps(3, size=1, iteration=0))
    tree = build_tree(spec, 1)
    assert tree.is_sde_edge.tolist() == [False] + [True] * 8 + [False] * 6  # step 2 is ODE
    assert spec.sde_edges() == 8
    chain = TreeSpec(6, roots=2, sde_steps=prune.mix_sde_steps(6, size=2, iteration=5, start=1, slide_every=2))
    assert chain.sde_steps == frozenset({3, 4})  # start 1 moved 5 // 2 = 2 steps later
    assert prune.mix_sde_steps(6, size=2, iteration=100, slide_every=1) == frozenset({4, 5})  # clamped at the end


def test_step_subsampling_and_step_mask():
    generator = torch.Generator().manual_seed(0)
    chosen = prune.subsample_steps(list(range(10)), 0.6, generator)
    assert len(chosen) == 6 and chosen <= set(range(10))
    tree = build_tree(SPEC, 1)
    assert prune.step_mask(tree, frozenset({1})).tolist() == [False] * 3 + [True] * 6 + [False] * 6
