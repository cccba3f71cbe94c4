"""Record GenEval's own verdicts on generated detections, for tests/test_geneval.py.

    python scripts/record_geneval_verdicts.py --geneval PATH/TO/geneval [--out tests/data/geneval_verdicts.json]

PATH is a checkout of djghosh13/geneval (the tests' file was made at af4902f). Its evaluator,
`evaluation/evaluate_images.py`, is imported as it is and its `evaluate_image` run on each case: the detector's call
answers with the case's recorded per-class boxes, and the colour classifier with the case's recorded colour of each box.
Everything else the evaluator imports at the top (mmdet, open_clip, clip_benchmark, pandas: the detector and the
CLIP model are not run) is stood in for, and it is told a GPU is there (it refuses to import without one). Nothing of
it is copied: the output holds the cases and its verdicts only.

The cases (`cases`, seeded): GenEval-style metadata of every tag over the evaluator's 80 classes, and detections built
to reach its edge cases: no detection, scores exactly at the thresholds (0.3; 0.9 on counting prompts), tied scores,
more than 16 boxes of a class, overlapping and identical boxes (also with non-maximum suppression on), two objects of
one class, an exclude clause at its count, a position against a clause that failed, and boxes that touch. Each box
row carries a sixth number, its id, which the evaluator ignores and the colour stand-in reads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import types
from pathlib import Path

import numpy as np

SIZE = 512
COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
RELATIONS = ["left of", "right of", "above", "below"]
COUNT_WORDS = {2: "two", 3: "three", 4: "four"}


def _box(rng: random.Random, score: float, ident: int) -> list[float]:
    x1, y1 = rng.uniform(0, SIZE - 40), rng.uniform(0, SIZE - 40)
    return [round(x1, 1), round(y1, 1), round(x1 + rng.uniform(8, SIZE / 2), 1), round(y1 + rng.uniform(8, SIZE / 2), 1), score, ident]


def _score(rng: random.Random, counting: bool) -> float:
    """A score, often at or near a threshold (0.3, 0.9) or tied with another."""
    special = [0.3, 0.9, 0.3000001, 0.8999999, 0.95, 0.5, 0.29]
    return rng.choice(special) if rng.random() < 0.35 else round(rng.uniform(0.85 if counting and rng.random() < 0.5 else 0.0, 1.0), 3)


def _metadata(rng: random.Random, tag: str, classes: list[str]) -> dict:
    a, b = rng.sample(classes, 2)
    if tag == "single_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}], "prompt": f"a photo of a {a}"}
    if tag == "two_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}, {"class": b, "count": 1}], "prompt": f"a photo of a {a} and a {b}"}
    if tag == "counting":
        n = rng.choice([2, 3, 4])
        return {"tag": tag, "include": [{"class": a, "count": n}], "exclude": [{"class": a, "count": n + 1}],
                "prompt": f"a photo of {COUNT_WORDS[n]} {a}s"}
    if tag == "colors":
        c = rng.choice(COLORS)
        return {"tag": tag, "include": [{"class": a, "count": 1, "color": c}], "prompt": f"a photo of a {c} {a}"}
    if tag == "position":
        r = rng.choice(RELATIONS)
        return {"tag": tag, "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [r, 0]}],
                "prompt": f"a photo of a {a} {r} a {b}"}
    c1, c2 = rng.sample(COLORS, 2)
    return {"tag": tag, "include": [{"class": a, "count": 1, "color": c1}, {"class": b, "count": 1, "color": c2}],
            "prompt": f"a photo of a {c1} {a} and a {c2} {b}"}


def cases(classes: list[str], count: int = 330, seed: int = 0) -> list[dict]:
    """`count` cases, each {metadata, boxes: {class: rows}, colours: {id: colour}, max_overlap} (module doc)."""
    rng = random.Random(seed)
    tags = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
    out = []
    for index in range(count):
        tag = tags[index % len(tags)]
        metadata = _metadata(rng, tag, classes)
        asked = [clause["class"] for clause in metadata["include"]]
        boxes: dict[str, list[list[float]]] = {}
        ident = 0
        kind = index % 11  # the edge case this one leans on
        for name in [*asked, rng.choice(classes)]:  # the asked classes and a distractor
            n = 0 if kind == 0 and rng.random() < 0.7 else 20 if kind == 1 and name == asked[0] else rng.randint(0, 5)
            rows = []
            for _ in range(n):
                rows.append(_box(rng, _score(rng, tag == "counting"), ident))
                ident += 1
            if kind == 2 and rows:  # an identical box, and a tie
                rows.append([*rows[0][:5], ident])
                ident += 1
            if kind == 3 and len(rows) >= 2:  # boxes that touch or nest
                rows[1][:4] = [rows[0][2], rows[0][1], rows[0][2] + 30, rows[0][3]]
            boxes.setdefault(name, []).extend(rows)
        if tag == "counting" and kind in (8, 9, 10):  # the asked count above 0.9, and lower ones beside it (or one more: the exclude)
            name, n = asked[0], metadata["include"][0]["count"] + (kind == 10)
            boxes[name] = [_box(rng, round(rng.uniform(0.9001, 1.0), 4), ident + k) for k in range(n)]
            boxes[name] += [_box(rng, rng.choice([0.9, 0.5, 0.2]), ident + n + k) for k in range(rng.randint(0, 3))]
            ident += len(boxes[name])
        if tag == "position" and kind in (4, 5, 6):  # boxes placed to stand in (or just miss) the relation
            target, mover = metadata["include"][0]["class"], metadata["include"][1]["class"]
            if boxes.get(target) and boxes.get(mover):
                t = boxes[target][0]
                shift = {"left of": (-1, 0), "right of": (1, 0), "above": (0, -1), "below": (0, 1)}[metadata["include"][1]["position"][0]]
                gap = rng.choice([0.0, 10.0, 60.0, 200.0])
                width, height = t[2] - t[0], t[3] - t[1]
                x, y = t[0] + shift[0] * (width + gap), t[1] + shift[1] * (height + gap)
                boxes[mover][0][:4] = [x, y, x + width, y + height]
        colours = {}
        for name, rows in boxes.items():
            asked_colour = next((c["color"] for c in metadata["include"] if c["class"] == name and "color" in c), None)
            for row in rows:
                colours[str(int(row[5]))] = asked_colour if asked_colour and rng.random() < 0.75 else rng.choice(COLORS)
        out.append({"metadata": metadata, "boxes": boxes, "colours": colours, "max_overlap": 0.5 if kind == 7 else 1.0})
    return out


def official_verdicts(geneval: Path, case_list: list[dict], classes: list[str]) -> list[bool]:
    """GenEval's evaluator's `correct` on each case (module doc)."""
    import torch

    for name in ("mmdet", "mmdet.apis", "open_clip", "clip_benchmark", "clip_benchmark.metrics", "pandas"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["mmdet.apis"].inference_detector = sys.modules["mmdet.apis"].init_detector = None
    sys.modules["mmdet"].__file__ = str(geneval / "mmdet_stand_in.py")
    zsc = types.SimpleNamespace()
    sys.modules["clip_benchmark.metrics"].zeroshot_classification = zsc
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # the evaluator asserts a GPU when imported
    spec = importlib.util.spec_from_file_location("geneval_evaluate_images", geneval / "evaluation" / "evaluate_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.cuda.is_available = available
    module.THRESHOLD, module.COUNTING_THRESHOLD, module.MAX_OBJECTS, module.POSITION_THRESHOLD = 0.3, 0.9, 16, 0.1
    module.classnames, module.object_detector = classes, None
    module.args = types.SimpleNamespace(options={})
    blank = Path(__file__).with_name("geneval-blank.png")
    from PIL import Image

    Image.new("RGB", (SIZE, SIZE)).save(blank)
    verdicts = []
    try:
        for case in case_list:
            rows = [np.asarray(case["boxes"].get(name, []), dtype=np.float64).reshape(-1, 6) for name in classes]
            module.inference_detector = lambda detector, path, rows=rows: rows
            module.NMS_THRESHOLD = case["max_overlap"]
            module.color_classification = lambda image, found, classname, colours=case["colours"]: [colours[str(int(box[5]))] for box, _ in found]
            verdicts.append(bool(module.evaluate_image(str(blank), case["metadata"])["correct"]))
    finally:
        blank.unlink()
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geneval", type=Path, required=True, help="a checkout of djghosh13/geneval")
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "tests" / "data" / "geneval_verdicts.json")
    args = parser.parse_args()
    classes = (args.geneval / "evaluation" / "object_names.txt").read_text().splitlines()
    case_list = cases(classes)
    for case, verdict in zip(case_list, official_verdicts(args.geneval, case_list, classes)):
        case["official_correct"] = verdict
    args.out.write_text(json.dumps({"source": "djghosh13/geneval evaluation/evaluate_images.py, evaluate_image", "classes": classes,
                                    "cases": case_list}, indent=None, separators=(",", ":")))
    by_tag = {}
    for case in case_list:
        by_tag.setdefault(case["metadata"]["tag"], []).append(case["official_correct"])
    print(f"{len(case_list)} cases; correct by GenEval's evaluator, per tag: "
          + ", ".join(f"{tag} {sum(v)}/{len(v)}" for tag, v in by_tag.items()) + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
