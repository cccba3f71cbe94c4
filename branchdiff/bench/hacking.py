"""`branchdiff bench hacking`: reward hacking measured against a ground truth, and what each mitigation saves.

Gao, Schulman and Hilton ("Scaling Laws for Reward Model Overoptimization", 2023) measured over-optimisation by
training on a proxy reward and watching a gold one the proxy was fit to. The built-in tasks' verifiers are exact
golds; their proxies (the hand-made `tiny-partial`, the learned `learned-proxy` of `bench proxies`) are hackable. So:

Runs. Each variant trains the default recipe (`tiny-mix-full`, its schedule sized to the budget: `iterations` = the
budget, `train.decay_start` = 0.6 of it) on the proxy `reward` for an iteration budget, over seeds, and at `points`
equally spaced iterations (0: the base model) records on the held-out prompts' fixed evaluation samples
(`images_per_prompt` ODE samples each):
- `proxy`: the run's training reward (each component's mean, averaged over its components);
- `gold`: the verifier's held-out strict score (the task's number), and `gold_partial` its partial credit;
- `kl`: KL(π_θ ‖ π_0) of the evaluated policy's sampler from the initial model's, on `kl_chains` SDE chains per
  held-out prompt (branchdiff/evaluation/policy_kl.py);
- the reward-hacking watch (branchdiff/training/hacking.py) as a run applies it: each evaluation's gold beside the
  training reward of the iteration after it (the policy it measured), with the run's `watch.window` and
  `watch.tolerance`; `alarm` is the first evaluation it flags.

Mitigations (`variants`, each `name[:key=value...]`, all on the same seeds):
- `none`: the default recipe on the proxy;  `kl`: with `train.kl_beta` (a sweep: `kl:train.kl_beta=0.01,...`);
- `guard`, `nft`, `awm`: GRPO-Guard, DiffusionNFT, AWM (objectives with implicit regularisation) on the same trees;
- `ensemble-mean`, `ensemble-min`, `ensemble-mean-std`: the proxies of `ensemble` as one reward, reduced so;
- `normalize-then-sum`, `sum-then-normalize`: those proxies as separate rewards, each normalised in its group before
  they are added (GDPO-style) or added then normalised;
- `lora`: a LoRA adapter instead of full fine-tuning (`lora:train.lora_rank=4`);
- `watch-stop`: the watch stops the run at its alarm and the run keeps its checkpoint at the best gold estimate so far
  (its evaluations are the watch's), so its gold from the alarm on is that checkpoint's;
- `gold-reward`: trained on the verifier's own partial credit (no proxy: what the watch flags there is a false alarm).

Per variant: gold and proxy against iterations and against √KL over seeds; each seed's peak gold, its gold at the end,
the KL spent; and the differences from `none` (paired by seed: Student's t on the per-seed differences).

Best-of-n on the same proxy: `bon_max` base-model ODE samples of each held-out prompt (noise BON_SEED) in groups of n;
each group's pick by the proxy and its gold; its KL from the base, log n − (n − 1)/n (Stiennon et al. 2020).

Fits (Gao et al.'s forms of the gold's rise over the base's, with d = √KL): RL: Δgold = d·(α − β·ln d); best-of-n:
Δgold = d·(α − β·d); least squares over every seed's evaluations (`fit_form`).

The watch's settings, measured (`watch_sweep`): the watch replayed on every run's record for each window and tolerance of
WATCH_WINDOWS × WATCH_TOLERANCES: its lead on the runs trained on a proxy (alarm iteration − the iteration of the run's
best gold), the gold a run it stopped keeps, and its false alarms on gold-reward's runs.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import yaml

from branchdiff.bench.curves import COMMON, TASKS, VARIANTS, split_spec, split_variants
from branchdiff.bench.equal_budget import paired_p
from branchdiff.bench.stats import t_interval
from branchdiff.bench.tables import table, write_outputs
from branchdiff.data.prompts import load_prompt_set
from branchdiff.errors import UserError
from branchdiff.evaluation.evaluate import OdeSampling, evaluate, sample_ode, summarize
from branchdiff.evaluation.policy_kl import initial_state, policy_kl
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import build_component
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.load import load_config
from branchdiff.training.hacking import WatchState, diverging
from branchdiff.training.preflight import check_inputs
from branchdiff.training.recipe import Trainer

BON_SEED, KL_SEED = 7101, 7102  # the noise of best-of-n's samples and of the KL's chains (not the evaluation's)
ENSEMBLES = {"ensemble-mean": "mean", "ensemble-min": "min", "ensemble-mean-std": "mean-std"}
COMBINED = {"normalize-then-sum": "normalize_then_sum", "sum-then-normalize": "sum_then_normalize"}
MITIGATIONS: dict[str, tuple[str, list[str]]] = {  # name: (the curves variant it starts from, its overrides)
    "none": ("default", []),
    "kl": ("default", ["train.kl_beta=0.01"]),
    "guard": ("default", ["train.loss=grpo-guard", "guard.clip_range=2e-5"]),
    "nft": ("default", ["train.loss=nft", "train.optimizer_every=32", "nft.beta=0.1"]),
    "awm": ("awm", ["awm.average_kl=1.0", "train.lr_schedule=cosine"]),  # the others' schedule: held, then a cosine from decay_start
    **{name: ("default", []) for name in (*ENSEMBLES, *COMBINED)},
    "lora": ("default", ["model.finetune=lora", "train.lora_rank=8", "train.learning_rate=3e-4"]),  # rank and rate untuned here
    "watch-stop": ("default", []),
    "gold-reward": ("default", []),
}
REFERENCE = "none"
WATCH_WINDOWS, WATCH_TOLERANCES = (1, 2), (0.0, 0.02, 0.05, 0.1)  # the watch's settings replayed on every run (watch_sweep)


def mitigation_spec(spec: str) -> tuple[str, list[str]]:
    """(mitigation, its extra overrides) of `name[:key=value...]` (the label in the tables is the spec)."""
    return split_spec(spec, list(MITIGATIONS), "mitigation", "kl:train.kl_beta=0.1")


def reward_overrides(name: str, reward: str, ensemble: Sequence[str], verifier: str) -> list[str]:
    """The `reward` (and `reward_combine`) overrides of a mitigation: the proxy given, the ensemble's proxies as one
    learned-proxy or as separate rewards, or the verifier itself."""
    if name == "gold-reward":
        return [f"reward={verifier}"]
    if name in ENSEMBLES or name in COMBINED:
        if len(ensemble) < 2:
            raise ValueError(f"mitigation {name} needs two or more proxies: give them as --ensemble PATH,PATH,... (bench proxies' folders)")
        if name in ENSEMBLES:
            return ["reward=" + json.dumps({"name": "learned-proxy", "kwargs": {"path": list(ensemble), "reduce": ENSEMBLES[name]}})]
        return ["reward=" + json.dumps([{"name": "learned-proxy", "label": f"proxy-{k}", "kwargs": {"path": path}} for k, path in enumerate(ensemble)]),
                f"reward_combine={COMBINED[name]}"]
    return [f"reward={reward}"]


def mitigation_config(label: str, reward: str, ensemble: Sequence[str], task: str, budget: int, seed: int, output_dir: str,
                      extra_overrides: Sequence[str] = ()) -> TrainConfig:
    """The training settings of mitigation `label` (`name[:key=value...]`) on `task` trained on `reward` for `budget`
    iterations: the curves variant it starts from, its schedule sized to the budget (held, then decaying from 0.6 of
    it), its own overrides, its reward, then `label`'s and `extra_overrides`."""
    name, extra = mitigation_spec(label)
    preset, base_overrides = VARIANTS[MITIGATIONS[name][0]]
    _, verifier_name, task_overrides = TASKS[task]
    schedule_size = [f"iterations={budget}", f"train.decay_start={round(0.6 * budget)}"]
    chosen = [*COMMON, *task_overrides, *base_overrides, *schedule_size, *MITIGATIONS[name][1],
              *reward_overrides(name, reward, ensemble, verifier_name), *extra, f"seed={seed}", f"output_dir={output_dir}", *extra_overrides]
    return load_config(preset, chosen)


