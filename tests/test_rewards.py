"""Rewards: the registry (names, dotted paths with keyword arguments, entry points), weighted
combination, failures at the boundary, and training with a user's reward named in YAML."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch

from branchdiff.cli import main
from branchdiff.rewards.combine import RewardSpec, combine, group_zscore, parse_reward_specs
from branchdiff.rewards.multi import MultiReward, RewardError
from branchdiff.rewards.registry import available, build_reward

USER_REWARD = '''
import torch


class Brightness:
    """A user's reward: mean brightness times a gain, in a module outside branchdiff."""

    name = "brightness"
    scale = "gain · mean pixel value"
    higher_is_better = True

    def __init__(self, gain: float = 1.0, device: str = "cpu") -> None:
        self.gain = gain

    def __call__(self, images, prompts, metadata):
        return self.gain * images.flatten(1).mean(dim=1)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`user_rewards.py` in a folder outside the package, importable as a user's own module."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "user_rewards.py").write_text(textwrap.dedent(USER_REWARD))
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.fixture
def installed_entry_point(user_module):
    """A distribution installed on sys.path whose entry point `branchdiff.rewards` names Brightness."""
    dist_info = user_module / "user_rewards-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: user-rewards\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[branchdiff.rewards]\nbrightness = user_rewards:Brightness\n")
    return "brightness"


IMAGES = torch.rand(4, 3, 8, 8)
PROMPTS = ["a", "a", "b", "b"]
METADATA = [{}] * 4
GROUPS = torch.tensor([0, 0, 1, 1])


def test_dotted_path_with_keyword_arguments(user_module):
    reward = build_reward("user_rewards:Brightness", "cpu", {"gain": 3.0})
    assert torch.allclose(reward(IMAGES, PROMPTS, METADATA), 3.0 * IMAGES.flatten(1).mean(1))


def test_entry_point_is_found_by_name_and_listed(installed_entry_point):
    reward = build_reward(installed_entry_point, "cpu", {"gain": 2.0})
    assert torch.allclose(reward(IMAGES, PROMPTS, METADATA), 2.0 * IMAGES.flatten(1).mean(1))
    rows = {row["name"]: row for row in available()}
    assert rows["brightness"]["source"] == "entry point" and rows["brightness"]["weights"] == "its package's (user_rewards:Brightness)"
    assert rows["tiny-geneval"]["status"] == "ready"


@pytest.mark.parametrize(
    "name, message",
    [
        ("tiny-genval", "unknown reward 'tiny-genval' (did you mean tiny-geneval, geneval?); available: tiny-geneval"),
        ("no_such_module:Thing", "reward 'no_such_module:Thing' could not be imported (No module named 'no_such_module'); expected 'package.module:Name'"),
    ],
)
def test_unknown_rewards_say_what_exists(name, message):
    with pytest.raises(ValueError) as error:
        build_reward(name)
    assert str(error.value).startswith(message)


def test_wrong_keyword_argument_names_the_reward(user_module):
    with pytest.raises(ValueError, match=r"^reward 'user_rewards:Brightness': .*unexpected keyword argument 'gian'; check its kwargs$"):
        build_reward("user_rewards:Brightness", "cpu", {"gian": 2.0})


def test_combination_modes_against_hand_computation():
    a = torch.tensor([1.0, 3.0, 10.0, 10.0])
    b = torch.tensor([100.0, 300.0, 5.0, 7.0])
    summed = combine({"a": a, "b": b}, {"a": 1.0, "b": 0.5}, GROUPS, "sum_then_normalize")
    assert torch.allclose(summed, torch.tensor([51.0, 153.0, 12.5, 13.5]))
    # each z-scored in its group (pairs: ±1/√2), then weighted: a's second group has no spread → 0
    z = 2**-0.5
    normalized = combine({"a": a, "b": b}, {"a": 1.0, "b": 0.5}, GROUPS, "normalize_then_sum")
    assert torch.allclose(normalized, torch.tensor([-z - 0.5 * z, z + 0.5 * z, -0.5 * z, 0.5 * z]), atol=1e-6)
    assert torch.allclose(group_zscore(torch.tensor([2.0, 2.0, 5.0]), torch.tensor([0, 0, 1])), torch.zeros(3))


