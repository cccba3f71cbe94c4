"""`branchdiff bench search`: the best reward a search finds against its budget of network rows, on
the built-in task, for best-of-N, fixed trees, DTS and DTS*, over seeds.

Each search runs on the 36 held-out prompts of the tiny task (`tiny:held_out`) with the packaged
model (or `$BRANCHDIFF_TINY_MODEL`), 10 SDE steps (flow, a = 0.7), maximising the tiny-geneval
partial credit (the training reward), once per seed at the largest budget. A search is anytime, so
the smaller budgets of the grid (1, 2, 4, … images' worth of rows, an image being 10 rows) are read
from the same run: at budget b a prompt's winner is its best leaf among the rounds whose spending
stayed within b. At every budget: the mean over prompts of the winner's reward, and the held-out
strict accuracy of the winners (tiny-geneval.strict, the verifier that training reports), each with
a 95% Student-t interval over seeds (branchdiff/bench/stats.py).

`ratios.nfe_best_of_n_over_dts_star`: at best-of-N's mean best reward at the top of the grid, the
rows best-of-N needs to first reach it over the rows DTS* needs (each linear between grid points),
with a bootstrap interval over seeds; the paper behind DTS* reports up to 5× on SD 1.5 (arXiv 2506.20701).
A variant is a search with settings, `dts-star:root_children=2:widening=1` (`parse_variant`), and
every DTS* variant gets its ratio. Each prompt has one selection in flight (a variant may set `parallel`),
so every search is the sequential algorithm and the anytime reading is exact; the 36 prompts' rollouts
share forwards of MAX_BATCH rows (branchdiff/search/run.py), and `fill` is the share of the rows
computed that were real, not padding.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import torch

from branchdiff.bench.stats import first_time_reaching, t_interval
from branchdiff.bench.tables import band, table, write_outputs
from branchdiff.data.prompts import load_prompt_set
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import build_component, score_component
from branchdiff.search.registry import SEARCHES
from branchdiff.search.sample import SearchSettings, search_prompts

STEPS = 10
MAX_BATCH = 32  # network rows per forward: fewer than the 36 prompts' rollouts, so forwards fill with one selection in flight each
VARIANT_KEYS = {"max_children": int, "root_children": int, "widening": float, "exploration": float, "temperature": float, "parallel": int,
                "x0_value": lambda text: bool(int(text))}
REWARD = "tiny-geneval"
STRICT = "strict"


def _curves(result, grid: list[int]) -> tuple[list[float], list[float]]:
    """Mean over prompts of the winner's reward and strict score at each budget of the grid."""
    rewards, stricts = [], []
    for budget in grid:
        best_rewards, best_stricts = [], []
        for p, rounds in enumerate(result.trace):
            made = max((r["images"] for r in rounds if r["nfe"] <= budget), default=0)
            if made == 0:
                continue
            index = max(range(made), key=lambda i: (result.rewards[p][i], -i))
            best_rewards.append(result.rewards[p][index])
            best_stricts.append(result.extras[p][index][STRICT])
        rewards.append(statistics.mean(best_rewards) if best_rewards else math.nan)
        stricts.append(statistics.mean(best_stricts) if best_stricts else math.nan)
    return rewards, stricts


