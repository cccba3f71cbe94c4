"""The built-in video task: grammar, renderer and the tiny-video verifier."""

import random

import numpy as np
import pytest
import torch

from branchdiff.data.tiny_task import IMAGE_SIZE, shape_mask
from branchdiff.data.tiny_video_task import FRAMES, SPEEDS, all_prompts, parse_prompt, render_batch, split_prompts
from branchdiff.rewards.tiny_video import EXPECTED_TRAVEL, TinyVideoVerifier, clip_direction

RED = np.asarray((0.9, 0.1, 0.1), dtype=np.float32)[:, None]


def test_grammar_and_split():
    prompts = all_prompts()
    assert len(prompts) == 96 and len({p.text for p in prompts}) == 96
    train, held_out = split_prompts()
    assert len(train) == 72 and len(held_out) == 24 and not {p.text for p in train} & {p.text for p in held_out}
    assert parse_prompt("two red circles moving left").count == 2 and parse_prompt("one blue square moving up").direction == "up"
    with pytest.raises(ValueError, match="not in the tiny-video grammar"):
        parse_prompt("two red circles on the left")


def test_rendered_clips_move_rigidly_inside_the_frame():
    """Every frame holds the asked objects, each frame the previous one shifted by 4 or 5 px along the direction."""
    for prompt in all_prompts()[:: 7]:
        clip = render_batch([prompt], seed=1)[0]  # (F, 3, 32, 32)
        assert clip.shape == (FRAMES, 3, IMAGE_SIZE, IMAGE_SIZE)
        areas = (clip.max(axis=1) > 0).sum(axis=(1, 2))  # (F,) foreground pixels per frame
        assert (areas == areas[0]).all() and areas[0] > 0  # nothing leaves the frame
        dy, dx = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}[prompt.direction]
        speeds = [s for s in SPEEDS if np.array_equal(np.roll(clip[0], (dy * s, dx * s), axis=(1, 2)), clip[1])]
        assert len(speeds) == 1
        for frame in range(1, FRAMES):
            assert np.array_equal(np.roll(clip[frame - 1], (dy * speeds[0], dx * speeds[0]), axis=(1, 2)), clip[frame])


def test_verifier_on_ground_truth_and_shuffled_prompts():
    prompts = all_prompts() * 2
    clips = torch.from_numpy(render_batch(prompts, seed=0))
    texts = [p.text for p in prompts]
    scores = TinyVideoVerifier().score(clips, texts)
    assert scores["strict"].min() == 1 and scores["partial"].min() == 1  # measured: every clip
    random.Random(0).shuffle(texts)
    shuffled = TinyVideoVerifier().score(clips, texts)
    assert shuffled["strict"].mean() < 0.05  # chance: 1/2 · 1/4 · 1/3 · 1/4 ≈ 0.01
    assert abs(shuffled["direction"].mean() - 0.25) < 0.08 and abs(shuffled["color"].mean() - 0.25) < 0.08


def test_strict_weight_blends_partial_and_strict_credit():
    """reward = (1 - w)·partial + w·strict against the two scores computed apart, on a right clip and one
    with the wrong direction; w outside [0, 1] refused."""
    prompt = parse_prompt("one red circle moving left")
    clips = torch.from_numpy(render_batch([prompt, parse_prompt("one red circle moving right")], seed=2))
    texts = [prompt.text] * 2
    plain = TinyVideoVerifier().score(clips, texts)
    assert plain["strict"].tolist() == [1.0, 0.0] and 0 < plain["partial"][1] < 1
    blend = TinyVideoVerifier(strict_weight=0.25)
    assert blend(clips, texts).tolist() == pytest.approx((0.75 * plain["partial"] + 0.25 * plain["strict"]).tolist())
    assert blend.reward_key == "blended" and "blended" in blend.score_keys and TinyVideoVerifier()(clips, texts).tolist() == plain["partial"].tolist()
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"tiny-video's strict_weight must be in \[0, 1\]"):
            TinyVideoVerifier(strict_weight=bad)


