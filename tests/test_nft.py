"""DiffusionNFT (`train.loss=nft`): its loss against an independent float64 computation and its
fixed points, the leaf advantages against the group formula, the soft-updated sampling policy
against its recursion, and a resumed run that ends where an unstopped one does. (Two processes:
tests/test_multiprocess.py.)"""

from __future__ import annotations

import pytest
import torch

from branchdiff.core.loss import nft_loss, nft_optimality
from branchdiff.errors import ConfigError
from branchdiff.settings.load import load_config


def _reference_loss(v_theta, v_old, x0, x_t, sigma, r, beta, advantage_clip):
    """Element by element in float64: the paper's A_max/β·(r·L⁺ + (1 − r)·L⁻)."""
    out = []
    for e in range(len(x0)):
        losses = []
        for v in ((1 - beta) * v_old[e] + beta * v_theta[e], (1 + beta) * v_old[e] - beta * v_theta[e]):
            error = (x_t[e].double() - float(sigma[e]) * v.double() - x0[e].double()).flatten()
            losses.append(float((error**2).mean()) / max(float(error.abs().mean()), 1e-5))
        out.append(advantage_clip / beta * (float(r[e]) * losses[0] + (1 - float(r[e])) * losses[1]))
    return torch.tensor(out, dtype=torch.float64)


def test_the_loss_equals_the_formula_and_vanishes_where_the_implicit_policy_hits_the_target():
    g = torch.Generator().manual_seed(0)
    x0, noise, v_old, v_theta = (torch.randn(5, 3, 4, 4, generator=g) for _ in range(4))
    sigma = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.1])
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
    r = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])
    for beta, advantage_clip in ((1.0, 5.0), (0.1, 5.0), (0.5, 2.0)):  # the policy term is 5×, 50× and 4× the bare bracket
        expected = _reference_loss(v_theta, v_old, x0, x_t, sigma, r, beta, advantage_clip)
        assert torch.allclose(nft_loss(v_theta, v_old, x0, x_t, sigma, r, beta, advantage_clip).double(), expected, rtol=1e-5, atol=1e-6)
    target = noise - x0  # the flow-matching velocity: x_t − σ·target = x0
    ones, zeros = torch.ones(5), torch.zeros(5)
    # r = 1: the loss is the positive branch, 0 when v⁺ = (1 − β)·v_old + β·v_θ is the target
    v_hit = (target - 0.5 * v_old) / 0.5
    assert nft_loss(v_hit, v_old, x0, x_t, sigma, ones, 0.5, 5.0).abs().max() < 1e-3
    # r = 0: the negative branch, 0 when v⁻ = (1 + β)·v_old − β·v_θ is the target: v_θ pushed to the other side of v_old
    v_away = (1.5 * v_old - target) / 0.5
    assert nft_loss(v_away, v_old, x0, x_t, sigma, zeros, 0.5, 5.0).abs().max() < 1e-3
    assert nft_optimality(torch.tensor([-10.0, -2.5, 0.0, 2.5, 10.0]), 5.0).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def _config(tmp_path, *extra):
    return load_config("tiny-chain", [f"output_dir={tmp_path}", "iterations=3", "prompts.per_iteration=2", "tree.roots=3", "train.loss=nft",
                                      "sampling.num_steps=4", "final_eval=false", "logging.report_to=none", "logging.sample_every=0",
                                      "train.learning_rate=1e-3", "train.minibatch=4", "train.optimizer_every=4", *extra])