def fit_form(d: np.ndarray, gain: np.ndarray, form: str) -> tuple[float, float]:
    """(α, β) of Gao et al.'s form fit by least squares to the gold's rise `gain` at d = √KL (module doc): `rl`
    gain = α·d − β·d·ln d, `bon` gain = α·d − β·d²; points at d = 0 carry no information and are dropped."""
    keep = d > 0
    d, gain = d[keep], gain[keep]
    second = d * np.log(d) if form == "rl" else d**2
    design = np.stack([d, -second], axis=1)  # (n, 2)
    (alpha, beta), *_ = np.linalg.lstsq(design, gain, rcond=None)
    return float(alpha), float(beta)


def best_of_n(proxy: np.ndarray, gold: np.ndarray, per_prompt: int) -> dict[int, dict[str, float]]:
    """For n = 1, 2, 4, ..., `per_prompt`: each prompt's samples (prompt-major, `per_prompt` each) in groups of n, each
    group's sample with the highest proxy score (the first on a tie); the mean proxy and gold of the picks and the KL
    log n − (n − 1)/n."""
    proxy, gold = proxy.reshape(-1, per_prompt), gold.reshape(-1, per_prompt)  # (P, S)
    rows = {}
    n = 1
    while n <= per_prompt:
        groups = per_prompt // n
        shaped_proxy = proxy[:, : groups * n].reshape(len(proxy), groups, n)
        picks = shaped_proxy.argmax(axis=2)  # (P, groups)
        picked_gold = np.take_along_axis(gold[:, : groups * n].reshape(len(gold), groups, n), picks[..., None], axis=2)
        picked_proxy = np.take_along_axis(shaped_proxy, picks[..., None], axis=2)
        rows[n] = {"proxy": float(picked_proxy.mean()), "gold": float(picked_gold.mean()), "kl": math.log(n) - (n - 1) / n}
        n *= 2
    return rows


