"""Rewards on videos (B, F, 3, H, W) (issue 28, third piece): a reward of images scores every N-th
frame and reduces a video's frame scores by their mean or minimum, equal to scoring the frames one by
one; its extra scores reduce alike; a reward that declares `video = True` gets the videos whole; a
reward of images given videos without `frames` stops with one line; the spec's keys are checked."""

from __future__ import annotations

import pytest
import torch

from branchdiff.rewards.combine import RewardSpec, parse_reward_specs
from branchdiff.rewards.frames import FrameAggregation
from branchdiff.rewards.multi import MultiReward, RewardError, score_component
from rewards_for_tests import Redness

VIDEOS = torch.rand(3, 7, 3, 8, 8, generator=torch.Generator().manual_seed(0))  # (B, F, 3, H, W)
PROMPTS = ["a red circle moving left", "two blue squares moving up", "a green triangle"]


class FrameCounter:
    """A reward of videos: how many frames it was given (it must get them whole)."""

    name, scale, video = "frames", "frames per video", True

    def __call__(self, videos, prompts, metadata):
        assert videos.dim() == 5
        return torch.full((len(videos),), float(videos.shape[1]))


class RednessWithExtras(Redness):
    score_keys = ("reward", "green")

    def score(self, images, prompts):
        return {"reward": self(images, prompts), "green": images[:, 1].flatten(1).mean(1)}


@pytest.mark.parametrize("every, reduce", [(1, "mean"), (3, "mean"), (2, "min")])
def test_a_reward_of_images_scores_every_nth_frame_and_reduces_per_video(every, reduce):
    scores, extras, failed = score_component(RednessWithExtras(), "redness", VIDEOS, PROMPTS, [{} for _ in PROMPTS],
                                             frames=FrameAggregation(every, reduce))
    frames = range(0, VIDEOS.shape[1], every)
    per_frame = torch.tensor([[Redness()(VIDEOS[b, f][None], [PROMPTS[b]]).item() for f in frames] for b in range(len(VIDEOS))])
    green = torch.tensor([[VIDEOS[b, f, 1].mean().item() for f in frames] for b in range(len(VIDEOS))])
    pick = (lambda x: x.mean(1)) if reduce == "mean" else (lambda x: x.min(1).values)
    assert not failed and scores.shape == (3,)
    assert torch.allclose(scores, pick(per_frame), atol=1e-6) and torch.allclose(extras["green"], pick(green), atol=1e-6)


def test_a_reward_of_videos_gets_them_whole_and_an_image_reward_needs_frames():
    scores, _, _ = score_component(FrameCounter(), "frames", VIDEOS, PROMPTS, [{} for _ in PROMPTS])
    assert scores.tolist() == [7.0, 7.0, 7.0]
    with pytest.raises(RewardError, match=r"^reward 'redness' scores images and the model makes videos \(B, F, 3, H, W\): give it frames: N "):
        score_component(Redness(), "redness", VIDEOS, PROMPTS, [{} for _ in PROMPTS])
    images = VIDEOS[:, 0]  # images are scored as before, frames or not
    assert torch.equal(score_component(Redness(), "redness", images, PROMPTS, [{}] * 3, frames=FrameAggregation(2))[0],
                       score_component(Redness(), "redness", images, PROMPTS, [{}] * 3)[0])


def test_a_config_names_frames_and_reduce_and_training_scores_videos_with_them():
    specs = parse_reward_specs([{"name": "rewards_for_tests:Redness", "frames": 2, "reduce": "min"}])
    assert specs[0].frames == FrameAggregation(2, "min") and parse_reward_specs("x:Y")[0].frames is None
    batch = MultiReward(specs, "sum_then_normalize")(VIDEOS, PROMPTS, [{}] * 3, torch.tensor([0, 0, 1]))
    expected = score_component(Redness(), "x", VIDEOS, PROMPTS, [{}] * 3, frames=FrameAggregation(2, "min"))[0]
    assert torch.allclose(batch.components["reward_rewards_for_tests_Redness"], expected)
    for entry, message in [({"name": "x:Y", "frames": 0}, "frames must be a whole number ≥ 1"),
                           ({"name": "x:Y", "frames": 2, "reduce": "median"}, "reduce must be one of mean, min, got 'median'")]:
        with pytest.raises(ValueError, match=message):
            parse_reward_specs([entry])
    assert RewardSpec("x:Y").frames is None


def test_on_a_video_family_every_reward_scores_videos_or_names_its_frames():
    from branchdiff.evaluation.preflight import check_video_rewards

    specs = parse_reward_specs([{"name": "rewards_for_tests:Redness", "frames": 2}, {"remote": "http://127.0.0.1:9", "frames": 1}])
    check_video_rewards("reward", specs, {"rewards_for_tests:Redness": Redness})
    check_video_rewards("reward", [RewardSpec("frames:Counter")], {"frames:Counter": FrameCounter})
    with pytest.raises(ValueError, match=r"'reward' entry '.*' scores images and the model makes videos: give it frames: N"):
        check_video_rewards("reward", [RewardSpec("rewards_for_tests:Redness")], {"rewards_for_tests:Redness": Redness})


