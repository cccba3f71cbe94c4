"""`branchdiff bench cache`: a task's rollouts with the first-block cache (`sampling.block_cache`, docs/gpu.md)
against the same rollouts without it, side by side in one process.

The run is the task's preset (`tiny-video`: DiffusionNFT's default on the video task, its blocks compiled;
`tiny` with `train.loss=nft`) and the overrides given. Each draw is one iteration's trees (that iteration's
prompts and noise); for every draw the rollout is grown once per threshold, the uncached one (0) first,
interleaved, and again `repeats` times, the first round discarded as a warm-up (it compiles). Per
threshold: the uncached rollout's median seconds over the cached one's (the speed-up), the forwards that
skipped every block after the first, the leaves' mean reward (the run's `reward`) beside the uncached
leaves' — the difference paired by draw, with its 95 % t interval and p (a paired t-test) — and the mean
|x_cached − x| of the leaves.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from scipy import stats

from branchdiff.bench.stats import t_interval
from branchdiff.bench.tables import print_result, table
from branchdiff.settings.load import load_config
from branchdiff.training.preflight import check_inputs
from branchdiff.training.recipe import Trainer

TASKS = {"tiny-video": ("tiny-video", []), "tiny": ("tiny-mix", ["train.loss=nft"])}
QUIET = ["logging.report_to=none", "final_eval=false", "eval_every=0", "output_dir=runs/bench-cache"]


def paired_p(differences: list[float]) -> float:
    """Two-sided p of a paired t-test (the mean of `differences` against 0); 1 for fewer than two or all zero."""
    if len(differences) < 2 or all(d == 0 for d in differences):
        return 1.0
    if statistics.pstdev(differences) == 0:
        return 0.0
    return float(stats.ttest_1samp(differences, 0.0).pvalue)


def bench_cache(json_path: Path | None, thresholds: list[float], draws: int = 5, first_draw: int = 0, repeats: int = 3,
                task: str = "tiny-video", extra_overrides: Sequence[str] = ()) -> dict:
    """Rows per threshold (module doc); `draws` iterations' trees from `first_draw` on."""
    given = ",".join(f"{t:g}" for t in thresholds)
    if not thresholds or any(not 0 < t < 1 for t in thresholds):
        raise ValueError(f"bench cache --thresholds {given}: give one or more thresholds, each in (0, 1) as sampling.block_cache takes "
                         "them, e.g. 0.1,0.3 (the uncached rollout, 0, is always measured)")
    cached = [item for item in extra_overrides if item.partition("=")[0].strip() == "sampling.block_cache"]
    if cached:
        raise ValueError(f"bench cache {cached[0]}: the benchmark sets sampling.block_cache itself, to each of --thresholds in turn; "
                         "give the values as --thresholds (e.g. --thresholds 0.3)")
    preset, overrides = TASKS[task]
    config = load_config(preset, [*overrides, *QUIET, *extra_overrides, f"sampling.block_cache={max(thresholds)}"])  # the run's refusals
    check_inputs(config)
    trainer = Trainer(config)  # (a model the cache cannot follow is refused here)
    levels = [0.0, *thresholds]
    seconds: dict[float, list[list[float]]] = {t: [[] for _ in range(draws)] for t in levels}
    rewards: dict[float, list[float]] = {t: [0.0] * draws for t in levels}
    distance: dict[float, list[float]] = {t: [0.0] * draws for t in levels}
    skipped: dict[float, list[float]] = {t: [0.0] * draws for t in levels}
    plain = trainer.settings
    for repeat in range(repeats + 1):  # round 0 warms up (compiles) and is discarded
        for index in range(draws):
            iteration = first_draw + index
            uncached = None
            for threshold in levels:
                trainer.settings = replace(plain, block_cache=threshold)
                rollout, _, scored, info = trainer.rollout_and_score(iteration)
                if repeat:
                    seconds[threshold][index].append(info["rollout_seconds"])
                if threshold == 0:
                    uncached = rollout.leaf_latents
                assert uncached is not None
                rewards[threshold][index] = float(scored.total.float().mean())
                distance[threshold][index] = float((rollout.leaf_latents - uncached).abs().mean())
                skipped[threshold][index] = rollout.forwards_cached / rollout.forwards if rollout.forwards else 0.0
    trainer.settings = plain
    base_seconds = [statistics.median(s) for s in seconds[0.0]]
    rows = {}
    for threshold in levels:
        medians = [statistics.median(s) for s in seconds[threshold]]
        gains = [b / m for b, m in zip(base_seconds, medians)]
        differences = [r - b for r, b in zip(rewards[threshold], rewards[0.0])]
        rows[f"{threshold:g}"] = {
            "threshold": threshold, "rollout_seconds": statistics.median(medians), "speedup": statistics.mean(gains),
            "speedup_interval": t_interval(gains), "forwards_skipped": statistics.mean(skipped[threshold]),
            "reward": statistics.mean(rewards[threshold]), "reward_minus_uncached": statistics.mean(differences),
            "reward_minus_uncached_interval": t_interval(differences), "p": paired_p(differences),
            "leaf_mean_abs_diff": statistics.mean(distance[threshold]), "per_draw_reward": rewards[threshold],
        }
    result = {"task": task, "preset": preset, "overrides": [*overrides, *extra_overrides], "draws": draws, "first_draw": first_draw,
              "repeats": repeats, "compile": trainer.runtime["compile"], "rows": rows}
    return print_result(format_cache(result), result, json_path)


def format_cache(result: dict) -> str:
    """The heading line and one row per threshold (module doc)."""
    heading = (f"bench cache: {result['task']} ({result['preset']} {' '.join(result['overrides'])}; compile {result['compile']}), "
               f"{result['draws']} draws from iteration {result['first_draw']}, median of {result['repeats']}")
    rows = []
    for row in result["rows"].values():
        (low, high), (d_low, d_high) = row["speedup_interval"], row["reward_minus_uncached_interval"]
        rows.append([f"{row['threshold']:g}", f"{row['rollout_seconds']:.3f}", f"{row['speedup']:.2f}× [{low:.2f}, {high:.2f}]",
                     f"{row['forwards_skipped']:.2f}", f"{row['reward']:.3f}",
                     f"{row['reward_minus_uncached']:+.3f} [{d_low:+.3f}, {d_high:+.3f}]",
                     "" if row["threshold"] == 0 else f"{row['p']:.3f}", f"{row['leaf_mean_abs_diff']:.4f}"])
    header = ["threshold", "rollout s", "speed-up [95 %]", "skipped", "reward", "Δ reward [95 %]", "p", "|Δx|"]
    return heading + "\n" + table(header, rows)
