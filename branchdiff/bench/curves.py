"""`branchdiff bench curves`: held-out strict accuracy against training wall time or iterations, per variant.

Every variant trains on the built-in task for the same budget, for each seed 0..S-1, in one process,
interleaved (seed 0: every variant, seed 1: every variant, ...). The budget is time (`--minutes`, on
a clock below) or iterations (`--iterations`). The clock counts only training (rollout + rewards +
update: `time.perf_counter` around `Trainer.run_iteration`); evaluation pauses it. At each point of a
fixed grid, t_k = k/(n-1) · budget, k = 0..n-1 (whole iterations, rounded, for an iteration budget),
the model of the first iteration boundary at or after t_k is evaluated: held-out strict accuracy
(`tiny-geneval.strict`) on `tiny:held_out` (36 prompts; with `--task tiny-video`, `tiny-video.strict`
on `tiny-video:held_out`, 24 prompts, the same presets moved onto the video model), `images_per_prompt` ODE images each
(default 4, half of `prompts.eval_seeds`' 8, to keep evaluation cheap: 144 images, a standard
error of about ±0.04 on a mean near 0.5) from the fixed evaluation noise. t_0 is the base model:
LoRA starts at B = 0 and the evaluation noise is fixed, so it is the same for every variant and
seed, and is evaluated once.

Variants are the packaged presets at their own best setting (hyperparameters such as the learning
rate follow them; docs/sweep.md), with the same shape for every variant: 8 prompts per iteration and
a trained group of 8 samples per prompt (64 trained images per iteration in all). So the same seed
draws the same prompts at every iteration in every variant. Where a variant differs from its preset:
- branch, branch_pruned: their 4 prompts × 16-leaf trees (splits at steps 0..3) → 8 prompts ×
  8-leaf trees (splits at steps 0..2, the last split dropped: tiny-mix's tree), with
  `optimizer_every` rescaled to keep four optimizer steps per iteration;
- chain (tiny-chain-window: chains with the SDE on the first 5 steps, the chains' best setting),
  mix, explore_seeds (8 kept of 32 seeds, regenerated as tiny-chain-window's chains), explore_tree
  (8 kept of 16 leaves, on a Mix tree): unchanged.
`bench_curves` refuses to run when the loaded variants differ in prompts or group size (a preset
changed its shape). Every variant also gets `explore.fidelity_every=0` (the explorers' pool-under-
policy diagnostic is measurement, not training) and no logging, checkpoints or final evaluation.
The explore presets run the emulated NVFP4 explorer, slower than the policy on CPU (docs/explore.md):
their wall time here is their CPU cost, not a GPU's.

Time or iterations: on a shared machine a time budget also ranks the machine's load (a variant's seeds run while the
machine is slower make fewer iterations), and an iteration budget hides what an iteration costs. Each run therefore
records, at every evaluation, both clocks' minutes and the iterations done, and each run's seconds per iteration; every
comparison with the reference is also read on the other axis, at equal iterations for a time budget and at equal wall
time for an iteration budget (`equal`, branchdiff/bench/equal_budget.py), and the plot shows both.

Clocks (`--clock`): `wall` counts the measured training time; `modelled` (branchdiff/bench/clock.py)
charges the explorer's network rows at their number format's cost on the GPU it targets (NVFP4 a
quarter of a BF16 row), so that the explore variants, whose 4-bit explorer is emulated and slow on
a CPU, are compared by what their mechanism costs where it runs. The budget and the grid are on the
chosen clock; both clocks' times of every evaluation are kept in the JSON.

Ratios: `time_to_chain_final[v]` is the first time v's mean curve reaches the chain's final mean
(linear between grid points; `bench.stats.first_time_reaching`) over the budget. The chain gets the
same rule, so its own value is ≤ 1 (below 1 when its mean curve peaked before the end); null when
never reached (with an iteration budget: iterations to reach it over the budget). `time_to_chain_final_other_clock`
is the same ratio on the other time clock (the wall's for an iteration budget), from the same runs
(`time_to_reference_final_on`): the explore variants' mechanism on the modelled clock beside their CPU cost on the
wall clock, in one run. Confidence (branchdiff/bench/stats.py): a 95% Student-t interval over seeds at every
grid point, a bootstrap interval for every `time_to_chain_final`, and Welch's test of each variant's
final accuracy against the chain's; the markdown says which differences are significant.
Before the timed runs, each variant runs one untimed iteration (a discarded trainer), so that the
process's one-time costs (allocations, kernel choices) are charged to no variant.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from branchdiff.bench.clock import modelled_seconds
from branchdiff.bench.equal_budget import compare_all, format_comparisons
from branchdiff.bench.stats import first_time_reaching, t_interval, time_ratio_interval, welch_p
from branchdiff.bench.tables import write_json
from branchdiff.data.prompts import load_prompt_set
from branchdiff.evaluation.evaluate import OdeSampling, evaluate, summarize
from branchdiff.objectives.registry import dataset_kind
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import build_component
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.load import load_config
from branchdiff.settings.trees import tree_spec
from branchdiff.training.preflight import check_inputs
from branchdiff.training.recipe import Trainer

COMMON = ["iterations=100000", "final_eval=false", "logging.report_to=none", "logging.sample_every=0",
          "logging.checkpoint_every=0", "explore.fidelity_every=0", "prompts.per_iteration=8"]
EIGHT_LEAVES = "tree.splits=[[0,2],[1,2],[2,2]]"
VARIANTS: dict[str, tuple[str, list[str]]] = {  # name: (preset, overrides equalising the shape: module doc)
    "chain": ("tiny-chain-window", []),
    "branch": ("tiny-branch", [EIGHT_LEAVES, "train.optimizer_every=140"]),  # 560 trained edges: four optimizer steps
    "branch_pruned": ("tiny-branch-pruned", [EIGHT_LEAVES, "train.optimizer_every=60"]),  # 240 trained edges (depths 1..5)
    "mix": ("tiny-mix", []),
    "explore_seeds": ("tiny-explore-seeds", []),
    "explore_tree": ("tiny-explore-tree", []),
    # the objectives (docs/objectives.md) on the same shape: clipped GRPO is `mix`
    "guard": ("tiny-mix", ["train.loss=grpo-guard"]),
    "layertuning": ("tiny-mix", ["train.loss=grpo-layertuning"]),
    "nft_tree": ("tiny-mix", ["train.loss=nft", "train.optimizer_every=32"]),  # 64 leaves × 2 steps: four optimizer steps
    "nft_tree_depthwise": ("tiny-mix", ["train.loss=nft", "train.optimizer_every=32", "nft.advantage=depthwise"]),
    "nft_chain": ("tiny-chain", ["tree.roots=8", "train.loss=nft", "sampling.sde=ode", "train.optimizer_every=32"]),  # DiffusionNFT's ODE chains
    "sol": ("tiny-sol", []),  # Sol-RL: explore seeds + NFT
    "awm": ("tiny-awm", []),  # Advantage Weighted Matching on the Mix trees' leaves
    "dgpo": ("tiny-dgpo", []),  # DGPO on the Mix trees' leaves
    "dppo": ("tiny-dppo", []),  # Flow-DPPO on the Mix trees' edges
    "dpo": ("tiny-dpo", []),  # online Diffusion-DPO on the Mix trees' leaves
    "mc_grpo": ("tiny-mc-grpo", []),  # MC-GRPO's median baseline on 9 chains, 8 trained
    "sft": ("tiny-sft", []),  # supervised fine-tuning on the task's ground truth (a ceiling, not a rival: it sees the answers)
    "dpo_offline": ("tiny-dpo-offline", []),  # offline Diffusion-DPO on ground truth over wrong drawings
    "default": ("tiny-mix-full", []),  # the default run's recipe (GRPO-LayerTuning on Mix, compiled, cosine after decay_start, evaluated as its average)
    "video_default": ("tiny-video", []),  # the video task's default recipe (DiffusionNFT on Mix, KL 0.3, compiled, cosine, its average): --task tiny-video
}
WARM_STARTS: dict[str, tuple[str, str, float]] = {  # name: (first variant, then variant, the first's share of the budget)
    "sft_then_default": ("sft", "default", 1 / 6),  # a minute of SFT on the task's ground truth, then the default's RL
    "dpo_offline_then_default": ("dpo_offline", "default", 1 / 6),
}
SAMPLING_VARIANTS = ("chain", "branch", "branch_pruned", "mix", "explore_seeds", "explore_tree")  # the default run: clipped GRPO on each sampler
REFERENCE = "chain"
TIME_CLOCKS = ("wall", "modelled")
CLOCKS = (*TIME_CLOCKS, "iterations")  # the budget's: two clocks of time, or the iterations done
TASKS: dict[str, tuple[str, str, list[str]]] = {  # task: (held-out prompts, verifier, overrides moving a tiny preset onto the task)
    "tiny": ("tiny:held_out", "tiny-geneval", []),
    "tiny-video": ("tiny-video:held_out", "tiny-video", ["model.family=tiny-video", "prompts.train=tiny-video:train",
                                                         "prompts.eval=tiny-video:held_out", "reward=tiny-video", "eval_rewards=[tiny-video]",
                                                         "watch.gold=tiny-video.strict"]),
}
TASK_DATA: dict[str, dict[str, str]] = {  # task: the dataset objectives' own keys moving them onto it (set only on a run of that objective)
    "tiny": {}, "tiny-video": {"sft": "sft.data=tiny-video:demonstrations", "dpo-offline": "dpo_offline.data=tiny-video:preferences"},
}


def split_variants(text: str) -> list[str]:
    """`--variants`' comma-separated specs; commas inside brackets belong to a value (`mix:tree.splits=[[0,2],[1,2]]`)."""
    specs, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1, "{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            specs.append(current)
            current = ""
        else:
            current += char
    return [spec for spec in [*specs, current] if spec]


