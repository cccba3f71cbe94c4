"""GenEval's decision rules (branchdiff/rewards/geneval_rules.py) against GenEval's own evaluator: on 330 recorded cases
(tests/data/geneval_verdicts.json, made by scripts/record_geneval_verdicts.py from djghosh13/geneval at af4902f) every
verdict equals the evaluator's; the relation and overlap rules on hand-worked boxes; the summary's overall."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from branchdiff.rewards.geneval_rules import Detection, iou, judge, keep_detections, relative_position, summarise
from conftest import TINY_CLIP  # the tiny detector and CLIP of conftest's geneval_parts

RECORDED = json.loads((Path(__file__).parent / "data" / "geneval_verdicts.json").read_text())


def _verdict(case: dict, classes: list[str], keep: dict | None = None, position_threshold: float = 0.1) -> bool:
    """The rules' verdict on a recorded case, the colours its recorded ones; `keep`: other settings of `keep_detections`."""
    rows = [case["boxes"].get(name, []) for name in classes]
    detected = keep_detections(rows, None, classes, case["metadata"]["tag"], **{"max_overlap": case["max_overlap"], **(keep or {})})
    colours = case["colours"]
    return judge(case["metadata"], detected, lambda classname, found: [colours[str(int(d.box[5]))] for d in found], position_threshold)[0]


def test_every_recorded_verdict_equals_genevals_own():
    classes, cases = RECORDED["classes"], RECORDED["cases"]
    assert len(cases) >= 200 and len(classes) == 80
    differences = [i for i, case in enumerate(cases) if _verdict(case, classes) != case["official_correct"]]
    assert differences == []
    # the cases reach every task and its edge cases, each way
    tags = Counter((case["metadata"]["tag"], case["official_correct"]) for case in cases)
    assert all(tags[(tag, verdict)] >= 5 for tag in ("single_object", "two_object", "counting", "colors", "position", "color_attr")
               for verdict in (True, False)), tags
    scores = [row[4] for case in cases for rows in case["boxes"].values() for row in rows]
    assert scores.count(0.3) >= 20 and scores.count(0.9) >= 20  # at the thresholds
    assert sum(1 for case in cases if not any(case["boxes"].values())) >= 5  # nothing detected
    assert sum(1 for case in cases if any(len(rows) > 16 for rows in case["boxes"].values())) >= 5  # the cap
    assert sum(1 for case in cases if case["max_overlap"] < 1) >= 20  # non-maximum suppression on
    identical = sum(1 for case in cases for rows in case["boxes"].values() if len({tuple(row[:5]) for row in rows}) < len(rows))
    assert identical >= 20  # two identical boxes of one class: overlapping, with tied scores


def test_a_change_of_one_rule_is_caught_by_the_recorded_verdicts():
    """The cases are sharp enough to fail a rule that is off by a little: scores equal to the thresholds admitted ('>=' for
    '>'), or the relation's margin at 0.2 instead of 0.1."""
    classes, cases = RECORDED["classes"], RECORDED["cases"]
    at_or_above = {"threshold": 0.2999999, "counting_threshold": 0.8999999}
    assert any(_verdict(case, classes, at_or_above) != case["official_correct"] for case in cases)
    assert any(_verdict(case, classes, position_threshold=0.2) != case["official_correct"] for case in cases)


def test_the_relation_of_two_boxes_by_hand():
    """A (0..10) beside B (30..40), same row: A's centre 5, B's 35, offset −30, shrunk by 0.1·(10 + 10) = 2 → 28 of 30: left of.
    Boxes that overlap by most of their size are in no relation; diagonal by the same amount both ways: two relations."""
    a, b = Detection(np.array([0, 0, 10, 10, 1.0])), Detection(np.array([30, 0, 40, 10, 1.0]))
    assert relative_position(a, b) == {"left of"} and relative_position(b, a) == {"right of"}
    near = Detection(np.array([1, 1, 11, 11, 1.0]))
    assert relative_position(a, near) == set()  # |offset| 1 per axis, shrunk by 2: nothing left
    diagonal = Detection(np.array([30, 30, 40, 40, 1.0]))
    assert relative_position(a, diagonal) == {"left of", "above"}  # dx = dy = −28/√1800 ≈ −0.66
    assert iou([0, 0, 9, 9], [0, 0, 9, 9]) == 1 and iou([0, 0, 9, 9], [10, 0, 19, 9]) == 0
    assert iou([0, 0, 9, 9], [5, 0, 14, 9]) == pytest.approx(50 / 150)  # 5×10 of 100 + 100 − 50


def test_the_overall_is_the_mean_of_the_tags_means():
    tags = ["counting"] * 4 + ["position"] * 2
    assert summarise(tags, [True, True, True, False, False, False]) == {"overall": pytest.approx((0.75 + 0.0) / 2), "counting": 0.75,
                                                                      "position": 0.0}