def _grid(budget: int, points: int) -> list[int]:
    return [round(budget * k / (points - 1)) for k in range(points)]


def _train_and_measure(config: TrainConfig, grid: list[int], measure, stop_at_alarm: bool) -> dict:
    """Train to the grid's end, measuring at each grid iteration (`measure(trainer)`: gold, gold_partial, proxy, kl) and
    pairing each measurement with the next iteration's training reward for the watch (the last with a rollout scored,
    not trained on); with `stop_at_alarm`, the run stops at the watch's first alarm (module doc)."""
    trainer = Trainer(config)
    initial = initial_state(trainer.adapter.denoiser)
    watch, window, tolerance = WatchState(), config.watch.window, config.watch.tolerance
    record: dict = {"eval_iterations": [], "gold": [], "gold_partial": [], "proxy": [], "kl": [], "train_reward": [], "alarm": None,
                    "stopped": None}
    iteration = 0
    for point in grid:
        while iteration < point:
            trainer.run_iteration(iteration)
            iteration += 1
        measured = measure(trainer, initial)
        for key, value in measured.items():
            record[key].append(value)
        record["eval_iterations"].append(iteration)
        if iteration < grid[-1]:
            reward = trainer.run_iteration(iteration).metrics["reward_mean"]
            iteration += 1
        else:
            reward = float(torch.nanmean(trainer.rollout_and_score(iteration)[2].total))
        record["train_reward"].append(reward)
        flagged = watch.add_evaluation(reward, measured["gold"], window, tolerance)["watch_diverging"]
        if flagged and record["alarm"] is None:
            record["alarm"] = record["eval_iterations"][-1]
            if stop_at_alarm:
                record["stopped"] = record["alarm"]
                break
    return record


def _kept_checkpoint(record: dict, grid: list[int]) -> dict:
    """A run the watch stopped, continued to the grid's end as the checkpoint it keeps: the evaluation with the best gold
    so far (the watch's own estimate), repeated at the points after the alarm."""
    best, done = int(np.argmax(record["gold"])), len(record["gold"])
    for key in ("gold", "gold_partial", "proxy", "kl"):
        record[key] = record[key] + [record[key][best]] * (len(grid) - done)
    record["kept"] = record["eval_iterations"][best]
    record["eval_iterations"] = record["eval_iterations"] + grid[done:]  # the kept checkpoint stands for the points it did not train to
    return record


