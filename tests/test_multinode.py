"""Two machines on one host: two `accelerate launch --num_machines 2 --machine_rank 0|1 --main_process_ip
127.0.0.1` launchers (one process each, gloo on CPU) train `tiny-chain` as one machine's launch of two
processes does, bit for bit, and so do two `torchrun --nnodes 2` with a c10d rendezvous; a run stopped and resumed across the same layout ends with the same weights;
a rank that dies on the second machine ends the job on both with one line naming it, seconds after it died.

Slow (a release check, about 3 minutes of subprocesses on one core): python -m pytest -m slow tests/test_multinode.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TESTS = Path(__file__).parent
pytestmark = pytest.mark.slow


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _overrides(model_dir: Path, run: Path) -> list[str]:
    return [f"model.path={model_dir}", f"output_dir={run}", "seed=5", "reward=rewards_for_tests:Redness", "prompts.per_iteration=2",
            "sampling.num_steps=3", "sampling.max_batch=8", "tree.roots=1", "tree.splits=[[0,2],[1,2]]", "advantage.scope=batch",
            "train.minibatch=2", "model.finetune=lora", "train.learning_rate=1e-2", "logging.checkpoint_every=1", "logging.sample_every=0",
            "logging.report_to=none", "final_eval=false", "eval_every=0", "collective_timeout=60"]


def _launch(folder: Path, program: list[str], machines: int, processes: int, timeout: float = 400,
            ended: dict[int, float] | None = None) -> list[tuple[int, str]]:
    """`program` under `machines` launchers on this host (machine ranks 0..machines−1, `processes` in all, started
    together); each launcher's exit status and stderr, in machine order. `ended`, where given, receives each launcher's
    end (time.time(), polled every 50 ms); the killed rank's program writes when it died to `folder`/killed-at."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true", "KILLED_AT": str(folder / "killed-at")}
    port = _free_port()
    launched = []
    for machine in range(machines):
        command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(processes),
                   "--num_machines", str(machines), "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1",
                   "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", *program]
        log = open(folder / f"machine-{machine}.log", "w")
        launched.append((subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log), log))
    deadline = time.monotonic() + timeout
    ends = {} if ended is None else ended
    while len(ends) < machines and time.monotonic() < deadline:
        for machine, (process, _) in enumerate(launched):
            if machine not in ends and process.poll() is not None:
                ends[machine] = time.time()
        time.sleep(0.05)
    results = []
    for machine, (process, log) in enumerate(launched):
        if process.poll() is None:
            for other, _ in launched:
                other.kill()
        status = process.wait()
        log.close()
        results.append((status, (folder / f"machine-{machine}.log").read_text()))
    return results


def _runs(folder: Path, plan: list[list]) -> list[str]:
    """tests/sharded_runs.py's program for `plan` ([mode, CLI arguments] a run)."""
    (folder / "runs.json").write_text(json.dumps(plan))
    return [str(TESTS / "sharded_runs.py"), str(folder / "runs.json")]


def _lora(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "lora" / "pytorch_lora_weights.safetensors")


@pytest.fixture(scope="module")
def layouts(tiny_model_dir, tmp_path_factory):
    """Two machines of one process (a 2-iteration run; a run of 1 iteration resumed to 2), and one machine of two."""
    base = tmp_path_factory.mktemp("multinode")
    two = base / "two-machines"
    two.mkdir()
    plan = [["ddp", ["train", "tiny-chain", *_overrides(tiny_model_dir, two / "whole"), "iterations=2"]],
            ["ddp", ["train", "tiny-chain", *_overrides(tiny_model_dir, two / "resumed"), "iterations=1"]],
            ["ddp", ["train", "tiny-chain", *_overrides(tiny_model_dir, two / "resumed"), "iterations=2", "--resume", "latest"]]]
    machines = _launch(two, _runs(two, plan), machines=2, processes=2)
    one = base / "one-machine"
    one.mkdir()
    single = _launch(one, _runs(one, [["ddp", ["train", "tiny-chain", *_overrides(tiny_model_dir, one / "whole"), "iterations=2"]]]),
                     machines=1, processes=2)
    return {"two": two, "one": one, "machines": machines, "single": single, "model_dir": tiny_model_dir}


def test_two_machines_train_like_one_machine_of_as_many_processes_bit_for_bit(layouts):
    for status, stderr in [*layouts["machines"], *layouts["single"]]:
        assert status == 0, stderr[-3000:]
    mine, theirs = _lora(layouts["two"] / "whole"), _lora(layouts["one"] / "whole")
    assert mine.keys() == theirs.keys() and len(mine) > 0
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    for a, b in zip(rows(layouts["two"] / "whole"), rows(layouts["one"] / "whole"), strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a.get("loss") == b.get("loss")


def test_a_run_resumed_across_two_machines_ends_with_the_uninterrupted_weights(layouts):
    for status, stderr in layouts["machines"]:
        assert status == 0, stderr[-3000:]
    whole, resumed = _lora(layouts["two"] / "whole"), _lora(layouts["two"] / "resumed")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_torchrun_on_two_machines_with_a_c10d_rendezvous_trains_the_same_weights(layouts, tmp_path):
    """docs/sharding.md's plain-torchrun recipe: two `torchrun --nnodes 2 --rdzv_backend c10d` (no node rank, no accelerate
    config) meeting at one endpoint train one machine's weights."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true"}
    endpoint = f"127.0.0.1:{_free_port()}"
    run = tmp_path / "run"
    command = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", endpoint, "--rdzv_id", "branchdiff-test", "-m", "branchdiff.cli", "train", "tiny-chain",
               *_overrides(layouts["model_dir"], run), "iterations=2"]
    launched = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=400)[1] for process in launched]
    assert all(process.returncode == 0 for process in launched), [output[-3000:] for output in outputs]
    mine, theirs = _lora(run), _lora(layouts["one"] / "whole")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_rank_that_dies_on_the_second_machine_ends_the_job_on_both_with_one_line(tiny_model_dir, tmp_path):
    """The survivor's collective fails as soon as gloo sees the dead rank's connection drop (its words vary: "closed" or "reset
    by peer"); the one line is the project's own and, the machines sharing this host, names the rank that ended. The seconds
    from the kill to the survivor machine's exit are printed (docs/sharding.md quotes them) and bounded well below
    collective_timeout plus the backend's margin."""
    run = tmp_path / "run"
    arguments = ["train", "tiny-chain", *_overrides(tiny_model_dir, run)[:-1], "collective_timeout=8", "iterations=3"]
    ended: dict[int, float] = {}
    machines = _launch(tmp_path, [str(TESTS / "killed_run.py"), "rankkill", "1", *arguments], machines=2, processes=2, timeout=240, ended=ended)
    assert all(status != 0 for status, _ in machines), [stderr[-2000:] for _, stderr in machines]
    lines = [line for _, stderr in machines for line in stderr.replace("\r", "\n").splitlines() if line.startswith("branchdiff: error: ")]
    assert len(lines) == 1, [stderr[-3000:] for _, stderr in machines]
    assert re.match(r"branchdiff: error: process rank 1 \(pid \d+ on .+, last in iteration 1\) ended while the others waited for it at a "
                    r"collective, so the job ends; the newest complete checkpoint, .+/iter-000000, is intact; its own output says why it "
                    r"ended \(killed, out of memory, an error\), then continue with --resume latest$", lines[0]), lines[0]
    after = ended[0] - float((tmp_path / "killed-at").read_text())
    print(f"the surviving machine's launcher ended {after:.1f} s after the kill")
    assert 0 < after < 30, after
