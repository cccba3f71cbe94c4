"""`branchdiff bench search`: the best reward a search finds against its budget of network rows, for
best-of-N, fixed trees, DTS and DTS*, over seeds, on one of two tasks (`--task`):

- `tiny` (the default): the 36 held-out prompts of the tiny task (`tiny:held_out`) with the packaged
  model (or `$BRANCHDIFF_TINY_MODEL`), maximising the tiny-geneval partial credit (the training
  reward); beside it, the held-out strict accuracy of the winners (tiny-geneval.strict, the verifier
  that training reports). Its reward saturates near 1 within a few dozen images.
- `mixture`: a search that does not saturate within the budgets. The 16-D Gaussian-mixture flow of
  `bench search --sampler` (its exact velocity as the model, branchdiff/bench/gmm.py), 32 prompts,
  each an independent search for a point x*_p drawn once from p: r(x) = exp(−‖x − x*_p‖²/(2·D·w²)),
  w = 0.5. A sample of p lands at r ≈ 0.05 on average and the best of N keeps closing in slowly
  (in 16 dimensions the nearest of N draws approaches like N^(−1/16)), so best-of-N still gains from
  160 to 640 rows, and a search that refines the prefixes of its best images has room to show it.

Each search runs with 10 SDE steps (flow, a = 0.7) once per seed at the largest budget. A search is
anytime, so every smaller budget of the grid (every image's worth of rows, an image being 10 rows) is
read from the same run: at budget b a prompt's winner is its best leaf among the rounds whose spending
stayed within b. At every budget: the mean over prompts of the winner's reward (and the tiny task's
strict accuracy), each with a 95% Student-t interval over seeds (branchdiff/bench/stats.py); the table
shows the budgets 1, 2, 4, … images. `rows_by_depth`: where each search's rows went, the mean over
prompts and seeds of the network rows spent at each depth of its trees.

What each search spends per prompt: network rows, decodes and reward calls (every image, and every x̂0 an early stop or
an in-flight value scores: branchdiff/search/cost.py), and their cost in row-equivalents under each price set of
`prices` (`PRICE_SETS`: a reward call counted as one row, and the FLOP prices of a decode and a reward call at the tiny
task's and three real families' weights and sizes, branchdiff/plan/search_prices.py). Under each price set the curves
are read again on a grid of best-of-N's images in cost (an image: its rows, a decode and a call), and the ratios
computed in cost.

The mixture's targets are drawn with `target_seed`: TARGET_SEED, which no lever was tuned on, unless a run asks for
the targets the levers were tuned on (TUNING_TARGET_SEED, with noise seed 0) to report them apart.

`ratios.nfe_best_of_n_over_dts_star` (and one per search beside best-of-N): at best-of-N's mean best reward at the top of the grid, the
rows best-of-N needs to first reach it over the rows DTS* needs (each linear between grid points),
with a bootstrap interval over seeds; the paper behind DTS* reports up to 5× on SD 1.5 (arXiv 2506.20701).
A variant is a search with settings, `dts-star:root_children=2:widening=1` (`parse_variant`), and
every variant gets its ratio. Each prompt has one selection in flight (a variant may set `parallel`),
so every search is the sequential algorithm and the anytime reading is exact; the prompts' rollouts
share forwards of MAX_BATCH rows (branchdiff/search/run.py), and `fill` is the share of the rows
computed that were real, not padding.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from branchdiff.bench.gmm import GaussianMixtureAdapter, random_mixture, target_reward
from branchdiff.bench.stats import first_time_reaching, seed_summary
from branchdiff.bench.tables import band, table, write_outputs
from branchdiff.data.prompts import load_prompt_set
from branchdiff.models.base import ModelAdapter
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import build_component, score_component
from branchdiff.search.cost import ROWS, Prices
from branchdiff.search.forest import SearchForest
from branchdiff.search.registry import SEARCHES
from branchdiff.search.run import Score
from branchdiff.search.sample import DTS_OPTIONS, TREE_SEARCHES, SearchSettings, search_of, search_prompts

STEPS = 10
MAX_BATCH = 32  # network rows per forward: fewer than the prompts' rollouts, so forwards fill with one selection in flight each
VARIANT_KEYS = {"max_children": int, "root_children": int, "widening": float, "exploration": float, "temperature": float, "parallel": int,
                "x0_value": lambda text: bool(int(text)), "rollout_depth": int}
STRICT = "strict"
TASKS = ("tiny", "mixture")
MIXTURE_DIMS, MIXTURE_PROMPTS, TARGET_WIDTH = 16, 32, 0.5  # the mixture task (module doc)
TUNING_TARGET_SEED, TARGET_SEED = 123, 2027  # the targets DTS*'s levers were tuned on (with noise seed 0), and held-out ones
# price sets (module doc): fixed prices, or (preset, its overrides, the reward, its kwargs) priced by branchdiff/plan/search_prices.py
PRICE_SETS: dict[str, Prices | tuple[str, list[str], str, dict]] = {
    "call-as-row": Prices(reward=1.0),
    "tiny": ("tiny-mix", [], "tiny-geneval", {}),
    "sd35-pickscore-512": ("sd35-pickscore", ["model.resolution=512"], "pickscore", {}),
    "flux-hps-1024": ("flux-hps-branchgrpo", ["model.resolution=1024"], "hpsv2.1", {}),
    "wan-1.3b-videoalign": ("wan-mq-chain", [], "videoalign", {"num_frames": 9}),
}


@dataclass(frozen=True)
class SearchTask:
    """What a search benchmark searches: the model, its prompts, the reward's name, the score of a batch, and the
    verifier whose value of each winner is read beside its reward (None: none)."""
    name: str
    adapter: ModelAdapter
    prompts: list[str]
    reward: str
    score: Score
    verifier: str | None


def tiny_task(prompts: int | None = None) -> SearchTask:
    """The built-in task's held-out prompts (the first `prompts`, None: all 36), tiny-geneval searched, strict read."""
    from branchdiff.models import load_adapter

    texts = load_prompt_set("tiny:held_out").prompts
    texts = texts[:prompts] if prompts else texts
    reward_name = "tiny-geneval"
    reward = build_component(parse_reward_specs([reward_name])[0], "cpu")

    def score(batch: torch.Tensor, prompt_index: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        value, more, _ = score_component(reward, reward_name, batch, [texts[i] for i in prompt_index], [{} for _ in prompt_index])
        return value, {STRICT: more[STRICT]}

    return SearchTask("tiny", load_adapter("tiny", None), texts, reward_name, score, STRICT)


def mixture_task(prompts: int | None = None, target_seed: int = TARGET_SEED) -> SearchTask:
    """The 16-D mixture's target-point search (module doc): `prompts` searches (None: MIXTURE_PROMPTS), each its own x*_p,
    the targets drawn with `target_seed`."""
    mixture = random_mixture(MIXTURE_DIMS)
    count = prompts or MIXTURE_PROMPTS
    targets = mixture.sample(max(count, MIXTURE_PROMPTS), torch.Generator().manual_seed(target_seed))[:count]  # the first n of the task's
    reward = target_reward(targets, TARGET_WIDTH)

    def score(points: torch.Tensor, prompt_index: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return reward(points, prompt_index), {}

    return SearchTask("mixture", GaussianMixtureAdapter(mixture), [""] * count, "target proximity", score, None)


def parse_prices(text: str) -> list[str]:
    """`--prices` text, e.g. "tiny,call-as-row": names of PRICE_SETS (`known_prices`)."""
    return known_prices([name.strip() for name in text.split(",") if name.strip()])


def known_prices(names: list[str]) -> list[str]:
    """`names` if they are price sets of PRICE_SETS (and there is one); otherwise one line naming the allowed ones."""
    unknown = [name for name in names if name not in PRICE_SETS]
    if unknown or not names:
        raise ValueError(f"bench search --prices: unknown price set(s) {', '.join(unknown) or '(none given)'}; allowed: {', '.join(PRICE_SETS)}")
    return names


def price_sets(names: list[str]) -> dict[str, dict]:
    """Each named price set of PRICE_SETS: {"decode", "reward"} in rows, and for a family's the FLOPs they come from."""
    from branchdiff.plan.search_prices import price_search
    from branchdiff.settings.load import load_config

    priced = {}
    for name in known_prices(names):
        chosen = PRICE_SETS[name]
        if isinstance(chosen, Prices):
            priced[name] = {"decode": chosen.decode, "reward": chosen.reward}
            continue
        preset, overrides, reward, kwargs = chosen
        run = price_search(load_config(preset, overrides), reward, kwargs)
        priced[name] = {"decode": run.prices.decode, "reward": run.prices.reward, "row_flops": run.row_flops, "decode_flops": run.decode_flops,
                        "reward_flops": run.reward_flops, "from": f"{preset} {' '.join(overrides)} + {reward}".replace("  ", " ")}
    return priced


def cost_grid(prices: Prices, images: int) -> list[float]:
    """1..`images` of best-of-N's images in cost: each its STEPS rows, a decode and a reward call."""
    return [(STEPS + prices.evaluation) * k for k in range(1, images + 1)]


def best_curves(result, grid: list[float], verifier: str | None = STRICT, prices: Prices = ROWS) -> tuple[list[float], list[float]]:
    """Mean over prompts of the winner's reward and of its `verifier` score (NaN without one) at each budget of the grid
    (in rows, or in cost under `prices`); NaN at a budget where a prompt has no image yet (a mean over some of the prompts
    would not compare). A prompt's rounds spend and make images cumulatively, so its images at a budget are those of its
    last round within it, and its winner among its first m images is the running best (the first made among equals)."""
    spent = [[prices.cost(r["nfe"], r["decodes"], r["reward_calls"]) for r in rounds] for rounds in result.trace]  # non-decreasing
    running = [_running_best(rewards) for rewards in result.rewards]
    rewards, checks = [], []
    for budget in grid:
        made = [rounds[k - 1]["images"] if (k := bisect.bisect_right(costs, budget)) else 0 for costs, rounds in zip(spent, result.trace)]
        if 0 in made:
            rewards.append(math.nan)
            checks.append(math.nan)
            continue
        winners = [running[p][m - 1] for p, m in enumerate(made)]
        rewards.append(statistics.mean(result.rewards[p][i] for p, i in enumerate(winners)))
        checks.append(statistics.mean(result.extras[p][i][verifier] for p, i in enumerate(winners)) if verifier else math.nan)
    return rewards, checks


def _running_best(rewards: list[float]) -> list[int]:
    """For each k, the index of the best of rewards[:k + 1], the first on a tie."""
    best, indices = 0, []
    for i, reward in enumerate(rewards):
        if reward > rewards[best]:
            best = i
        indices.append(best)
    return indices


def rows_by_depth(forest: SearchForest) -> list[float]:
    """Network rows spent at each depth 0..T−1, mean over the forest's prompts: a node's rows are its model output's
    (two under CFG)."""
    rows = [0] * forest.num_steps
    for depth, output in zip(forest.depth, forest.output):
        if output is not None:
            rows[depth] += forest.rows_per_node()
    return [count / forest.num_prompts for count in rows]


def bench_search(images: int, seeds: int, json_path: Path | None, out_dir: Path, searches: list[str] | None = None,
                 prompts: int | None = None, task: str = "tiny", first_seed: int = 0, target_seed: int | None = None,
                 prices: list[str] | None = None) -> dict:
    """Run every search (module doc) for `seeds` seeds from `first_seed` at a budget of `images` images' rows per
    prompt on `task` (`prompts`: the first n prompts, None: the task's all; `target_seed`: the mixture's targets, None:
    TARGET_SEED); read each in rows and under each price set of `prices` (None: all of PRICE_SETS); write
    out_dir/search-bench.png and search-bench.md, print the tables, return (and write to `json_path`) the result."""
    names = list(SEARCHES) if searches is None else searches
    variants = {name: parse_variant(name) for name in names}
    if images < 1 or seeds < 1:
        raise ValueError(f"bench search needs images ≥ 1 and seeds ≥ 1; got {images}, {seeds}")
    if task not in TASKS:
        raise ValueError(f"bench search: unknown task {task!r}; allowed: {', '.join(TASKS)}")
    if target_seed is not None and task != "mixture":
        raise ValueError("bench search: --target-seed draws the mixture task's targets; add --task mixture or leave it out")
    priced = price_sets(list(PRICE_SETS) if prices is None else prices)
    chosen = tiny_task(prompts) if task == "tiny" else mixture_task(prompts, TARGET_SEED if target_seed is None else target_seed)
    grid = [STEPS * k for k in range(1, images + 1)]
    price_of = {name: Prices(p["decode"], p["reward"]) for name, p in priced.items()}
    grids = {name: cost_grid(price_of[name], images) for name in priced}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for seed in range(first_seed, first_seed + seeds):
        for name in names:
            search, options = variants[name]
            settings = SearchSettings(search, STEPS * images, STEPS, seed=seed, max_batch=MAX_BATCH, **options)
            forest, result = search_prompts(chosen.adapter, chosen.prompts, settings, chosen.score)
            best, checked = best_curves(result, grid, chosen.verifier)
            fill = sum(forest.nfe) / forest.rows_computed if forest.rows_computed else math.nan  # NaN: no forward (nothing fit the budget)
            spent = {"rows": forest.nfe, "decodes": forest.decodes, "reward_calls": forest.reward_calls}
            runs[name].append({"best_reward": best, "strict": checked, "nfe": list(forest.nfe), "fill": fill, "rows_by_depth": rows_by_depth(forest),
                               "spent": {key: statistics.mean(values) for key, values in spent.items()},
                               "priced": {set_name: best_curves(result, grids[set_name], None, price_of[set_name])[0] for set_name in priced}})
            shown = table_columns(grid)
            print(f"seed {seed} {name}: best reward " + " ".join(f"{best[i]:.3f}" for i in shown)
                  + (" | strict " + " ".join(f"{checked[i]:.3f}" for i in shown) if chosen.verifier else "")
                  + " | per prompt: rows {rows:.0f}, decodes {decodes:.1f}, reward calls {reward_calls:.1f}".format(**runs[name][-1]["spent"])
                  + f" | rows per forward {fill:.1%} of {MAX_BATCH}".replace("nan%", "—"), flush=True)
    result = {**_result(runs, grid, seeds, chosen, priced, grids), "first_seed": first_seed}
    if task == "mixture":
        result["target_seed"] = TARGET_SEED if target_seed is None else target_seed
    print(format_table(result))
    print(format_spent(result))
    print(format_ratio(result))
    command = (f"branchdiff bench search --images {images} --seeds {seeds}" + (f" --first-seed {first_seed}" if first_seed else "")
               + (f" --task {task}" if task != "tiny" else "") + (f" --target-seed {target_seed}" if target_seed is not None else "")
               + (f" --variants {','.join(names)}" if searches else "") + (f" --prices {','.join(priced)}" if prices else "")
               + (f" --json {json_path}" if json_path else "") + f" --out {out_dir}")
    write_outputs(out_dir, "search-bench", f"Best reward against network rows per prompt, {task} task", f"`{command}` (searches={names}, "
                  f"prompts={len(chosen.prompts)})", f"{format_table(result, markdown=True)}\n\n{format_spent(result, markdown=True)}\n\n"
                  f"{format_ratio(result, markdown=True)}\n\n{format_depths(result)}", lambda path: plot_search(result, path), result, json_path)
    return result


def table_columns(grid: list[int]) -> list[int]:
    """Indices of the grid's budgets the table shows: 1, 2, 4, … images and the last."""
    shown = [i for i in range(len(grid)) if (i + 1) & i == 0]
    return shown if shown[-1] == len(grid) - 1 else [*shown, len(grid) - 1]


def _ratios(searches: dict, curve, grid: list[float]) -> dict:
    """Each search's `nfe_ratio` against best-of-N on the curves `curve(entry)` read on `grid`, with its interval."""
    ratios: dict = {}
    for name in searches:
        if name != "best-of-n" and "best-of-n" in searches:
            reference, variant = curve(searches["best-of-n"]), curve(searches[name])
            key = "nfe_best_of_n_over_" + name.replace("-", "_")
            ratios[key] = nfe_ratio(reference["mean"], variant["mean"], grid)
            ratios[key + "_ci"] = nfe_ratio_interval(reference["seeds"], variant["seeds"], grid)
    return ratios


def _result(runs: dict[str, list[dict]], grid: list[int], seeds: int, task: SearchTask, priced: dict[str, dict],
            grids: dict[str, list[float]]) -> dict:
    searches = {}
    for name, seed_runs in runs.items():
        entry: dict = {"rows_by_depth": [statistics.mean(v) for v in zip(*(r["rows_by_depth"] for r in seed_runs))]}
        for key in ("best_reward", "strict") if task.verifier else ("best_reward",):
            entry[key] = seed_summary([r[key] for r in seed_runs])
        entry["nfe_mean"] = statistics.mean(n for r in seed_runs for n in r["nfe"])
        entry["fill"] = statistics.mean(r["fill"] for r in seed_runs)
        entry["spent"] = {key: statistics.mean(r["spent"][key] for r in seed_runs) for key in seed_runs[0]["spent"]}
        entry["priced"] = {set_name: seed_summary([r["priced"][set_name] for r in seed_runs]) for set_name in priced}
        searches[name] = entry
    return {"task": task.name, "grid_nfe": grid, "seeds": seeds, "prompts": len(task.prompts), "steps": STEPS, "reward": task.reward,
            "searches": searches, "ratios": _ratios(searches, lambda entry: entry["best_reward"], grid), "prices": priced,
            "grid_cost": grids, "ratios_cost": {set_name: _ratios(searches, lambda entry, s=set_name: entry["priced"][s], grids[set_name])
                                                for set_name in priced}}


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
    ignored = [key for key in settings if key in DTS_OPTIONS] if name not in TREE_SEARCHES else []
    if ignored:  # it would run as if they were not there
        raise ValueError(f"bench search: {variant!r}: {name} does not use {', '.join(ignored)}: these set how {', '.join(TREE_SEARCHES)} "
                         "grow their trees; leave them out, or name one of those searches")
    try:
        search_of(SearchSettings(name, STEPS, STEPS, **settings))  # the search's own refusals (dts-is takes no early stops)
    except ValueError as error:
        raise ValueError(f"bench search: {variant!r}: {error}") from None
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
    """Per search and budget (1, 2, 4, … images): the mean best reward and the winners' strict accuracy [95% intervals]."""
    shown = table_columns(result["grid_nfe"])
    header = ["search", "score", *(f"{result['grid_nfe'][i]} rows" for i in shown)]
    rows = []
    for name, entry in result["searches"].items():
        for key, label in (("best_reward", f"best {result['reward']}"), ("strict", "winner strict")):
            if key not in entry:
                continue
            cells = ("—" if math.isnan(entry[key]["mean"][i]) else f"{entry[key]['mean'][i]:.3f} [{entry[key]['ci'][i][0]:.3f}, {entry[key]['ci'][i][1]:.3f}]"
                     for i in shown)
            rows.append([name, label, *cells])
    return table(header, rows, markdown)


def format_depths(result: dict) -> str:
    """Where the rows went: per search, the mean rows per prompt spent at each depth."""
    depths = len(next(iter(result["searches"].values()))["rows_by_depth"])
    rows = [[name, *(f"{v:.1f}" for v in entry["rows_by_depth"])] for name, entry in result["searches"].items()]
    return "Network rows per prompt at each depth (0: the initial noises' first step):\n\n" + table(["search", *map(str, range(depths))], rows, True)


def format_spent(result: dict, markdown: bool = False) -> str:
    """Per search: the mean rows, decodes and reward calls a prompt spent over the whole budget, and their cost under each
    price set (row-equivalents)."""
    sets = result.get("prices", {})
    header = ["search", "rows", "decodes", "reward calls", *(f"cost: {name}" for name in sets)]
    rows = []
    for name, entry in result["searches"].items():
        spent = entry["spent"]
        costs = (Prices(p["decode"], p["reward"]).cost(spent["rows"], spent["decodes"], spent["reward_calls"]) for p in sets.values())
        rows.append([name, f"{spent['rows']:.0f}", f"{spent['decodes']:.1f}", f"{spent['reward_calls']:.1f}", *(f"{c:.0f}" for c in costs)])
    prices = "; ".join(f"{name}: a decode {p['decode']:.3g} rows, a reward call {p['reward']:.3g}" for name, p in sets.items())
    return f"Spent per prompt over the whole budget (prices: {prices}):\n\n" + table(header, rows, markdown)


def format_ratio(result: dict, markdown: bool = False) -> str:
    """Per search beside best-of-N, the rows best-of-N needs to first reach its mean best reward at the top of the grid over the rows
    the variant needs, and the same in cost under each price set [95% bootstrap intervals]; and rows per forward."""
    def cell(ratios: dict, key: str) -> str:
        ratio, (low, high) = ratios[key], ratios[key + "_ci"]
        return f"never [{low:.2f}, {high:.2f}]" if ratio is None else f"{ratio:.2f}× [{low:.2f}, {high:.2f}]"

    keys = [key for key in result["ratios"] if not key.endswith("_ci")]
    sets = list(result.get("ratios_cost", {}))
    fills = ", ".join(f"{name} {entry['fill']:.1%}".replace("nan%", "—") for name, entry in result["searches"].items())
    if not keys:
        return f"nfe_best_of_n_over_*: needs best-of-n and another search\nrows per forward, share of {MAX_BATCH}: {fills}"
    rows = [[key, cell(result["ratios"], key), *(cell(result["ratios_cost"][s], key) for s in sets)] for key in keys]
    return ("What best-of-N needs to first reach its mean best reward at the top of the grid, over what the variant needs "
            "(≥ 1: the variant is cheaper), in rows and in cost [95% bootstrap interval over seeds]:\n\n"
            + table(["variant", "rows", *(f"cost: {s}" for s in sets)], rows, markdown) + f"\n\nrows per forward, share of {MAX_BATCH}: {fills}")


def plot_search(result: dict, path: Path) -> None:
    """Mean best reward and winners' strict accuracy against rows per prompt (log scale), 95% bands."""
    from matplotlib.figure import Figure

    panels = [("best_reward", f"best {result['reward']} (searched)"), ("strict", "winners' held-out strict accuracy")]
    panels = [(key, label) for key, label in panels if key in next(iter(result["searches"].values()))]
    figure = Figure(figsize=(max(8, 5 * len(panels)), 4.5))
    grid = result["grid_nfe"]
    for column, (key, label) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), column + 1)
        for name, entry in result["searches"].items():
            band(axes, grid, entry[key], name, "network rows per prompt (10 per image)", label)
        axes.legend(fontsize=7)
    figure.suptitle(f"{result['task']} task, {result['prompts']} prompts, {result['seeds']} seed(s): mean and 95% interval")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
