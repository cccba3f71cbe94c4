"""A benchmark's table in its papers' layout (branchdiff/evaluation/benchmarks.py), and the rows papers report on it, for
`branchdiff eval --benchmark NAME --compare PAPER` (docs/benchmarks.md). Each paper's rows carry their source; a column a
paper does not report is left blank. Scales: branchdiff's `clip-score` is 100·cosine, which DiffusionNFT's ClipScore
column reports as the cosine (`SCALE`); the others are on the papers' scales already (PickScore ≈ 100·cosine, HPS the
cosine, GenEval and OCR fractions, ImageReward standardised, Aesthetic 1–10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from branchdiff.evaluation.benchmarks import Benchmark
from branchdiff.rewards.geneval_rules import summarise

SCALE = {"clip-score": 0.01}  # score: the factor that puts branchdiff's value on the papers' scale


@dataclass(frozen=True)
class PaperRows:
    source: str
    rows: dict[str, dict[str, float]]  # model: {score: value}


FLOW_GRPO_PAPER = "Flow-GRPO, arXiv 2505.05470"
NFT_PAPER = "DiffusionNFT, arXiv 2509.16117, Table 1"
PAPERS: dict[str, dict[str, PaperRows]] = {
    "geneval": {
        "flow-grpo": PaperRows(f"{FLOW_GRPO_PAPER}, Table 1", {
            "SD3.5-M": {"overall": 0.63, "single_object": 0.98, "two_object": 0.78, "counting": 0.50, "colors": 0.81, "position": 0.24,
                        "color_attr": 0.52},
            "SD3.5-M + Flow-GRPO": {"overall": 0.95, "single_object": 1.00, "two_object": 0.99, "counting": 0.95, "colors": 0.92,
                                    "position": 0.99, "color_attr": 0.86}}),
        "diffusionnft": PaperRows(NFT_PAPER, {"SD3.5-M (no CFG)": {"overall": 0.24}, "SD3.5-M (CFG)": {"overall": 0.63},
                                              "SD3.5-M + DiffusionNFT (multi-reward)": {"overall": 0.94}}),
        "geneval": PaperRows("GenEval, djghosh13/geneval README.md:25-32", {
            "SD v1.5": {"overall": 0.43, "single_object": 0.97, "two_object": 0.38, "counting": 0.35, "colors": 0.76, "position": 0.04,
                        "color_attr": 0.06},
            "SDXL": {"overall": 0.55, "single_object": 0.98, "two_object": 0.74, "counting": 0.39, "colors": 0.85, "position": 0.15,
                     "color_attr": 0.23}}),
    },
    "ocr": {
        "flow-grpo": PaperRows(f"{FLOW_GRPO_PAPER}, Table 2 (with KL)", {"SD3.5-M": {"ocr": 0.59}, "SD3.5-M + Flow-GRPO": {"ocr": 0.92}}),
        "diffusionnft": PaperRows(NFT_PAPER, {"SD3.5-M (no CFG)": {"ocr": 0.12}, "SD3.5-M (CFG)": {"ocr": 0.59},
                                              "SD3.5-M + DiffusionNFT (multi-reward)": {"ocr": 0.91}}),
    },
    "pickscore": {
        "flow-grpo": PaperRows(f"{FLOW_GRPO_PAPER}, Table 2 (with KL)", {"SD3.5-M": {"pickscore": 21.72},
                                                                        "SD3.5-M + Flow-GRPO": {"pickscore": 23.31}}),
        "diffusionnft": PaperRows(f"{NFT_PAPER} (its PickScore column is on DrawBench)", {
            "SD3.5-M (no CFG)": {"pickscore": 20.51}, "SD3.5-M (CFG)": {"pickscore": 22.34},
            "SD3.5-M + DiffusionNFT (multi-reward)": {"pickscore": 23.80}}),
    },
    "drawbench": {
        "diffusionnft": PaperRows(NFT_PAPER, {
            "SD3.5-M (no CFG)": {"clip-score": 0.237, "hpsv2.1": 0.204, "aesthetic": 5.13, "imagereward": -0.58, "pickscore": 20.51},
            "SD3.5-M (CFG)": {"clip-score": 0.285, "hpsv2.1": 0.279, "aesthetic": 5.36, "imagereward": 0.85, "pickscore": 22.34},
            "SD3.5-M + DiffusionNFT (multi-reward)": {"clip-score": 0.293, "hpsv2.1": 0.331, "aesthetic": 6.01, "imagereward": 1.49,
                                                      "pickscore": 23.80}}),
        "flow-grpo": PaperRows(f"{FLOW_GRPO_PAPER}, Table 2 (DrawBench columns; the PickScore-trained model with KL)", {
            "SD3.5-M": {"aesthetic": 5.39, "imagereward": 0.87, "pickscore": 22.34},
            "SD3.5-M + Flow-GRPO (PickScore)": {"aesthetic": 5.92, "imagereward": 1.28, "pickscore": 23.53}}),
    },
}


def paper_rows(benchmark_name: str, paper: str) -> PaperRows:
    known = PAPERS.get(benchmark_name, {})
    if paper not in known:
        raise ValueError(f"--compare {paper}: no rows of that paper on benchmark {benchmark_name}; "
                         + (f"known: {', '.join(known)}" if known else "no paper's rows are recorded for it (docs/benchmarks.md)"))
    return known[paper]


def benchmark_row(chosen: Benchmark, scores: dict[str, list[float]], tags: list[str], styles: list[str]) -> dict[str, dict[str, float]]:
    """Our table: {group: {column score: value}}; group "all", and each style for a benchmark by style. `scores`: per image,
    by score name; `tags`, `styles`: each image's prompt tag and style. GenEval's columns are its tags' means and their mean."""
    if chosen.by_tag:  # an image its scorer failed on (NaN) is left out, as the other benchmarks leave it out, and counted
        verdicts = scores[chosen.rewards[0]]
        kept = [(tag, value == 1.0) for tag, value in zip(tags, verdicts) if math.isfinite(value)]
        table = summarise([tag for tag, _ in kept], [ok for _, ok in kept])
        return {"all": {**table, **({"failed": float(len(verdicts) - len(kept))} if len(kept) < len(verdicts) else {})}}
    groups = {"all": [True] * len(styles)}
    if chosen.by_style:
        groups.update({style: [s == style for s in styles] for style in sorted(set(styles))})
    table = {}
    for group, member in groups.items():
        table[group] = {}
        for column, _ in chosen.columns:
            values = [v for v, keep in zip(scores[column], member) if keep and math.isfinite(v)]
            table[group][column] = sum(values) / len(values) * SCALE.get(column, 1.0) if values else float("nan")
    return table


def format_table(chosen: Benchmark, ours: dict[str, dict[str, float]], label: str, compare: PaperRows | None = None) -> str:
    """The papers' layout: a row per model (ours, then the compared paper's), a column per score; a benchmark by style
    adds a row per style of ours."""
    header = ["model", *(title for _, title in chosen.columns)]
    rows = [[f"{label}" + ("" if group == "all" else f" ({group})"), *(_cell(values.get(c)) for c, _ in chosen.columns)]
            for group, values in ours.items()]
    if compare is not None:
        rows += [[f"{model} [paper]", *(_cell(values.get(c)) for c, _ in chosen.columns)] for model, values in compare.rows.items()]
    widths = [max(len(row[i]) for row in [header, *rows]) + 2 for i in range(len(header))]
    lines = ["".join(cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join(lines) + (f"\n[paper]: {compare.source}" if compare is not None else "")


def _cell(value: float | None) -> str:
    if value is None:
        return ""
    if math.isnan(value):
        return "n/a"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"