def split_spec(spec: str, allowed: Sequence[str], kind: str, example: str) -> tuple[str, list[str]]:
    """(name, its extra overrides) of a benchmark's spec `name[:key=value[:key=value...]]`, the name one of `allowed`
    (`kind` and `example` for the refusal); the spec is its label in the tables."""
    name, *overrides = spec.split(":")
    if name not in allowed:
        raise ValueError(f"unknown {kind} {name!r} in {spec!r}; allowed: {', '.join(allowed)}, each optionally with "
                         f":key=value overrides (e.g. {example})")
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise ValueError(f"{kind} {spec!r}: {bad[0]!r} is not key=value; write name:key=value:key=value")
    return name, overrides


def variant_spec(spec: str) -> tuple[str, list[str]]:
    """(variant, its extra overrides) of a spec `name[:key=value[:key=value...]]` (the tuning grids: `awm:train.learning_rate=1e-4`)."""
    return split_spec(spec, [*VARIANTS, *WARM_STARTS], "variant", "awm:train.learning_rate=1e-4")


def group_size(config: TrainConfig) -> int:
    """Trained samples per prompt: the leaves of a prompt's trees (but the median baseline's pivot), or the kept seeds'
    leaves / kept leaves (explore)."""
    spec = tree_spec(config, 0)
    if config.explore.mode == "seeds":
        return config.explore.keep * spec.leaves // spec.roots
    if config.explore.mode == "tree":
        return config.explore.keep
    if config.advantage.baseline == "median" and spec.leaves % 2 == 1:  # the pivot at the median trains nothing
        return spec.leaves - 1
    return spec.leaves


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


