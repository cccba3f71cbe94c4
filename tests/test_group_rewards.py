"""Rewards that see the group (branchdiff/rewards/group.py): the rank and tournament formulas against hand
computations and scipy's ranks, the grouping every caller uses, `group-rank` through the combiners, the reward
server and `rewards check`, and a tiny tree run whose leaf rewards are the ranks of its leaves' images among
their prompt's leaves."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import rankdata

from branchdiff.cli import main
from branchdiff.rewards.combine import RewardSpec, group_zscore
from branchdiff.rewards.group import group_rows, ranks, tournament
from branchdiff.rewards.multi import MultiReward, RewardError, score_component
from branchdiff.rewards.registry import available, build_reward
from branchdiff.settings.load import load_config
from branchdiff.training.recipe import Trainer
from rewards_for_tests import Redness  # tests/ is on sys.path

RANK = {"name": "group-rank", "kwargs": {"reward": "rewards_for_tests:Redness"}}


def _scipy_ranks(scores: torch.Tensor) -> torch.Tensor:
    """(rank − 1) / (G − 1), ties averaged: an independent computation of `ranks`."""
    return torch.tensor((rankdata(scores.numpy(), method="average") - 1) / (len(scores) - 1), dtype=torch.float32)


def test_ranks_and_tournaments_against_hand_computations():
    assert ranks(torch.tensor([0.3, -1.0, 2.0, 0.3])).tolist() == pytest.approx([1.5 / 3, 0, 1, 1.5 / 3])
    assert ranks(torch.tensor([7.0])).tolist() == [0.5]  # nothing to compare with
    assert torch.isnan(ranks(torch.tensor([1.0, float("nan"), 2.0]))).all()  # no order: the group is dropped
    scores = torch.randn(9, generator=torch.Generator().manual_seed(0)).round(decimals=1)  # ties likely
    assert torch.allclose(ranks(scores), _scipy_ranks(scores))
    # a judge that prefers whatever it sees first by 0.15 over the truth: both orders cancel the bias
    truth = torch.tensor([[0.5, 0.7, 0.8], [0.3, 0.5, 0.6], [0.2, 0.4, 0.5]])  # P(row beats column), truth + truth.T = 1
    assert tournament(truth + 0.15).tolist() == pytest.approx([(0.7 + 0.8) / 2, (0.3 + 0.6) / 2, (0.2 + 0.4) / 2])
    assert tournament(torch.tensor([[0.5]])).tolist() == [0.5]


def test_groups_are_the_given_indices_or_the_shared_prompts():
    assert group_rows(["a", "b", "a", "c", "b"], None) == [[0, 2], [1, 4], [3]]
    assert group_rows(["a", "a", "a", "a"], torch.tensor([1, 1, 0, 0])) == [[0, 1], [2, 3]]


def _images(count: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(count, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_group_rank_is_the_rank_of_its_inner_reward_within_each_group_and_the_combiners_take_it():
    images, groups = _images(10), torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
    prompts = [f"p{g}" for g in groups.tolist()]
    redness = Redness()(images, prompts)
    expected = torch.cat([_scipy_ranks(redness[groups == g]) for g in range(3)])
    reward = build_reward("group-rank", "cpu", RANK["kwargs"])
    scores, _, failed = score_component(reward, "group-rank", images, prompts, [{}] * 10, groups=groups)
    assert not failed and torch.allclose(scores, expected)
    # a lower-is-better inner reward (mean pixel value) is ranked by its negative: the darkest image of each group ranks first
    darkness = build_reward("group-rank", "cpu", {"reward": "rewards_for_tests:Darkness"})
    darkest_first = torch.cat([_scipy_ranks(-images[groups == g].flatten(1).mean(1)) for g in range(3)])
    assert torch.allclose(score_component(darkness, "group-rank", images, prompts, [{}] * 10, groups=groups)[0], darkest_first)
    # both combiners: the rank enters like any component, the sum's normalisation acts on it per group
    for mode in ("sum_then_normalize", "normalize_then_sum"):
        batch = MultiReward([RewardSpec(**RANK, weight=2.0), RewardSpec("rewards_for_tests:Redness")], mode)(images, prompts, [{}] * 10, groups)
        parts = (2 * expected + redness) if mode == "sum_then_normalize" else (2 * group_zscore(expected, groups) + group_zscore(redness, groups))
        assert torch.allclose(batch.total, parts, atol=1e-6), mode
        assert torch.allclose(batch.components["reward_group-rank"], expected)


def test_group_rank_settings_and_videos_are_one_line():
    with pytest.raises(ValueError, match=r"reward 'group-rank': reward='' must name the reward whose rank it gives"):
        build_reward("group-rank", "cpu", {"reward": ""})
    with pytest.raises(ValueError, match=r"unknown reward 'no-such'"):
        build_reward("group-rank", "cpu", {"reward": "no-such"})
    reward = build_reward("group-rank", "cpu", RANK["kwargs"])
    with pytest.raises(RewardError, match=r"reward 'group-rank' ranks whole groups and scores images, and the model makes videos"):
        score_component(reward, "group-rank", torch.rand(2, 3, 3, 8, 8), ["a", "a"], [{}, {}])
    assert "group-rank" in [row["name"] for row in available()]


def test_a_served_group_reward_gets_one_group_a_request():
    from branchdiff.rewards.remote import RemoteReward
    from branchdiff.rewards.server import BackgroundServer

    images, groups = _images(9, seed=1), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    prompts = ["same prompt"] * 9  # groups by index, not by prompt: a tree's prompts may repeat across groups
    local = score_component(build_reward("group-rank", "cpu", RANK["kwargs"]), "group-rank", images, prompts, [{}] * 9, groups=groups)[0]
    with BackgroundServer(build_reward("group-rank", "cpu", RANK["kwargs"])) as server:
        client = RemoteReward(server.url, image_format="float32", chunk_size=2)  # a group goes whole whatever chunk_size
        assert client.health["group"] is True
        served = score_component(client, "remote", images, prompts, [{}] * 9, groups=groups)[0]
        assert server.batcher.requests == 3
    assert torch.equal(served, local)


def test_rewards_check_scores_a_group_reward_by_group(tiny_model_dir, capsys):
    assert main(["rewards", "check", "group-rank", "--kwargs", "{reward: rewards_for_tests:Redness}", "--model", str(tiny_model_dir),
                 "--num-prompts", "2", "--group-size", "3", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "reward 'group-rank', scale: rank within the group" in out and " zero_spread_fraction  0\n" in out


def test_a_tiny_tree_run_trains_on_each_leafs_rank_among_its_prompts_leaves(tiny_model_dir, tmp_path):
    config = load_config(None, [
        f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", "iterations=1", "seed=0", f"reward={RANK}".replace("'", ""),
        "prompts.per_iteration=2", "tree.roots=1", "tree.splits=[[0, 2], [1, 3]]", "sampling.num_steps=3", "sampling.max_batch=8",
        "train.minibatch=4", "model.finetune=lora", "train.learning_rate=1e-2", "final_eval=false", "logging.report_to=none"])
    result = Trainer(config).run_iteration(0)
    tree = result.rollout.tree
    leaf_prompts = tree.prompt[tree.leaf_index]  # (12,) six leaves a prompt
    leaf_rewards = result.node_rewards[tree.leaf_index].float()
    redness = Redness()(result.leaf_images, result.prompts)
    for group in range(2):
        assert torch.allclose(leaf_rewards[leaf_prompts == group], _scipy_ranks(redness[leaf_prompts == group]))
    assert result.metrics["reward_mean"] == pytest.approx(0.5)  # the ranks of a group average ½
    assert result.metrics["edges_trained"] > 0 and result.metrics["grad_norm"] > 0


class FailsOnRain:
    """A group reward that ranks by redness, raises on the prompt 'rain' and answers the wrong shape for 'snow'."""

    name = "fails-on-rain"
    scale = "rank"

    def score_group(self, images, prompts, metadata):
        if prompts[0] == "rain":
            raise RuntimeError("judge down")
        return torch.zeros(len(prompts) + 1) if prompts[0] == "snow" else ranks(Redness()(images, prompts))


def test_a_group_rewards_wrong_shape_stops_even_when_optional_and_its_failure_stays_with_its_request():
    from concurrent.futures import Future

    from branchdiff.rewards.remote import RemoteReward, RemoteRewardError
    from branchdiff.rewards.server import BackgroundServer, Batcher, _Request

    images = _images(4)
    with pytest.raises(RewardError, match=r"reward 'fails-on-rain' returned shape \(3,\) for 2 images"):
        score_component(FailsOnRain(), "fails-on-rain", images, ["snow", "snow", "sun", "sun"], [{}] * 4, required=False)
    failed = score_component(FailsOnRain(), "fails-on-rain", images, ["rain", "rain", "sun", "sun"], [{}] * 4, required=False)
    assert failed[2] and torch.isnan(failed[0]).all()  # optional and raising: missing for the batch, as any reward
    # served: two groups taken in one batch are answered one by one, the failing one alone failing
    batcher = Batcher(FailsOnRain(), "fails-on-rain", "cpu", 64)
    requests = [_Request(images[:2], ["rain", "rain"], [{}, {}], Future()), _Request(images[2:], ["sun", "sun"], [{}, {}], Future())]
    batcher._score_groups(requests)
    assert isinstance(requests[0].answer.exception(), RuntimeError)
    assert requests[1].answer.result() == ranks(Redness()(images[2:], ["sun", "sun"])).tolist()
    with BackgroundServer(FailsOnRain()) as server:  # a client that does not send groups whole is refused
        with pytest.raises(RemoteRewardError, match=r"scores one prompt's group a request and this request holds 2 prompts"):
            RemoteReward(server.url, retries=0)(images[:2], ["sun", "moon"], None)


def test_an_evaluation_refuses_a_group_reward_in_one_line(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"model.path={tiny_model_dir}", f"output_dir={run}", "iterations=1", f"eval_rewards=[{RANK}]".replace("'", ""),
                 "prompts.per_iteration=1", "tree.roots=2", "sampling.num_steps=2", "logging.report_to=none"]) != 0
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("branchdiff: error")]
    assert len(error) == 1 and "'eval_rewards': 'group-rank' scores each sample against its group's others, so its mean is ½" in error[0]
    assert not (run / "metrics.jsonl").exists()  # refused before training


def test_the_server_counts_a_request_before_answering_it():
    """A client that holds its answer sees its request counted (CI once read 2 of 3: the count came after the answer)."""
    from branchdiff.rewards.server import Batcher, _Request

    images = _images(4)
    for reward, name in ((build_reward("group-rank", "cpu", RANK["kwargs"]), "group-rank"), (Redness(), "redness")):
        batcher = Batcher(reward, name, "cpu", 64)
        seen: list[int] = []
        requests = [_Request(images[i:i + 2], ["p", "p"], [{}, {}]) for i in (0, 2)]
        for r in requests:
            r.answer.add_done_callback(lambda _, b=batcher, counts=seen: counts.append(b.requests))  # runs inside set_result
        for r in requests:
            batcher.submit(r)
        for r in requests:
            r.answer.result(timeout=10)
        assert seen and all(count >= i + 1 for i, count in enumerate(seen)) and batcher.requests == 2