def test_a_served_rewards_own_health_says_whether_it_needs_frames():
    """Preflight asks a reward server's /health: a served reward of videos needs no frames, a served reward of
    images does (one line), and an unreachable server is one line before anything is written."""
    from branchdiff.evaluation.preflight import check_video_rewards
    from branchdiff.rewards.registry import build_reward
    from branchdiff.rewards.remote import RemoteRewardError
    from branchdiff.rewards.server import BackgroundServer

    fast = {"retries": 0, "timeout": 5.0}
    with BackgroundServer(build_reward("flicker")) as videos, BackgroundServer(Redness()) as images:
        check_video_rewards("reward", [RewardSpec(remote=videos.url, kwargs=fast)], {})
        check_video_rewards("reward", [RewardSpec(remote=images.url, kwargs=fast, frames=FrameAggregation(2, "mean"))], {})
        with pytest.raises(ValueError, match=r"'reward' entry '.*' scores images and the model makes videos: give it frames: N"):
            check_video_rewards("reward", [RewardSpec(remote=images.url, kwargs=fast)], {})
    with pytest.raises(RemoteRewardError, match=r"^reward server http://127.0.0.1:9/health is not reachable .*serve-reward"):
        check_video_rewards("eval_rewards", [RewardSpec(remote="http://127.0.0.1:9", kwargs=fast)], {})


def test_a_reward_server_scores_videos_through_their_frames():
    """A served reward of images scores a video family's frames as a local one does."""
    from branchdiff.rewards.server import BackgroundServer

    with BackgroundServer(Redness()) as server:
        remote = MultiReward([RewardSpec(remote=server.url, kwargs={"image_format": "float32"}, frames=FrameAggregation(3, "min"))],
                             "sum_then_normalize")
        served = remote(VIDEOS, PROMPTS, [{}] * 3, torch.tensor([0, 1, 2])).components
    local = score_component(Redness(), "redness", VIDEOS, PROMPTS, [{}] * 3, frames=FrameAggregation(3, "min"))[0]
    assert torch.equal(next(iter(served.values())), local)


def test_flicker_is_the_mean_change_of_blurred_adjacent_frames():
    from branchdiff.rewards.registry import build_reward

    reward = build_reward("flicker")
    scores = reward(VIDEOS, PROMPTS, [{}] * 3)

    def blur(frame: torch.Tensor) -> torch.Tensor:  # 3×3 mean over the neighbours a pixel has, written out
        out = torch.empty_like(frame)
        height, width = frame.shape[1:]
        for y in range(height):
            for x in range(width):
                out[:, y, x] = frame[:, max(0, y - 1) : y + 2, max(0, x - 1) : x + 2].mean(dim=(1, 2))
        return out

    for b in range(len(VIDEOS)):
        blurred = [blur(frame) for frame in VIDEOS[b]]
        expected = torch.stack([(blurred[t] - blurred[t - 1]).abs().mean() for t in range(1, len(blurred))]).mean()
        assert scores[b].item() == pytest.approx(expected.item(), abs=1e-6)
    still = VIDEOS[:, :1].expand(-1, 4, -1, -1, -1)  # the same frame four times
    assert reward(still, PROMPTS, [{}] * 3).abs().max() == 0 and reward(VIDEOS[:, :1], PROMPTS, [{}] * 3).tolist() == [0.0] * 3
    assert (reward.video, reward.higher_is_better) == (True, False)
    with pytest.raises(ValueError, match=r"reward 'flicker' scores videos \(B, F, 3, H, W\), got \(3, 3, 8, 8\)"):
        reward(VIDEOS[:, 0], PROMPTS, [{}] * 3)


def test_a_group_reward_of_images_on_a_video_family_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """group-rank of a reward of images, with frames, on the video task: one line before anything loads (it stopped after
    the first rollout, with config.yaml written); group-rank of a reward of videos scores them whole without frames."""
    import branchdiff.models
    from branchdiff.cli import main
    from branchdiff.evaluation.preflight import check_video_rewards
    from branchdiff.rewards.group_rank import GroupRank

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded before the reward was checked")

    monkeypatch.setattr(branchdiff.models, "load_adapter", loaded)
    reward = "{name: group-rank, kwargs: {reward: rewards_for_tests:Redness}, frames: 2}"
    assert main(["train", "tiny-video", f"reward={reward}", f"output_dir={tmp_path / 'run'}", "final_eval=false", "logging.report_to=none"]) == 2
    line = [line for line in capsys.readouterr().err.splitlines() if line.startswith("branchdiff")][-1]
    assert line == ("branchdiff: error: 'reward' entry 'group-rank' ranks whole groups and scores images, and the model makes videos: a group "
                    "reward of videos must score them whole (video = True); rank a reward of videos instead")
    assert not (tmp_path / "run").exists()
    of_videos = parse_reward_specs([{"name": "group-rank", "kwargs": {"reward": "flicker"}}])
    check_video_rewards("reward", of_videos, {"group-rank": GroupRank})  # flicker scores videos: group-rank does too, no frames asked
