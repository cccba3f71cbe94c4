"""LayerTuning-RL (`train.loss=grpo-layertuning`): the reward-conditioned clip and the SFT term
against hand computations, the best paths of a hand-made tree, and on the tiny model an update's
per-edge losses equal clipped GRPO's plus the weighted SFT term on the best paths, computed
independently. (Two processes: tests/test_multiprocess.py; every flow family:
tests/test_model_families.py.)"""

from __future__ import annotations

import pytest
import torch

from branchdiff.core.loss import clipped_surrogate, reward_clipped_surrogate, sft_velocity_loss
from branchdiff.core.tree import Split, TreeSpec, build_tree
from branchdiff.errors import ConfigError
from branchdiff.settings.load import load_config


def test_the_clip_opens_with_the_advantage_and_is_plain_clipping_at_zero_sensitivity():
    advantages = torch.tensor([2.0, 2.0, -2.0, -2.0, 0.5, -0.5])
    ratio = torch.tensor([1.25, 1.35, 0.75, 0.65, 1.2, 0.8])
    log_prob, old = ratio.log(), torch.zeros(6)
    loss, clipped = reward_clipped_surrogate(log_prob, old, advantages, 0.1, 1.0)
    # bounds: A = 2 → [0.9, 1.3]; A = −2 → [0.7, 1.1]; A = 0.5 → [0.9, 1.15]; A = −0.5 → [0.85, 1.1]
    expected = torch.tensor([-2 * 1.25, -2 * 1.3, 2 * 0.75, 2 * 0.7, -0.5 * 1.15, 0.5 * 0.85])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert clipped.tolist() == [False, True, False, True, True, True]
    plain = clipped_surrogate(log_prob, old, advantages, 0.1)
    same = reward_clipped_surrogate(log_prob, old, advantages, 0.1, 0.0)
    assert torch.equal(plain[0], same[0]) and torch.equal(plain[1], same[1])


def test_the_sft_term_is_zero_on_the_velocity_that_reaches_the_target():
    g = torch.Generator().manual_seed(0)
    x, target, velocity = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([1.0, 0.5, 0.2])
    exact = (x - target) / sigma.view(-1, 1, 1, 1)
    assert torch.allclose(x - sigma.view(-1, 1, 1, 1) * exact, target, atol=1e-6)  # the step x − σ·v* lands on x0*
    assert sft_velocity_loss(exact, x, target, sigma).abs().max() < 1e-10
    expected = [float(((velocity[e].double() - exact[e].double()) ** 2).mean()) for e in range(3)]
    assert torch.allclose(sft_velocity_loss(velocity, x, target, sigma).double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5)


def test_best_paths_follow_each_groups_highest_leaf_to_its_root():
    from branchdiff.objectives.layertuning import best_paths

    tree = build_tree(TreeSpec(2, (Split(0, 2), Split(1, 2)), roots=1), 2)  # 2 prompts × (1 root → 2 → 4 leaves)
    leaves = tree.leaf_index
    rewards = torch.zeros(tree.num_nodes)
    rewards[leaves] = torch.tensor([0.1, 0.2, 0.9, 0.3, 0.5, 0.5, 0.1, 0.0])  # best: leaf 2 of prompt 0, leaf 0 of prompt 1 (first on ties)
    target = best_paths(tree, rewards)
    for best in (int(leaves[2]), int(leaves[4])):
        node, path = best, []
        while node >= 0:
            path.append(node)
            node = int(tree.parent[node])
        assert all(target[n] == best for n in path)
    assert int((target >= 0).sum()) == 2 * 3  # root, middle node, leaf per prompt


