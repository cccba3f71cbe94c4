"""`ocr` (branchdiff/rewards/ocr.py): the edit distance and the score against hand computations, and the real
PP-OCRv4 models of rapidocr-onnxruntime reading text rendered with PIL (two fonts, several sizes, noise): the
reward of each image equals the score computed by hand from the text drawn in it and the prompt's quoted text.
A prompt set in Flow-GRPO's text-rendering format (a text file, a prompt a line) loads and a tiny run with the
reward goes end to end."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from branchdiff.cli import main
from branchdiff.rewards.ocr import OCRReward, edit_distance, target_text, text_score
from branchdiff.rewards.registry import available, build_reward

# Flow-GRPO's text-rendering prompts: a scene, the text to render between double quotes
PROMPTS = ['A neon sign above a bar that reads "OPEN LATE"', 'A chalkboard menu with "Soup of the day" written on it',
           'A wooden plank carved with "Hello World"']


@pytest.mark.parametrize(("a", "b", "distance"), [("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("abc", "", 3),
                                                  ("abc", "abc", 0), ("helloword", "helloworld", 1), ("a", "b", 1)])
def test_the_edit_distance_is_levenshteins(a, b, distance):
    assert edit_distance(a, b) == distance == edit_distance(b, a)


def test_the_score_of_read_text_against_the_target():
    assert target_text(PROMPTS[1]) == "Soup of the day" and target_text("no quotes here") == "no quotes here"
    assert text_score("SOUP OF THE DAY", "Soup of the day") == 1.0  # case and spaces ignored
    assert text_score("menu: soup of the day, 5$", "Soup of the day") == 1.0  # the target inside more text: distance 0
    assert text_score("Hello Word", "Hello World") == pytest.approx(1 - 1 / 10)  # one letter missing of "helloworld"
    assert text_score("Hxllo Wxrld", "Hello World") == pytest.approx(1 - 2 / 10)
    assert text_score("", "Hello World") == 0.0 and text_score("a completely different long sentence", "Hi") == 0.0  # capped at |t|
    assert text_score("", "") == 1.0 and text_score("x", "") == 0.0


def _font(size: int, serif: bool) -> ImageFont.FreeTypeFont:
    path = Path("/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf")
    if serif and path.is_file():
        return ImageFont.truetype(str(path), size)
    return ImageFont.load_default(size=size)  # Pillow's own scalable font, present everywhere


def _rendered(text: str, size: int, serif: bool, noise: float, seed: int) -> torch.Tensor:
    """`text` drawn dark on a light background (3, 192, 640) in [0, 1], with Gaussian pixel noise of std `noise`."""
    image = Image.new("RGB", (640, 192), (235, 230, 220))
    ImageDraw.Draw(image).text((24, 96), text, fill=(20, 20, 30), font=_font(size, serif), anchor="lm")
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255
    return (pixels + noise * torch.randn(pixels.shape, generator=torch.Generator().manual_seed(seed))).clamp(0, 1)


def _engine() -> None:
    """rapidocr-onnxruntime is in the [test] extra; its OpenCV needs the system's libGL, so an image without it skips here."""
    pytest.importorskip("rapidocr_onnxruntime", reason="rapidocr-onnxruntime (the [ocr] extra) or its OpenCV does not import here")


@pytest.fixture(scope="module")
def reward():
    _engine()
    return build_reward("ocr")


def test_the_real_models_read_rendered_text_and_score_it_as_computed_by_hand(reward):
    drawn = [("OPEN LATE", 56, False, 0.0), ("Soup of the day", 44, True, 0.03), ("Hello World", 64, False, 0.05),  # the asked text
             ("OPEN LAT", 56, True, 0.0), ("Soup of the bay", 48, False, 0.02), ("", 48, False, 0.0)]  # a letter off, one wrong, none
    prompts = [*PROMPTS, *PROMPTS]
    images = torch.stack([_rendered(text, size, serif, noise, seed) for seed, (text, size, serif, noise) in enumerate(drawn)])
    scores = reward(images, prompts, [{} for _ in prompts])
    by_hand = [1.0, 1.0, 1.0, 1 - 1 / 8, 1 - 1 / 12, 0.0]  # "openlate" less its e; "soupoftheday" with b for d; "helloworld" unread
    assert scores.shape == (6,) and scores.dtype == torch.float32
    assert scores.tolist() == pytest.approx(by_hand)


def test_it_is_listed_and_its_settings_are_checked():
    _engine()
    assert any(row["name"] == "ocr" and row["status"] == "ready" for row in available())
    for settings, words in (({"min_confidence": 1.5}, "min_confidence = 1.5 must be a number in [0, 1)"),
                            ({"angle_classifier": "no"}, "angle_classifier = 'no' must be true or false"),
                            ({"channels": "rbg"}, "channels='rbg' must be one of rgb, bgr"), ({"quotes": "curly"}, "quotes='curly' must be one of straight, any")):
        with pytest.raises(ValueError, match=re.escape(words)):
            build_reward("ocr", kwargs=settings)


