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

The sampler's own law. Every leaf of every tree is drawn by the same finite-step SDE, whose law q differs from p;
a sampler that weighs its leaves correctly approaches q*(x) ∝ q(x)·exp(λ·r(x)), not p*. So each distance is also
measured to q*: `LAW_DRAWS` unguided SDE samples through the same engine (best-of-N's leaves, `law_samples`) resampled
by exp(λ·r) give the REFERENCE draws of q* (and RUNS more, its floor `exact-q*`). Beside them the tilted mass
Z = E[exp(λ·r)] under p (`EXACT_DRAWS` exact draws) and under q (the law draws), each with its standard error, and
each tree sampler's estimate of it from its tree (`tilted_mass`): DTS's exp(λ·V(root)), dts-is's Σ w(ℓ)·exp(λ·r(ℓ)),
best-of-N's mean exp(λ·r) over its images (unbiased for Z under q), each a mean over the runs and seeds with its
standard error, so that a bias is stated against the law the leaves were drawn from.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import cast

import torch

from branchdiff.bench.gmm import MIXTURES, GaussianMixture, GaussianMixtureAdapter, make_reward, mmd2_to, target_samples
from branchdiff.bench.stats import seed_summary
from branchdiff.bench.tables import band, table, write_outputs
from branchdiff.search.best_of_n import BestOfN
from branchdiff.search.dts import DTS, draw_leaf
from branchdiff.search.dts_is import DTSIS, draw_leaf_is, mass_weights
from branchdiff.search.run import run_search
from branchdiff.search.sample import SearchSettings, new_forest
from branchdiff.search.smc import run_smc

STEPS = 20  # flow SDE steps (a = 0.7, the searches' default)
RUNS = 256  # independent samples per method, budget and seed
REFERENCE = 4000  # exact draws of p* each distance is measured against
LAW_DRAWS, LAW_CHUNK, EXACT_DRAWS = 65_536, 8192, 200_000  # unguided SDE samples of q (in forests of LAW_CHUNK), exact draws of p
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


def law_samples(adapter: GaussianMixtureAdapter, count: int, seed: int, chunk: int = LAW_CHUNK) -> torch.Tensor:
    """`count` samples (count, D) of the sampler's own law q: unguided SDE samples through the engine, as a tree's leaves
    are drawn (best-of-N's images, one per prompt, in forests of `chunk` prompts, noise seeds seed, seed + 1, ...)."""
    drawn = []
    for index, start in enumerate(range(0, count, chunk)):
        size = min(chunk, count - start)
        forest = new_forest(adapter, [""] * size, SearchSettings("best-of-n", STEPS, STEPS, seed=seed + index, max_batch=size))
        result = run_search(forest, BestOfN(), STEPS, lambda points, _: (torch.zeros(len(points)), {}), seed + index)
        drawn.append(forest.leaf_latents([leaves[0] for leaves in result.leaves]).double())
    return torch.cat(drawn)


def tilted_mass(values: torch.Tensor) -> dict[str, float]:
    """The mean of per-draw (or per-tree) estimates of Z = E[exp(λ·r)] and its standard error."""
    return {"mean": float(values.mean()), "se": float(values.std() / len(values) ** 0.5)}


def draw_samples(sampler: str, adapter: GaussianMixtureAdapter, reward, temperature: float, budget: int, runs: int,
                 seed: int) -> tuple[torch.Tensor, float | None, torch.Tensor | None, float]:
    """`runs` samples (runs, D) of `sampler` at `budget` rows each, the mean over the runs of the best reward their
    search found (None for SMC), each run's estimate of the tilted mass E[exp(λ·r)] (None where the sampler makes
    none: SMC, dts-unguided), and the reward calls (each with its decode) a run made, on average (module doc)."""
    prompts = [""] * runs

    def score(points: torch.Tensor, _: list[int]) -> tuple[torch.Tensor, dict]:
        return reward(points), {}

    generator = torch.Generator().manual_seed(seed)
    settings = SearchSettings("best-of-n", budget, STEPS, seed=seed, max_batch=runs, temperature=temperature)
    forest = new_forest(adapter, prompts, settings)
    if sampler == "smc":
        drawn = forest.leaf_latents(run_smc(forest, budget // STEPS, score, temperature, seed)).double()
        return drawn, None, None, statistics.mean(forest.reward_calls)
    tilts = None
    if sampler in ("dts", "dts-unguided"):
        result = run_search(forest, DTS(temperature=temperature, guided=sampler == "dts"), budget, score, seed)
        leaves = [draw_leaf(forest, p, temperature, generator) for p in range(runs)]
        if sampler == "dts":  # its own estimate: the soft value at the virtual root
            tilts = torch.exp(temperature * torch.tensor([forest.value[p] for p in range(runs)], dtype=torch.float64))
    elif sampler == "dts-is":
        search = DTSIS(temperature=temperature)
        result = run_search(forest, search, budget, score, seed)
        leaves = [draw_leaf_is(forest, search, p, result.leaves[p], result.rewards[p], generator) for p in range(runs)]
        tilts = torch.stack([(mass_weights(forest, search, p, result.leaves[p]) * torch.exp(temperature * torch.tensor(result.rewards[p], dtype=torch.float64)))
                             .sum() for p in range(runs)])
    else:
        result = run_search(forest, BestOfN(), budget, score, seed)
        weights = [torch.softmax(temperature * torch.tensor(result.rewards[p], dtype=torch.float64), 0) for p in range(runs)]
        leaves = [result.leaves[p][int(torch.multinomial(w, 1, generator=generator))] for p, w in enumerate(weights)]
        tilts = torch.stack([torch.exp(temperature * torch.tensor(result.rewards[p], dtype=torch.float64)).mean() for p in range(runs)])
    return forest.leaf_latents(leaves).double(), statistics.mean(max(found) for found in result.rewards), tilts, statistics.mean(forest.reward_calls)


def bench_sampler(images: int, seeds: int, json_path: Path | None, out_dir: Path, temperature: float = 4.0,
                  samplers: list[str] | None = None, testbeds: tuple[tuple[int, str], ...] = TESTBEDS, runs: int = RUNS,
                  law_draws: int = LAW_DRAWS) -> dict:
    """Every sampler (`samplers`: those named, None: all) on every testbed at budgets of 1, 2, 4, … `images`
    images' rows (module doc), against p* and against the sampler's own law's q* (`law_draws` SDE samples); writes
    out_dir/sampler.png and sampler.md, prints the tables, returns (and writes to `json_path`) the result."""
    names = list(SAMPLERS) if samplers is None else samplers
    if [n for n in names if n not in SAMPLERS] or seeds < 1 or images < 1:
        raise ValueError(f"bench search --sampler needs known samplers ({', '.join(SAMPLERS)}), images ≥ 1 and seeds ≥ 1; got {names}, {images}, {seeds}")
    grid = [STEPS * 2**k for k in range(images.bit_length()) if 2**k <= images]
    result: dict = {"steps": STEPS, "runs": runs, "reference": REFERENCE, "temperature": temperature, "grid_nfe": grid, "seeds": seeds, "testbeds": {},
                    "law_draws": law_draws, "law": {}, "reward_calls": {}}
    for dims, reward_name in testbeds:
        mixture = MIXTURES[dims]()
        adapter, reward = GaussianMixtureAdapter(mixture), make_reward(reward_name, mixture)
        widths = bandwidths(mixture)
        name = f"{dims}-D {reward_name}"
        law = law_samples(adapter, law_draws, seed=30_000)  # (law_draws, D): q, the SDE sampler's own law
        law_tilt = torch.softmax(temperature * reward(law).double(), 0)  # q* as weights on q's draws
        exact = mixture.sample(EXACT_DRAWS, torch.Generator().manual_seed(5))
        distances: dict[str, list[list[float]]] = {s: [] for s in (*names, "exact")}  # per sampler: per seed, per budget
        to_law: dict[str, list[list[float]]] = {s: [] for s in (*names, "exact-q*")}
        found: dict[str, list[list[float]]] = {s: [] for s in names if s != "smc"}  # per sampler: per seed, per budget
        calls: dict[str, list[list[float]]] = {s: [] for s in names}  # per sampler: per seed, per budget: reward calls (and decodes) per sample
        masses: dict[str, list[list[torch.Tensor]]] = {}  # per sampler: per budget, per seed: each run's estimate of E[exp(λ·r)]
        for seed in range(seeds):
            distance = mmd2_to(target_samples(mixture, reward, temperature, REFERENCE, seed=10_000 + seed), widths)
            law_reference = law[torch.multinomial(law_tilt, REFERENCE, replacement=True, generator=torch.Generator().manual_seed(40_000 + seed))]
            law_distance = mmd2_to(law_reference, widths)
            distances["exact"].append([distance(target_samples(mixture, reward, temperature, runs, seed=20_000 + seed))] * len(grid))
            floor = law[torch.multinomial(law_tilt, runs, replacement=True, generator=torch.Generator().manual_seed(50_000 + seed))]
            to_law["exact-q*"].append([law_distance(floor)] * len(grid))
            for sampler in names:
                drawn = [draw_samples(sampler, adapter, reward, temperature, budget, runs, seed) for budget in grid]
                distances[sampler].append([distance(samples) for samples, *_ in drawn])
                to_law[sampler].append([law_distance(samples) for samples, *_ in drawn])
                calls[sampler].append([called for *_, called in drawn])
                if sampler in found:
                    found[sampler].append([cast(float, best) for _, best, *_ in drawn])
                if drawn[0][2] is not None:
                    for point, (_, _, tilts, _) in enumerate(drawn):
                        masses.setdefault(sampler, [[] for _ in grid])[point].append(cast(torch.Tensor, tilts))
                print(f"{name} seed {seed} {sampler}: MMD² to p* " + " ".join(f"{d:.4f}" for d in distances[sampler][-1])
                      + " | to q* " + " ".join(f"{d:.4f}" for d in to_law[sampler][-1]), flush=True)
        result["testbeds"][name] = {sampler: seed_summary(rows) | ({"best": seed_summary(found[sampler])} if sampler in found else {})
                                    for sampler, rows in distances.items()}
        result["reward_calls"][name] = {sampler: [statistics.mean(v) for v in zip(*rows)] for sampler, rows in calls.items()}
        result["law"][name] = {"distances": {sampler: seed_summary(rows) for sampler, rows in to_law.items()},
                               "z_p": tilted_mass(torch.exp(temperature * reward(exact).double())),
                               "z_q": tilted_mass(torch.exp(temperature * reward(law).double())), "q_star_ess": float(1 / (law_tilt**2).sum()),
                               "estimates": {sampler: [tilted_mass(torch.cat(point)) for point in per_budget] for sampler, per_budget in masses.items()}}
    print(format_table(result))
    print(format_law(result))
    chosen = "" if testbeds == TESTBEDS else " --testbeds " + ",".join(f"{dims}-D-{reward}" for dims, reward in testbeds)
    command = (f"branchdiff bench search --sampler --images {images} --seeds {seeds} --temperature {temperature}"
               + (f" --variants {','.join(names)}" if samplers else "") + chosen + (f" --json {json_path}" if json_path else "") + f" --out {out_dir}")
    write_outputs(out_dir, "sampler", "Distance to the reward-tilted target against network rows, Gaussian-mixture flows",
                  f"`{command}` (λ = {temperature}, {runs} samples per point, {STEPS} flow SDE steps, {law_draws} samples of the sampler's law)",
                  f"{format_table(result, markdown=True)}\n\n{format_law(result, markdown=True)}", lambda path: plot_sampler(result, path), result, json_path)
    return result


def format_table(result: dict, markdown: bool = False) -> str:
    """Per testbed and sampler: mean squared MMD to p* at each budget [95% interval over seeds], then the mean best reward found
    and the reward calls (each with a decode) a sample cost beside its rows."""
    header = ["testbed", "sampler", *(f"{n} rows" for n in result["grid_nfe"])]
    rows = [[testbed, sampler, *(f"{m:.4f} [{lo:.4f}, {hi:.4f}]" for m, (lo, hi) in zip(entry["mean"], entry["ci"]))]
            for testbed, samplers in result["testbeds"].items() for sampler, entry in samplers.items()]
    best = [[testbed, f"{sampler}: best reward", *(f"{m:.3f}" for m in entry["best"]["mean"])]
            for testbed, samplers in result["testbeds"].items() for sampler, entry in samplers.items() if "best" in entry]
    calls = [[testbed, f"{sampler}: {label}", *(f"{value(n, c):.1f}" for n, c in zip(result["grid_nfe"], per_budget))]
             for testbed, samplers in result.get("reward_calls", {}).items() for sampler, per_budget in samplers.items()
             for label, value in (("reward calls (= decodes)", lambda n, c: c), ("cost, a call as a row", lambda n, c: n + c))]
    return table(header, rows + best + calls, markdown)


def format_law(result: dict, markdown: bool = False) -> str:
    """Against the SDE sampler's own law: per testbed the tilted mass Z under p and under q, each tree sampler's estimate
    of it at each budget with its distance from both in standard errors; then the squared MMD of every sampler to q*."""
    grid = result["grid_nfe"]
    lines = []
    for testbed, law in result["law"].items():
        z_p, z_q = law["z_p"], law["z_q"]
        rows = [[label, *[f"{z['mean']:.3f} ± {z['se']:.3f}"] * len(grid)] for label, z in (("E_p (exact draws)", z_p), ("E_q (the SDE's own law)", z_q))]
        for sampler, points in law["estimates"].items():
            cells = []
            for point in points:
                from_q = (point["mean"] - z_q["mean"]) / math.hypot(point["se"], z_q["se"])
                from_p = (point["mean"] - z_p["mean"]) / math.hypot(point["se"], z_p["se"])
                cells.append(f"{point['mean']:.3f} ± {point['se']:.3f} ({from_q:+.1f} SE from E_q, {from_p:+.1f} from E_p)")
            rows.append([f"{sampler}'s estimate", *cells])
        lines.append(f"{testbed}: Z = E[exp(λ·r)], the tilted mass, and the samplers' estimates (mean ± standard error over the runs and seeds):\n\n"
                     + table(["", *(f"{n} rows" for n in grid)], rows, markdown))
    distances = [[testbed, sampler, *(f"{m:.4f} [{lo:.4f}, {hi:.4f}]" for m, (lo, hi) in zip(entry["mean"], entry["ci"]))]
                 for testbed, law in result["law"].items() for sampler, entry in law["distances"].items()]
    ess = ", ".join(f"{testbed} {law['q_star_ess']:.0f}" for testbed, law in result["law"].items())
    lines.append(f"Squared MMD to q* ∝ q·exp(λ·r), the SDE's own law tilted ({result['law_draws']} SDE samples resampled; effective sample size "
                 f"{ess}):\n\n" + table(["testbed", "sampler", *(f"{n} rows" for n in grid)], distances, markdown))
    return "\n\n".join(lines)


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