def test_an_updates_edge_losses_are_grpos_plus_the_weighted_sft_term_on_the_best_paths(tmp_path):
    from branchdiff.models.base import select_embeds
    from branchdiff.objectives.grpo import GRPOPlan
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config("tiny-mix", [f"output_dir={tmp_path}", "prompts.per_iteration=2", "sampling.num_steps=4",
                                               "tree.splits=[[0,2],[1,2]]", "tree.mix_window=2", "train.loss=grpo-layertuning",
                                               "layertuning.sft_weight=0.5", "layertuning.clip_sensitivity=0.0", "final_eval=false",
                                               "logging.report_to=none", "logging.sample_every=0"]))
    objective = trainer.objective
    rollout, _, rewards, info = trainer.rollout_and_score(0)
    signal = objective.signal(rollout, rewards.total, 0)
    ours = objective.plan(rollout, info["embeds"], signal, info["address"])
    plain = GRPOPlan(objective, rollout, info["embeds"], signal.node_advantages, signal.trained, 0)
    got = torch.cat([ours.loss(i) for i in range(len(ours.terms))]).detach()
    grpo = torch.cat([plain.loss(i) for i in range(len(plain.terms))]).detach()
    edges = torch.cat([ours.edges[rows] for rows in ours.minibatch_edges])  # the child node of each term, in order
    # independently: the SFT term of every trained edge on a best path
    leaves = rollout.tree.leaf_index
    per_prompt = signal.node_rewards[leaves].reshape(2, -1)
    best = leaves.reshape(2, -1)[torch.arange(2), per_prompt.argmax(dim=1)]
    expected = torch.zeros(len(edges))
    for row, child in enumerate(edges.tolist()):
        descendant = [b for b in best.tolist() if _is_ancestor(rollout.tree, child, b)]
        advantage = float(signal.node_advantages[child])
        if not descendant or advantage <= 0:
            continue
        parent = int(rollout.tree.parent[child])
        depth = int(rollout.tree.depth[parent])
        sigma = float(trainer.schedule.sigmas[depth])
        with torch.no_grad():
            v = trainer.adapter.predict(rollout.latents[[parent]], trainer.schedule.model_times[[depth]],
                                        select_embeds(info["embeds"], rollout.tree.prompt[[parent]]), None)
        target = (rollout.latents[parent] - rollout.latents[descendant[0]]) / sigma
        expected[row] = 0.5 * advantage * float((v[0].double() - target.double()).pow(2).mean())
    assert (expected > 0).sum() >= 2  # some edges of the best paths train
    assert torch.allclose(got - grpo, expected, rtol=1e-4, atol=1e-6)
    assert ours.stats["sft_edges"] == int((expected > 0).sum())


def _is_ancestor(tree, node: int, leaf: int) -> bool:
    while leaf >= 0:
        if leaf == node:
            return True
        leaf = int(tree.parent[leaf])
    return False


def test_a_ddim_family_is_refused_by_the_settings_and_by_branchdiff_config(capsys):
    """Refused when the config is read, before the pipeline loads (it was refused only when the objective was built)."""
    from branchdiff.cli import main

    line = ("'train.loss' = 'grpo-layertuning' regresses flow-matching velocities toward the best sample; model.family=sd15 is an "
            "ε-prediction (DDIM) family: use train.loss=grpo")
    with pytest.raises(ConfigError) as refused:
        load_config("sd15-hps", ["train.loss=grpo-layertuning"])
    assert str(refused.value) == line
    assert main(["config", "sd15-hps", "train.loss=grpo-layertuning"]) == 2
    assert capsys.readouterr().err.strip() == f"branchdiff: error: {line}"


def test_a_run_resumed_from_its_checkpoint_ends_like_an_unstopped_one(tmp_path):
    """A tree (so groups have a best path and the SFT term acts) with two optimizer steps per
    iteration: the run stopped after iteration 0 and resumed ends with the same weights and metrics."""
    from resumed_runs import assert_resumed_run_equals_straight  # tests/ is on sys.path

    def args(run, iterations):
        return ["train", "tiny-mix", f"output_dir={run}", f"iterations={iterations}", "prompts.per_iteration=2", "train.loss=grpo-layertuning",
                "layertuning.sft_weight=0.1", "final_eval=false", "eval_every=0", "logging.report_to=none", "logging.sample_every=0",
                "logging.checkpoint_every=1", "train.learning_rate=1e-3", "train.minibatch=8", "train.optimizer_every=22", "train.ema_decay=0.5"]

    lines = assert_resumed_run_equals_straight(args, tmp_path, 1, 2)
    assert lines[1]["optimizer_steps"] == 2 and lines[1]["sft_edges"] > 0 and lines[1]["sft"] > 0
