"""A check shared by the one- and two-process tests of the reward-hacking watch: a run with `watch.stop` keeps, in
RUN/best/, the weights its best held-out gold evaluated."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file


def assert_kept_best(run: Path, lora_after: Callable[[int], dict[str, torch.Tensor]]) -> None:
    """RUN/best/best.json names the first evaluation with the highest `watch_gold` in metrics.jsonl, and RUN/best/lora holds
    the weights it evaluated: LoRA's B at 0 before any update (iteration 0), else `lora_after(iteration − 1)`, the LoRA
    after the update before it (keys as the export writes them)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    golds = [(row["iteration"], row["watch_gold"]) for row in rows if "watch_gold" in row]
    best_iteration, best_gold = max(golds, key=lambda pair: (pair[1], -pair[0]))  # the first of equal golds
    kept = json.loads((run / "best" / "best.json").read_text())
    assert (kept["iteration"], kept["gold"]) == (best_iteration, best_gold), (kept, golds)
    exported = load_file(run / "best" / "lora" / "pytorch_lora_weights.safetensors")
    if best_iteration == 0:
        assert all(not value.any() for key, value in exported.items() if "lora_B" in key)
    else:
        expected = lora_after(best_iteration - 1)
        assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
