"""`branchdiff bench proxies`: learned proxies of a built-in task's verifier, fit on N samples of the base model, and
their accuracy on samples they never saw.

Data. A pool of 2·max(N) samples of the base model (ODE, the task's training prompts, `images_per_prompt` seeds each
from the noise of POOL_SEED) is scored by the verifier. Proxy (N, s) is fit on N samples drawn from the pool with
seed s, so that the seeds of one N see different data (at the largest N, half the pool each). Two test sets: fresh
seeds of the training prompts (TEST_SEED: the same prompts, samples never seen) and the held-out prompts (prompts never
seen).

Fit. `ProxyNet` (branchdiff/rewards/learned_proxy.py), initialised from seed s, minimises the mean squared error to
the verifier's `partial` over `steps` Adam steps of 64 samples (lr 2e-3), whatever N: a small N is fit to its few
samples many times over, the weak, overfit proxy the measurement needs beside the strong ones.

Accuracy, per proxy and per ensemble (the mean of one N's seeds), on each test set:
- `pearson`, `spearman`: correlation of the proxy's scores with the verifier's partial;
- `pair_accuracy`: over the pairs of samples of one prompt whose partial differs, the fraction the proxy orders as
  the verifier does (ties in the proxy count half): what a group-relative objective reads;
- `mae`: mean |proxy − partial|.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from branchdiff.bench.tables import table, write_outputs
from branchdiff.data.prompts import load_prompt_set
from branchdiff.evaluation.evaluate import OdeSampling, sample_ode
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.learned_proxy import ProxyNet, as_channels, in_channels, prompt_features, reduce_ensemble, save_proxy
from branchdiff.rewards.multi import build_component
from branchdiff.settings.load import load_config
from branchdiff.training.recipe import Trainer

POOL_SEED, TEST_SEED = 7001, 7002  # the noise of the pool and of the test samples (not the evaluation's)
TASKS = {  # task: (training prompts, held-out prompts, verifier, overrides moving tiny-mix onto it)
    "tiny": ("tiny:train", "tiny:held_out", "tiny-geneval", []),
    "tiny-video": ("tiny-video:train", "tiny-video:held_out", "tiny-video",
                   ["model.family=tiny-video", "prompts.train=tiny-video:train", "prompts.eval=tiny-video:held_out", "reward=tiny-video",
                    "eval_rewards=[tiny-video]", "watch.gold=tiny-video.strict"]),
}
QUIET = ["final_eval=false", "logging.report_to=none", "logging.sample_every=0", "logging.checkpoint_every=0"]


def pair_accuracy(proxy: np.ndarray, truth: np.ndarray, groups: np.ndarray) -> float:
    """Over the pairs (i, j) of one group with truth_i ≠ truth_j, the fraction with sign(proxy_i − proxy_j) =
    sign(truth_i − truth_j), a tie in the proxy counting 1/2; NaN when no pair differs."""
    hits, pairs = 0.0, 0
    for group in np.unique(groups):
        members = np.nonzero(groups == group)[0]
        for i, j in itertools.combinations(members, 2):
            if truth[i] == truth[j]:
                continue
            pairs += 1
            agreement = np.sign(proxy[i] - proxy[j]) * np.sign(truth[i] - truth[j])
            hits += 1.0 if agreement > 0 else 0.5 if agreement == 0 else 0.0
    return hits / pairs if pairs else float("nan")


def accuracy(proxy: np.ndarray, truth: np.ndarray, groups: np.ndarray) -> dict[str, float]:
    """The module doc's four numbers of proxy scores (n,) against the verifier's (n,), samples grouped by prompt (n,)."""
    return {"pearson": float(stats.pearsonr(proxy, truth)[0]), "spearman": float(stats.spearmanr(proxy, truth)[0]),
            "pair_accuracy": pair_accuracy(proxy, truth, groups), "mae": float(np.abs(proxy - truth).mean())}


def fit_proxy(samples: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, seed: int, steps: int, width: int = 16) -> ProxyNet:
    """A ProxyNet fit to `labels` (n,) of `samples` (n, C, 32, 32) with prompt `features` (n, D) (module doc's Fit)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    network = ProxyNet(samples.shape[1], features.shape[1], width)
    optimizer = torch.optim.Adam(network.parameters(), lr=2e-3)
    for _ in range(steps):
        batch = torch.randint(len(samples), (min(64, len(samples)),), generator=generator)
        loss = (network(samples[batch], features[batch]) - labels[batch]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return network.eval()


def _draw(trainer: Trainer, source: str, per_prompt: int, seed: int, verifier) -> dict:
    """Base-model ODE samples of every prompt of `source` (`per_prompt` seeds from noise `seed`) with their verifier
    scores: samples as channels (n, C, 32, 32), prompts, prompt index (n,), partial and strict (n,)."""
    config = trainer.config
    prompts = load_prompt_set(source).prompts
    pixels, texts = sample_ode(trainer.adapter, prompts, OdeSampling(per_prompt, config.sampling.num_steps, config.sampling.shift,
                                                                      config.prompts.eval_guidance, seed=seed))
    scores = verifier.score(pixels, texts)
    index = {text: k for k, text in enumerate(prompts)}
    return {"samples": as_channels(pixels.float()), "prompts": texts, "group": np.array([index[t] for t in texts]),
            "partial": scores["partial"].numpy(), "strict": scores["strict"].numpy()}


def build_proxies(task: str, sizes: list[int], seeds: int, out_dir: Path, json_path: Path | None = None, steps: int = 1000,
                  test_per_prompt: int = 4, extra_overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Proxies `out_dir/<verifier>-n<N>-s<seed>/` for every N of `sizes` and seed 0..seeds−1, their accuracy and their
    ensembles' (module doc), written to out_dir/proxies.md, .png and `json_path`; returns the result."""
    if task not in TASKS:
        raise ValueError(f"bench proxies --task {task}: not a built-in task; give one of {', '.join(TASKS)}")
    if not sizes or any(n < 2 for n in sizes) or seeds < 1 or steps < 1:
        raise ValueError(f"bench proxies: give --sizes of at least 2 samples each (e.g. 64,256,1024), --seeds ≥ 1 and --steps ≥ 1; got "
                         f"{sizes}, {seeds}, {steps}")
    train_source, held_out_source, verifier_name, overrides = TASKS[task]
    verifier = build_component(parse_reward_specs([verifier_name])[0], "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_config("tiny-mix", [*QUIET, *overrides, f"output_dir={tmp}", *extra_overrides]))
        train_prompts = len(load_prompt_set(train_source).prompts)
        pool = _draw(trainer, train_source, -(-2 * max(sizes) // train_prompts), POOL_SEED, verifier)
        tests = {"training prompts, new seeds": _draw(trainer, train_source, test_per_prompt, TEST_SEED, verifier),
                 "held-out prompts": _draw(trainer, held_out_source, test_per_prompt, TEST_SEED, verifier)}
    pool_features = prompt_features(verifier_name, pool["prompts"])
    test_features = {name: prompt_features(verifier_name, test["prompts"]) for name, test in tests.items()}
    rows: list[dict] = []
    for n in sizes:
        scores_by_seed: dict[str, list[np.ndarray]] = {name: [] for name in tests}
        for seed in range(seeds):
            chosen = torch.from_numpy(np.random.default_rng(seed).choice(len(pool["partial"]), n, replace=False))
            network = fit_proxy(pool["samples"][chosen], pool_features[chosen], torch.from_numpy(pool["partial"][chosen]).float(), seed, steps)
            folder = out_dir / f"{verifier_name}-n{n}-s{seed}"
            row = {"n": n, "seed": seed, "folder": str(folder), "accuracy": {}}
            with torch.no_grad():
                for name, test in tests.items():
                    predicted = network(test["samples"], test_features[name]).numpy()
                    scores_by_seed[name].append(predicted)
                    row["accuracy"][name] = accuracy(predicted, test["partial"], test["group"])
            save_proxy(folder, network, {"task": verifier_name, "channels": in_channels(verifier_name), "prompt_dim": pool_features.shape[1],
                                         "width": 16, "label": f"{verifier_name}'s partial", "samples": n, "seed": seed, "steps": steps,
                                         "pool": f"ODE samples of the base model on {train_source}, noise seed {POOL_SEED}",
                                         "accuracy": row["accuracy"]})
            rows.append(row)
        ensemble = {"n": n, "seed": "ensemble", "folder": "", "accuracy": {}}
        for name, test in tests.items():
            mean = reduce_ensemble(torch.from_numpy(np.stack(scores_by_seed[name])), "mean").numpy()
            ensemble["accuracy"][name] = accuracy(mean, test["partial"], test["group"])
        rows.append(ensemble)
    result = {"task": task, "verifier": verifier_name, "sizes": sizes, "seeds": seeds, "steps": steps, "pool_size": len(pool["partial"]),
              "tests": {name: {"samples": len(test["partial"]), "partial_mean": float(test["partial"].mean()),
                               "strict_mean": float(test["strict"].mean())} for name, test in tests.items()},
              "proxies": rows}
    text = format_proxies(result)
    print(text)
    command = (f"`branchdiff bench proxies --task {task} --sizes {','.join(map(str, sizes))} --seeds {seeds} --steps {steps} --out {out_dir}`")
    write_outputs(out_dir, "proxies", f"Learned proxies of {verifier_name}: accuracy on unseen samples", command,
                  format_proxies(result, markdown=True), lambda path: plot_proxies(result, path), result, json_path)
    return result


def format_proxies(result: dict, markdown: bool = False) -> str:
    """One row per proxy and ensemble: pair accuracy, Spearman and MAE on each test set."""
    tests = list(result["tests"])
    header = ["N", "seed", *(f"{metric} ({test})" for test in tests for metric in ("pair acc.", "spearman", "mae"))]
    rows = [[str(row["n"]), str(row["seed"]), *(f"{row['accuracy'][test][key]:.3f}" for test in tests
                                                for key in ("pair_accuracy", "spearman", "mae"))] for row in result["proxies"]]
    sets = "; ".join(f"{name}: {t['samples']} samples, partial {t['partial_mean']:.3f}, strict {t['strict_mean']:.3f}"
                     for name, t in result["tests"].items())
    return table(header, rows, markdown) + f"\n\nTest sets ({sets}); pool {result['pool_size']} samples; {result['steps']} Adam steps per proxy."


def plot_proxies(result: dict, path: Path) -> None:
    """Pair accuracy against N (log axis): each seed's proxy as a point, the ensembles as a line, per test set."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4))
    axes = figure.add_subplot()
    for test in result["tests"]:  # a test set of one sample per prompt has no pairs: nothing to draw
        points = [(row["n"], row["accuracy"][test]["pair_accuracy"], row["seed"] == "ensemble") for row in result["proxies"]
                  if np.isfinite(row["accuracy"][test]["pair_accuracy"])]
        if points:
            line, = axes.plot(*zip(*[(n, a) for n, a, ensemble in points if ensemble]), marker="o", label=f"{test}: ensemble of the seeds")
            axes.scatter(*zip(*[(n, a) for n, a, ensemble in points if not ensemble]), color=line.get_color(), alpha=0.5, s=12,
                         label=f"{test}: each proxy")
            axes.set_xscale("log", base=2)
    axes.set_xlabel("samples the proxy was fit on (N)")
    axes.set_ylabel("pair accuracy against the verifier")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.savefig(path, dpi=120, bbox_inches="tight")

