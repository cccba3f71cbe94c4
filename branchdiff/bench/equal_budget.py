"""`bench curves` runs compared on the axis their budget was not set on: at equal iterations where the budget was
time, at equal wall time where it was iterations.

Why: a time budget on a shared machine ranks the load as well as the objectives (one variant's seeds run while the
machine is slower make fewer iterations), and an iteration budget hides what an iteration costs. Each comparison is
therefore read both ways.

A run's held-out accuracy is known at its evaluations, (x_k, s_k) with x the run's spend on the axis (iterations, or
wall minutes) at evaluation k; between two evaluations it is read linearly:

    s(x) = s_{k−1} + (x − x_{k−1}) / (x_k − x_{k−1}) · (s_k − s_{k−1}),   x_{k−1} ≤ x ≤ x_k.

A variant is compared with the reference at x* = min over every run of both of its last x: the largest spend every
run reached, so that no run is extrapolated. The difference of means at x* is tested with Student's paired t-test on
the per-seed differences d_i = s_i^variant(x*) − s_i^reference(x*) where the runs are the same seeds in the same order,
with Welch's test otherwise; p = 1 for fewer than two seeds a side, and where every d_i is 0.
"""

from __future__ import annotations

import statistics

import numpy as np
from scipy import stats

from branchdiff.bench.stats import welch_p


def value_at(spend: list[float], values: list[float], x: float) -> float:
    """s(x) of one run: linear between its evaluations (module doc); `spend` non-decreasing (an evaluation repeated for
    grid points one iteration passed keeps its value), x within [spend[0], spend[-1]]."""
    if not spend[0] <= x <= spend[-1]:
        raise ValueError(f"{x} is outside the run's evaluations [{spend[0]}, {spend[-1]}]: a run is read between its evaluations only")
    points = {float(at): float(value) for at, value in zip(spend, values)}  # a repeated spend holds one value (the last)
    xs = sorted(points)
    return float(np.interp(x, xs, [points[at] for at in xs]))


def paired_p(differences: list[float]) -> float:
    """Two-sided p of Student's paired t-test that the mean of the per-seed `differences` is 0; 1 for fewer than two, or
    for differences all 0 (and 0 for equal non-zero differences: no spread, a sure sign; equal within 1e-12, rounding)."""
    if len(differences) < 2:
        return 1.0
    if max(differences) - min(differences) <= 1e-12:  # no spread but rounding: the t statistic is 0/0 or ±∞
        return 1.0 if abs(differences[0]) <= 1e-12 else 0.0
    return float(stats.ttest_1samp(differences, 0.0).pvalue)


def compare_at_equal_spend(reference: tuple[list[list[float]], list[list[float]]], variant: tuple[list[list[float]], list[list[float]]],
                           paired: bool) -> dict:
    """The variant against the reference at x* (module doc). Each side is (spend per run, values per run), both (runs, points).
    Returns at (x*), reference and variant (each run's s(x*)), their means, difference (variant − reference), per_seed
    (the d_i where paired, else None), p and test ("paired t" or "Welch")."""
    (reference_spend, reference_values), (variant_spend, variant_values) = reference, variant
    at = min(run[-1] for run in [*reference_spend, *variant_spend])
    at_reference = [value_at(x, s, at) for x, s in zip(reference_spend, reference_values)]
    at_variant = [value_at(x, s, at) for x, s in zip(variant_spend, variant_values)]
    paired = paired and len(at_reference) == len(at_variant)
    per_seed = [v - r for v, r in zip(at_variant, at_reference)] if paired else None
    return {"at": at, "reference": at_reference, "variant": at_variant, "reference_mean": statistics.mean(at_reference),
            "variant_mean": statistics.mean(at_variant), "difference": statistics.mean(at_variant) - statistics.mean(at_reference),
            "per_seed": per_seed, "p": paired_p(per_seed) if per_seed is not None else welch_p(at_variant, at_reference),
            "test": "paired t" if paired else "Welch"}


def compare_all(variants: dict[str, dict], reference: str, spend_of, paired: bool) -> dict[str, dict]:
    """`compare_at_equal_spend` of every variant but the reference against it; `spend_of(v)`: a variant's spend per run
    and evaluation on the axis, (runs, points); each variant's values are its `strict`."""
    reference_side = (spend_of(variants[reference]), variants[reference]["strict"])
    return {name: compare_at_equal_spend(reference_side, (spend_of(v), v["strict"]), paired)
            for name, v in variants.items() if name != reference}


def format_comparisons(comparisons: dict[str, dict], reference: str, axis: str) -> str:
    """One line per variant: its mean and the reference's at the spend both reached on `axis` (e.g. "iterations"), the
    difference, the test's p, and the per-seed differences where paired."""
    lines = []
    for name, c in comparisons.items():
        verdict = (f"significantly {'higher' if c['difference'] > 0 else 'lower'}" if c["p"] < 0.05 else "not significantly different")
        seeds = f"; per seed {', '.join(f'{d:+.3f}' for d in c['per_seed'])}" if c["per_seed"] is not None else ""
        lines.append(f"- {name}: {c['variant_mean']:.3f} vs {reference} {c['reference_mean']:.3f} at {c['at']:.4g} {axis} "
                     f"({c['difference']:+.3f}, {verdict}, {c['test']} p = {c['p']:.3f}{seeds})")
    return "\n".join(lines)
