"""Before a CUDA run loads its model: `branchdiff plan`'s estimate of every phase on this device, and a
refusal, in one line naming the phase, the estimate, the device's memory and the change that fits,
when the estimate exceeds the device's memory (`branchdiff train --force` launches anyway). The plan is
written to RUN/plan.json, where the run report sets it beside the measured peaks (docs/plan.md)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from branchdiff.errors import UserError
from branchdiff.plan.clock import GPUS
from branchdiff.plan.estimate import GIB, Estimator, Plan, Target, with_change
from branchdiff.runtime import storage
from branchdiff.runtime.sharding import ShardingSettings

PLAN_FILE = "plan.json"


def device_target() -> Target | None:
    """This process's CUDA device as a plan target (its name and total memory, the launch's processes and
    sharding); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
    properties = torch.cuda.get_device_properties(index)
    sharding = ShardingSettings.from_environment()
    gpu = replace(GPUS["h100-80gb"], name=properties.name, memory=float(properties.total_memory))
    return Target(int(os.environ.get("WORLD_SIZE", "1")), ("fsdp-offload" if sharding.offload else "fsdp") if sharding.enabled else "none", gpu)


def check_fits(source: str | None, overrides: list[str], force: bool, target: Target | None = None) -> Plan | None:
    """The run's plan on this device, or None where there is no CUDA device or no memory model for its
    family. Raises UserError when the estimated peak exceeds the device's memory, unless `force`."""
    target = target or device_target()
    if target is None:
        return None
    try:
        plan = with_change(source, overrides, target, Estimator())
    except ValueError as error:  # a family without a memory model: the launch goes on unplanned
        print(f"branchdiff: no memory estimate for this run ({error})")
        return None
    if plan.peak > plan.capacity and not force:
        change = f"{plan.change} fits (→ {plan.change_peak / GIB:.1f} GiB)" if plan.change_peak else plan.change
        raise UserError(f"plan: the {plan.peak_phase} phase needs an estimated {plan.peak / GIB:.1f} GiB per process and {plan.gpu} has "
                        f"{plan.capacity / GIB:.1f} GiB; {change}; or add --force to launch anyway (branchdiff plan shows every phase; docs/plan.md)")
    return plan


def write_plan(run_dir: Path, plan: Plan) -> None:
    """RUN/plan.json: every phase's estimated peak (GiB) beside what the run will measure."""
    storage.write_text(run_dir / PLAN_FILE, json.dumps(plan.to_json(), indent=1, default=str) + "\n")
