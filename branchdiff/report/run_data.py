"""What a run's report reads from the run directory (branchdiff/report/run_report.py is the page):
  config.yaml              the effective config
  metrics.jsonl            one JSON object per iteration; a line cut off by a crash is skipped
  eval.json                the final base-vs-trained evaluation
  samples/iter-*.png       training leaves of random prompts
  samples/eval-iter-*.png  fixed held-out prompts and seeds at each evaluation
Only metrics.jsonl is required; an input that is absent or does not parse reads as None (or empty).

The held-out evaluation logged at iteration i (`eval_<score>`) ran before that iteration's update,
on the policy after i updates; the final evaluation (eval.json, scores named without `eval_`) ran
after the update of its `after_iteration`, so it lies at after_iteration + 1 on the same axis.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from branchdiff.objectives.registry import all_update_metrics
from branchdiff.report.figures import Column

# keys of metrics.jsonl that are not reward components (branchdiff/training/metrics.py, recipe.py)
NOT_COMPONENTS = frozenset({
    "iteration", "reward_mean", "reward_std", "reward_zero_spread_fraction", "reward_group_std",
    "groups_dropped", "nfe_rollout", "nfe_rollout_computed", "nfe_trained", "rollout_forwards", "rollout_forwards_cached",
    "edges_trained", "rollout_seconds", "reward_seconds", "train_seconds", "eval_seconds", "learning_rate",
}) | all_update_metrics()
NOT_COMPONENT_PREFIXES = ("accuracy_", "eval_", "explore_", "advantage_", "watch_", "memory_")
NOT_COMPONENT_SUFFIXES = ("_failed", "_nonfinite")  # per-component failure counts
DEPTH_KEY = re.compile(r"^(advantage_std|advantage_abs_mean|edges_trained)/depth_(\d+)$")
GRID_FILE = re.compile(r"^(eval-)?iter-(\d+)\.png$")

Grid = tuple[int, Path]  # (iteration, path) of a sample grid


@dataclass
class Run:
    """What a run directory holds."""

    run_dir: Path
    iterations: np.ndarray  # (R,) the logged iterations, increasing
    columns: dict[str, Column]  # every numeric metric, in first-logged order
    config: dict | None  # config.yaml parsed
    config_text: str | None  # config.yaml as written
    evaluation: dict | None  # eval.json

    def has(self, *keys: str) -> list[str]:
        """The keys the run logged."""
        return [k for k in keys if k in self.columns]

    def aligned(self, key: str) -> np.ndarray:
        """(R,) the key's values on every logged iteration, NaN where not logged."""
        out = np.full(len(self.iterations), np.nan)
        if key in self.columns:
            iterations, values = self.columns[key]
            out[np.searchsorted(self.iterations, iterations)] = values
        return out

    def means(self, model: str) -> dict[str, float]:
        """eval.json's mean of each score over all prompts for `model` ("base" or "trained"), by score
        name; {} without eval.json."""
        group = (self.evaluation or {}).get(model)
        scores = group.get("all") if isinstance(group, dict) else None
        if not isinstance(scores, dict):
            return {}
        return {score: float(row["mean"]) for score, row in scores.items()
                if isinstance(row, dict) and isinstance(row.get("mean"), (int, float)) and not isinstance(row["mean"], bool)}

    def after_iteration(self) -> int | None:
        """The iteration whose update the final evaluation followed: eval.json's `after_iteration`
        (None without it: eval.json written before the key was)."""
        stated = (self.evaluation or {}).get("after_iteration")
        return stated if isinstance(stated, int) and not isinstance(stated, bool) else None

    def final_x(self) -> int | None:
        """Where the final evaluation lies on the held-out curves: after_iteration + 1, else the last
        logged iteration + 1 (None without either)."""
        after = self.after_iteration()
        if after is None and len(self.iterations):
            after = int(self.iterations[-1])
        return None if after is None else after + 1


def read_metrics(path: Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl with an integer `iteration`, sorted by iteration; lines
    that do not parse (a crash cuts the last one) are skipped, a repeated iteration keeps its last line."""
    rows: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("iteration"), int):
            rows[row["iteration"]] = row
    return [rows[i] for i in sorted(rows)]


def columns(rows: list[dict]) -> dict[str, Column]:
    """Every numeric key of `rows` (sorted by iteration) as (iterations, values), in first-seen order."""
    pairs: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "iteration":
                pairs.setdefault(key, []).append((row["iteration"], value))
    return {key: (np.array([p[0] for p in kept], dtype=float), np.array([p[1] for p in kept], dtype=float)) for key, kept in pairs.items()}


def reward_components(keys: list[str]) -> list[str]:
    """Reward component keys among metric keys: the ones no other part of the metrics claims."""
    return [k for k in keys if k not in NOT_COMPONENTS and not k.startswith(NOT_COMPONENT_PREFIXES)
            and not k.endswith(NOT_COMPONENT_SUFFIXES) and not DEPTH_KEY.match(k)]


def sample_grids(run_dir: Path) -> tuple[list[Grid], list[Grid]]:
    """The held-out and the training sample grids of a run, each sorted by iteration."""
    grids: dict[bool, list[Grid]] = {True: [], False: []}
    folder = run_dir / "samples"
    for path in folder.glob("*.png") if folder.is_dir() else []:
        if match := GRID_FILE.match(path.name):
            grids[bool(match[1])].append((int(match[2]), path))
    return sorted(grids[True]), sorted(grids[False])


def read_run(run_dir: Path) -> Run:
    """The run in `run_dir`. Raises FileNotFoundError when it has no metrics.jsonl."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no metrics.jsonl); pass the output_dir of branchdiff train")
    rows = read_metrics(metrics)
    config_path, eval_path = run_dir / "config.yaml", run_dir / "eval.json"
    config_text = config_path.read_text(errors="replace") if config_path.is_file() else None
    try:
        config = yaml.safe_load(config_text) if config_text else None
    except yaml.YAMLError:
        config = None
    try:
        evaluation = json.loads(eval_path.read_bytes()) if eval_path.is_file() else None
    except ValueError:  # not JSON, or not UTF-8 text
        evaluation = None
    return Run(run_dir, np.array([r["iteration"] for r in rows], dtype=float), columns(rows),
               config if isinstance(config, dict) else None, config_text, evaluation if isinstance(evaluation, dict) else None)
