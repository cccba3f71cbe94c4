"""`videoalign`: a Qwen2-VL reward of videos (VQ, MQ, TA), on a tiny random model of the same transformers classes."""

import pytest
import torch

from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import build_component, score_component
from tiny_pipelines import VIDEOALIGN_TOKENS, save_videoalign

PROMPTS = ["one red circle moving left", "two blue squares moving up and away from the camera", "a cat"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_videoalign(tmp_path_factory.mktemp("videoalign"))


def _reference(folder, video: torch.Tensor, prompt: str) -> dict[str, float]:
    """One video alone (no padding): the processor's input, the language model's last hidden state at each reward
    token found by its place in the token list (the video's merged features in place of its tokens, the language
    model called without position ids, as VideoReward's release calls it: tokens numbered 0, 1, 2, ...), the head,
    the folder's standardisation."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    settings = json.loads((folder / "videoalign.json").read_text())
    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": settings["template"].replace("{prompt}", prompt)}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    frames = (video * 255).round().to(torch.uint8)  # (F, 3, H, W)
    inputs = processor(text=[text], videos=[frames], return_tensors="pt", videos_kwargs={"do_rescale": True})
    with torch.no_grad():
        inner = model.model
        embeds = inner.language_model.embed_tokens(inputs["input_ids"])  # (1, L, hidden)
        video = inner.visual(inputs["pixel_values_videos"], grid_thw=inputs["video_grid_thw"]).pooler_output
        embeds[inputs["input_ids"] == model.config.video_token_id] = video
        hidden = inner.language_model(inputs_embeds=embeds).last_hidden_state[0]  # (L, hidden)
    head = load_file(str(folder / "reward_head.safetensors"))["weight"][0]
    tokens = inputs["input_ids"][0].tolist()
    scores = {}
    for dimension, token in VIDEOALIGN_TOKENS.items():
        raw = (hidden[tokens.index(processor.tokenizer.convert_tokens_to_ids(token))] @ head).item()
        scores[dimension] = (raw - settings["mean"][dimension]) / settings["std"][dimension]
    return scores


def test_scores_equal_a_per_video_reference_and_the_reward_is_the_named_dimension(folder):
    """Batched (prompts of different lengths, padded) scores equal each video scored alone; `overall` is their sum;
    `num_frames` reads evenly spaced frames."""
    torch.manual_seed(0)
    videos = torch.rand(3, 5, 3, 32, 32)
    reward = build_component(parse_reward_specs([{"name": "videoalign", "kwargs": {"path": str(folder), "dimension": "MQ", "batch_size": 2}}])[0], "cpu")
    scores = reward.score(videos, PROMPTS)
    for row, (video, prompt) in enumerate(zip(videos, PROMPTS)):
        expected = _reference(folder, video, prompt)
        for dimension in VIDEOALIGN_TOKENS:
            assert scores[dimension][row].item() == pytest.approx(expected[dimension], abs=1e-4)
    assert torch.allclose(scores["overall"], scores["VQ"] + scores["MQ"] + scores["TA"])
    assert torch.equal(reward(videos, PROMPTS, [{}] * 3), scores["MQ"])
    fewer = build_component(parse_reward_specs([{"name": "videoalign", "kwargs": {"path": str(folder), "num_frames": 3}}])[0], "cpu")
    assert torch.allclose(fewer(videos, PROMPTS), reward.score(videos[:, [0, 2, 4]], PROMPTS)["overall"], atol=1e-5)
    through_training, extras, failed = score_component(reward, "videoalign", videos, PROMPTS, [{}] * 3)
    assert not failed and torch.equal(through_training, scores["MQ"]) and torch.equal(extras["TA"], scores["TA"])


def test_bad_settings_and_inputs_are_one_line(folder, tmp_path):
    from branchdiff.rewards.videoalign import VideoAlignReward

    with pytest.raises(FileNotFoundError, match=r"needs path=FOLDER, a local Qwen2-VL reward model with config.json, videoalign.json, "
                                                r"reward_head.safetensors .*; no path was given"):
        VideoAlignReward()
    with pytest.raises(ValueError, match="dimension='motion'; allowed: overall, VQ, MQ, TA"):
        VideoAlignReward(str(folder), dimension="motion")
    reward = VideoAlignReward(str(folder))
    with pytest.raises(ValueError, match=r"scores videos \(B, F, 3, H, W\), got \(2, 3, 32, 32\)"):
        reward(torch.rand(2, 3, 32, 32), PROMPTS[:2])
    broken = tmp_path / "broken"
    save_videoalign(broken)
    text = (broken / "videoalign.json").read_text().replace(" alignment <|TA_reward|>", "")
    (broken / "videoalign.json").write_text(text)
    with pytest.raises(ValueError, match=r"the TA token '<\|TA_reward\|>' must be one token of the tokenizer and appear once in the template"):
        VideoAlignReward(str(broken))


def test_the_release_preprocessing_rules_against_hand_computations():
    from branchdiff.rewards.videoalign import release_frame_count, release_size

    video = {"fps": 2.0, "num_frames": None, "min_frames": 4, "max_frames": 768, "frame_factor": 2, "size_factor": 28,
             "min_pixels": 128 * 28 * 28, "max_pixels": 240 * 320}
    assert release_frame_count(81, 16.0, video) == 10  # Wan's 81 frames at 16 fps: 5.06 s, 10.1 frames at 2 fps
    assert release_frame_count(9, 8.0, video) == 4  # 2.25 raised to the minimum of 4
    assert release_frame_count(3, 16.0, video) == 2  # never more frames than the clip has, rounded down to a pair
    assert release_frame_count(81, 16.0, {**video, "num_frames": 9}) == 8  # 9 / 2 = 4.5 rounds half to even
    with pytest.raises(ValueError, match="reads at least 2 frames of a video; got videos of 1"):
        release_frame_count(1, 16.0, video)
    # 480×832 is 476×840 at multiples of 28, over 76 800 pixels: scaled by √(480·832 / 76 800) and floored to multiples of 28
    assert release_size(480, 832, video) == (196, 364)
    assert release_size(24, 40, video) == (252, 420)  # under 128·28·28: scaled up and ceiled
    assert release_size(270, 290, {**video, "min_pixels": 28 * 28, "max_pixels": 10**6}) == (280, 280)  # within the budget: the nearest multiples of 28


def test_a_head_of_three_rows_reads_row_d_for_dimension_d(folder, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    three = tmp_path / "three"
    shutil.copytree(folder, three)
    head = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    save_file({"weight": head}, str(three / "reward_head.safetensors"))
    videos = torch.rand(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    scores = build_component(parse_reward_specs([{"name": "videoalign", "kwargs": {"path": str(three)}}])[0], "cpu").score(videos, PROMPTS[:2])
    for row, dimension in enumerate(VIDEOALIGN_TOKENS):  # row d alone as a one-row head gives dimension d's score
        save_file({"weight": head[row : row + 1]}, str(three / "reward_head.safetensors"))
        single = build_component(parse_reward_specs([{"name": "videoalign", "kwargs": {"path": str(three)}}])[0], "cpu").score(videos, PROMPTS[:2])
        assert torch.allclose(scores[dimension], single[dimension], atol=1e-6)
    assert load_file(str(three / "reward_head.safetensors"))["weight"].shape == (1, 32)
