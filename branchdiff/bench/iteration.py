"""`branchdiff bench tree`: one full training iteration of each algorithm, side by side.

Every variant is a full iteration (rollout + rewards + advantages + update) on the built-in model,
measured in one process, interleaved (variant A, B, C, A, B, C, ...), median of `repeats`, in the
configuration users run by default (`sampling.exact=false`: only real rows are computed) and, as a
second column, with `sampling.exact=true` (every rollout forward padded to `max_batch` rows for
bit-exact regeneration). Beside them: the same tree expanded node by node with batch-1 forwards
and per-edge updates (the BranchGRPO release's way), and the bare model forwards the batched tree
rollout needed (its real rows, unpadded).

NFE model of an iteration's cost: `rollout_nfe + c · trained_nfe`, where trained_nfe counts the
parent forwards (with backward) of the update and c is the measured cost of such a row relative
to a rollout row. A variant's efficiency is its measured speed-up over the chain divided by the
speed-up this model implies: 1.0 means no overhead beyond the model's own arithmetic.

Where a variant's efficiency goes (`efficiency_lost`, fractions of its iteration that sum with the
efficiency to 1): with k = its NFE cost over the chain's, the model predicts k × the chain's seconds;
the measured iteration exceeds that by (a) its rollout rows costing more than the chain's (narrow tree
levels: a forward of few rows pays the same fixed cost as one of 64), (b) its trained rows costing
more than the chain's, (c) the work that does not shrink with the NFE count (scoring the leaves, the
optimizer, the rest) beyond k × the chain's, (d) the median iteration differing from the sum of its
phases' medians (noise between rounds), and (e) the model's c differing from the chain's own ratio of
a trained row to a rollout row. `forward_ms_per_row` gives the bare forward's cost per row
at each batch size.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from branchdiff.bench.tables import print_result
from branchdiff.core.engine import forward_chunked
from branchdiff.explore.pool import ranking_agreement
from branchdiff.models.base import select_embeds
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.load import load_config
from branchdiff.training.preflight import check_inputs
from branchdiff.training.recipe import Trainer

ANCHOR_SPLITS = "[[0,2],[3,2],[6,2],[9,2]]"  # BranchGRPO: T = 20, k = 2 at steps 0, 3, 6, 9 → 16 leaves
BASE = [
    "sampling.num_steps=20", "sampling.shift=3.0", "sampling.sde=dance", "sampling.noise_level=0.3",
    "sampling.max_batch=64", "prompts.per_iteration=4", "train.minibatch=64",
    "logging.report_to=none", "final_eval=false", "iterations=1000",
]
TREE = ["tree.roots=1", f"tree.splits={ANCHOR_SPLITS}"]
VARIANTS: dict[str, list[str]] = {
    "chain": ["tree.roots=16"],
    "tree": TREE,
    "tree_depth_pruned": [*TREE, f"prune.depths=[{','.join(str(d) for d in range(11, 21))}]"],
    "tree_width_pruned": [*TREE, "prune.width=global", "prune.width_ratio=0.25"],
    "mix": [*TREE, "tree.mix_window=4"],
    # later splits (158 instead of 203 forwards) and Mix: SDE on steps 0-2 and the splits only
    "best": ["tree.roots=1", "tree.splits=[[3,2],[6,2],[9,2],[12,2]]", "tree.mix_window=3"],
    "tree_compiled": [*TREE, "model.compile=blocks"],  # the tree with each transformer block compiled (torch.compile, Inductor)
}
PROFILE = ("rollout_seconds", "decode_seconds", "score_seconds", "forward_backward_seconds", "optimizer_seconds", "other_seconds")
RATIO_NAMES = {"tree": "chain_over_tree", "tree_depth_pruned": "chain_over_tree_pruned", "tree_width_pruned": "chain_over_tree_width_pruned",
               "mix": "chain_over_mix", "best": "chain_over_best"}
LOST_PARTS = ("rollout_rows", "trained_rows", "fixed", "medians", "cost_model")
NOT_AGAINST_THE_MODEL = ("tree_per_node", "tree_compiled")  # a benchmark of the release's way, and of compilation


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _probe(trainer: Trainer, rows: int) -> tuple:
    """The arguments of `adapter.predict` for `rows` rows of noise at a mid-schedule step, one prompt."""
    adapter = trainer.adapter
    step = trainer.schedule.model_times[len(trainer.schedule.model_times) // 2]
    embeds = select_embeds(adapter.encode_prompts(["one red circle on the left"]), torch.zeros(rows, dtype=torch.long))
    return torch.randn(rows, *adapter.latent_shape, device=adapter.device), step.expand(rows), embeds, trainer.settings.guidance


def measure_trained_row_cost(trainer: Trainer, rows: int = 64, repeats: int = 5) -> float:
    """c: seconds of a forward+backward row (LoRA gradients) over seconds of a no-grad rollout row."""
    inputs = _probe(trainer, rows)
    rollout_rows = partial(torch.no_grad()(trainer.adapter.predict), *inputs)

    def trained_rows() -> None:
        trainer.adapter.predict(*inputs).square().mean().backward()
        trainer.optimizer.zero_grad(set_to_none=True)

    rollout_rows(), trained_rows()  # warm-up
    return _median_time(trained_rows, repeats) / _median_time(rollout_rows, repeats)


def forward_ms_per_row(trainer: Trainer, sizes: tuple[int, ...] = (4, 8, 16, 32, 64), repeats: int = 5) -> dict[int, float]:
    """Milliseconds per row of a no-grad denoiser forward at each batch size (a mid-schedule step)."""
    costs = {}
    for rows in sizes:
        forward = partial(torch.no_grad()(trainer.adapter.predict), *_probe(trainer, rows))
        forward()  # warm-up
        costs[rows] = 1000 * _median_time(forward, repeats) / rows
    return costs


def rollout_and_bare_seconds(trainer: Trainer, iteration: int) -> tuple[float, float]:
    """Seconds of a batched rollout of this iteration's tree, and of only the model forwards of its
    real rows (same chunks, no padding), measured back to back."""
    rollout, _, _, info = trainer.rollout_and_score(iteration)
    tree, adapter = rollout.tree, trainer.adapter
    settings = replace(trainer.settings, exact=False)
    start = time.perf_counter()
    with torch.no_grad():
        for depth in range(tree.spec.num_steps):
            level = torch.arange(tree.level_start[depth], tree.level_start[depth + 1])
            embeds = select_embeds(info["embeds"], tree.prompt[level])
            forward_chunked(adapter, rollout.latents[level], rollout.schedule.model_times[depth].expand(len(level)), embeds, settings)
    return info["rollout_seconds"], time.perf_counter() - start


def variant_row(runs: list[dict]) -> dict:
    """A variant's figures over its measured iterations (each a run_iteration's metrics with its `seconds`): medians."""
    return {
        "nfe_rollout": runs[0]["nfe_rollout"],
        "nfe_rollout_computed": runs[0]["nfe_rollout_computed"],
        "nfe_trained": runs[0]["nfe_trained"],
        "edges_trained": runs[0]["edges_trained"],
        "seconds": statistics.median(r["seconds"] for r in runs),
        "rollout_seconds": statistics.median(r["rollout_seconds"] for r in runs),
        "train_seconds": statistics.median(r["train_seconds"] for r in runs),
        "reward_mean": statistics.mean(r["reward_mean"] for r in runs),
        "profile": {key: statistics.median(_phases(r)[key] for r in runs) for key in PROFILE},
    }


def _phases(run: dict) -> dict[str, float]:
    """Where an iteration's seconds went: the rollout, decoding the leaves, scoring them, the update's
    forwards and backwards, its optimizer steps (with gradient clipping), and the rest (advantages,
    pruning, the update's plan, metrics, bookkeeping)."""
    phases = {"rollout_seconds": run["rollout_seconds"], "decode_seconds": run["decode_seconds"],
              "score_seconds": run["reward_seconds"] - run["decode_seconds"], "forward_backward_seconds": run["forward_backward_seconds"],
              "optimizer_seconds": run["optimizer_seconds"]}
    phases["other_seconds"] = run["seconds"] - sum(phases.values())
    return phases


def bench_tree(json_path: Path | None = None, repeats: int = 3, extra_overrides: list[str] = (), variants: list[str] | None = None) -> dict:
    """Rows per variant (default configuration) with an `exact` sub-row (sampling.exact=true), and
    the ratios of both configurations. `variants`: a subset of VARIANTS (None: all); the ratios
    need the chain and the tree."""
    names = list(VARIANTS) if variants is None else variants
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not {"chain", "tree"} <= set(names):
        raise ValueError(f"bench tree --variants {','.join(names)}: choose among {', '.join(VARIANTS)}, with chain and tree (the ratios need them)")
    torch.manual_seed(0)

    def config(overrides: list[str]) -> TrainConfig:
        return load_config(None, [*BASE, *overrides, "output_dir=runs/bench", *extra_overrides])

    def make(overrides: list[str]) -> Trainer:
        return Trainer(config(overrides))

    configurations = {"default": [], "exact": ["sampling.exact=true"]}
    for name, overrides in VARIANTS.items():  # every variant's settings and inputs, before any model loads
        if name in names:
            check_inputs(config(overrides))
    trainers = {(name, conf): make([*overrides, *conf_overrides])
                for conf, conf_overrides in configurations.items() for name, overrides in VARIANTS.items() if name in names}
    per_node = make([*TREE, "train.minibatch=1"])
    c = measure_trained_row_cost(trainers["chain", "default"])
    row_costs = forward_ms_per_row(trainers["chain", "default"])
    samples: dict[tuple[str, str], list[dict]] = {key: [] for key in [*trainers, ("tree_per_node", "default")]}
    rollout_over_bare: dict[str, list[float]] = {conf: [] for conf in configurations}
    for repeat in range(repeats + 1):  # the first round warms up and is discarded
        for key, trainer in trainers.items():
            start = time.perf_counter()
            metrics = trainer.run_iteration(repeat).metrics
            if repeat:
                samples[key].append({**metrics, "seconds": time.perf_counter() - start})
        start = time.perf_counter()
        metrics = per_node.run_iteration(repeat, per_node=True).metrics
        if repeat:
            samples["tree_per_node", "default"].append({**metrics, "seconds": time.perf_counter() - start})
            for conf in configurations:
                rollout_seconds, bare_seconds = rollout_and_bare_seconds(trainers["tree", conf], repeat)
                rollout_over_bare[conf].append(rollout_seconds / bare_seconds)
    rows: dict[str, dict] = {}
    ratios: dict = {"trained_row_cost_c": c, "forward_ms_per_row": row_costs}
    for conf in configurations:
        conf_rows = {name: variant_row(runs) for (name, run_conf), runs in samples.items() if run_conf == conf}
        conf_ratios = chain_ratios(conf_rows, c)
        conf_ratios["rollout_over_bare_forward"] = statistics.median(rollout_over_bare[conf])
        if conf == "default":
            rows, ratios = conf_rows, {**ratios, **conf_ratios}
        else:
            for name, row in conf_rows.items():
                rows[name][conf] = row
            ratios[conf] = conf_ratios
    result = {"variants": rows, "ratios": ratios, "repeats": repeats, "base": BASE, "overrides": VARIANTS, "exact_column": configurations["exact"]}
    return print_result(format_bench(rows, ratios), result, json_path)


def chain_ratios(rows: dict[str, dict], c: float) -> dict:
    """Speed-ups over the chain, and each variant's efficiency against the NFE model (module doc)."""
    chain = rows["chain"]
    chain_cost = chain["nfe_rollout_computed"] + c * chain["nfe_trained"]
    ratios: dict = {}
    for name, row in rows.items():
        if name == "chain":
            continue
        speedup = chain["seconds"] / row["seconds"]
        implied = chain_cost / (row["nfe_rollout_computed"] + c * row["nfe_trained"])
        row.update(speedup=speedup, nfe_speedup=implied, efficiency=speedup / implied, efficiency_lost=efficiency_lost(row, chain, c))
        if name in RATIO_NAMES:
            ratios[RATIO_NAMES[name]] = speedup
    if "tree_per_node" in rows:
        ratios["per_node_over_batched"] = rows["tree_per_node"]["seconds"] / rows["tree"]["seconds"]
    if "tree_compiled" in rows:
        ratios["compiled_over_eager"] = rows["tree_compiled"]["seconds"] / rows["tree"]["seconds"]
    ratios["efficiency"] = {name: row["efficiency"] for name, row in rows.items() if "efficiency" in row and name not in NOT_AGAINST_THE_MODEL}
    return ratios


def _split(variant: dict) -> tuple[float, float, float, float]:
    """A variant's median seconds as rollout R, trained forwards and backwards T, the work that does not shrink with
    the NFE count F (scoring, decoding, optimizer, the rest), and D = S - R - T - F: the median iteration less the
    sum of its phases' medians (each median is taken over the rounds on its own)."""
    profile = variant["profile"]
    rollout, trained = profile["rollout_seconds"], profile["forward_backward_seconds"]
    fixed = sum(profile.values()) - rollout - trained
    return rollout, trained, fixed, variant["seconds"] - rollout - trained - fixed


def efficiency_lost(row: dict, chain: dict, c: float) -> dict[str, float]:
    """Where `row`'s efficiency against the NFE model goes (module doc), as fractions of its seconds S:
    1 - efficiency = rollout_rows + trained_rows + fixed + medians + cost_model, exactly.

    k = (n + c·m) / (n_chain + c·m_chain) with n rollout rows and m trained rows; implied seconds k·S_chain;
    rollout_rows = R - R_chain·n/n_chain, trained_rows = T - T_chain·m/m_chain, fixed = F - k·F_chain,
    medians = D - k·D_chain (`_split`), cost_model = R_chain·(n/n_chain - k) + T_chain·(m/m_chain - k)."""
    k = (row["nfe_rollout_computed"] + c * row["nfe_trained"]) / (chain["nfe_rollout_computed"] + c * chain["nfe_trained"])
    rollout_share = row["nfe_rollout_computed"] / chain["nfe_rollout_computed"]
    trained_share = row["nfe_trained"] / chain["nfe_trained"]
    rollout, trained, fixed, medians = _split(row)
    chain_rollout, chain_trained, chain_fixed, chain_medians = _split(chain)
    parts = {"rollout_rows": rollout - chain_rollout * rollout_share, "trained_rows": trained - chain_trained * trained_share,
             "fixed": fixed - k * chain_fixed, "medians": medians - k * chain_medians,
             "cost_model": chain_rollout * (rollout_share - k) + chain_trained * (trained_share - k)}
    return {name: value / row["seconds"] for name, value in parts.items()}


def format_bench(rows: dict, ratios: dict) -> str:
    """The default configuration's table with the exact=true column (rows computed, s/iter, speed-up)."""
    lines = [f"{'variant':<18}{'NFE roll':>9}{'computed':>9}{'NFE train':>10}{'edges':>7}{'s/iter':>8}{'speed-up':>9}"
             f"{'NFE-implied':>12}{'efficiency':>11} | {'exact: computed':>15}{'s/iter':>8}{'speed-up':>9}"]
    for name, row in rows.items():
        exact = row.get("exact", {})
        lines.append(
            f"{name:<18}{row['nfe_rollout']:>9}{row['nfe_rollout_computed']:>9}{row['nfe_trained']:>10}{row['edges_trained']:>7}"
            f"{row['seconds']:>8.2f}{row.get('speedup', 1.0):>9.2f}{row.get('nfe_speedup', 1.0):>12.2f}{row.get('efficiency', 1.0):>11.2f} | "
            + (f"{exact['nfe_rollout_computed']:>15}{exact['seconds']:>8.2f}{exact.get('speedup', 1.0):>9.2f}" if exact else "")
        )
    for label, values in (("ratios (default)", ratios), ("ratios (exact=true)", ratios.get("exact", {}))):
        lines.append(f"{label}: " + ", ".join(f"{k}={v:.2f}" for k, v in values.items() if not isinstance(v, dict)))
    lines.append("efficiency lost to (fractions of each iteration): rollout rows dearer than the chain's, trained rows dearer, "
                 "work not shrinking with NFE, medians of phases against the iteration's, the NFE model's c")
    for name, row in rows.items():
        if "efficiency_lost" in row and name not in NOT_AGAINST_THE_MODEL:
            lines.append(f"  {name:<18}" + "".join(f"{row['efficiency_lost'][part]:>8.3f}" for part in LOST_PARTS))
    if "forward_ms_per_row" in ratios:
        lines.append("forward ms per row by batch: " + ", ".join(f"{batch}: {ms:.2f}" for batch, ms in ratios["forward_ms_per_row"].items()))
    return "\n".join(lines)


# FP4 (Blackwell) and FP8 (Hopper) explorers side by side; each GPU backend follows its CPU emulation
EXPLORE_BACKENDS = ("nvfp4-emulated", "mxfp4-emulated", "fp8-emulated", "fp8-emulated-tensor", "bnb-fp4", "bnb-nf4",
                    "te-nvfp4", "torchao-fp8", "te-fp8")


def _explore_overrides(backend: str, extra_overrides: list[str]) -> list[str]:
    """`bench explore`'s settings of one backend's run."""
    return ["explore.mode=seeds", f"explore.backend={backend}", "explore.pool=16", "explore.keep=16", "explore.preview_sampler=sde",
            "explore.fidelity_every=0", "prompts.per_iteration=8", "logging.report_to=none", "final_eval=false", "output_dir=runs/bench-explore",
            *extra_overrides]


def bench_explore(json_path: Path | None = None, iterations: int = 4, extra_overrides: list[str] = (),
                  backends: tuple[str, ...] = EXPLORE_BACKENDS) -> dict:
    """Ranking fidelity and cost of each low-precision explorer (FP4, FP8) on the built-in model.
    Every candidate is regenerated (keep = pool) with the training sampler, so pool and regenerated
    samples differ only by the quantisation; ρ and τ are pooled over prompts and iterations. A
    backend this machine cannot run gets a row with the one-line reason."""
    rows: dict[str, dict] = {}
    for backend in backends:  # every backend's settings and inputs, before any model loads
        check_inputs(load_config(None, _explore_overrides(backend, extra_overrides)))
    for backend in backends:
        try:
            trainer = Trainer(load_config(None, _explore_overrides(backend, extra_overrides)))
        except (RuntimeError, ImportError) as error:
            rows[backend] = {"available": False, "reason": str(error).splitlines()[0]}
            continue
        pool, regenerated, timings = [], [], []
        for iteration in range(iterations):
            _, _, _, info = trainer.rollout_and_score(iteration)
            pool.append(info["explore_kept"][0])  # keep = pool: the kept subset is the whole pool
            regenerated.append(info["explore_kept"][1])
            timings.append(info["explore_stats"])
        agreement = ranking_agreement(torch.cat(pool), torch.cat(regenerated))
        rows[backend] = {
            "available": True, **agreement,
            "latent_mean_abs_diff": statistics.mean(t["quant_latent_mean_abs_diff"] for t in timings),
            "pool_seconds": statistics.median(t["pool_seconds"] for t in timings),
            "regen_seconds": statistics.median(t["regen_seconds"] for t in timings),
        }
        rows[backend]["pool_over_regen_seconds"] = rows[backend]["pool_seconds"] / rows[backend]["regen_seconds"]
    spearman = {name: row["spearman"] for name, row in rows.items() if row["available"]}
    ratios = {"spearman_pool_vs_regen": spearman.get("nvfp4-emulated"), **{f"spearman_{k}": v for k, v in spearman.items()}}
    if "fp8-emulated" in spearman and "nvfp4-emulated" in spearman:  # Hopper's explorer against Blackwell's
        ratios["spearman_fp8_minus_nvfp4"] = spearman["fp8-emulated"] - spearman["nvfp4-emulated"]
    result = {"backends": rows, "ratios": ratios, "iterations": iterations}
    return print_result(format_explore(rows), result, json_path)


def format_explore(rows: dict) -> str:
    """One line per backend: ranking agreement (pooled ρ and τ, mean within-prompt ρ, top-half
    overlap), latent gap, cost."""
    lines = [f"{'backend':<20}{'spearman':>9}{'kendall':>9}{'ρ within':>9}{'top-K':>7}{'|Δx| mean':>10}{'pool s':>8}{'regen s':>8}{'pool/regen':>11}"]
    for name, row in rows.items():
        if not row["available"]:
            lines.append(f"{name:<20}  unavailable: {row['reason']}")
            continue
        lines.append(f"{name:<20}{row['spearman']:>9.3f}{row['kendall']:>9.3f}{row['spearman_within']:>9.3f}{row['topk_overlap']:>7.2f}{row['latent_mean_abs_diff']:>10.4f}"
                     f"{row['pool_seconds']:>8.2f}{row['regen_seconds']:>8.2f}{row['pool_over_regen_seconds']:>11.2f}")
    lines.append("emulated FP4/FP8 runs the matmuls in the original dtype after quantise-dequantise: slower than the policy, not faster")
    return "\n".join(lines)
