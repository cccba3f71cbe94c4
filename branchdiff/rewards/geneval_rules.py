"""GenEval's decision rules (Ghosh et al., NeurIPS 2023; the rules of its evaluator, djghosh13/geneval
`evaluation/evaluate_images.py` at af4902f), as functions of a detector's output: which detections count, whether an
image satisfies its prompt's metadata, and the summary table. No model here: the detector and the colour classifier
are parts the caller plugs in (branchdiff/rewards/geneval.py), so the rules are tested on recorded detections.

A prompt's metadata: `tag` (single_object, two_object, counting, colors, position, color_attr), `include` (clauses
{class, count, color?, position?: [relation, index of an earlier include clause]}, all required) and `exclude`
(clauses {class, count}, any one fails the image).

Detections kept per class (`keep_detections`): a class's boxes [x1, y1, x2, y2, score] ordered by score, highest first
(numpy's argsort, as the evaluator orders them, ties included), those with a score above the threshold (0.3; 0.9 on
counting prompts: strictly above), at most 16, then, where `max_overlap` < 1, greedy non-maximum suppression at that
IoU (off by default: max_overlap 1).

An image is correct (`judge`) when, for each include clause in order: the class has at least `count` kept detections;
the first `count` of them (the most confident) have at least `count` of the asked colour, where a colour is asked; and,
where a position is asked and the clause matched so far, each of them stands in the relation to each detection the
referenced clause matched (that clause must have matched); and no exclude clause's class has `count` or more. The
relation of A to B (`relative_position`): with centres c and sizes d (width, height) of the boxes, the offset
o = c_A − c_B shrunk by 0.1·(d_A + d_B) per axis toward 0 (not past it), r = shrunk / |o|; none when every |r| < 1e-3;
else "left of" when r_x < −0.5, "right of" when r_x > 0.5, "above" when r_y < −0.5, "below" when r_y > 0.5.

The score (`summarise`): the mean correctness per tag, and the overall, the mean of the six tags' means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

THRESHOLD = 0.3  # a detection counts above this score
COUNTING_THRESHOLD = 0.9  # ... above this one on counting prompts
MAX_OBJECTS = 16  # kept per class
MAX_OVERLAP = 1.0  # IoU of non-maximum suppression; 1: none
POSITION_THRESHOLD = 0.1  # the share of the two boxes' sizes an offset must exceed
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
TABLE = {"single_object": "Single obj.", "two_object": "Two obj.", "counting": "Counting", "colors": "Colors", "position": "Position",
         "color_attr": "Attr. binding"}  # the GenEval paper's column names, overall first


@dataclass(frozen=True)
class Detection:
    box: np.ndarray  # (5,) x1, y1, x2, y2 in pixels, score (further columns ride along)
    mask: np.ndarray | None = None  # (H, W) bool, the instance's mask where the detector gives one


def iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """Intersection over union of two boxes in pixels, each side counting its end pixel (+1), as the evaluator computes it."""
    def area(box: Sequence[float]) -> float:
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inner = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inner
    return inner / union if union else 0


def keep_detections(boxes: Sequence[np.ndarray], masks: Sequence[Sequence[np.ndarray]] | None, classnames: Sequence[str], tag: str,
                    threshold: float = THRESHOLD, counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS,
                    max_overlap: float = MAX_OVERLAP) -> dict[str, list[Detection]]:
    """The detections that count, by class name (module doc). `boxes[c]`: (N_c, 5) for class c of `classnames`;
    `masks[c][i]`: detection i's mask (None: a detector without masks). Classes with none kept are left out."""
    limit = counting_threshold if tag == "counting" else threshold
    kept = {}
    for index, classname in enumerate(classnames):
        found = np.asarray(boxes[index])  # its own dtype: a detector's float32 scores compare in float32, as the evaluator's
        found = found.reshape(-1, found.shape[-1] if found.ndim == 2 else 5)  # columns past the fifth ride along (an id)
        order = np.argsort(found[:, 4])[::-1]
        order = order[found[order, 4] > limit][:max_objects].tolist()
        chosen = []
        while order:
            best = order.pop(0)
            chosen.append(Detection(found[best], None if masks is None else masks[index][best]))
            if max_overlap < 1:
                order = [other for other in order if iou(found[best], found[other]) < max_overlap]
        if chosen:
            kept[classname] = chosen
    return kept


def relative_position(a: Detection, b: Detection, threshold: float = POSITION_THRESHOLD) -> set[str]:
    """The relations of A to B (module doc)."""
    corners = np.array([a.box[:4], b.box[:4]]).reshape(2, 2, 2)  # (box, corner, xy)
    centre_a, centre_b = corners.mean(axis=-2)
    size_a, size_b = np.abs(np.diff(corners, axis=-2))[..., 0, :]
    offset = centre_a - centre_b
    shrunk = np.maximum(np.abs(offset) - threshold * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


ColourOf = Callable[[str, list[Detection]], list[str]]  # (class, its detections) → each one's colour name (COLORS)


def judge(metadata: dict, detected: dict[str, list[Detection]], colour_of: ColourOf,
          position_threshold: float = POSITION_THRESHOLD) -> tuple[bool, list[str]]:
    """Whether an image with `detected` (`keep_detections`) satisfies `metadata`, and why not (module doc); `colour_of`
    is asked only for a clause that asks a colour and has its count."""
    correct, reasons = True, []
    matched: list[list[Detection] | None] = []
    for clause in metadata.get("include", []):
        classname, count = clause["class"], clause["count"]
        found = detected.get(classname, [])[:count]
        ok = len(found) >= count
        if not ok:
            reasons.append(f"expected {classname}>={count}, found {len(found)}")
        if ok and "color" in clause:
            colours = colour_of(classname, found)
            if colours.count(clause["color"]) < count:
                ok = False
                reasons.append(f"expected {clause['color']} {classname}>={count}, found {colours.count(clause['color'])} {clause['color']}")
        if ok and "position" in clause:
            relation, target = clause["position"]
            if matched[target] is None:
                ok = False
                reasons.append(f"no target for {classname} to be {relation}")
            elif not all(relation in relative_position(one, other, position_threshold) for one in found for other in matched[target]):
                ok = False
                reasons.append(f"expected {classname} {relation} target")
        correct = correct and ok
        matched.append(found if ok else None)
    for clause in metadata.get("exclude", []):
        if len(detected.get(clause["class"], [])) >= clause["count"]:
            correct = False
            reasons.append(f"expected {clause['class']}<{clause['count']}, found {len(detected[clause['class']])}")
    return correct, reasons


def summarise(tags: Sequence[str], correct: Sequence[bool]) -> dict[str, float]:
    """{tag: mean correctness} for the tags present, and "overall": the mean of those means (GenEval's score)."""
    by_tag: dict[str, list[bool]] = {}
    for tag, ok in zip(tags, correct):
        by_tag.setdefault(tag, []).append(bool(ok))
    scores = {tag: float(np.mean(values)) for tag, values in by_tag.items()}
    return {"overall": float(np.mean(list(scores.values()))) if scores else float("nan"), **scores}