def test_a_missing_component_is_left_out_of_its_group_not_zero():
    a = torch.tensor([1.0, 3.0, 10.0, 12.0])
    b = torch.tensor([100.0, float("nan"), 5.0, 7.0])  # non-finite in group 0: b is missing there
    total = combine({"a": a, "b": b}, {"a": 1.0, "b": 1.0}, GROUPS, "sum_then_normalize")
    assert torch.allclose(total, torch.tensor([1.0, 3.0, 15.0, 19.0]))
    none_left = combine({"b": b}, {"b": 1.0}, GROUPS, "sum_then_normalize")
    assert torch.isnan(none_left[:2]).all() and torch.allclose(none_left[2:], torch.tensor([5.0, 7.0]))


def test_reward_specs_from_config_values():
    assert parse_reward_specs("tiny-geneval") == [RewardSpec(name="tiny-geneval")]
    specs = parse_reward_specs([{"name": "x:Y", "weight": 2, "kwargs": {"k": 1}}, {"remote": "http://127.0.0.1:9", "required": False}])
    assert specs[0] == RewardSpec("x:Y", None, 2.0, True, {"k": 1}) and specs[1].remote == "http://127.0.0.1:9" and not specs[1].required
    two = parse_reward_specs([{"name": "learned-proxy", "label": "proxy-0"}, {"name": "learned-proxy", "label": "proxy-1", "weight": 2}])
    assert [spec.label for spec in two] == ["proxy-0", "proxy-1"] and [spec.name for spec in two] == ["learned-proxy"] * 2
    for bad, message in [
        ([], "'reward' is an empty list"),
        ({"name": "a", "remote": "b"}, "needs exactly one of 'name' and 'remote'"),
        ({"name": "a", "wieght": 2}, "unknown keys ['wieght']; allowed: name, remote, weight, required, kwargs"),
        (["a", "a"], "names a component twice"),
        ([{"name": "a", "label": "x"}, {"name": "b", "label": "x"}], "names a component twice: ['x', 'x']"),
        ({"name": "a", "label": ""}, "label must be a non-empty string"),
        (3, "'reward' entry 3 must be"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_reward_specs(bad)


class Failing:
    name = "failing"

    def __call__(self, images, prompts, metadata):
        raise RuntimeError("model server on fire")


class WrongShape:
    name = "wrong-shape"

    def __call__(self, images, prompts, metadata):
        return torch.zeros(len(prompts), 2)


class Constant:
    name = "constant"

    def __call__(self, images, prompts, metadata):
        return torch.ones(len(prompts))


def _multi(monkeypatch, rewards: dict[str, object], required: dict[str, bool]) -> MultiReward:
    monkeypatch.setattr("branchdiff.rewards.multi.build_reward", lambda name, device, kwargs: rewards[name])
    return MultiReward([RewardSpec(name, required=required[name]) for name in rewards], "sum_then_normalize")


def test_a_required_reward_that_fails_stops_with_its_name_and_prompt(monkeypatch):
    multi = _multi(monkeypatch, {"failing": Failing(), "constant": Constant()}, {"failing": True, "constant": True})
    with pytest.raises(RewardError, match=r"^reward 'failing' failed on a batch of 4 images \(first prompt 'a'\): RuntimeError: model server on fire"):
        multi(IMAGES, PROMPTS, METADATA, GROUPS)


def test_a_reward_failing_on_clips_counts_them_as_videos():
    """A batch of 2 clips of 5 frames was reported as "a batch of 2 images" (and, through frames, of 10)."""
    from branchdiff.rewards.multi import score_component

    class FailingOnVideos(Failing):
        video = True

    with pytest.raises(RewardError, match=r"^reward 'clips' failed on a batch of 2 videos \(first prompt 'a'\)"):
        score_component(FailingOnVideos(), "clips", torch.rand(2, 5, 3, 8, 8), ["a", "b"], [{}, {}])


def test_an_optional_reward_that_fails_is_missing_and_counted(monkeypatch):
    multi = _multi(monkeypatch, {"failing": Failing(), "constant": Constant()}, {"failing": False, "constant": True})
    with pytest.warns(RuntimeWarning, match="reward 'failing' failed on a batch of 4 images.*missing for this batch"):
        batch = multi(IMAGES, PROMPTS, METADATA, GROUPS)
    assert torch.equal(batch.total, torch.ones(4))  # the constant alone, not the constant plus a zero
    assert batch.counts["reward_failing_failed"] == 1 and torch.isnan(batch.components["reward_failing"]).all()


def test_a_wrong_shape_is_caught_at_the_boundary(monkeypatch):
    multi = _multi(monkeypatch, {"wrong-shape": WrongShape()}, {"wrong-shape": True})
    with pytest.raises(RewardError, match=r"returned shape \(4, 2\) for 4 images; it must return one score per image, shape \(4,\)"):
        multi(IMAGES, PROMPTS, METADATA, GROUPS)


def test_training_with_a_user_reward_named_in_yaml(user_module, tiny_model_dir, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        model: {{path: {tiny_model_dir}}}
        output_dir: {tmp_path / "run"}
        iterations: 1
        final_eval: false
        prompts: {{per_iteration: 2}}
        sampling: {{num_steps: 3}}
        tree: {{roots: 3}}
        logging: {{report_to: none, sample_every: 0}}
        reward:
          - name: user_rewards:Brightness
            weight: 1.0
            kwargs: {{gain: 10.0}}
          - {{name: tiny-geneval, weight: 0.5}}
        reward_combine: normalize_then_sum
        """))
    assert main(["train", str(config)]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 1 < metrics["reward_user_rewards_Brightness"] < 10 and 0 <= metrics["reward_tiny-geneval"] <= 1  # gain 10 applied
    assert metrics["edges_trained"] > 0 and "accuracy_strict" in metrics and 0 <= metrics["reward_zero_spread_fraction"] <= 1


def _one_iteration(model_dir, run, reward: str) -> list[str]:
    """Overrides of a one-iteration tiny-chain run on `model_dir` into `run` with `reward`."""
    return [f"model.path={model_dir}", f"output_dir={run}", "iterations=1", "final_eval=false", "prompts.per_iteration=2",
            "sampling.num_steps=3", "tree.roots=3", "logging.report_to=none", f"reward={reward}"]


def _first_metrics(run) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_training_with_an_entry_point_reward(installed_entry_point, tiny_model_dir, tmp_path):
    assert main(["train", "tiny-chain", *_one_iteration(tiny_model_dir, tmp_path / "run", "{name: brightness, kwargs: {gain: 100.0}}")]) == 0
    metrics = _first_metrics(tmp_path / "run")
    assert 10 < metrics["reward_brightness"] < 100 and metrics["reward_mean"] == pytest.approx(metrics["reward_brightness"])


def test_spread_statistics_against_hand_computation():
    from branchdiff.training.signal_check import spread_statistics

    scores = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    stats = spread_statistics(scores)
    assert stats["within_group_std"] == pytest.approx((2**0.5 + 0) / 2)  # std([1, 3]) = √2, std([5, 5]) = 0
    assert stats["between_prompt_std"] == pytest.approx(torch.tensor([2.0, 5.0]).std().item())
    assert stats["zero_spread_fraction"] == 0.5 and (stats["min"], stats["max"]) == (1.0, 5.0)


def test_rewards_list_and_check_commands(user_module, tiny_model_dir, capsys):
    assert main(["rewards", "list"]) == 0
    assert "tiny-geneval" in capsys.readouterr().out
    assert main(["rewards", "check", "user_rewards:Brightness", "--model", str(tiny_model_dir), "--num-prompts", "2",
                 "--group-size", "3", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "reward 'user_rewards:Brightness', scale: gain · mean pixel value; 6 images (2 prompts × 3)" in out
    assert "within_group_std" in out and "seconds_per_image" in out


def test_training_with_a_reward_server(user_module, tiny_model_dir, tmp_path):
    """One training iteration whose reward is served over HTTP on 127.0.0.1 (`reward: {remote: URL}`);
    the logged component equals the in-process reward of the same images."""
    from branchdiff.rewards.server import BackgroundServer

    with BackgroundServer(build_reward("user_rewards:Brightness", "cpu", {"gain": 2.0})) as server:
        remote = f"{{remote: '{server.url}', kwargs: {{image_format: float32}}}}"
        assert main(["train", "tiny-chain", *_one_iteration(tiny_model_dir, tmp_path / "run", remote)]) == 0
    metrics = _first_metrics(tmp_path / "run")
    name = "reward_" + server.url.replace(":", "_").replace("/", "_")
    local = "{name: user_rewards:Brightness, kwargs: {gain: 2.0}}"
    assert main(["train", "tiny-chain", *_one_iteration(tiny_model_dir, tmp_path / "local", local)]) == 0
    in_process = _first_metrics(tmp_path / "local")
    assert metrics[name] == in_process["reward_user_rewards_Brightness"] and metrics["edges_trained"] > 0  # float32 wire: exact


def test_serve_reward_and_list_name_the_built_ins(capsys):
    assert main(["serve-reward", "hpsv2.2"]) == 2
    assert "unknown reward 'hpsv2.2' (did you mean hpsv2.1, hpsv2?)" in capsys.readouterr().err
    assert main(["rewards", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("hpsv2.1", "pickscore", "clip-score", "aesthetic", "imagereward"))
    assert re.search(r"^imagereward +built-in +missing ImageReward ", listed, flags=re.M)  # not installed here
    assert "  imagereward: pip install image-reward in its own environment" in listed


def test_rewards_list_is_narrow_and_ready_only_when_the_weights_are_here(capsys, monkeypatch, tmp_path):
    """Rows were ~270 characters, and a reward whose weights come from the hub said "ready" with nothing downloaded."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["rewards", "list"]) == 0
    listed = capsys.readouterr().out
    assert max(len(line) for line in listed.splitlines()) <= 120
    assert re.search(r"^tiny-geneval +built-in +ready ", listed, flags=re.M)
    assert all(re.search(rf"^{re.escape(name)} +built-in +not downloaded ", listed, flags=re.M) for name in ("hpsv2.1", "pickscore"))
    assert "  hpsv2.1: checkpoint = xswu/HPSv2 HPS_v2.1_compressed.pt" in listed


@pytest.mark.parametrize(
    "reward, message",
    [
        ("rewards_for_tests:Failing", "reward 'rewards_for_tests:Failing' failed on a batch of 6 images (first prompt "),
        ("rewards_for_tests:WrongShape", "reward 'rewards_for_tests:WrongShape' returned shape (6, 2) for 6 images; it must return one score per image"),
    ],
)
def test_a_broken_reward_stops_training_and_eval_with_one_line(reward, message, tiny_model_dir, tmp_path, capsys):
    assert main(["train", "tiny-chain", *_one_iteration(tiny_model_dir, tmp_path / "run", reward)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("branchdiff: error: " + message)
    assert "weights not found second line" in lines[-1] or "WrongShape" in reward  # a two-line message folded into the one line
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", "tiny:held_out", "--rewards", reward, "--seeds", "1",
                 "--steps", "2", "--out", str(tmp_path / "eval")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("branchdiff: error: reward 'rewards_for_tests:")


def test_non_finite_scores_are_counted_not_trained_on(tiny_model_dir, tmp_path, capsys):
    both = "[rewards_for_tests:AllNaN, rewards_for_tests:Redness]"
    assert main(["train", "tiny-chain", *_one_iteration(tiny_model_dir, tmp_path / "run", both)]) == 0
    metrics = _first_metrics(tmp_path / "run")
    assert metrics["reward_rewards_for_tests_AllNaN_nonfinite"] == 6 and metrics["groups_dropped"] == 0
    assert metrics["reward_mean"] == pytest.approx(metrics["reward_rewards_for_tests_Redness"])  # the NaN component is left out
    # every group dropped: the run stops with one line, after a checkpoint of the iteration
    assert main(["train", "tiny-chain", *_one_iteration(tiny_model_dir, tmp_path / "nan", "rewards_for_tests:AllNaN")]) == 2
    assert "every group of iteration 0 had a non-finite reward (reward_rewards_for_tests_AllNaN" in capsys.readouterr().err.splitlines()[-1]
    metrics = _first_metrics(tmp_path / "nan")
    assert metrics["groups_dropped"] == 2 and metrics["edges_trained"] == 0 and metrics["optimizer_steps"] == 0
    assert (tmp_path / "nan" / "checkpoints" / "iter-000000" / "trainer_state.json").is_file()
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", "tiny:held_out", "--rewards", "rewards_for_tests:AllNaN",
                 "--seeds", "1", "--steps", "2", "--out", str(tmp_path / "eval")]) == 0
    assert "(36 NaN)" in capsys.readouterr().out


def test_one_non_finite_leaf_drops_its_whole_group(tiny_model_dir, tmp_path):
    """Before: only the NaN leaf was set to 0 and its siblings trained against that 0."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    config = load_config("tiny-chain", _one_iteration(tiny_model_dir, tmp_path / "run", "rewards_for_tests:FirstNaN"))
    result = Trainer(config).run_iteration(0)
    tree = result.rollout.tree
    first, second = tree.prompt == 0, tree.prompt == 1  # the NaN leaf is the first leaf, in group 0
    assert result.metrics["groups_dropped"] == 1
    assert torch.all(result.node_advantages[first] == 0) and not result.trained[first].any()
    assert result.node_advantages[second].abs().sum() > 0 and result.trained[second].any()
    assert result.metrics["edges_trained"] == int(result.trained[second].sum())


def test_a_lower_is_better_reward_enters_the_signal_negated(monkeypatch):
    from rewards_for_tests import Darkness

    multi = _multi(monkeypatch, {"darkness": Darkness()}, {"darkness": True})
    batch = multi(IMAGES, PROMPTS, METADATA, GROUPS)
    assert torch.equal(batch.total, -IMAGES.flatten(1).mean(1)) and torch.equal(batch.components["reward_darkness"], IMAGES.flatten(1).mean(1))


def test_group_spread_against_hand_computation():
    from branchdiff.training.metrics import group_spread

    total = torch.tensor([1.0, 3.0, 5.0, 5.0, float("nan"), 2.0])
    groups, flat, std_sum = group_spread(total, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert (groups, flat) == (3, 2) and std_sum == pytest.approx(2**0.5)  # std([1, 3]) = √2; [5, 5] and the lone [2] flat


def test_a_failed_optional_reward_reports_the_same_score_keys(monkeypatch):
    """Regression (review): a failed optional reward with extra scores (tiny-geneval) reported none,
    so processes gathered different metric keys and the collectives of the iteration diverged."""
    from branchdiff.rewards.tiny_geneval import TinyGenEval

    class Broken(TinyGenEval):
        def score(self, images, prompts):
            raise RuntimeError("down")

    working = _multi(monkeypatch, {"tiny-geneval": TinyGenEval()}, {"tiny-geneval": False})(IMAGES, PROMPTS, METADATA, GROUPS)
    with pytest.warns(RuntimeWarning):
        failed = _multi(monkeypatch, {"tiny-geneval": Broken()}, {"tiny-geneval": False})(IMAGES, PROMPTS, METADATA, GROUPS)
    assert list(failed.extras) == list(working.extras) == ["strict", "count", "color", "shape", "position"]
    assert list(failed.counts) == list(working.counts) and all(torch.isnan(v).all() for v in failed.extras.values())