def test_leaf_advantages_are_group_normalised_and_the_sampling_policy_follows_its_recursion(tmp_path):
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(_config(tmp_path, "nft.old_decay_rate=0.05", "nft.old_decay_max=0.4", "nft.advantage_clip=1.5"))
    objective, params = trainer.objective, trainer.finetune.params
    rollout, _, _, _ = trainer.rollout_and_score(0)
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.3, float("nan")])  # the second prompt is dropped
    signal = objective.signal(rollout, rewards, 0)
    leaves = rollout.tree.leaf_index
    first = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    expected = ((first - first.mean()) / (first.std() + 1e-4)).clamp(-1.5, 1.5).float()
    assert torch.allclose(signal.node_advantages[leaves[:3]], expected, atol=1e-6) and signal.node_advantages[leaves[3:]].abs().max() == 0
    assert signal.trained.tolist() == [node in leaves[:3].tolist() for node in range(rollout.tree.num_nodes)] and signal.groups_dropped == 1
    old = [p.detach().clone() for p in params]  # θ_old before any update is θ
    steps = 0
    for iteration in range(3):
        steps += trainer.run_iteration(iteration).metrics["optimizer_steps"]  # 12 terms, one step every 4: 3 a iteration
        d = min(0.05 * steps, 0.4)  # the decay counts optimizer steps (0.15, 0.3, then 0.4), as the paper's script does
        assert steps == 3 * (iteration + 1)
        old = [d * o + (1 - d) * p.detach() for o, p in zip(old, params)]
        with objective.sampling_weights():
            assert all(torch.allclose(p, o, rtol=0, atol=1e-6) for p, o in zip(params, old))
    assert not all(torch.equal(p, o) for p, o in zip(params, old))  # the live weights are back, ahead of the sampling policy


@pytest.mark.slow  # release only: keeps the suite under 15 minutes on 2 cores
def test_a_run_resumed_from_its_checkpoint_ends_like_an_unstopped_one(tmp_path):
    def args(run, iterations):
        return ["train", "tiny-chain", f"output_dir={run}", f"iterations={iterations}", "prompts.per_iteration=2", "tree.roots=3",
                "train.loss=nft", "sampling.num_steps=4", "final_eval=false", "logging.report_to=none", "logging.sample_every=0",
                "logging.checkpoint_every=1", "train.learning_rate=1e-3", "train.minibatch=4", "train.optimizer_every=4",
                "nft.old_decay_rate=0.3"]

    from resumed_runs import assert_resumed_run_equals_straight  # tests/ is on sys.path

    def sampling_policy_saved(run):
        assert (run / "checkpoints" / "iter-000001" / "sampling_policy.safetensors").is_file()

    assert_resumed_run_equals_straight(args, tmp_path, 2, 3, sampling_policy_saved)


def test_too_many_timesteps_and_a_ddim_family_are_refused_by_the_settings(tmp_path):
    """Refused when the config is read (so `branchdiff config` too), before any model loads; they were refused only
    when the objective was built, after the pipeline had loaded."""
    with pytest.raises(ConfigError, match=r"'nft.timesteps' = 5 exceeds sampling.num_steps = 4; use nft.timesteps ≤ 4"):
        _config(tmp_path, "nft.timesteps=5")
    with pytest.raises(ConfigError, match="'train.loss' = 'nft' trains on the flow-matching forward process; model.family=sd15 is an "
                                          "ε-prediction \\(DDIM\\) family: use train.loss=grpo"):
        load_config("sd15-hps", ["train.loss=nft"])


def test_depthwise_advantages_credit_each_term_with_its_ancestor_at_the_next_depth(tmp_path):
    """`nft.advantage=depthwise`: a term at step k takes the depth-wise advantage of the edge into its
    leaf's ancestor at depth k + 1 (walked up independently here); on a tree they differ from the leaf's."""
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config("tiny-mix", [f"output_dir={tmp_path}", "prompts.per_iteration=2", "sampling.num_steps=4",
                                               "tree.splits=[[0,2],[1,2]]", "tree.mix_window=2", "train.loss=nft", "nft.advantage=depthwise",
                                               "nft.timesteps=4", "final_eval=false", "logging.report_to=none", "logging.sample_every=0"]))
    objective = trainer.objective
    rollout, _, rewards, info = trainer.rollout_and_score(0)
    signal = objective.signal(rollout, rewards.total, 0)
    plan = objective.plan(rollout, info["embeds"], signal, info["address"])
    tree, expected, leaf_only = rollout.tree, [], []
    for leaf, step in zip(plan.nodes.tolist(), plan.steps.tolist()):
        node = leaf
        while int(tree.depth[node]) > step + 1:
            node = int(tree.parent[node])
        assert int(tree.depth[node]) == step + 1
        expected.append(float(signal.node_advantages[node]))
        leaf_only.append(float(signal.node_advantages[leaf]))
    assert torch.allclose(plan.optimality, nft_optimality(torch.tensor(expected), 5.0), atol=1e-6)
    assert sorted(set(plan.steps.tolist())) == [0, 1, 2, 3] and expected != leaf_only
