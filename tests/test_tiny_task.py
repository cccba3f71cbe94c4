"""The built-in task: grammar, renderer and the tiny-geneval verifier."""

import random

import numpy as np
import pytest
import torch

from branchdiff.data.tiny_task import IMAGE_SIZE, all_prompts, parse_prompt, render_batch, shape_mask, split_prompts
from branchdiff.rewards.tiny_geneval import TinyGenEval, classify_shape, detect_objects


def test_grammar_and_split():
    prompts = all_prompts()
    assert len(prompts) == 144 and len({p.text for p in prompts}) == 144
    train, held_out = split_prompts()
    assert len(held_out) == 36 and not {p.text for p in train} & {p.text for p in held_out}
    assert parse_prompt("two red circles on the left").count == 2
    with pytest.raises(ValueError, match="not in the tiny grammar"):
        parse_prompt("a purple hexagon")


def test_verifier_on_ground_truth_and_shuffled_prompts():
    prompts = all_prompts() * 2
    images = torch.from_numpy(render_batch(prompts, seed=0))
    texts = [p.text for p in prompts]
    scores = TinyGenEval().score(images, texts)
    assert scores["strict"].mean() >= 0.95  # measured 1.00
    random.Random(0).shuffle(texts)
    shuffled = TinyGenEval().score(images, texts)
    assert shuffled["strict"].mean() < 0.05  # chance: 1/3 · 1/4 · 1/3 · ~1/3 ≈ 0.01
    assert abs(shuffled["color"].mean() - 0.25) < 0.08 and abs(shuffled["shape"].mean() - 1 / 3) < 0.08
    assert abs(shuffled["count"].mean() - 1 / 3) < 0.08


def test_partial_credit_formula():
    prompt = parse_prompt("two red circles on the left")
    image = render_batch([parse_prompt("one red circle on the left")], seed=3)
    scores = TinyGenEval().score(torch.from_numpy(image), [prompt.text])
    # one object of two, everything right but the count: mean(1 - 1/3, 1/2, 1/2, 1/2), the missing object counted against each
    assert scores["partial"].item() == pytest.approx((2 / 3 + 3 / 2) / 4)
    assert scores["strict"].item() == 0 and scores["count"].item() == 0 and scores["shape"].item() == 1
    extra = TinyGenEval().score(torch.from_numpy(render_batch([prompt], seed=3)), ["one red circle on the left"])
    # two correct objects for one asked: mean(1 - 1/3, min(2, 1)/2, 1/2, 1/2)
    assert extra["partial"].item() == pytest.approx((2 / 3 + 3 / 2) / 4)


def test_dropping_an_object_whose_shape_came_out_wrong_no_longer_pays():
    """Two red circles asked: two objects with one drawn as a square beat one correct circle alone
    (with credit as a fraction of the objects drawn, the single circle won, 0.92 against 0.875)."""
    circle, square = shape_mask("circle", 8), shape_mask("square", 8)
    both = np.zeros((3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    red = np.asarray((0.9, 0.1, 0.1), dtype=np.float32)[:, None]
    both[:, 3:11, 3:11][:, circle] = red
    both[:, 20:28, 3:11][:, square] = red  # the left half, apart from the circle
    one = both.copy()
    one[:, 20:28, 3:11] = 0
    scores = TinyGenEval().score(torch.from_numpy(np.stack([both, one])), ["two red circles on the left"] * 2)
    assert scores["count"].tolist() == [1.0, 0.0] and scores["shape"].tolist() == [0.0, 1.0]
    assert scores["partial"].tolist() == pytest.approx([(1 + 1 + 1 / 2 + 1) / 4, (2 / 3 + 3 / 2) / 4])
    assert scores["partial"][0] > scores["partial"][1]


def test_strict_weight_blends_partial_and_strict_credit():
    """reward = (1 - w)·partial + w·strict, against the two scores computed apart; w outside [0, 1] refused."""
    asked = parse_prompt("two red circles on the left")
    images = torch.from_numpy(render_batch([asked, parse_prompt("one red circle on the left")], seed=3))  # right, then one missing
    texts = [asked.text] * 2
    plain = TinyGenEval().score(images, texts)
    assert plain["strict"].tolist() == [1.0, 0.0] and 0 < plain["partial"][1] < 1
    blend = TinyGenEval(strict_weight=0.25)
    assert blend(images, texts).tolist() == pytest.approx((0.75 * plain["partial"] + 0.25 * plain["strict"]).tolist())
    assert blend.reward_key == "blended" and "blended" in blend.score_keys and TinyGenEval().reward_key == "partial"
    assert TinyGenEval()(images, texts).tolist() == plain["partial"].tolist()
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"strict_weight must be in \[0, 1\]"):
            TinyGenEval(strict_weight=bad)


def _place(mask: np.ndarray, color=(0.9, 0.1, 0.1)) -> np.ndarray:
    image = np.zeros((3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    h, w = mask.shape
    image[:, 4 : 4 + h, 4 : 4 + w][:, mask] = np.asarray(color, dtype=np.float32)[:, None]
    return image


def test_shapes_that_game_fill_ratio_fail():
    size = 9
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    rounded_square = np.ones((size, size), dtype=bool)
    for y, x in [(0, 0), (0, -1), (-1, 0), (-1, -1)]:
        rounded_square[y, x] = False  # corners cut: fill ratio 0.95, between disc and square
    assert classify_shape(rounded_square) == "unknown"
    blob = ((yy - 4.5) / 4.5) ** 2 + ((xx - 4.5) / 2.2) ** 2 <= 1  # an ellipse, 2:1
    assert detect_objects(_place(blob))[0].shape == "unknown"
    ragged = shape_mask("circle", size).copy()
    ragged[::2, :] = False  # striped: fill ratio halves, no template fits
    assert classify_shape(ragged) == "unknown"
    for shape in ("circle", "square", "triangle"):
        for s in (7, 8, 9):
            assert classify_shape(shape_mask(shape, s)) == shape


def test_one_pixel_boundary_error_is_tolerated():
    circle = shape_mask("circle", 8).copy()
    circle[0, 3:5] = False  # a flattened top
    assert classify_shape(circle) == "circle"
