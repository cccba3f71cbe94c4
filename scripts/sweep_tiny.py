"""Sweep training settings on the built-in task: every configuration × seed is a real `branchdiff
train` run (a subprocess, one torch thread, `--jobs` at a time), evaluated on the held-out prompts
every `--eval-every` iterations and at the end (8 images per prompt, the README's final evaluation);
the table gives held-out strict accuracy (mean, min and max over seeds) at each evaluation, and the
seconds per iteration of one thread.

    python scripts/sweep_tiny.py sweep.yaml --seeds 0 1 2 --iterations 240 --eval-every 60 --out sweep/

sweep.yaml maps a configuration's name to its preset and overrides:

    full-3e-5: {preset: tiny-mix, overrides: [model.finetune=full, train.learning_rate=3.0e-5]}

Runs already finished under --out (their eval.json present) are read, not run again, so a sweep can
be extended. Writes --out/sweep.md and --out/sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

SCORE = "tiny-geneval.strict"


def run_one(name: str, preset: str, overrides: list[str], seed: int, iterations: int, eval_every: int, out: Path) -> dict:
    """One training run (or its earlier result): strict accuracy at each evaluation and seconds per iteration."""
    run = out / f"{name}-seed{seed}"
    if not (run / "eval.json").is_file():
        if run.exists():
            shutil.rmtree(run)  # an unfinished run: trained again from the start
        command = [sys.executable, "-m", "branchdiff.cli", "train", preset, *overrides, f"seed={seed}", f"iterations={iterations}",
                   f"eval_every={eval_every}", f"output_dir={run}", "logging.sample_every=0", "logging.checkpoint_every=0",
                   "logging.report_to=none", "prompts.eval_seeds=8"]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(command, env=environment, capture_output=True, text=True)
        if done.returncode != 0:
            return {"name": name, "seed": seed, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = {row["iteration"]: row[f"eval_{SCORE}"] for row in rows if f"eval_{SCORE}" in row}
    final = json.loads((run / "eval.json").read_text())
    curve[iterations] = final["trained"]["all"][SCORE]["mean"]
    seconds = sum(row["rollout_seconds"] + row["reward_seconds"] + row["train_seconds"] for row in rows) / len(rows)
    return {"name": name, "seed": seed, "curve": curve, "seconds_per_iteration": seconds, "count": final["trained"]["all"]["tiny-geneval.count"]["mean"]}


def table(results: list[dict], names: list[str]) -> str:
    """Markdown: per configuration, strict accuracy mean [min, max] over seeds at each evaluation."""
    done = [r for r in results if "curve" in r]
    points = sorted({int(i) for r in done for i in r["curve"]})
    lines = ["| configuration | seeds | " + " | ".join(f"it {p}" for p in points) + " | count (final) | s/iter (1 thread) |",
             "|" + "---|" * (len(points) + 4)]
    for name in names:
        mine = [r for r in done if r["name"] == name]
        if not mine:
            continue
        cells = []
        for p in points:
            values = [r["curve"][p] for r in mine if p in r["curve"]]
            cells.append(f"{statistics.mean(values):.3f} [{min(values):.2f}, {max(values):.2f}]" if values else "–")
        count = statistics.mean(r["count"] for r in mine)
        speed = statistics.mean(r["seconds_per_iteration"] for r in mine)
        lines.append(f"| {name} | {len(mine)} | " + " | ".join(cells) + f" | {count:.2f} | {speed:.2f} |")
    failed = [f"- {r['name']} seed {r['seed']}: {r['error']}" for r in results if "error" in r]
    return "\n".join(lines + ([""] + failed if failed else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", type=Path, help="YAML: name → {preset, overrides}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=240)
    parser.add_argument("--eval-every", type=int, default=60)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("sweep"))
    parser.add_argument("--only", nargs="+", help="run (or read) only these configurations of the file")
    args = parser.parse_args()
    configs = yaml.safe_load(args.configs.read_text())
    if args.only:
        unknown = sorted(set(args.only) - set(configs))
        if unknown:
            parser.error(f"--only: {', '.join(unknown)} not in {args.configs} (it has {', '.join(configs)})")
        configs = {name: configs[name] for name in args.only}
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(name, spec["preset"], list(spec.get("overrides", [])), seed) for seed in args.seeds for name, spec in configs.items()]
    start = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run_one(*job, args.iterations, args.eval_every, args.out), jobs))
    only = f" --only {' '.join(args.only)}" if args.only else ""
    text = (f"`python scripts/sweep_tiny.py {args.configs}{only} --seeds {' '.join(map(str, args.seeds))} --iterations {args.iterations} "
            f"--eval-every {args.eval_every} --jobs {args.jobs}` ({time.time() - start:.0f} s)\n\n" + table(results, list(configs)))
    (args.out / "sweep.md").write_text(text + "\n")
    (args.out / "sweep.json").write_text(json.dumps({"configs": configs, "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
