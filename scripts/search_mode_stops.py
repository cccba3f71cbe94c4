#!/usr/bin/env python
"""Early-stopped rollouts on the 16-D mixture's `mode` reward (the testbed of `bench search --sampler`), as a search:
DTS* at λ 10 with full rollouts, with early stops (k = 10 of 20 steps), and under progressive widening from one child a
node (16 roots, w = 0.5) without and with early stops (k = 5). 64 independent searches a seed, seeds 0-2, one run of
640 rows each read at 160, 320 and 640 rows as `bench search` reads its runs (the mean over runs of the best reward
found; NaN while some run has no finished image). docs/search.md, "Early-stopped rollouts", quotes its output.

    python scripts/search_mode_stops.py          # ~15 min on 2 CPU cores
"""

from __future__ import annotations

import statistics

from branchdiff.bench.gmm import MIXTURES, GaussianMixtureAdapter, make_reward
from branchdiff.bench.search import best_curves
from branchdiff.search.dts import DTS
from branchdiff.search.run import run_search
from branchdiff.search.sample import SearchSettings, new_forest

RUNS, STEPS, BUDGET, GRID, SEEDS = 64, 20, 640, [160, 320, 640], 3
VARIANTS: dict[str, dict] = {
    "full rollouts": {},
    "k = 10": {"rollout_depth": 10},
    "widening 0.5, one child, 16 roots": {"max_children": 1, "widening": 0.5, "root_children": 16},
    "widening 0.5, one child, 16 roots, k = 5": {"max_children": 1, "widening": 0.5, "root_children": 16, "rollout_depth": 5},
}


def main() -> None:
    mixture = MIXTURES[16]()
    adapter, reward = GaussianMixtureAdapter(mixture), make_reward("mode", mixture)
    for label, settings in VARIANTS.items():
        curves = []
        for seed in range(SEEDS):
            forest = new_forest(adapter, [""] * RUNS, SearchSettings("dts-star", BUDGET, STEPS, seed=seed, max_batch=RUNS))
            result = run_search(forest, DTS(greedy=True, temperature=10.0, **settings), BUDGET, lambda x, _: (reward(x), {}), seed)
            curves.append(best_curves(result, GRID, None)[0])
        print(label + ": " + ", ".join(f"{rows} rows {statistics.mean(c[i] for c in curves):.3f} (seeds {', '.join(f'{c[i]:.3f}' for c in curves)})"
                                       for i, rows in enumerate(GRID)), flush=True)


if __name__ == "__main__":
    main()