@pytest.mark.parametrize("prompt", ['A sign that reads "OPEN LATE" in neon', 'Say "hello', 'a "b" c "d"', '"" empty', 'x "y z"'])
def test_the_target_is_flow_grpos_split_of_the_prompt(prompt):
    """Flow-GRPO's rule, `prompt.split('"')[1]`: after the first straight quote, up to the next or the end (one unmatched
    quote takes the rest of the prompt)."""
    assert target_text(prompt) == prompt.split('"')[1]


def test_curly_quotes_and_prompts_without_quotes():
    assert target_text("A sign that reads \u201cOPEN\u201d") == "A sign that reads \u201cOPEN\u201d"  # straight quotes only, as Flow-GRPO
    assert target_text("A sign that reads \u201cOPEN\u201d", quotes="any") == "OPEN"
    assert target_text("no quotes here") == target_text("no quotes here", quotes="any") == "no quotes here"
    assert OCRReward.check_prompts(['a "b"', "c \u201cd\u201d"], quotes="any") is None
    warning = OCRReward.check_prompts(['a sign "OPEN"', "a sign \u201cOPEN\u201d", "a sign"])
    assert warning.startswith("2 of 3 prompts (the first: prompt 2) hold no text between double quotes, so 'ocr' scores them against the "
                              "whole prompt") and "prompt 2 uses curly quotes (“ ”), which kwargs {quotes: any} reads" in warning


def test_a_prompt_set_without_quoted_text_is_warned_when_read(capsys):
    from branchdiff.data.prompts import PromptSet
    from branchdiff.evaluation.preflight import check_prompt_set
    from branchdiff.rewards.combine import RewardSpec

    prompts = PromptSet("signs.txt", ['a sign "OPEN"', "a sign that reads closed"], [{}, {}])
    check_prompt_set(prompts, "tiny", (32, 32), [RewardSpec("ocr")], {"ocr": OCRReward})
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("branchdiff")] == [
        "branchdiff: warning: reward 'ocr' on 'signs.txt': 1 of 2 prompts (the first: prompt 2) hold no text between double quotes, so 'ocr' "
        "scores them against the whole prompt; quote the text to render, e.g. a sign that reads \"OPEN\""]
    check_prompt_set(PromptSet("signs.txt", ['a sign "OPEN"'], [{}]), "tiny", (32, 32), [RewardSpec("ocr")], {"ocr": OCRReward})
    assert "branchdiff" not in capsys.readouterr().err


def test_it_reads_as_flow_grpo_by_default_angle_classifier_off_and_low_confidence_lines_kept_when_asked(reward):
    """Upside-down text: with the angle classifier off (Flow-GRPO's setting, the default) PP-OCRv4 reads it as "NE" at a
    confidence of about 0.49, below the default cut of 0.5 (nothing read: 0); with min_confidence 0.3 that line counts
    ("ne" inside "openlate": 6 insertions, 1 − 6/8); with the classifier on it reads "OPEN LATE" (1)."""
    upright = _rendered("OPEN LATE", 56, False, 0.0, 0)
    images = torch.stack([upright, upright.flip(1).flip(2)])
    prompts = [PROMPTS[0]] * 2
    assert reward(images, prompts).tolist() == [1.0, 0.0]
    assert build_reward("ocr", kwargs={"min_confidence": 0.3})(images, prompts).tolist() == [1.0, 1 - 6 / 8]
    assert build_reward("ocr", kwargs={"angle_classifier": True})(images, prompts).tolist() == [1.0, 1.0]


class RecordingEngine:
    """RapidOCR's call signature: records each array and its keywords, reads one line per call."""

    def __init__(self, lines):
        self.lines, self.calls = lines, []

    def __call__(self, image, **keywords):
        self.calls.append((image.copy(), keywords))
        return [[None, text, confidence] for text, confidence in self.lines], None


def test_the_engine_gets_rgb_pixels_by_default_bgr_when_asked_and_the_confidence_cut(reward, monkeypatch):
    import branchdiff.rewards.ocr as ocr

    engine = RecordingEngine([("OPEN", 0.45), ("LATE", 0.9)])
    monkeypatch.setattr(ocr, "rapidocr_engine", lambda angle_classifier, min_confidence: engine)
    image = torch.rand(1, 3, 8, 12)
    pixels = (image[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()  # (H, W, 3) RGB
    for settings, expected, score in (({}, pixels, 1 - 4 / 8), ({"channels": "bgr", "min_confidence": 0.4}, pixels[:, :, ::-1], 1.0)):
        engine.calls.clear()
        assert build_reward("ocr", kwargs=settings)(image, [PROMPTS[0]]).tolist() == [score]
        array, keywords = engine.calls[0]
        assert np.array_equal(array, expected) and keywords == {"use_cls": False, "text_score": settings.get("min_confidence", 0.5)}


def test_a_text_rendering_prompt_set_loads_and_a_tiny_run_scores_with_ocr(tmp_path, monkeypatch):
    """Flow-GRPO's format (dataset/ocr/train.txt: a prompt a line) through prompts.train; the built-in model draws
    shapes, not letters, so every score is 0 here (no group has a spread to learn from): the run goes end to end and
    logs the reward."""
    _engine()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "train.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"output_dir={run}", "reward=ocr", f"prompts.train={prompts}", "iterations=1", "prompts.per_iteration=1",
                 "tree.roots=2", "sampling.num_steps=3", "final_eval=false", "logging.sample_every=0", "logging.report_to=none"]) == 0
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["reward_ocr"] == metrics["reward_mean"] == 0.0 and metrics["reward_ocr_failed"] == 0 and metrics["reward_zero_spread_fraction"] == 1.0


