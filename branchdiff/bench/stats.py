"""Confidence and significance for curves measured over a few seeds (`branchdiff bench curves`).

- `t_interval(values)`: the 95% interval of a mean over seeds, mean ± t_{0.975, n−1} · s / √n
  (Student's t: with 3 seeds t = 4.30, so an interval is about 2.5 standard deviations wide).
- `first_time_reaching(times, values, target)`: where a piecewise-linear curve first reaches a value.
- `time_ratio_interval(...)`: a percentile bootstrap over seeds of a variant's time to reach the
  reference's final mean, over the budget: each resample draws the seeds of both with replacement,
  takes the reference's resampled final mean as the target and the variant's resampled mean curve's
  first time reaching it (never: infinity, above any budget); the 2.5th and 97.5th percentiles.
- `welch_p(a, b)`: the two-sided p-value of Welch's t-test that two sets of seeds share a mean.
A difference is called significant at p < 0.05, or when a time ratio's interval lies below 1.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
from scipy import stats

LEVEL = 0.95


def t_interval(values: list[float]) -> tuple[float, float]:
    """(low, high) of the 95% Student-t interval of the mean of `values`; (mean, mean) for one value."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, mean
    half = stats.t.ppf((1 + LEVEL) / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


def seed_summary(per_seed: list[list[float]]) -> dict:
    """Per point, the mean over seeds and its 95% t-interval (NaN where a seed's value is not finite: a search with no
    image there yet), beside the values (per seed, per point)."""
    per_point = [list(v) for v in zip(*per_seed)]  # (points, seeds)
    return {"seeds": per_seed, "mean": [statistics.mean(v) if all(map(math.isfinite, v)) else math.nan for v in per_point],
            "ci": [list(t_interval(v)) if all(map(math.isfinite, v)) else [math.nan, math.nan] for v in per_point]}


def first_time_reaching(times: list[float], values: list[float], target: float) -> float | None:
    """First time the piecewise-linear curve through (times[k], values[k]) reaches `target`:
    times[0] if values[0] ≥ target; else, for the first k with values[k] ≥ target,
    t = t_{k-1} + (target − v_{k-1}) / (v_k − v_{k-1}) · (t_k − t_{k-1}) (t_k itself where v_{k-1} is NaN: no value
    before it, e.g. a search with no image yet); None if no value reaches it."""
    if values[0] >= target:
        return times[0]
    for k in range(1, len(values)):
        if values[k] >= target:
            if math.isnan(values[k - 1]):
                return times[k]
            fraction = (target - values[k - 1]) / (values[k] - values[k - 1])
            return times[k - 1] + fraction * (times[k] - times[k - 1])
    return None


def time_ratio_interval(reference: list[list[float]], variant: list[list[float]], times: list[float], resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """(low, high) percentile-bootstrap interval of the variant's time to reach the reference's
    final mean, over the budget times[-1]; curves are (seeds, points). Infinity where never reached."""
    rng = np.random.default_rng(seed)
    reference_curves, variant_curves = np.asarray(reference, dtype=float), np.asarray(variant, dtype=float)
    ratios = []
    for _ in range(resamples):
        target = reference_curves[rng.integers(len(reference_curves), size=len(reference_curves))].mean(axis=0)[-1]
        curve = variant_curves[rng.integers(len(variant_curves), size=len(variant_curves))].mean(axis=0)
        reached = first_time_reaching(times, curve.tolist(), float(target))
        ratios.append(math.inf if reached is None else reached / times[-1])
    low, high = np.quantile(ratios, [(1 - LEVEL) / 2, (1 + LEVEL) / 2], method="inverted_cdf")  # no interpolation: infinities stay
    return float(low), float(high)


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test (unequal variances) for the means of `a` and `b`; 1 when
    either has fewer than two values or both are constant and equal."""
    if len(a) < 2 or len(b) < 2:
        return 1.0
    if statistics.pvariance(a) == 0 and statistics.pvariance(b) == 0:
        return 1.0 if statistics.mean(a) == statistics.mean(b) else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)