# ---------------------------------------------------------------- the reward: a detector and a colour classifier around the rules
def test_the_detector_scores_and_labels_as_transformers_own_post_processing_on_a_square_image(geneval_parts):
    """On an image of the network's own input size (no resize, no padding) the mmdetection-style post-processing here and
    transformers' `post_process_instance_segmentation` compute the same thing: the same (class, score) pairs, best first."""
    import torch
    from PIL import Image

    from branchdiff.rewards.geneval import Mask2FormerDetector

    detector = Mask2FormerDetector(str(geneval_parts / "detector"), shortest_edge=384, longest_edge=384)
    image = Image.fromarray((np.random.default_rng(0).random((384, 384, 3)) * 255).astype("uint8"))
    boxes, _ = detector(image)
    mine = sorted(((round(float(row[4]), 6), label) for label, rows in enumerate(boxes) for row in rows), reverse=True)[:12]
    inputs = detector.processor(images=image, return_tensors="pt")
    with torch.no_grad():
        outputs = detector.model(**inputs)
    theirs = detector.processor.post_process_instance_segmentation(outputs, threshold=0.0)[0]["segments_info"]
    assert sorted(((s["score"], s["label_id"]) for s in theirs), reverse=True) == mine


def test_a_non_square_image_is_resized_as_mmdetection_does_and_padded_not_stretched(geneval_parts):
    """768 × 512: mmdetection's test pipeline resizes to 1200 × 800 (the shortest side to 800, the longest within 1333) and pads
    to 1216 × 800 with zeros after normalising; transformers' size_divisor stretched it to 1216 × 800 instead."""
    import torch
    from PIL import Image

    from branchdiff.rewards.geneval import Mask2FormerDetector

    detector = Mask2FormerDetector(str(geneval_parts / "detector"))
    image = Image.fromarray((np.random.default_rng(0).random((512, 768, 3)) * 255).astype("uint8"))
    pixels, mask, resized = detector.network_input(image)
    assert resized == (800, 1200) and pixels.shape == (1, 3, 800, 1216) and mask.shape == (1, 800, 1216)
    assert int(mask.sum()) == 800 * 1200 and bool((mask[:, :, 1200:] == 0).all()) and bool((pixels[..., 1200:] == 0).all())
    unpadded = detector.processor(images=image, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels[..., :1200], unpadded)
    boxes, masks = detector(image)
    assert all(len(rows) == len(ms) for rows, ms in zip(boxes, masks)) and all(m.shape == (512, 768) for ms in masks for m in ms)


def test_float32_scores_meet_the_thresholds_as_genevals_float32_comparison_does():
    """mmdetection's scores are float32 and GenEval compares them in float32: float32(0.3) is not above 0.3 there. Cast to
    float64 it is (0.30000001192...), and such a detection was kept."""
    rows = np.array([[0, 0, 10, 10, 0.3], [0, 0, 10, 10, 0.9], [0, 0, 10, 10, 0.95]], dtype=np.float32)
    assert [len(keep_detections([rows], None, ["cat"], tag).get("cat", [])) for tag in ("colors", "counting")] == [2, 1]


def test_a_masks_box_is_its_extent_with_the_end_pixel_past_it():
    import torch

    from branchdiff.rewards.geneval import mask_box

    mask = torch.zeros(10, 12, dtype=torch.bool)
    mask[2:5, 3:9] = True
    assert mask_box(mask).tolist() == [3, 2, 9, 5] and mask_box(torch.zeros(4, 4, dtype=torch.bool)).tolist() == [0, 0, 0, 0]


def test_the_reward_turns_detections_into_genevals_verdicts_and_runs_whole_on_tiny_models(geneval_parts, monkeypatch):
    """With the detector answering a recorded case's boxes and the colours its recorded ones, the reward gives GenEval's own
    verdict on every case of each tag; with the tiny random models it scores images end to end (0 or 1, partial in [0, 1])."""
    import torch

    from branchdiff.rewards.geneval import GenEvalReward
    from branchdiff.rewards.multi import score_component

    classes = RECORDED["classes"]
    reward = GenEvalReward(detector=str(geneval_parts / "detector"), clip=TINY_CLIP, clip_checkpoint=str(geneval_parts / "clip.pt"), classes=classes,
                           detector_shortest_edge=64)
    images = torch.rand(3, 3, 48, 64, generator=torch.Generator().manual_seed(1))
    metadata = [RECORDED["cases"][i]["metadata"] for i in (0, 3, 4)]  # single object, colors, position
    scores, extra, failed = score_component(reward, "geneval", images, [m["prompt"] for m in metadata], metadata)
    assert not failed and scores.shape == (3,) and set(scores.tolist()) <= {0.0, 1.0}
    assert ((extra["partial"] >= 0) & (extra["partial"] <= 1)).all()
    chosen = [case for tag in ("single_object", "two_object", "counting", "colors", "position", "color_attr")
              for case in [c for c in RECORDED["cases"] if c["metadata"]["tag"] == tag and c["max_overlap"] == 1][:6]]
    for case in chosen:
        rows = [torch.tensor(case["boxes"].get(name, []), dtype=torch.float64).reshape(-1, 6) for name in classes]
        monkeypatch.setattr(reward, "detect", lambda image, rows=rows: (rows, [[None] * len(r) for r in rows]))
        monkeypatch.setattr(reward, "colours", lambda image, classname, found, case=case: [case["colours"][str(int(d.box[5]))] for d in found])
        verdict = reward(images[:1], [case["metadata"]["prompt"]], [case["metadata"]])
        assert verdict.tolist() == [float(case["official_correct"])], case["metadata"]
    with pytest.raises(ValueError, match="reward 'geneval' scores prompts with GenEval metadata"):
        reward(images[:1], ["a photo of a cat"], [{}])