def test_the_engine_is_checked_and_paddleocr_where_it_is_missing_is_one_line():
    with pytest.raises(ValueError, match=r"engine='tesseract' must be one of rapidocr, paddleocr"):
        build_reward("ocr", kwargs={"engine": "tesseract"})
    if importlib.util.find_spec("paddleocr") is not None:
        pytest.skip("PaddleOCR is installed here: test_paddleocr_reads_rendered_text runs it")
    with pytest.raises(ImportError, match=r"engine: paddleocr needs PaddleOCR 3 and PaddlePaddle: pip install paddlepaddle paddleocr") as raised:
        build_reward("ocr", kwargs={"engine": "paddleocr"})
    assert "\n" not in str(raised.value)


@pytest.mark.slow
def test_paddleocr_reads_rendered_text_as_rapidocr_does(reward):
    """Where PaddleOCR 3 is installed and its models can be fetched (slow: the first use downloads them)."""
    pytest.importorskip("paddleocr", reason="PaddleOCR is not installed here")
    paddle = build_reward("ocr", kwargs={"engine": "paddleocr"})
    images = torch.stack([_rendered("OPEN LATE", 56, False, 0.0, 0), _rendered("Soup of the day", 48, True, 0.0, 1)])
    prompts = PROMPTS[:2]
    assert paddle(images, prompts, [{}, {}]).tolist() == pytest.approx(reward(images, prompts, [{}, {}]).tolist()) == [1.0, 1.0]


WORDS = ["HI", "OK", "GO", "UP"]


@pytest.mark.slow
def test_a_tiny_model_taught_to_draw_words_trains_on_the_ocr_reward(reward, tmp_path, monkeypatch):
    """The built-in model draws shapes, so every OCR score of its images is 0. Taught to draw two-letter words first
    (SFT on 32×32 renderings, 1200 steps, ~100 s), its samples are read now and then: the reward has a spread within
    groups, and GRPO trains on it (an update of the weights); each leaf's reward is the OCR score of its own image."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = []
    for index in range(32):
        word = WORDS[index % 4]
        image = Image.new("RGB", (32, 32), "white")
        ImageDraw.Draw(image).text((2 + index % 4, 5 + index % 5), word, fill="black", font=ImageFont.load_default(size=18 + index % 3))
        image.save(tmp_path / f"{index}.png")
        rows.append(json.dumps({"prompt": f'a sign that says "{word}"', "image": f"{index}.png"}))
    (tmp_path / "demos.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "prompts.txt").write_text("\n".join(f'a sign that says "{w}"' for w in WORDS) + "\n")
    common = ["final_eval=false", "logging.report_to=none", "model.finetune=full"]
    taught = Trainer(load_config("tiny-chain", [f"output_dir={tmp_path / 'sft'}", "train.loss=sft", f"sft.data={tmp_path / 'demos.jsonl'}",
                                                "iterations=1200", "prompts.per_iteration=8", "train.learning_rate=1e-3", "sft.timesteps=4", *common]))
    for iteration in range(1200):
        taught.run_iteration(iteration)
    taught.adapter.save_pretrained(tmp_path / "model")
    trainer = Trainer(load_config("tiny-chain", [f"output_dir={tmp_path / 'grpo'}", f"model.path={tmp_path / 'model'}", "reward=ocr",
                                                 f"prompts.train={tmp_path / 'prompts.txt'}", "prompts.per_iteration=4", "tree.roots=4",
                                                 "iterations=2", "train.learning_rate=1e-4", *common]))
    before = {k: v.detach().clone() for k, v in trainer.adapter.denoiser.named_parameters()}
    results = [trainer.run_iteration(iteration) for iteration in range(2)]
    assert any(r.metrics["reward_zero_spread_fraction"] < 1 and r.metrics["reward_mean"] > 0 for r in results)
    assert any(not torch.equal(before[k], v) for k, v in trainer.adapter.denoiser.named_parameters())
    last = results[-1]
    leaves = last.rollout.tree.leaf_index
    prompts = [last.prompts[p] for p in last.rollout.tree.prompt[leaves].tolist()]
    assert last.node_rewards[leaves].float().tolist() == pytest.approx(reward(last.leaf_images, prompts, [{}] * len(prompts)).tolist())