def time_to_reference_final_on(times: dict[str, list[float]], means: dict[str, list[float]], reference: str = REFERENCE
                               ) -> dict[str, float | None]:
    """`time_to_reference_final` on the clock the budget was not set on: each variant's mean curve
    against its own evaluation times on that clock (`times`: the mean over seeds at each
    evaluation), first reaching the reference's final mean, over the reference's time at its final
    evaluation on that clock (None when never reached)."""
    target, budget = means[reference][-1], times[reference][-1]
    reached = {name: first_time_reaching(times[name], curve, target) for name, curve in means.items()}
    return {name: None if t is None else t / budget for name, t in reached.items()}


def _train_and_evaluate(phases: list[tuple[TrainConfig, float]], grid: list[float], held_out_strict, base: float | None,
                        clock: str) -> dict:
    """Train until the last grid point of `clock` (seconds on a time clock, iterations on `iterations`); strict accuracy
    at each grid point (point 0: `base`, evaluated here when None), with both time clocks' training minutes and the
    iterations done at each evaluation. `phases`: each config with the spend on `clock` it runs until (a warm start: the
    first's weights carried into the next, whose own iterations count from 0); a single config runs to the end."""
    trainer = Trainer(phases[0][0])
    strict, at = [held_out_strict(trainer) if base is None else base], {"wall": [0.0], "modelled": [0.0]}
    at_iterations = [0]
    spent, iteration = {"wall": 0.0, "modelled": 0.0, "iterations": 0}, 0
    for index, (config, until) in enumerate(phases):
        if index:  # the next phase starts from the weights the previous one trained
            previous, trainer = trainer, Trainer(config)
            trainer.adapter.denoiser.load_state_dict(previous.adapter.denoiser.state_dict())
            iteration = 0
        backend = config.explore.backend if config.explore.mode != "off" else None
        while len(strict) < len(grid) and spent[clock] < until:
            start = time.perf_counter()
            metrics = trainer.run_iteration(iteration).metrics
            spent["wall"] += time.perf_counter() - start
            spent["modelled"] += modelled_seconds(metrics, backend)
            iteration += 1
            spent["iterations"] += 1
            if spent[clock] >= grid[len(strict)]:
                value = held_out_strict(trainer)
                while len(strict) < len(grid) and spent[clock] >= grid[len(strict)]:  # one iteration may pass several
                    strict.append(value)
                    at_iterations.append(spent["iterations"])
                    for name in at:
                        at[name].append(spent[name] / 60)
    return {"strict": strict, "eval_minutes": at, "eval_iterations": at_iterations, "iterations": spent["iterations"],
            "seconds": {name: spent[name] for name in TIME_CLOCKS}}