def bench_hacking(reward: str, budget: int, seeds: int, json_path: Path | None, out_dir: Path, points: int = 9,
                  variants: list[str] | None = None, ensemble: Sequence[str] = (), images_per_prompt: int = 4, kl_chains: int = 2,
                  bon_max: int = 32, extra_overrides: Sequence[str] = (), task: str = "tiny", first_seed: int = 0) -> dict:
    """Train each variant on the proxy `reward` (a reward spec as the config's `reward` takes it) for `budget`
    iterations over seeds first_seed.., measure gold, proxy and KL at `points` iterations, best-of-n up to `bon_max`,
    and write out_dir/hacking.md, .png and `json_path` (module doc); returns the result."""
    if budget < points - 1 or seeds < 1 or points < 2 or kl_chains < 1 or bon_max < 1:
        raise ValueError(f"bench hacking needs --iterations ≥ --points − 1 ({points - 1}), --seeds ≥ 1, --points ≥ 2, --kl-chains ≥ 1 and "
                         f"--best-of-n ≥ 1; got {budget}, {seeds}, {points}, {kl_chains}, {bon_max}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    labels = variants or [REFERENCE]
    specs = {label: mitigation_spec(label) for label in labels}
    source, verifier_name, _ = TASKS[task]
    prompt_set = load_prompt_set(source)
    verifier = build_component(parse_reward_specs([verifier_name])[0], "cpu")
    grid = _grid(budget, points)

    def config(label: str, seed: int, tmp: str) -> TrainConfig:
        return mitigation_config(label, reward, ensemble, task, budget, seed, f"{tmp}/{len(label)}-{hash(label)}", extra_overrides)

    def components(config: TrainConfig) -> dict[str, object]:
        return proxy_rewards(config.reward)

    def measure_with(rewards: dict[str, object]):
        def measure(trainer: Trainer, initial: dict) -> dict[str, float]:
            sampling = trainer.config.sampling
            with trainer.evaluated_weights():
                result = evaluate(trainer.adapter, prompt_set, {verifier_name: verifier, **rewards},
                                  OdeSampling(images_per_prompt, sampling.num_steps, sampling.shift, trainer.config.prompts.eval_guidance))
                kl = policy_kl(trainer.adapter, initial, prompt_set.prompts, trainer.schedule, trainer.settings, kl_chains, KL_SEED)
            means = summarize(result)["all"]
            return {"gold": means[f"{verifier_name}.strict"]["mean"], "gold_partial": means[verifier_name]["mean"],  # the verifier's reward: its partial credit
                    "proxy": statistics.mean(means[label]["mean"] for label in rewards), "kl": float(kl.mean())}
        return measure

    runs: dict[str, list[dict]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        for label in labels:  # every variant's settings and inputs, before any model loads
            check_inputs(config(label, first_seed, tmp))
        bon = _best_of_n_base(config(labels[0], first_seed, tmp), prompt_set, verifier, verifier_name, proxy_rewards(yaml.safe_load(reward)),
                              bon_max)
        for seed in range(first_seed, first_seed + seeds):
            for label in labels:
                loaded = config(label, seed, tmp)
                record = _train_and_measure(loaded, grid, measure_with(components(loaded)), specs[label][0] == "watch-stop")
                if record["stopped"] is not None:
                    record = _kept_checkpoint(record, grid)
                record["seed"] = seed
                runs[label].append(record)
                print(f"seed {seed} {label}: gold " + " ".join(f"{v:.3f}" for v in record["gold"]) + " | proxy "
                      + " ".join(f"{v:.3f}" for v in record["proxy"]) + " | kl " + " ".join(f"{v:.3g}" for v in record["kl"])
                      + (f" | alarm at {record['alarm']}" if record["alarm"] is not None else ""), flush=True)
    result = summarize_hacking(runs, grid, bon, {"reward": reward, "ensemble": list(ensemble), "task": task, "budget": budget,
                                                  "images_per_prompt": images_per_prompt, "kl_chains": kl_chains})
    _write(result, out_dir, json_path, f"`branchdiff bench hacking --reward '{reward}' --iterations {budget} --seeds {seeds}"
           + (f" --first-seed {first_seed}" if first_seed else "") + f" --points {points} --variants '{','.join(labels)}'"
           + (f" --ensemble {','.join(ensemble)}" if ensemble else "") + (f" --task {task}" if task != "tiny" else "") + f" --out {out_dir}`")
    return result


def _best_of_n_base(config: TrainConfig, prompt_set, verifier, verifier_name: str, rewards: dict[str, object], bon_max: int) -> dict:
    """Best-of-n on the base model (module doc), up to `bon_max` samples per held-out prompt."""
    trainer = Trainer(config)
    sampling = config.sampling
    pixels, texts = sample_ode(trainer.adapter, prompt_set.prompts, OdeSampling(bon_max, sampling.num_steps, sampling.shift,
                                                                                 config.prompts.eval_guidance, seed=BON_SEED))
    proxy = np.mean([reward(pixels, texts, [{}] * len(texts)).numpy() for reward in rewards.values()], axis=0)  # (P·S,)
    gold = verifier.score(pixels, texts)["strict"].numpy()
    return {str(n): row for n, row in best_of_n(proxy, gold, bon_max).items()}


def first_alarm(run: dict, window: int, tolerance: float) -> int | None:
    """The index of the first evaluation of `run` (its train_reward and gold series) the watch flags with these
    settings, or None."""
    for k in range(len(run["gold"])):
        if diverging(run["train_reward"][: k + 1], run["gold"][: k + 1], window, tolerance):
            return k
    return None


def watch_sweep(runs: dict[str, list[dict]], windows: Sequence[int] = WATCH_WINDOWS, tolerances: Sequence[float] = WATCH_TOLERANCES) -> list[dict]:
    """The watch replayed on every run's record with each (window, tolerance). On the runs trained on a proxy to the
    end (every variant but gold-reward and watch-stop): how many it flags, its lead (the alarm's iteration minus the
    iteration of the run's best gold; > 0: after the peak), and the gold a run stopped there keeps (its best evaluation
    up to the alarm; its end when never flagged) against the gold at the end without stopping. On gold-reward's runs:
    its false alarms."""
    proxy_runs = [run for label, label_runs in runs.items() if mitigation_spec(label)[0] not in ("gold-reward", "watch-stop") for run in label_runs]
    gold_runs = [run for label, label_runs in runs.items() if mitigation_spec(label)[0] == "gold-reward" for run in label_runs]
    rows = []
    for window in windows:
        for tolerance in tolerances:
            leads, kept = [], []
            for run in proxy_runs:
                alarm = first_alarm(run, window, tolerance)
                if alarm is not None:
                    leads.append(run["eval_iterations"][alarm] - run["eval_iterations"][int(np.argmax(run["gold"]))])
                kept.append(max(run["gold"][: alarm + 1]) if alarm is not None else run["gold"][-1])
            rows.append({"window": window, "tolerance": tolerance, "flagged": len(leads), "proxy_runs": len(proxy_runs),
                         "median_lead": float(np.median(leads)) if leads else None, "kept_gold": statistics.mean(kept) if kept else None,
                         "end_gold": statistics.mean(run["gold"][-1] for run in proxy_runs) if proxy_runs else None,
                         "false_alarms": sum(first_alarm(run, window, tolerance) is not None for run in gold_runs), "gold_runs": len(gold_runs)})
    return rows


def summarize_hacking(runs: dict[str, list[dict]], grid: list[int], bon: dict, settings: dict) -> dict:
    """Per variant: mean curves, peak and end gold with their intervals, KL at the end, differences from `none` paired by
    seed, the watch's alarms, Gao et al.'s RL fit; best-of-n and its fit."""
    variants = {}
    reference = runs.get(REFERENCE)
    base = statistics.mean(run["gold"][0] for label_runs in runs.values() for run in label_runs)
    for label, label_runs in runs.items():
        peak, end = [max(run["gold"]) for run in label_runs], [run["gold"][-1] for run in label_runs]
        d = np.sqrt(np.maximum([kl for run in label_runs for kl in run["kl"]], 0.0))
        gain = np.array([g - run["gold"][0] for run in label_runs for g in run["gold"]])
        entry = {"runs": label_runs, "seeds": [run["seed"] for run in label_runs],
                 **{f"mean_{key}": [statistics.mean(values) for values in zip(*(run[key] for run in label_runs))]
                    for key in ("gold", "gold_partial", "proxy", "kl")},
                 "peak_gold": peak, "end_gold": end, "peak_ci": list(t_interval(peak)), "end_ci": list(t_interval(end)),
                 "end_kl": statistics.mean(run["kl"][-1] for run in label_runs), "end_proxy": statistics.mean(run["proxy"][-1] for run in label_runs),
                 "alarms": [run["alarm"] for run in label_runs],
                 "peak_iterations": [run["eval_iterations"][int(np.argmax(run["gold"]))] for run in label_runs],
                 "rl_fit": list(fit_form(d, gain, "rl")) if (d > 0).sum() >= 2 else None}
        if reference is not None and label != REFERENCE and [r["seed"] for r in reference] == entry["seeds"]:
            for key, of in (("end", lambda run: run["gold"][-1]), ("peak", lambda run: max(run["gold"]))):
                differences = [of(run) - of(ref) for run, ref in zip(label_runs, reference)]
                entry[f"{key}_vs_{REFERENCE}"] = {"difference": statistics.mean(differences), "per_seed": differences, "p": paired_p(differences)}
        variants[label] = entry
    bon_d = np.sqrt([row["kl"] for row in bon.values()])
    bon_gain = np.array([row["gold"] - bon["1"]["gold"] for row in bon.values()])
    return {"grid": grid, "base_gold": base, "variants": variants, "best_of_n": bon,
            "bon_fit": list(fit_form(bon_d, bon_gain, "bon")) if (bon_d > 0).sum() >= 2 else None, "watch": watch_sweep(runs), "settings": settings}


def format_hacking(result: dict, markdown: bool = False) -> str:
    """The mitigation table: peak and end gold [95 % interval], their difference from `none` (paired p), KL and proxy at the
    end, the watch's alarms; then best-of-n."""
    header = ["variant", "seeds", "peak gold", "gold at end", f"end − {REFERENCE} (paired p)", f"peak − {REFERENCE} (paired p)",
              "KL at end", "proxy at end", "alarms (iteration)"]
    rows = []
    for label, v in result["variants"].items():
        versus = [f"{v[key]['difference']:+.3f} (p = {v[key]['p']:.3f})" if key in v else "—" for key in (f"end_vs_{REFERENCE}", f"peak_vs_{REFERENCE}")]
        alarms = [a for a in v["alarms"] if a is not None]
        rows.append([label, str(len(v["seeds"])), f"{statistics.mean(v['peak_gold']):.3f} [{v['peak_ci'][0]:.3f}, {v['peak_ci'][1]:.3f}]",
                     f"{statistics.mean(v['end_gold']):.3f} [{v['end_ci'][0]:.3f}, {v['end_ci'][1]:.3f}]", *versus, f"{v['end_kl']:.3g}",
                     f"{v['end_proxy']:.3f}", f"{len(alarms)} of {len(v['alarms'])}" + (f" ({', '.join(map(str, alarms))})" if alarms else "")])
    bon = result["best_of_n"]
    bon_rows = [[n, f"{row['kl']:.3f}", f"{row['proxy']:.3f}", f"{row['gold']:.3f}"] for n, row in bon.items()]
    fit = result["bon_fit"]
    watch_rows = [[str(row["window"]), f"{row['tolerance']:g}", f"{row['flagged']} of {row['proxy_runs']}",
                   "—" if row["median_lead"] is None else f"{row['median_lead']:+g}", _number(row["kept_gold"]), _number(row["end_gold"]),
                   f"{row['false_alarms']} of {row['gold_runs']}"] for row in result.get("watch", [])]
    return (table(header, rows, markdown) + f"\n\nBase model's gold: {result['base_gold']:.3f}. Best-of-n on the same proxy (base samples):\n\n"
            + table(["n", "KL", "proxy of the pick", "gold of the pick"], bon_rows, markdown)
            + (f"\n\nBest-of-n fit: Δgold = d·({fit[0]:.3f} − {fit[1]:.3f}·d), d = √KL" if fit else "")
            + ("\n\nThe watch replayed on the proxy runs (every variant but gold-reward and watch-stop) and on gold-reward's:\n\n"
               + table(["window", "tolerance", "proxy runs flagged", "median lead (its.)", "gold kept if stopped", "gold at end",
                        "false alarms (gold-reward)"], watch_rows, markdown) if watch_rows else ""))


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def plot_hacking(result: dict, path: Path) -> None:
    """Gold and proxy against iterations and against √KL (each variant's mean over seeds; best-of-n's against √KL)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 8))
    axes = figure.subplots(2, 2)
    for k, (label, v) in enumerate(result["variants"].items()):
        root_kl = np.sqrt(np.maximum(v["mean_kl"], 0.0))
        line, = axes[0, 0].plot(result["grid"], v["mean_gold"], marker="o", markersize=3, label=label,
                                linestyle=("-", "--", ":")[k // 10 % 3])  # matplotlib's 10 colours, then again dashed, dotted
        axes[0, 1].plot(result["grid"], v["mean_proxy"], marker="o", markersize=3, color=line.get_color(), linestyle=line.get_linestyle())
        axes[1, 0].plot(root_kl, v["mean_gold"], marker="o", markersize=3, color=line.get_color(), linestyle=line.get_linestyle())
        axes[1, 1].plot(root_kl, v["mean_proxy"], marker="o", markersize=3, color=line.get_color(), linestyle=line.get_linestyle())
    bon = list(result["best_of_n"].values())
    bon_d = np.sqrt([row["kl"] for row in bon])
    axes[1, 0].plot(bon_d, [row["gold"] for row in bon], "k--", marker="s", markersize=3, label="best-of-n")
    axes[1, 1].plot(bon_d, [row["proxy"] for row in bon], "k--", marker="s", markersize=3)
    for (row, column), (x, y) in {(0, 0): ("iterations", "gold: held-out strict"), (0, 1): ("iterations", "proxy (held-out images)"),
                                  (1, 0): ("√KL from the initial model (nats^½)", "gold: held-out strict"),
                                  (1, 1): ("√KL from the initial model (nats^½)", "proxy (held-out images)")}.items():
        axes[row, column].set_xlabel(x)
        axes[row, column].set_ylabel(y)
        axes[row, column].grid(alpha=0.3)
    figure.legend(*axes[0, 0].get_legend_handles_labels(), loc="upper center", ncol=4, fontsize=8)
    handles, labels = axes[1, 0].get_legend_handles_labels()
    axes[1, 0].legend(handles[-1:], labels[-1:], fontsize=8)
    figure.savefig(path, dpi=110, bbox_inches="tight")


def _write(result: dict, out_dir: Path, json_path: Path | None, command: str) -> None:
    print(format_hacking(result))
    write_outputs(out_dir, "hacking", "Reward hacking against the verifier", command, format_hacking(result, markdown=True),
                  lambda path: plot_hacking(result, path), result, json_path)


def merge_hacking(paths: list[Path], out_dir: Path, json_path: Path | None) -> dict:
    """One result of several `bench hacking` runs of the same proxy, grid and variants, each over its own seeds (a
    benchmark split over cores with `--first-seed`), summarised again on all their seeds; best-of-n is the first file's."""
    results = []
    for path in paths:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            raise UserError(f"bench hacking --merge: {path} is not a bench hacking result ({error}); give the JSON files --json wrote") from None
    first = results[0]
    for path, result in zip(paths, results):
        if not isinstance(result, dict) or "variants" not in result or result.get("grid") != first.get("grid"):
            raise UserError(f"bench hacking --merge: {path} is not a bench hacking result of the grid of {paths[0]}; merge runs of the same "
                            "--iterations and --points")
        if result.get("settings", {}).get("reward") != first["settings"]["reward"]:
            raise UserError(f"bench hacking --merge: {path} trained on another proxy than {paths[0]}; merge runs of the same --reward")
    runs: dict[str, list[dict]] = {}
    for path, result in zip(paths, results):
        for label, v in result["variants"].items():
            for run in v["runs"]:
                if any(other["seed"] == run["seed"] for other in runs.get(label, [])):
                    raise UserError(f"bench hacking --merge: seed {run['seed']} of {label} is in two files (again in {path}); merge files of "
                                    "different seeds, each once")
                runs.setdefault(label, []).append(run)
    for label_runs in runs.values():
        label_runs.sort(key=lambda run: run["seed"])
    merged = summarize_hacking(runs, first["grid"], first["best_of_n"], first["settings"])
    _write(merged, out_dir, json_path, f"`branchdiff bench hacking --merge {','.join(map(str, paths))} --out {out_dir}`")
    return merged


def proxy_rewards(value: object) -> dict[str, object]:
    """The components of a `reward` value (a name, a mapping or a list), built, labelled proxy/0, proxy/1, ..."""
    return {f"proxy/{k}": build_component(spec, "cpu") for k, spec in enumerate(parse_reward_specs(value))}


def parse_reward_option(text: str) -> str:
    """`--reward`: a reward name or a YAML mapping or list (as the config's `reward` takes it), checked now; returned as the
    override's value."""
    try:
        value = yaml.safe_load(text)
        parse_reward_specs(value)
    except (yaml.YAMLError, ValueError) as error:
        raise UserError(f"bench hacking --reward {text!r}: {error}; give a reward's name or a mapping, e.g. --reward '{{name: tiny-partial, "
                        "kwargs: {terms: [count, color]}}'") from None
    return json.dumps(value) if not isinstance(value, str) else value


def parse_variants(text: str | None) -> list[str] | None:
    """`--variants`: comma-separated mitigations, each checked (commas inside brackets belong to a value)."""
    if text is None:
        return None
    labels = split_variants(text)
    for label in labels:
        mitigation_spec(label)
    return labels
