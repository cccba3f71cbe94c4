"""`branchdiff bench search --sampler`: how close each search's samples come to the reward-tilted
target p*(x) ∝ p(x)·exp(λ·r(x)), at equal network rows, on Gaussian-mixture flows whose p and p*
are known (branchdiff/bench/gmm.py).

A method at a budget of B rows makes one sample per independent run (`RUNS` runs, each a prompt of
one batched search): DTS grows a tree of B rows (its descent weighing children by exp(λ·V), the
paper's) and draws a leaf by descending it the same way (`search.dts.draw_leaf`); `dts-unguided`
grows the tree with a uniform descent instead (its growth then never looks at rewards, so the tree is
an unbiased sample of p_θ) and draws the leaf the same way; `dts-is` grows the tree as DTS does and draws a leaf with
importance weights for that growth (branchdiff/search/dts_is.py); importance-resampled best-of-N draws N = B/T independent samples and keeps
one with probability softmax(λ·r); SMC walks N = B/T particles, resampled at every step by the
reward of their predicted clean sample (branchdiff/search/smc.py). The distance of the RUNS samples
to p* is the unbiased squared MMD against `REFERENCE` exact draws of p* (on a grid in 2-D, by exact
importance weights in 16-D), with a 95% Student-t interval over seeds; `exact` is the same distance
for RUNS exact draws of p*, the floor no sampler can beat at this sample size. The base model's
distance is best-of-N's at one image (N = 1: no tilt). Beside the distance, the best reward each run's
search found (mean over the runs; SMC's particles are not a search, it has none): a sampler that
converges should not lose what guided growth finds.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import cast

import torch

from branchdiff.bench.gmm import MIXTURES, GaussianMixture, GaussianMixtureAdapter, make_reward, mmd2_to, target_samples
from branchdiff.bench.stats import t_interval
from branchdiff.bench.tables import band, table, write_outputs
from branchdiff.search.best_of_n import BestOfN
from branchdiff.search.dts import DTS, draw_leaf
from branchdiff.search.dts_is import DTSIS, draw_leaf_is
from branchdiff.search.run import run_search
from branchdiff.search.sample import SearchSettings, new_forest
from branchdiff.search.smc import run_smc

STEPS = 20  # flow SDE steps (a = 0.7, the searches' default)
RUNS = 256  # independent samples per method, budget and seed
REFERENCE = 4000  # exact draws of p* each distance is measured against
SAMPLERS = ("dts", "dts-unguided", "dts-is", "best-of-n-is", "smc")
TESTBEDS = ((2, "mode"), (2, "sharp"), (2, "smooth"), (16, "mode"))  # (dimension, reward)


def parse_testbeds(text: str) -> tuple[tuple[int, str], ...]:
    """`--testbeds` text, e.g. "2-D-mode,16-D-mode", as (dimension, reward) pairs of `TESTBEDS`; another is one line naming them."""
    known = {f"{dims}-D-{reward}": (dims, reward) for dims, reward in TESTBEDS}
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        raise ValueError(f"bench search --sampler --testbeds {text!r}: unknown {', '.join(unknown) or 'empty list'}; allowed: {', '.join(known)}")
    return tuple(known[name] for name in chosen)


def bandwidths(mixture: GaussianMixture) -> tuple[float, ...]:
    """MMD kernel widths: 1, 2 and 4 times a component's typical radius s·√D."""
    radius = float(mixture.scales.mean()) * mixture.dims**0.5
    return (radius, 2 * radius, 4 * radius)


