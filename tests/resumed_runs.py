"""A check shared by the objectives' resume tests: a run stopped after some iterations and resumed
with `--resume latest` ends with the same exported weights and metrics (measurements aside) as a run
never stopped."""

from __future__ import annotations

import json
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
