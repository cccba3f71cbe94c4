"""Crash-proof training: a run killed (SIGKILL) at any moment, or stopped with Ctrl-C, and resumed
with `--resume latest` ends with the weights of a run never stopped, bit for bit (CPU, fp32);
metrics and TensorBoard logs after the checkpoint are rewritten, never duplicated.

The killed runs are subprocesses of tests/killed_run.py; resumes run in this process through the CLI.
Iterations 0..5, checkpoints after iterations 2 and 5, two optimizer steps per iteration, a cosine
learning rate after one iteration of warm-up (a resumed run continues on the same curve), and a
moving average of the weights (the export, the held-out evaluations: a resumed run continues the
same average).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from branchdiff.cli import main
from resumed_runs import deterministic  # tests/ is on sys.path

TESTS = Path(__file__).parent
ITERATIONS = 6


def _args(model_dir: Path, run: Path, eval_prompts: Path) -> list[str]:
    # tiny-mix: 22 trained edges per prompt, 44 per iteration in minibatches of 8 parents; optimizer_every 16 → 2 optimizer steps
    return ["train", "tiny-mix", f"model.path={model_dir}", f"output_dir={run}", f"iterations={ITERATIONS}", "seed=3",
            "prompts.per_iteration=2", "model.finetune=lora", "train.minibatch=8", "train.optimizer_every=16", "train.learning_rate=3e-3",
            "train.lr_schedule=cosine", "train.warmup_iterations=1", "train.ema_decay=0.9", "logging.checkpoint_every=3",
            "logging.sample_every=0", "eval_every=2", f"prompts.eval={eval_prompts}", "prompts.eval_seeds=1", "final_eval=false"]


@pytest.fixture(scope="module")
def setting(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    eval_prompts = base / "eval.txt"
    eval_prompts.write_text("two red circles on the left\none blue square at the top\n")
    never_stopped = base / "never-stopped"
    assert main(_args(tiny_model_dir, never_stopped, eval_prompts)) == 0
    return {"base": base, "model_dir": tiny_model_dir, "eval_prompts": eval_prompts, "reference": never_stopped}


def _killed(setting: dict, name: str, point: str, n: int) -> tuple[Path, subprocess.CompletedProcess]:
    run = setting["base"] / name
    # the killed process computes with as many threads as this one: another count sums in another order (last-bit differences)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    args = _args(setting["model_dir"], run, setting["eval_prompts"])
    process = subprocess.run([sys.executable, str(TESTS / "killed_run.py"), point, str(n), *args], env=env,
                             capture_output=True, text=True, timeout=600)
    return run, process


def _resume(setting: dict, run: Path) -> None:
    assert main([*_args(setting["model_dir"], run, setting["eval_prompts"]), "--resume", "latest"]) == 0


def _iterations(run: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(run: Path, reference: Path) -> None:
    """Final LoRA bit for bit, every metrics line once, the same numbers, TensorBoard steps once."""
    final, expected = (load_file(r / "lora" / "pytorch_lora_weights.safetensors") for r in (run, reference))
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    assert _iterations(run) == list(range(ITERATIONS))
    lines, expected_lines = ([json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (run, reference))
    for line, expected_line in zip(lines, expected_lines):
        assert deterministic(line) == deterministic(expected_line)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "logs" / "branchdiff")).Reload()  # drops steps a later session purged
    assert [e.step for e in events.Scalars("reward_mean")] == list(range(ITERATIONS))
    assert [e.step for e in events.Scalars("eval_tiny-geneval.strict")] == [0, 2, 4]


def test_the_metrics_carry_the_scheduled_learning_rate(setting):
    """Warm-up over iteration 0, then cosine decay over iterations 1..5 of 6: 3e-3·½(1 + cos(π(i − 1)/5))."""
    rates = [json.loads(line)["learning_rate"] for line in (setting["reference"] / "metrics.jsonl").read_text().splitlines()]
    expected = [0.0, *(3e-3 * 0.5 * (1 + math.cos(math.pi * (i - 1) / 5)) for i in range(1, ITERATIONS))]
    assert rates == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_sigkill_in_the_middle_of_an_iteration_then_resume_gives_the_same_weights(setting):
    # the 10th optimizer step is iteration 4's second: killed after its first step changed the weights
    run, process = _killed(setting, "sigkill", "optimizer_step", 10)
    assert process.returncode == -9, process.stderr[-2000:]
    assert _iterations(run) == [0, 1, 2, 3]  # iteration 3 is after the checkpoint of iteration 2
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["iter-000002"]
    _resume(setting, run)
    _assert_same_run(run, setting["reference"])


@pytest.mark.slow  # release only: keeps the suite under 15 minutes on 2 cores
def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_complete_one(setting):
    run, process = _killed(setting, "killed-in-save", "write_state", 2)  # the second checkpoint (iteration 5), before it is published
    assert process.returncode == -9, process.stderr[-2000:]
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == [".staging-000005", "iter-000002"]  # the half-written one never took a checkpoint's name
    _resume(setting, run)  # --resume latest: iteration 2's
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000002", "iter-000005"]
    _assert_same_run(run, setting["reference"])


def test_ctrl_c_stops_after_the_iteration_with_a_checkpoint_and_exit_130(setting):
    run, process = _killed(setting, "ctrl-c", "sigint", 1)
    assert process.returncode == 130, process.stderr[-2000:]
    last = process.stderr.strip().splitlines()[-1]
    assert last == (f"branchdiff: interrupted after 2 of {ITERATIONS} iterations, a checkpoint of them saved in {run / 'checkpoints'}; "
                    "continue with --resume latest")
    assert "Traceback" not in process.stderr
    assert _iterations(run) == [0, 1] and (run / "checkpoints" / "iter-000001").is_dir() and (run / "report.html").is_file()
    _resume(setting, run)
    _assert_same_run(run, setting["reference"])