def bench_search(images: int, seeds: int, json_path: Path | None, out_dir: Path, searches: list[str] | None = None,
                 prompts: int | None = None) -> dict:
    """Run every search (module doc) for `seeds` seeds at a budget of `images` images' rows per
    prompt (`prompts`: the first n held-out prompts, None: all 36); write out_dir/search.png and
    search.md, print the table, return (and write to `json_path`) the result."""
    from branchdiff.models import load_adapter

    names = list(SEARCHES) if searches is None else searches
    variants = {name: parse_variant(name) for name in names}
    if images < 1 or seeds < 1:
        raise ValueError(f"bench search needs images ≥ 1 and seeds ≥ 1; got {images}, {seeds}")
    prompt_set = load_prompt_set("tiny:held_out")
    texts = prompt_set.prompts[:prompts] if prompts else prompt_set.prompts
    adapter = load_adapter("tiny", None)
    reward = build_component(parse_reward_specs([REWARD])[0], "cpu")
    grid = [STEPS * 2**k for k in range(int(math.log2(images)) + 1)]
    if grid[-1] != STEPS * images:
        grid.append(STEPS * images)

    def score(batch: torch.Tensor, prompt_index: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        value, more, _ = score_component(reward, REWARD, batch, [texts[i] for i in prompt_index], [{} for _ in prompt_index])
        return value, {STRICT: more[STRICT]}

    runs: dict[str, list[dict]] = {name: [] for name in names}
    for seed in range(seeds):
        for name in names:
            search, options = variants[name]
            settings = SearchSettings(search, STEPS * images, STEPS, seed=seed, max_batch=MAX_BATCH, **options)
            forest, result = search_prompts(adapter, texts, settings, score)
            best, strict = _curves(result, grid)
            fill = sum(forest.nfe) / forest.rows_computed if forest.rows_computed else math.nan  # NaN: no forward (nothing fit the budget)
            runs[name].append({"best_reward": best, "strict": strict, "nfe": [forest.nfe[p] for p in range(len(texts))], "fill": fill})
            print(f"seed {seed} {name}: best reward " + " ".join(f"{v:.3f}" for v in best) + " | strict " + " ".join(f"{v:.3f}" for v in strict)
                  + f" | rows per forward {fill:.1%} of {MAX_BATCH}".replace("nan%", "—"), flush=True)
    result = _result(runs, grid, seeds, len(texts))
    print(format_table(result))
    print(format_ratio(result))
    command = (f"branchdiff bench search --images {images} --seeds {seeds}" + (f" --variants {','.join(names)}" if searches else "")
               + (f" --json {json_path}" if json_path else "") + f" --out {out_dir}")
    write_outputs(out_dir, "search", "Best reward against network rows per prompt, tiny task", f"`{command}` (searches={names}, prompts={len(texts)})",
                  f"{format_table(result, markdown=True)}\n\n{format_ratio(result)}", lambda path: plot_search(result, path), result, json_path)
    return result


def _result(runs: dict[str, list[dict]], grid: list[int], seeds: int, prompts: int) -> dict:
    searches = {}
    for name, seed_runs in runs.items():
        entry = {}
        for key in ("best_reward", "strict"):
            per_point = [list(v) for v in zip(*(r[key] for r in seed_runs))]  # (points, seeds); NaN: no image within that budget yet
            entry[key] = {"seeds": [r[key] for r in seed_runs],
                          "mean": [statistics.mean(v) if all(map(math.isfinite, v)) else math.nan for v in per_point],
                          "ci": [list(t_interval(v)) if all(map(math.isfinite, v)) else [math.nan, math.nan] for v in per_point]}
        entry["nfe_mean"] = statistics.mean(n for r in seed_runs for n in r["nfe"])
        entry["fill"] = statistics.mean(r["fill"] for r in seed_runs)
        searches[name] = entry
    ratios = {}
    for name in searches:
        if name.startswith("dts-star") and "best-of-n" in searches:
            reference, variant = searches["best-of-n"]["best_reward"], searches[name]["best_reward"]
            key = "nfe_best_of_n_over_" + name.replace("-", "_")
            ratios[key] = nfe_ratio(reference["mean"], variant["mean"], grid)
            ratios[key + "_ci"] = nfe_ratio_interval(reference["seeds"], variant["seeds"], grid)
    return {"grid_nfe": grid, "seeds": seeds, "prompts": prompts, "steps": STEPS, "reward": REWARD, "searches": searches, "ratios": ratios}


def parse_variant(variant: str) -> tuple[str, dict[str, float | int]]:
    """A search and its settings from `name[:key=value...]`, e.g. `dts-star:root_children=8:widening=1` (keys: VARIANT_KEYS)."""
    name, *options = variant.split(":")
    if name not in SEARCHES:
        raise ValueError(f"bench search: unknown search {name!r} in {variant!r}; allowed: {', '.join(SEARCHES)}, each optionally with "
                         f":key=value settings ({', '.join(VARIANT_KEYS)})")
    settings: dict[str, float | int] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in VARIANT_KEYS or not value:
            raise ValueError(f"bench search: {option!r} in {variant!r} is not key=value with a key of {', '.join(VARIANT_KEYS)}")
        settings[key] = VARIANT_KEYS[key](value)
    return name, settings


def nfe_ratio(reference: list[float], variant: list[float], grid: list[int]) -> float | None:
    """Rows the reference curve needs to first reach its own final value over the rows the variant
    needs (linear between grid points; `bench.stats.first_time_reaching`); None when the variant never does."""
    target = reference[-1]
    reached = first_time_reaching(grid, variant, target)
    return None if reached is None else first_time_reaching(grid, reference, target) / reached


def nfe_ratio_interval(reference: list[list[float]], variant: list[list[float]], grid: list[int], resamples: int = 2000,
                       seed: int = 0) -> list[float]:
    """Percentile-bootstrap 95% interval of `nfe_ratio` over seeds (each resample draws the seeds of
    both with replacement); a resample where the variant never reaches the target counts as 0."""
    rng = np.random.default_rng(seed)
    reference_curves, variant_curves = np.asarray(reference, dtype=float), np.asarray(variant, dtype=float)
    ratios = []
    for _ in range(resamples):
        ref = reference_curves[rng.integers(len(reference_curves), size=len(reference_curves))].mean(axis=0)
        var = variant_curves[rng.integers(len(variant_curves), size=len(variant_curves))].mean(axis=0)
        ratio = nfe_ratio(ref.tolist(), var.tolist(), grid)
        ratios.append(0.0 if ratio is None else ratio)
    low, high = np.quantile(ratios, [0.025, 0.975], method="inverted_cdf")
    return [float(low), float(high)]


def format_table(result: dict, markdown: bool = False) -> str:
    """Per search and budget: the mean best reward and the winners' strict accuracy [95% intervals]."""
    header = ["search", "score", *(f"{n} rows" for n in result["grid_nfe"])]
    rows = []
    for name, entry in result["searches"].items():
        for key, label in (("best_reward", f"best {REWARD}"), ("strict", "winner strict")):
            cells = ("—" if math.isnan(m) else f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, (lo, hi) in zip(entry[key]["mean"], entry[key]["ci"]))
            rows.append([name, label, *cells])
    return table(header, rows, markdown)


def format_ratio(result: dict) -> str:
    """One line per DTS* variant: the rows best-of-N needs over the rows it needs, with the interval; and rows per forward."""
    top = result["grid_nfe"][-1]
    lines = []
    for key, ratio in result["ratios"].items():
        if key.endswith("_ci"):
            continue
        low, high = result["ratios"][key + "_ci"]
        value = "never reaches it within the budget" if ratio is None else f"{ratio:.2f}× fewer rows"
        lines.append(f"{key} (rows best-of-N needs to first reach its mean best reward at {top} rows, over the rows the variant needs): "
                     f"{value} [95% bootstrap interval over seeds {low:.2f}, {high:.2f}]")
    if not lines:
        lines.append("nfe_best_of_n_over_dts_star: needs both best-of-n and dts-star")
    fills = ", ".join(f"{name} {entry['fill']:.1%}".replace("nan%", "—") for name, entry in result["searches"].items())
    return "\n".join(lines + [f"rows per forward, share of {MAX_BATCH}: {fills}"])


def plot_search(result: dict, path: Path) -> None:
    """Mean best reward and winners' strict accuracy against rows per prompt (log scale), 95% bands."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    grid = result["grid_nfe"]
    for column, (key, label) in enumerate((("best_reward", f"best {REWARD} (searched)"), ("strict", "winners' held-out strict accuracy"))):
        axes = figure.add_subplot(1, 2, column + 1)
        for name, entry in result["searches"].items():
            band(axes, grid, entry[key], name, "network rows per prompt (10 per image)", label, marker="o", markersize=3)
        axes.legend(fontsize=8)
    figure.suptitle(f"tiny task, {result['prompts']} prompts, {result['seeds']} seed(s): mean and 95% interval")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