def _clip(boxes_per_frame: list[list[tuple[int, int]]], shape: str = "circle", size: int = 8) -> np.ndarray:
    """A red clip with a `shape` of side `size` at each (top, left) of each frame."""
    clip = np.zeros((len(boxes_per_frame), 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    for frame, boxes in enumerate(boxes_per_frame):
        for top, left in boxes:
            clip[frame, :, top : top + size, left : left + size][:, shape_mask(shape, size)] = RED
    return clip


def test_direction_from_the_track_of_centroids():
    """The least-squares velocity of the mean centroid, times F − 1: 4 px a frame left is 16 px along, full credit;
    the same clip asked to move right is 16 px against; 2 px a frame (8 px) is the least travel that counts, with half credit."""
    left = _clip([[(12, 20 - 4 * f)] for f in range(5)])
    slow = _clip([[(12, 20 - 2 * f)] for f in range(5)])
    still = _clip([[(12, 20)]] * 5)
    verifier = TinyVideoVerifier()
    scores = verifier.score(torch.from_numpy(np.stack([left, left, slow, still])), ["one red circle moving left", "one red circle moving right",
                                                                                    "one red circle moving left", "one red circle moving left"])
    assert scores["direction"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores["partial"].tolist() == pytest.approx([1.0, 0.75, (3 + 8 / EXPECTED_TRAVEL) / 4, 0.75])
    # sideways drift: along 16 px, across 12 px > 16 / 2 fails the direction, partial (16 − 12) / 16
    track = [(t, np.array([10.0 + 3.0 * t, 20.0 - 4.0 * t])) for t in range(5)]
    assert clip_direction(track, 5, "left") == pytest.approx((0.0, 4 / EXPECTED_TRAVEL))
    assert clip_direction(track[:1], 5, "left") == (0.0, 0.0)  # one frame with objects: no track


def test_attributes_hold_in_most_frames():
    """A shape wrong in 2 of 5 frames still counts as right; an object missing from 3 of 5 frames fails the count;
    partial credit averages each frame's terms."""  # circles of side 8 at (top, left): centroid (top + 4, left + 4)
    frames = [[(4, 23 - 4 * f), (20, 23 - 4 * f)] for f in range(5)]
    clip = _clip(frames)
    for frame in (1, 3):  # the second object drawn as a square in two frames
        top, left = frames[frame][1]
        clip[frame, :, top : top + 8, left : left + 8] = RED[:, :, None]
    dropped = _clip([boxes if f < 2 else boxes[:1] for f, boxes in enumerate(frames)])
    scores = TinyVideoVerifier().score(torch.from_numpy(np.stack([clip, dropped])), ["two red circles moving left"] * 2)
    assert scores["shape"].tolist() == [1.0, 1.0] and scores["count"].tolist() == [1.0, 0.0] and scores["strict"].tolist() == [1.0, 0.0]
    shape_partial = (3 * 1 + 2 * 0.5) / 5  # 2 of 2 circles in three frames, 1 of 2 in two
    assert scores["partial"][0].item() == pytest.approx((1 + 1 + shape_partial + 1) / 4)
    count = (2 * 1 + 3 * 2 / 3) / 5  # a frame with one of two objects: count 2/3, colour and shape 1/2 each
    colour = shape = (2 * 1 + 3 * 0.5) / 5
    # the mean centroid jumps 8 px up when the lower object vanishes: the track drifts sideways, less direction credit
    track = [(f, np.array([16.0 if f < 2 else 8.0, 27.0 - 4 * f])) for f in range(5)]
    direction = clip_direction(track, 5, "left")[1]
    assert direction < 1 and scores["partial"][1].item() == pytest.approx((count + colour + shape + direction) / 4)


def test_verifier_refuses_images_and_foreign_prompts():
    verifier = TinyVideoVerifier()
    with pytest.raises(ValueError, match=r"scores videos \(B, F, 3, H, W\), got \(2, 3, 32, 32\)"):
        verifier(torch.zeros(2, 3, 32, 32), ["one red circle moving left"] * 2)
    with pytest.raises(ValueError, match="prompt 2: prompt 'two red circles on the left' is not in the tiny-video grammar"):
        verifier.check_prompts(["one red circle moving left", "two red circles on the left"])


def test_eval_of_the_video_family_defaults_to_its_own_task(tmp_path):
    """`branchdiff eval --family tiny-video` scores the video task's held-out prompts with its verifier
    (it once defaulted to the image task's, and the image verifier was refused on videos)."""
    from branchdiff.settings.evaluation import resolve

    settings, _, _ = resolve({"family": "tiny-video"}, None)
    assert (settings.prompts, settings.rewards) == ("tiny-video:held_out", "tiny-video")
    settings, _, _ = resolve({"family": "tiny-video", "prompts": "tiny-video:all", "rewards": "flicker"}, None)
    assert (settings.prompts, settings.rewards) == ("tiny-video:all", "flicker")
    settings, _, _ = resolve({}, None)
    assert (settings.prompts, settings.rewards) == ("tiny:held_out", "tiny-geneval")


@pytest.mark.parametrize("missing", [0, 1, 2, 3, 4])
def test_a_square_may_lose_two_corner_pixels_in_a_clip_but_not_in_an_image(missing):
    """The video rule (tiny_video.clip_shape): a square-fitting object with ≥ 2 of its four box-corner pixels
    set is a square, as the model draws moving squares through 8-px patches; tiny-geneval still asks all four.
    A circle sets none and stays a circle."""
    from branchdiff.rewards.tiny_geneval import detect_objects
    from branchdiff.rewards.tiny_video import clip_shape

    clip = _clip([[(10, 20 - 4 * f)] for f in range(5)], shape="square", size=10)
    for top, left in ((0, 0), (0, 9), (9, 0), (9, 9))[:missing]:
        for f in range(5):  # the same corner pixel in every frame
            clip[f, :, 10 + top, 20 - 4 * f + left] = 0
    (square,) = detect_objects(clip[0])
    assert (square.nearest_shape, square.corners) == ("square", 4 - missing)
    assert square.shape == ("square" if missing == 0 else "unknown")  # tiny-geneval's rule, unchanged
    assert clip_shape(square) == ("square" if missing <= 2 else "unknown")
    scores = TinyVideoVerifier().score(torch.from_numpy(clip[None]), ["one red square moving left"])
    assert scores["shape"].item() == float(missing <= 2) and scores["strict"].item() == float(missing <= 2)
    (circle,) = detect_objects(_clip([[(10, 10)]], shape="circle", size=10)[0])
    assert (circle.corners, circle.shape, clip_shape(circle)) == (0, "circle", "circle")
