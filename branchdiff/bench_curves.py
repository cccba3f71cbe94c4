"""`branchdiff bench curves`: held-out strict accuracy against training wall time, per variant.

Every variant trains on the built-in task for the same wall-time budget, for each seed 0..S-1,
in one process, interleaved (seed 0: every variant, seed 1: every variant, ...). The clock counts
only training (rollout + rewards + update: `time.perf_counter` around `Trainer.run_iteration`);
evaluation pauses it. At each time of a fixed grid, t_k = k/(n-1) · budget, k = 0..n-1, the
model of the first iteration boundary at or after t_k is evaluated: held-out strict accuracy
(`tiny-geneval.strict`) on `tiny:held_out` (36 prompts), `images_per_prompt` ODE images each
(default 4, half of `prompts.eval_seeds`' 8, to keep evaluation cheap: 144 images, a standard
error of about ±0.04 on a mean near 0.5) from the fixed evaluation noise. t_0 is the base model:
LoRA starts at B = 0 and the evaluation noise is fixed, so it is the same for every variant and
seed, and is evaluated once.

Variants are the packaged presets (hyperparameters such as the learning rate follow them), with
the same shape for every variant: 8 prompts per iteration and a trained group of 8 samples per
prompt (the shape of tiny-mix and both explore presets;
64 trained images per iteration in all). So the same seed draws the same prompts at every
iteration in every variant. Where a preset differs:
- chain: tiny-chain's 4 prompts × 16 chains → 8 × 8 (`tree.roots=8`);
- branch, branch_pruned: their 4 prompts × 16-leaf trees (splits at steps 0..3) → 8 prompts ×
  8-leaf trees (splits at steps 0..2, the last split dropped: tiny-mix's tree);
- mix, explore_seeds (8 kept of 32 seeds), explore_tree (8 kept of 16 leaves): unchanged.
`bench_curves` refuses to run when the loaded variants differ in prompts or group size (a preset
changed its shape). Every variant also gets `explore.fidelity_every=0` (the explorers' pool-under-
policy diagnostic is measurement, not training) and no logging, checkpoints or final evaluation.
The explore presets run the emulated NVFP4 explorer, slower than the policy on CPU (docs/explore.md):
their wall time here is their CPU cost, not a GPU's.

Ratios: `time_to_chain_final[v]` is the first time v's mean curve reaches the chain's final mean
(linear between grid points; `first_time_reaching`) over the budget. The chain gets the same rule,
so its own value is ≤ 1 (below 1 when its mean curve peaked before the end); null when never reached.
Before the timed runs, each variant runs one untimed iteration (a discarded trainer), so that the
process's one-time costs (allocations, kernel choices) are charged to no variant.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from branchdiff.config import TrainConfig, load_config, tree_spec
from branchdiff.data import load_prompt_set
from branchdiff.evaluate import evaluate, summarize
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import build_component
from branchdiff.trainer import Trainer

COMMON = ["iterations=100000", "final_eval=false", "logging.tensorboard=false", "logging.sample_every=0",
          "logging.checkpoint_every=0", "explore.fidelity_every=0", "prompts.per_iteration=8"]
EIGHT_LEAVES = "tree.splits=[[0,2],[1,2],[2,2]]"
VARIANTS: dict[str, tuple[str, list[str]]] = {  # name: (preset, overrides equalising the shape: module doc)
    "chain": ("tiny-chain", ["tree.roots=8"]),
    "branch": ("tiny-branch", [EIGHT_LEAVES]),
    "branch_pruned": ("tiny-branch-pruned", [EIGHT_LEAVES]),
    "mix": ("tiny-mix", []),
    "explore_seeds": ("tiny-explore-seeds", []),
    "explore_tree": ("tiny-explore-tree", []),
}
REFERENCE = "chain"
SCORE = "tiny-geneval.strict"


def group_size(config: TrainConfig) -> int:
    """Trained samples per prompt: the leaves of a prompt's trees, or the kept seeds' leaves / kept leaves (explore)."""
    spec = tree_spec(config, 0)
    if config.explore.mode == "seeds":
        return config.explore.keep * spec.leaves // spec.roots
    if config.explore.mode == "tree":
        return config.explore.keep
    return spec.leaves


def first_time_reaching(times: list[float], values: list[float], target: float) -> float | None:
    """First time the piecewise-linear curve through (times[k], values[k]) reaches `target`:
    times[0] if values[0] ≥ target; else, for the first k with values[k] ≥ target,
    t = t_{k-1} + (target − v_{k-1}) / (v_k − v_{k-1}) · (t_k − t_{k-1}); None if no value reaches it."""
    if values[0] >= target:
        return times[0]
    for k in range(1, len(values)):
        if values[k] >= target:
            fraction = (target - values[k - 1]) / (values[k] - values[k - 1])
            return times[k - 1] + fraction * (times[k] - times[k - 1])
    return None


def time_to_reference_final(grid: list[float], means: dict[str, list[float]], reference: str = REFERENCE
                            ) -> tuple[dict[str, float | None], dict[str, str]]:
    """Per variant: `first_time_reaching` the reference's final mean, over the budget grid[-1]
    (None when never reached, with a note)."""
    target = means[reference][-1]
    ratios, notes = {}, {}
    for name, curve in means.items():
        reached = first_time_reaching(grid, curve, target)
        ratios[name] = None if reached is None else reached / grid[-1]
        if reached is None:
            notes[name] = f"never reached (final {curve[-1]:.3f} < {reference} final {target:.3f})"
    return ratios, notes


def _train_and_evaluate(config: TrainConfig, grid_seconds: list[float], held_out_strict, base: float | None) -> dict:
    """Train until the last grid time; strict accuracy at each grid time (t_0: `base`, evaluated here when None)."""
    trainer = Trainer(config)
    strict, eval_minutes = [held_out_strict(trainer) if base is None else base], [0.0]
    trained, iteration = 0.0, 0
    while len(strict) < len(grid_seconds):
        start = time.perf_counter()
        trainer.run_iteration(iteration)
        trained += time.perf_counter() - start
        iteration += 1
        if trained >= grid_seconds[len(strict)]:
            value = held_out_strict(trainer)
            while len(strict) < len(grid_seconds) and trained >= grid_seconds[len(strict)]:  # one iteration may pass several
                strict.append(value)
                eval_minutes.append(trained / 60)
    return {"strict": strict, "eval_minutes": eval_minutes, "iterations": iteration, "seconds": trained}


def bench_curves(minutes: float, seeds: int, json_path: Path | None, out_dir: Path, points: int = 7,
                 variants: list[str] | None = None, images_per_prompt: int = 4, extra_overrides: list[str] = ()) -> dict:
    """Held-out strict accuracy of each variant at `points` equally spaced training times up to
    `minutes` (module doc), over seeds 0..seeds-1; writes out_dir/curves.png and curves.md, prints
    the table and ratios, returns (and writes to `json_path`) the result.

    variants: names of VARIANTS (None: all); images_per_prompt: held-out images per prompt at each
    evaluation; extra_overrides: appended to every variant's overrides (tests: `prompts.per_iteration=1`)."""
    if minutes <= 0 or seeds < 1 or points < 2:
        raise ValueError(f"bench curves needs minutes > 0, seeds ≥ 1 and points ≥ 2; got {minutes}, {seeds}, {points}")
    names = list(VARIANTS) if variants is None else variants
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r}; allowed: {', '.join(VARIANTS)}")
    grid = [minutes * k / (points - 1) for k in range(points)]
    prompt_set = load_prompt_set("tiny:held_out")
    reward = {"tiny-geneval": build_component(parse_reward_specs(["tiny-geneval"])[0], "cpu")}

    def held_out_strict(trainer: Trainer) -> float:
        sampling = trainer.config.sampling
        result = evaluate(trainer.adapter, prompt_set, reward, images_per_prompt, num_steps=sampling.num_steps,
                          shift=sampling.shift, guidance=trainer.config.prompts.eval_guidance)
        return summarize(result)["all"][SCORE]["mean"]

    runs: dict[str, list[dict]] = {name: [] for name in names}
    load_start = os.getloadavg()[0]
    base = None  # held-out strict of the base model, from the first run
    with tempfile.TemporaryDirectory() as tmp:
        def config(name: str, seed: int) -> TrainConfig:
            preset, overrides = VARIANTS[name]
            return load_config(preset, [*COMMON, *overrides, f"seed={seed}", f"output_dir={tmp}/{name}-{seed}", *extra_overrides])

        shapes = {}
        for name in names:
            loaded = config(name, 0)
            shapes[name] = (loaded.prompts.per_iteration, group_size(loaded))
        if len(set(shapes.values())) > 1:
            raise ValueError(f"variants differ in (prompts per iteration, group size): {shapes}; equalise them in VARIANTS")
        for name in names:  # one untimed iteration of each variant: the process's one-time costs fall on none of them
            Trainer(config(name, 0)).run_iteration(0)
        for seed in range(seeds):
            for name in names:
                run = _train_and_evaluate(config(name, seed), [t * 60 for t in grid], held_out_strict, base)
                base = run["strict"][0]  # the base model: the same for every variant and seed (module doc)
                runs[name].append(run)
                print(f"seed {seed} {name}: {run['iterations']} iterations in {run['seconds']:.0f} s, strict "
                      + " ".join(f"{v:.3f}" for v in run["strict"]), flush=True)
    result = _result(minutes, seeds, grid, runs, images_per_prompt, shapes[names[0]])
    result["notes"]["machine"] = (f"{len(os.sched_getaffinity(0))} CPU cores, torch threads {torch.get_num_threads()}, load average "
                                  f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (other processes slow the clock)")
    print(format_table(result))
    print(format_ratios(result))
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(result, out_dir / "curves.png")
    command = f"branchdiff bench curves --minutes {minutes:g} --seeds {seeds}" + (f" --json {json_path}" if json_path else "") + f" --out {out_dir}"
    parameters = f"points={points}, images_per_prompt={images_per_prompt}, variants={names}, extra_overrides={list(extra_overrides)}"
    (out_dir / "curves.md").write_text(
        f"# Held-out strict accuracy against training wall time\n\n`{command}` ({parameters})\n\n"
        f"{datetime.datetime.now().isoformat(timespec='minutes')}, {result['notes']['machine']}\n\n"
        f"![curves](curves.png)\n\n{format_table(result, markdown=True)}\n\n{format_ratios(result)}\n\n"
        + "".join(f"- {key}: {note}\n" for key, note in result["notes"].items() if isinstance(note, str) and key != "machine"))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    return result


def _result(minutes: float, seeds: int, grid: list[float], runs: dict[str, list[dict]], images_per_prompt: int, shape: tuple[int, int]) -> dict:
    variants = {}
    for name, seed_runs in runs.items():
        per_time = list(zip(*(r["strict"] for r in seed_runs)))  # (points,) tuples of per-seed values
        variants[name] = {
            "strict": [r["strict"] for r in seed_runs],  # (seeds, points)
            "mean": [statistics.mean(v) for v in per_time],
            "std": [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per_time],
            "iterations": [r["iterations"] for r in seed_runs],
            "eval_minutes": [r["eval_minutes"] for r in seed_runs],  # training time at each evaluation (the boundary at or after the grid time)
            "seconds_per_iteration": sum(r["seconds"] for r in seed_runs) / sum(r["iterations"] for r in seed_runs),
        }
    notes = {
        "evaluation": f"{SCORE} mean on tiny:held_out, {images_per_prompt} ODE images per prompt, fixed evaluation noise",
        "shape": f"{shape[0]} prompts per iteration × {shape[1]} trained samples per prompt in every variant",
        "time_0": "the base model (LoRA B = 0), evaluated once and shared by every variant and seed",
        "std": "sample standard deviation over seeds (0 with one seed); the plot's band is min–max over seeds",
    }
    step = grid[1] * 60
    slow = [name for name, v in variants.items() if v["seconds_per_iteration"] > step]
    if slow:
        notes["coarse_grid"] = f"{', '.join(slow)}: an iteration takes longer than the grid step ({step:.1f} s), so grid values repeat"
    ratios: dict = {}
    if REFERENCE in variants:
        ratios["time_to_chain_final"], notes["time_to_chain_final"] = time_to_reference_final(
            grid, {name: v["mean"] for name, v in variants.items()})
    return {"minutes": minutes, "seeds": seeds, "grid_minutes": grid, "variants": variants, "ratios": ratios, "notes": notes}


def format_table(result: dict, markdown: bool = False) -> str:
    """Per variant: mean ± std over seeds at each grid time (the last is the final), iterations, s/iteration."""
    header = ["variant", *(f"{t:.2f} min" for t in result["grid_minutes"]), "iterations", "s/iter"]
    header[-3] += " (final)"
    rows = [[name, *(f"{m:.3f} ± {s:.3f}" for m, s in zip(v["mean"], v["std"])),
             f"{statistics.mean(v['iterations']):.0f}", f"{v['seconds_per_iteration']:.2f}"] for name, v in result["variants"].items()]
    if markdown:
        return "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows])
    widths = [max(len(row[i]) for row in [header, *rows]) + 2 for i in range(len(header))]
    return "\n".join(row[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(row[1:], widths[1:])) for row in [header, *rows])


def format_ratios(result: dict) -> str:
    """One line: each variant's time to reach the chain's final mean, over the budget."""
    ratios = result["ratios"].get("time_to_chain_final")
    if ratios is None:
        return f"time_to_chain_final: no {REFERENCE} variant in this run"
    notes = result["notes"]["time_to_chain_final"]
    target = result["variants"][REFERENCE]["mean"][-1]
    cells = [f"{name} {notes[name] if value is None else f'{value:.2f}'}" for name, value in ratios.items()]
    return f"time to reach {REFERENCE}'s final mean ({target:.3f}) / budget: " + ", ".join(cells)


def plot_curves(result: dict, path: Path) -> None:
    """Mean held-out strict over seeds against training minutes, one line per variant, min–max band."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axes = figure.add_subplot()
    grid = result["grid_minutes"]
    for name, v in result["variants"].items():
        per_time = list(zip(*v["strict"]))
        style = {"color": "black", "linestyle": "--"} if name == REFERENCE else {}
        line, = axes.plot(grid, v["mean"], marker="o", markersize=3, label=name, **style)
        axes.fill_between(grid, [min(x) for x in per_time], [max(x) for x in per_time], color=line.get_color(), alpha=0.15)
    axes.set_xlabel("training wall time (minutes; evaluation not counted)")
    axes.set_ylabel("held-out strict accuracy")
    axes.set_title(f"tiny task, {result['seeds']} seed(s): mean, band min–max")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
