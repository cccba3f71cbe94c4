"""Run one training iteration of a config and print each phase's measured peak memory beside `branchdiff
plan`'s estimate of it, as JSON (tests/test_plan.py runs it in a fresh process, so the process's resident
set holds nothing but this run: `python tests/plan_measured.py OVERRIDES...`)."""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

from branchdiff.plan import GIB, Estimator, Target, with_change
from branchdiff.settings.load import load_config
from branchdiff.training.recipe import Trainer


def resident() -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def main(overrides: list[str]) -> None:
    plan = with_change(None, overrides, Target(), Estimator())
    gc.collect()
    start = resident()  # the interpreter and its libraries: not the run's
    metrics = Trainer(load_config(None, overrides)).run_iteration(0).metrics
    phases = {}
    for phase in ("rollout", "reward", "train"):
        estimate = max(plan.phase_peak("train"), plan.phase_peak("optimizer")) if phase == "train" else plan.phase_peak(phase)
        phases[phase] = {"measured_gib": (metrics[f"memory_{phase}_gb"] * GIB - start) / GIB, "estimated_gib": estimate / GIB}
    print(json.dumps(phases))


if __name__ == "__main__":
    main(sys.argv[1:])