def bench_curves(budget: float, seeds: int, json_path: Path | None, out_dir: Path, points: int = 7,
                 variants: list[str] | None = None, images_per_prompt: int = 4, extra_overrides: Sequence[str] = (), clock: str = "wall",
                 reference: str = REFERENCE, task: str = "tiny", first_seed: int = 0) -> dict:
    """Held-out strict accuracy of each variant at `points` equally spaced points of the budget up to
    `budget` (minutes on a time clock, iterations on `iterations`; module doc), over seeds first_seed..first_seed+seeds-1 (a later first seed continues a
    run's seeds in another process: the runs of each seed depend on nothing else); writes out_dir/curves.png and curves.md, prints
    the table and ratios, returns (and writes to `json_path`) the result.

    variants: names of VARIANTS (None: the sampling variants; the objectives' are named); images_per_prompt: held-out images per prompt at each
    evaluation; extra_overrides: appended to every variant's overrides (tests: `prompts.per_iteration=1`);
    clock: `wall`, `modelled` or `iterations`, the clock of the budget and the grid (module doc); reference: the variant
    whose final mean the others' times are measured against (`time_to_<reference>_final`); task: the built-in
    task trained and evaluated, `tiny` (images) or `tiny-video` (clips: the same presets on the video model,
    its prompts and its verifier)."""
    if budget <= 0 or seeds < 1 or points < 2 or clock not in CLOCKS:
        raise ValueError(f"bench curves needs a budget > 0, seeds ≥ 1, points ≥ 2 and a clock of {', '.join(CLOCKS)}; got {budget}, "
                         f"{seeds}, {points}, {clock!r}")
    if clock == "iterations" and (budget != int(budget) or budget < points - 1):
        raise ValueError(f"bench curves --iterations {budget:g} --points {points}: give a whole number of iterations, at least one per "
                         f"evaluation after the first ({points - 1}), e.g. --iterations {max(points - 1, math.ceil(budget))}")
    names = list(SAMPLING_VARIANTS) if variants is None else variants
    specs = {name: variant_spec(name) for name in names}  # label: (variant, its extra overrides)
    if reference not in names and reference not in VARIANTS:
        raise ValueError(f"unknown reference {reference!r}; allowed: {', '.join(VARIANTS)}, or one of the variants given")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    grid = _grid(budget, points, clock)  # in the budget's unit: minutes, or iterations
    grid_spend = [t * 60 for t in grid] if clock in TIME_CLOCKS else grid  # the clock's own: seconds, or iterations
    source, verifier, task_overrides = TASKS[task]
    prompt_set = load_prompt_set(source)
    reward = {verifier: build_component(parse_reward_specs([verifier])[0], "cpu")}
    score = f"{verifier}.strict"

    def held_out_strict(trainer: Trainer) -> float:
        sampling = trainer.config.sampling
        with trainer.evaluated_weights():  # the weights a run evaluates and exports: the moving average, where it keeps one
            result = evaluate(trainer.adapter, prompt_set, reward,
                              OdeSampling(images_per_prompt, sampling.num_steps, sampling.shift, trainer.config.prompts.eval_guidance))
        return summarize(result)["all"][score]["mean"]

    runs: dict[str, list[dict]] = {name: [] for name in names}
    load_start = os.getloadavg()[0]
    base = None  # held-out strict of the base model, from the first run
    with tempfile.TemporaryDirectory() as tmp:
        def config(variant: str, seed: int, extra: list[str], label: str) -> TrainConfig:
            preset, overrides = VARIANTS[variant]
            chosen = [*COMMON, *task_overrides, *overrides, *extra, f"seed={seed}", f"output_dir={tmp}/{len(label)}-{hash(label)}-{seed}",
                      *extra_overrides]
            data = TASK_DATA[task].get(load_config(preset, chosen).train.loss)  # a dataset objective's set on this task
            return load_config(preset, [*chosen, data] if data else chosen)

        def phases(label: str, seed: int) -> list[tuple[TrainConfig, float]]:
            variant, extra = specs[label]
            if variant in WARM_STARTS:
                first, then, share = WARM_STARTS[variant]
                return [(config(first, seed, [], label + first), share * grid_spend[-1]), (config(then, seed, extra, label), math.inf)]
            return [(config(variant, seed, extra, label), math.inf)]

        shapes = {}
        for name in names:  # every variant's settings and inputs, before any model loads
            for loaded, _ in phases(name, 0):
                check_inputs(loaded)
                if not dataset_kind(loaded.train.loss):  # a dataset objective draws rows, not groups: its shape is its own
                    shapes[name] = (loaded.prompts.per_iteration, group_size(loaded))
        if len(set(shapes.values())) > 1:
            raise ValueError(f"variants differ in (prompts per iteration, group size): {shapes}; equalise them in VARIANTS")
        for name in names:  # one untimed iteration of each variant: the process's one-time costs fall on none of them
            for loaded, _ in phases(name, 0):
                Trainer(loaded).run_iteration(0)
        for seed in range(first_seed, first_seed + seeds):
            for name in names:
                run = _train_and_evaluate(phases(name, seed), grid_spend, held_out_strict, base, clock)
                base = run["strict"][0]  # the base model: the same for every variant and seed (module doc)
                runs[name].append(run)
                print(f"seed {seed} {name}: {run['iterations']} iterations in {run['seconds']['wall']:.0f} s (wall), strict "
                      + " ".join(f"{v:.3f}" for v in run["strict"]), flush=True)
    result = summarize_runs(budget, seeds, grid, runs, images_per_prompt, next(iter(shapes.values()), None), clock, reference, source, score)
    result["seed_ids"] = list(range(first_seed, first_seed + seeds))  # each run's seed, so that a merge can refuse one counted twice
    rows = [name for name in names if name not in shapes]
    if shapes and rows:  # beside the rollout variants, the dataset objectives' shape is their rows
        result["notes"]["shape"] += f"; {', '.join(rows)}: prompts.per_iteration rows of a dataset an iteration"
    result["notes"]["machine"] = (f"{len(os.sched_getaffinity(0))} CPU cores, torch threads {torch.get_num_threads()}, load average "
                                  f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (other processes slow the clock)")
    print(format_table(result))
    print(format_ratios(result))
    print(format_equal(result))
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(result, out_dir / "curves.png")
    budget_options = f"--iterations {budget:g}" if clock == "iterations" else f"--minutes {budget:g} --clock {clock}"
    command = (f"branchdiff bench curves {budget_options} --seeds {seeds}" + (f" --first-seed {first_seed}" if first_seed else "")
               + f" --variants '{','.join(names)}'" + (f" --json {json_path}" if json_path else "")
               + (f" --reference {reference}" if reference != REFERENCE else "") + (f" --task {task}" if task != "tiny" else "")
               + f" --out {out_dir}")
    parameters = f"points={points}, images_per_prompt={images_per_prompt}, variants={names}, extra_overrides={list(extra_overrides)}"
    (out_dir / "curves.md").write_text(
        f"# Held-out strict accuracy against {axis_title(clock)}\n\n`{command}` ({parameters})\n\n"
        f"{datetime.datetime.now().isoformat(timespec='minutes')}, {result['notes']['machine']}\n\n"
        f"![curves](curves.png)\n\n{format_table(result, markdown=True)}\n\n{format_ratios(result)}\n\n{format_significance(result)}\n\n"
        f"{format_equal(result)}\n\n"
        + "".join(f"- {key}: {note}\n" for key, note in result["notes"].items() if isinstance(note, str) and key != "machine"))
    if json_path:
        write_json(json_path, result)
    print(f"wrote {out_dir / 'curves.md'}, {out_dir / 'curves.png'}" + (f", {json_path}" if json_path else ""))
    return result


def summarize_runs(budget: float, seeds: int, grid: list[float], runs: dict[str, list[dict]], images_per_prompt: int, shape: tuple[int, int] | None,
            clock: str, reference: str = REFERENCE, source: str = "tiny:held_out", score: str = "tiny-geneval.strict", paired: bool = True) -> dict:
    """The result of `runs` (per variant, each seed's run as `_train_and_evaluate` returns it) on `grid` (the budget's unit):
    the curves and their intervals, the ratios and tests against the reference at equal budget, and the same comparison
    on the other axis (`equal`: branchdiff/bench/equal_budget.py; `paired`: the variants' runs are the same seeds in order)."""
    variants = {}
    for name, seed_runs in runs.items():
        per_time = [list(v) for v in zip(*(r["strict"] for r in seed_runs))]  # (points,) lists of per-seed values
        variants[name] = {
            "strict": [r["strict"] for r in seed_runs],  # (seeds, points)
            "mean": [statistics.mean(v) for v in per_time],
            "std": [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per_time],
            "ci": [list(t_interval(v)) for v in per_time],  # 95% Student-t interval of the mean, per point
            "iterations": [r["iterations"] for r in seed_runs],
            # training time on both clocks and iterations at each evaluation (the iteration boundary at or after the grid point)
            "eval_minutes": {c: [r["eval_minutes"][c] for r in seed_runs] for c in TIME_CLOCKS},
            "eval_iterations": [r["eval_iterations"] for r in seed_runs],  # (seeds, points)
            "seconds_per_iteration": {c: sum(r["seconds"][c] for r in seed_runs) / sum(r["iterations"] for r in seed_runs) for c in TIME_CLOCKS},
            "run_seconds_per_iteration": {c: [r["seconds"][c] / r["iterations"] for r in seed_runs] for c in TIME_CLOCKS},  # (seeds,)
        }
    notes = {
        "evaluation": f"{score} mean on {source}, {images_per_prompt} ODE images per prompt, fixed evaluation noise",
        "shape": (f"{shape[0]} prompts per iteration × {shape[1]} trained samples per prompt in every variant" if shape
                  else "dataset objectives only: each trains prompts.per_iteration rows an iteration"),
        "clock": (f"{clock}: the budget and the grid; eval_minutes holds both time clocks (branchdiff/bench/clock.py) and "
                  "eval_iterations the iterations at each evaluation"),
        "time_0": "the base model (LoRA B = 0), evaluated once and shared by every variant and seed",
        "confidence": "[low, high]: the 95% Student-t interval of the mean over seeds; the plot's band is that interval",
    }
    if clock in TIME_CLOCKS:
        step = grid[1] * 60
        slow = [name for name, v in variants.items() if v["seconds_per_iteration"][clock] > step]
        if slow:
            notes["coarse_grid"] = f"{', '.join(slow)}: an iteration takes longer than the grid step ({step:.1f} s), so grid values repeat"
    ratios: dict = {}
    equal: dict = {}
    if reference in variants:
        key = f"time_to_{reference}_final"
        ratios[key], notes[key] = time_to_reference_final(grid, {name: v["mean"] for name, v in variants.items()}, reference)
        reference_runs = variants[reference]["strict"]
        # an interval or a test over fewer than two seeds of either side says nothing: None ("n/a" in the tables)
        enough = {name: len(reference_runs) > 1 and len(v["strict"]) > 1 for name, v in variants.items()}
        ratios[f"{key}_ci"] = {name: list(time_ratio_interval(reference_runs, v["strict"], grid)) if enough[name] else None
                               for name, v in variants.items()}
        other = _other_clock(clock)
        ratios[f"{key}_other_clock"] = time_to_reference_final_on(
            {name: [statistics.mean(t) for t in zip(*v["eval_minutes"][other])] for name, v in variants.items()},
            {name: v["mean"] for name, v in variants.items()}, reference)
        ratios[f"final_vs_{reference}_p"] = {name: welch_p([r[-1] for r in v["strict"]], [r[-1] for r in reference_runs]) if enough[name] else None
                                             for name, v in variants.items() if name != reference}
        axis = "iterations" if clock in TIME_CLOCKS else "wall minutes"
        equal = {"axis": axis, "comparisons": compare_all(variants, reference, _spend_on(axis), paired)}
    return {"budget": budget, "unit": "iterations" if clock == "iterations" else "minutes", "seeds": seeds, "clock": clock, "grid": grid,
            "reference": reference, "variants": variants, "ratios": ratios, "equal": equal, "notes": notes}


def _grid(budget: float, points: int, clock: str) -> list[float]:
    """The evaluation points, equally spaced from 0 to the budget: minutes on a time clock, whole iterations on `iterations`."""
    if clock == "iterations":
        return [round(budget * k / (points - 1)) for k in range(points)]
    return [budget * k / (points - 1) for k in range(points)]


def _other_clock(clock: str) -> str:
    """The time clock a result's ratios are also read on: the modelled clock for a wall budget, else the wall clock."""
    return "modelled" if clock == "wall" else "wall"


def _spend_on(axis: str):
    """A variant's spend per run at each evaluation on `axis` ("iterations" or "wall minutes"), (runs, points)."""
    if axis == "iterations":
        return lambda v: v["eval_iterations"]
    return lambda v: v["eval_minutes"]["wall"]


def axis_title(clock: str) -> str:
    return "training iterations" if clock == "iterations" else f"training time ({clock} clock)"


def format_table(result: dict, markdown: bool = False) -> str:
    """Per variant: the mean over seeds [95% interval] at each grid point (the last is the final), iterations, and seconds
    per iteration (on the budget's clock; the wall's for an iteration budget) pooled over the seeds, with the seeds' range."""
    clock = "wall" if result["clock"] == "iterations" else result["clock"]
    unit = "it." if result["unit"] == "iterations" else "min"
    header = ["variant", "seeds", *(f"{t:.0f} {unit}" if unit == "it." else f"{t:.2f} {unit}" for t in result["grid"]), "iterations",
              f"s/iter ({clock}; seeds' range)"]
    header[-3] += " (final)"

    def rate(v: dict) -> str:
        each = v["run_seconds_per_iteration"][clock]
        return f"{v['seconds_per_iteration'][clock]:.2f}" + (f" ({min(each):.2f}–{max(each):.2f})" if len(each) > 1 else "")

    rows = [[name, str(len(v["strict"])),
             *(f"{m:.3f} [{low:.3f}, {high:.3f}]" if len(v["strict"]) > 1 else f"{m:.3f} [n/a]" for m, (low, high) in zip(v["mean"], v["ci"])),
             f"{statistics.mean(v['iterations']):.0f}", rate(v)] for name, v in result["variants"].items()]
    if markdown:
        return "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows])
    widths = [max(len(row[i]) for row in [header, *rows]) + 2 for i in range(len(header))]
    return "\n".join(row[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(row[1:], widths[1:])) for row in [header, *rows])


def format_equal(result: dict) -> str:
    """The comparisons on the other axis (`equal`): at equal iterations for a time budget, at equal wall time for an
    iteration budget."""
    equal = result.get("equal")
    if not equal:
        return ""
    axis, reference = equal["axis"], result["reference"]
    estimated = " (estimated: see the notes)" if "eval_iterations" in result["notes"] and axis == "iterations" else ""
    return (f"At equal {axis}{estimated}: each variant against {reference} at the most {axis} every run of both reached, each run "
            f"read linearly between its evaluations (branchdiff/bench/equal_budget.py):\n"
            + format_comparisons(equal["comparisons"], reference, axis))


def _interval(bounds: list[float] | None) -> str:
    if bounds is None:
        return "[n/a: one seed]"
    low, high = bounds
    return f"[{low:.2f}, {'never' if math.isinf(high) else f'{high:.2f}'}]"


def format_ratios(result: dict) -> str:
    """One line: each variant's time to reach the reference's final mean, over the budget, with its interval."""
    reference = result.get("reference", REFERENCE)
    key = f"time_to_{reference}_final"
    ratios = result["ratios"].get(key)
    if ratios is None:
        return f"{key}: no {reference} variant in this run"
    notes, intervals = result["notes"][key], result["ratios"][f"{key}_ci"]
    target = result["variants"][reference]["mean"][-1]
    cells = [f"{name} {notes[name] if value is None else f'{value:.2f}'} {_interval(intervals[name])}" for name, value in ratios.items()]
    other = _other_clock(result["clock"])
    on_other = ", ".join(f"{name} {'never' if value is None else f'{value:.2f}'}"
                         for name, value in result["ratios"][f"{key}_other_clock"].items())
    spend = "iterations" if result["clock"] == "iterations" else "time"
    return (f"{spend} to reach {reference}'s final mean ({target:.3f}) / budget [95% bootstrap interval]: " + ", ".join(cells)
            + f"\n\nthe same on the {other} clock (each variant's mean {other} time at each evaluation; over the {reference}'s at its end): {on_other}")


def format_significance(result: dict) -> str:
    """Which differences from the reference (the chain unless named) are significant: final accuracy
    (Welch, p < 0.05) and time to the reference's final (bootstrap interval below 1)."""
    reference = result.get("reference", REFERENCE)
    if reference not in result["variants"]:
        return ""
    own = "the chain's" if reference == "chain" else f"{reference}'s"
    reference_final = result["variants"][reference]["mean"][-1]
    lines = []
    for name, p in result["ratios"][f"final_vs_{reference}_p"].items():
        final = result["variants"][name]["mean"][-1]
        if p is None:  # fewer than two seeds on a side: no interval, no test
            counts = f"{len(result['variants'][name]['strict'])} and {len(result['variants'][reference]['strict'])}"
            lines.append(f"- {name}: final {final:.3f} vs {own} {reference_final:.3f}: n/a (a test needs two seeds of each; {counts} here).")
            continue
        low, high = result["ratios"][f"time_to_{reference}_final_ci"][name]
        accuracy = (f"final {final:.3f} vs {own} {reference_final:.3f}: " + (f"significantly {'higher' if final > reference_final else 'lower'}"
                    if p < 0.05 else "not significantly different") + f" (Welch p = {p:.3f})")
        speed = (f"reaches {own} final significantly sooner (interval below 1)" if high < 1 else
                 "significantly later or never (interval above 1)" if low > 1 else f"time to {own} final not significantly different")
        lines.append(f"- {name}: {accuracy}; {speed}.")
    chosen = result["variants"][reference]
    base, (low, high) = chosen["mean"][0], chosen["ci"][-1]
    if len(chosen["strict"]) > 1 and low <= base:
        lines.append(f"- {own} own final is not significantly above the base ({base:.3f} within its interval "
                     f"[{low:.3f}, {high:.3f}]): times to reach it compare noise levels, not learning.")
    return f"Significance ({_seed_counts(result)}):\n" + "\n".join(lines)


def _seed_counts(result: dict) -> str:
    """"3 seeds", or each variant's own count where they differ (files merged over other variants)."""
    counts = {len(v["strict"]) for v in result["variants"].values()}
    if len(counts) == 1:
        count = counts.pop()
        return f"{count} seed{'' if count == 1 else 's'}"
    return "seeds: " + ", ".join(f"{name} {len(v['strict'])}" for name, v in result["variants"].items())


def plot_curves(result: dict, path: Path) -> None:
    """Mean held-out strict over seeds, one line per variant: on the left against the budget's axis with its 95% interval
    as a band; on the right against the other axis (iterations, or wall minutes for an iteration budget), each point at
    the seeds' mean spend there."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5))
    budget_axes, other_axes = figure.subplots(1, 2, sharey=True)
    grid = result["grid"]
    other = "wall minutes" if result["clock"] == "iterations" else "iterations"
    spend_of = _spend_on(other)
    for name, v in result["variants"].items():
        style = {"color": "black", "linestyle": "--"} if name == result.get("reference", REFERENCE) else {}
        line, = budget_axes.plot(grid, v["mean"], marker="o", markersize=3, label=name, **style)
        budget_axes.fill_between(grid, [low for low, _ in v["ci"]], [high for _, high in v["ci"]], color=line.get_color(), alpha=0.12)
        spend = [statistics.mean(point) for point in zip(*spend_of(v))]
        other_axes.plot(spend, v["mean"], marker="o", markersize=3, color=line.get_color(), **{k: x for k, x in style.items() if k != "color"})
    label = {"wall": "training wall time, minutes", "modelled": "modelled GPU time (branchdiff/bench/clock.py), minutes",
             "iterations": "training iterations"}[result["clock"]]
    budget_axes.set_xlabel(f"{label}; evaluation not counted")
    other_axes.set_xlabel("iterations, the seeds' mean at each evaluation" if other == "iterations"
                          else "training wall time, minutes, the seeds' mean at each evaluation")
    budget_axes.set_ylabel("held-out strict accuracy")
    budget_axes.set_title(f"{_seed_counts(result)}: mean and 95% interval")
    other_axes.set_title(f"the same runs against {other}")
    for axes in (budget_axes, other_axes):
        axes.grid(alpha=0.3)
    other_axes.legend(*budget_axes.get_legend_handles_labels(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.savefig(path, dpi=120, bbox_inches="tight")  # the image grows to hold the legend beside the axes