def draw_samples(sampler: str, adapter: GaussianMixtureAdapter, reward, temperature: float, budget: int, runs: int,
                 seed: int) -> tuple[torch.Tensor, float | None]:
    """`runs` samples (runs, D) of `sampler` at `budget` rows each, and the mean over the runs of the best reward their
    search found (None for SMC) (module doc)."""
    prompts = [""] * runs

    def score(points: torch.Tensor, _: list[int]) -> tuple[torch.Tensor, dict]:
        return reward(points), {}

    generator = torch.Generator().manual_seed(seed)
    settings = SearchSettings("best-of-n", budget, STEPS, seed=seed, max_batch=runs, temperature=temperature)
    forest = new_forest(adapter, prompts, settings)
    if sampler == "smc":
        return forest.leaf_latents(run_smc(forest, budget // STEPS, score, temperature, seed)).double(), None
    if sampler in ("dts", "dts-unguided"):
        result = run_search(forest, DTS(temperature=temperature, guided=sampler == "dts"), budget, score, seed)
        leaves = [draw_leaf(forest, p, temperature, generator) for p in range(runs)]
    elif sampler == "dts-is":
        search = DTSIS(temperature=temperature)
        result = run_search(forest, search, budget, score, seed)
        leaves = [draw_leaf_is(forest, search, p, result.leaves[p], result.rewards[p], generator) for p in range(runs)]
    else:
        result = run_search(forest, BestOfN(), budget, score, seed)
        weights = [torch.softmax(temperature * torch.tensor(result.rewards[p], dtype=torch.float64), 0) for p in range(runs)]
        leaves = [result.leaves[p][int(torch.multinomial(w, 1, generator=generator))] for p, w in enumerate(weights)]
    return forest.leaf_latents(leaves).double(), statistics.mean(max(found) for found in result.rewards)


def bench_sampler(images: int, seeds: int, json_path: Path | None, out_dir: Path, temperature: float = 4.0,
                  samplers: list[str] | None = None, testbeds: tuple[tuple[int, str], ...] = TESTBEDS, runs: int = RUNS) -> dict:
    """Every sampler (`samplers`: those named, None: all) on every testbed at budgets of 1, 2, 4, … `images`
    images' rows (module doc); writes out_dir/sampler.png and sampler.md, prints the table, returns (and
    writes to `json_path`) the result."""
    names = list(SAMPLERS) if samplers is None else samplers
    if [n for n in names if n not in SAMPLERS] or seeds < 1 or images < 1:
        raise ValueError(f"bench search --sampler needs known samplers ({', '.join(SAMPLERS)}), images ≥ 1 and seeds ≥ 1; got {names}, {images}, {seeds}")
    grid = [STEPS * 2**k for k in range(images.bit_length()) if 2**k <= images]
    result: dict = {"steps": STEPS, "runs": runs, "reference": REFERENCE, "temperature": temperature, "grid_nfe": grid, "seeds": seeds, "testbeds": {}}
    for dims, reward_name in testbeds:
        mixture = MIXTURES[dims]()
        adapter, reward = GaussianMixtureAdapter(mixture), make_reward(reward_name, mixture)
        widths = bandwidths(mixture)
        name = f"{dims}-D {reward_name}"
        distances: dict[str, list[list[float]]] = {s: [] for s in (*names, "exact")}  # per sampler: per seed, per budget
        found: dict[str, list[list[float]]] = {s: [] for s in names if s != "smc"}  # per sampler: per seed, per budget
        for seed in range(seeds):
            distance = mmd2_to(target_samples(mixture, reward, temperature, REFERENCE, seed=10_000 + seed), widths)
            distances["exact"].append([distance(target_samples(mixture, reward, temperature, runs, seed=20_000 + seed))] * len(grid))
            for sampler in names:
                drawn = [draw_samples(sampler, adapter, reward, temperature, budget, runs, seed) for budget in grid]
                distances[sampler].append([distance(samples) for samples, _ in drawn])
                if sampler in found:
                    found[sampler].append([cast(float, best) for _, best in drawn])
                print(f"{name} seed {seed} {sampler}: MMD² " + " ".join(f"{d:.4f}" for d in distances[sampler][-1]), flush=True)
        result["testbeds"][name] = {sampler: _summary(rows) | ({"best": _summary(found[sampler])} if sampler in found else {})
                                    for sampler, rows in distances.items()}
    print(format_table(result))
    chosen = "" if testbeds == TESTBEDS else " --testbeds " + ",".join(f"{dims}-D-{reward}" for dims, reward in testbeds)
    command = (f"branchdiff bench search --sampler --images {images} --seeds {seeds} --temperature {temperature}"
               + (f" --variants {','.join(names)}" if samplers else "") + chosen + (f" --json {json_path}" if json_path else "") + f" --out {out_dir}")
    write_outputs(out_dir, "sampler", "Distance to the reward-tilted target against network rows, Gaussian-mixture flows",
                  f"`{command}` (λ = {temperature}, {runs} samples per point, {STEPS} flow SDE steps)", format_table(result, markdown=True),
                  lambda path: plot_sampler(result, path), result, json_path)
    return result


def _summary(rows: list[list[float]]) -> dict:
    """Per budget, the mean of the seeds' values and its 95% t-interval, beside the values (per seed, per budget)."""
    return {"seeds": rows, "mean": [statistics.mean(v) for v in zip(*rows)], "ci": [list(t_interval(list(v))) for v in zip(*rows)]}


def format_table(result: dict, markdown: bool = False) -> str:
    """Per testbed and sampler: mean squared MMD to p* at each budget [95% interval over seeds], then the mean best reward found."""
    header = ["testbed", "sampler", *(f"{n} rows" for n in result["grid_nfe"])]
    rows = [[testbed, sampler, *(f"{m:.4f} [{lo:.4f}, {hi:.4f}]" for m, (lo, hi) in zip(entry["mean"], entry["ci"]))]
            for testbed, samplers in result["testbeds"].items() for sampler, entry in samplers.items()]
    best = [[testbed, f"{sampler}: best reward", *(f"{m:.3f}" for m in entry["best"]["mean"])]
            for testbed, samplers in result["testbeds"].items() for sampler, entry in samplers.items() if "best" in entry]
    return table(header, rows + best, markdown)


def plot_sampler(result: dict, path: Path) -> None:
    """Squared MMD to p* against rows per sample (log scale), one panel per testbed, 95% bands."""
    from matplotlib.figure import Figure

    testbeds = result["testbeds"]
    figure = Figure(figsize=(4 * len(testbeds), 3.6))
    grid = result["grid_nfe"]
    for column, (testbed, samplers) in enumerate(testbeds.items()):
        axes = figure.add_subplot(1, len(testbeds), column + 1)
        for sampler, entry in samplers.items():
            style = {"linestyle": "--", "color": "grey"} if sampler == "exact" else {"marker": "o", "markersize": 3}
            band(axes, grid, entry, sampler, f"network rows per sample ({result['steps']} per image)", "squared MMD to p*", **style)
        axes.set_title(testbed)
        axes.legend(fontsize=8)
    figure.suptitle(f"λ = {result['temperature']}, {result['runs']} samples per point, {result['seeds']} seed(s): mean and 95% interval")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
