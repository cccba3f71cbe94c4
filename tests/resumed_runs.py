"""Checks shared by the resume tests: a run stopped after some iterations (or killed mid-iteration) and resumed
with `--resume latest` ends with the same exported weights and metrics (measurements aside) as a run
never stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from branchdiff.cli import main


def deterministic(metrics: dict) -> dict:
    """The metrics a seeded run reproduces: without the measured times (`*seconds*`) and peak
    memory (`memory_*`, the process's high-water mark, which depends on what ran before)."""
    return {k: v for k, v in metrics.items() if "seconds" not in k and not k.startswith("memory_")}


def assert_resumed_run_equals_straight(args: Callable[[Path, int], list[str]], tmp_path: Path, stop: int, end: int,
                                       check_stopped: Callable[[Path], None] | None = None) -> list[dict]:
    """`args(run, iterations)`: the train command; the resumed run stops after `stop` iterations
    (then `check_stopped(run)`) and continues to `end`. Returns the straight run's metrics lines."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(straight, end)) == 0
    assert main(args(resumed, stop)) == 0
    if check_stopped is not None:
        check_stopped(resumed)
    assert main([*args(resumed, end), "--resume", "latest"]) == 0
    a, b = (load_file(run / "transformer" / "diffusion_pytorch_model.safetensors") for run in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (straight, resumed)]
    reproduced = [[deterministic(m) for m in run_lines] for run_lines in lines]
    assert reproduced[0] == reproduced[1] and len(reproduced[0]) == end
    return lines[0]


def assert_killed_lora_run_equals_straight(args: Callable[[Path], list[str]], tmp_path: Path, iterations: int) -> None:
    """`args(run)`: a LoRA train command of `iterations` iterations checkpointing every 2. SIGKILL inside iteration 3's
    optimizer step (after iteration 2's checkpoint, tests/killed_run.py), then `--resume latest`: the LoRA and the
    metrics equal those of the run never stopped (tmp_path/straight), bit for bit."""
    assert main(args(tmp_path / "straight")) == 0
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(torch.get_num_threads())}  # as many threads as this process: the same sums
    killed = subprocess.run([sys.executable, str(tests / "killed_run.py"), "optimizer_step", "3", *args(tmp_path / "killed")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert main([*args(tmp_path / "killed"), "--resume", "latest"]) == 0
    final, expected = (load_file(tmp_path / run / "lora" / "pytorch_lora_weights.safetensors") for run in ("killed", "straight"))
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    lines = [[deterministic(json.loads(line)) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("killed", "straight")]
    assert lines[0] == lines[1] and len(lines[0]) == iterations
