"""Two processes (`accelerate launch --num_processes 2`, gloo on CPU) against one.

Two launches share a module fixture: a 2-iteration run, then `--resume latest` to a third iteration
with the final evaluation. The trees branch (k = 2 at steps 0 and 1), advantages are normalised over
the batch (`advantage.scope=batch`) and branches are width-pruned over the batch (`prune.width=global`),
so processes train different numbers of edges and every batch-wide statistic must cross processes.
The one-process reference runs in this process with both processes' prompts (per_iteration 2 × 2).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from branchdiff.cli import main
from branchdiff.core.advantage import depthwise_advantages
from branchdiff.core.prune import width_mask
from branchdiff.core.tree import build_tree
from branchdiff.settings.load import load_config
from branchdiff.settings.trees import tree_spec
from branchdiff.training.recipe import Trainer
from resumed_runs import deterministic  # tests/ is on sys.path

TESTS = Path(__file__).parent
PER_PROCESS = 2


def _overrides(model_dir: Path, run: Path, per_iteration: int) -> list[str]:
    return [
        f"model.path={model_dir}", f"output_dir={run}", "seed=5", "reward=rewards_for_tests:Redness",
        f"prompts.per_iteration={per_iteration}", "sampling.num_steps=3", "sampling.max_batch=8", "tree.roots=1",
        "tree.splits=[[0,2],[1,2]]", "advantage.scope=batch", "prune.width=global", "prune.width_ratio=0.5",
        "train.minibatch=2", "model.finetune=lora", "train.learning_rate=1e-2", "logging.checkpoint_every=1", "logging.sample_every=1",
        "logging.report_to=none", "prompts.eval_seeds=1",
    ]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_two(record_dir: Path | None, cli_args: list[str], timeout: float = 300, program: list[str] | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch` two CPU processes of the CLI: `branchdiff train` recording into `record_dir`
    (tests/two_process_run.py), the plain CLI when `record_dir` is None, or `program` + `cli_args`; `env`: more variables."""
    accelerate = Path(sys.executable).parent / "accelerate"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true", **(env or {})}
    command = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()), "--mixed_precision", "no",
               "--dynamo_backend", "no",
               *(program or ([str(TESTS / "two_process_run.py"), str(record_dir)] if record_dir else ["-m", "branchdiff.cli"])), *cli_args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_process_run(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("two-process")
    run, records = base / "run", base / "records"
    records.mkdir()
    overrides = _overrides(tiny_model_dir, run, PER_PROCESS)
    trackers = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "SWANLAB_MODE": "local"}  # W&B and SwanLab write their files under RUN/logs
    first = launch_two(records, ["train", "tiny-chain", *overrides, "iterations=2", "final_eval=false", "eval_every=1", "watch.stop=true",
                                 "logging.report_to=[tensorboard,wandb,swanlab]"], env=trackers)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = launch_two(records, ["train", "tiny-chain", *overrides, "iterations=3", "--resume", "latest", "logging.report_to=[wandb,swanlab]"],
                         env=trackers)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = {(rank, it): torch.load(records / f"rank{rank}-iter{it}.pt", weights_only=True) for rank in (0, 1) for it in range(3)}
    return {"run": run, "record": record, "resumed": resumed, "model_dir": tiny_model_dir, "base": base}


def _lora(record: dict) -> dict[str, torch.Tensor]:
    return {k[len("lora/"):]: v for k, v in record.items() if k.startswith("lora/")}


def test_lora_is_bitwise_identical_on_both_processes_after_every_update(two_process_run):
    record = two_process_run["record"]
    for iteration in range(3):
        a, b = _lora(record[0, iteration]), _lora(record[1, iteration])
        assert a.keys() == b.keys() and len(a) > 0
        assert all(torch.equal(a[k], b[k]) for k in a), iteration
    assert any(not torch.equal(_lora(record[0, 0])[k], _lora(record[0, 2])[k]) for k in _lora(record[0, 0]))  # it trained


def test_processes_draw_different_prompts(two_process_run):
    record = two_process_run["record"]
    for iteration in range(3):
        keys = [record[rank, iteration]["keys"].tolist() for rank in (0, 1)]
        assert keys == [[0, 1], [2, 3]]
        ids = [set(record[rank, iteration]["prompt_ids"].tolist()) for rank in (0, 1)]
        assert not ids[0] & ids[1]


def _union(values: list[torch.Tensor], depths: list[torch.Tensor], num_steps: int) -> torch.Tensor:
    """Per-node values of both processes' trees in the level order of one tree batch holding all
    their prompts (process 0's prompts first): level d of the union is level d of 0, then of 1."""
    return torch.cat([v[d == depth] for depth in range(num_steps + 1) for v, d in zip(values, depths)])


def test_batch_statistics_equal_the_one_process_computation_on_the_union(two_process_run):
    """scope=batch advantages and global width pruning on two processes equal the one-process
    functions applied to the union of both processes' trees."""
    record = two_process_run["record"]
    config = load_config("tiny-chain", _overrides(two_process_run["model_dir"], two_process_run["run"], 2 * PER_PROCESS))
    spec = tree_spec(config, 0)
    union_tree = build_tree(spec, 2 * PER_PROCESS)
    edges_per_process = []
    for iteration in range(3):
        parts = [record[rank, iteration] for rank in (0, 1)]
        depths = [p["depth"] for p in parts]
        rewards = _union([p["node_rewards"] for p in parts], depths, spec.num_steps)
        expected = depthwise_advantages(union_tree, rewards, "batch").clamp(-5, 5)
        got = _union([p["advantages"] for p in parts], depths, spec.num_steps)
        assert torch.allclose(got, expected, atol=1e-6), iteration
        per_tree = depthwise_advantages(build_tree(spec, PER_PROCESS), parts[0]["node_rewards"], "batch").clamp(-5, 5)
        assert not torch.allclose(per_tree, parts[0]["advantages"], atol=1e-3)  # one process's own std is not the batch's
        trained = _union([p["trained"] for p in parts], depths, spec.num_steps)
        assert torch.equal(trained, width_mask(union_tree, expected, "global", 0.5) & union_tree.is_sde_edge)
        edges_per_process.append([int(p["trained"].sum()) for p in parts])
    assert any(a != b for a, b in edges_per_process)  # the processes trained unequal numbers of edges


def test_metrics_and_update_equal_one_process_on_both_prompt_sets(two_process_run):
    """One process with per_iteration = 2 × 2 draws the same prompts with the same noise; its first
    iteration's metrics and update must be those the two processes logged and made together (edges
    weigh the same wherever they are: the loss is normalised by the global edge count)."""
    two = [json.loads(line) for line in (two_process_run["run"] / "metrics.jsonl").read_text().splitlines()]
    single = Trainer(load_config("tiny-chain", _overrides(two_process_run["model_dir"], two_process_run["base"] / "single", 2 * PER_PROCESS)))
    result = single.run_iteration(0)
    one = result.metrics
    for key in ("nfe_rollout", "nfe_rollout_computed", "nfe_trained", "edges_trained", "optimizer_steps"):
        assert two[0][key] == one[key], key
    assert one["nfe_rollout"] == 2 * PER_PROCESS * (1 + 2 + 4)  # the sum over processes, not process 0's share
    for key in ("reward_mean", "reward_std", "loss", "clip_fraction", "kl", "grad_norm"):
        assert two[0][key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    assert two[0]["logprob_check"] < 1e-4 and one["logprob_check"] < 1e-4
    edges = [int(two_process_run["record"][rank, 0]["trained"].sum()) for rank in (0, 1)]
    assert edges[0] != edges[1]  # per-process normalisation would weigh these edges differently (grad_norm above)
    # the update itself: Adam's first step is about lr·sign(g), so gradient entries that differ only in
    # float rounding around 0 may flip; the two updates agree to 1% of their size
    trained_one = {k: v.detach() for k, v in single.adapter.denoiser.named_parameters() if "lora_" in k}
    trained_two = _lora(two_process_run["record"][0, 0])
    difference = torch.cat([(trained_one[k] - trained_two[k]).flatten() for k in trained_two])
    update = torch.cat([trained_two[k].flatten() for k in trained_two if "lora_B" in k])  # B starts at 0
    assert difference.norm() < 1e-2 * update.norm() and update.norm() > 0


def test_resume_continues_and_the_run_ends_with_the_evaluation_table(two_process_run):
    run, record = two_process_run["run"], two_process_run["record"]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    saved = load_file(run / "checkpoints" / "iter-000001" / "pytorch_lora_weights.safetensors")
    trained = _lora(record[0, 1])
    assert len(saved) == len(trained) and all(torch.equal(saved["transformer." + k.replace(".default", "")], v) for k, v in trained.items())
    out = two_process_run["resumed"].stdout
    assert "held-out evaluation" in out and "base" in out and "trained" in out
    assert set(json.loads((run / "eval.json").read_text())) == {"prompts", "images_per_prompt", "scales", "after_iteration", "base", "trained"}
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_a_watched_run_keeps_the_weights_of_its_best_evaluation_on_two_processes(two_process_run):
    """With watch.stop, RUN/best/ holds the weights its best held-out gold evaluated (both processes evaluate, the main one
    writes): those of the update before that evaluation."""
    from watched_runs import assert_kept_best

    assert_kept_best(two_process_run["run"], lambda iteration: {"transformer." + k.replace(".default", ""): v
                                                                for k, v in _lora(two_process_run["record"][0, iteration]).items()})


def test_heldout_evaluation_and_depth_statistics_equal_one_process(two_process_run):
    """`eval_every`: the two processes each sample half the eval prompts and log the scores of all;
    the per-depth advantage statistics sum over processes: both equal one process on all prompts."""
    two = [json.loads(line) for line in (two_process_run["run"] / "metrics.jsonl").read_text().splitlines()]
    single = Trainer(load_config("tiny-chain", _overrides(two_process_run["model_dir"], two_process_run["base"] / "single-eval", 2 * PER_PROCESS)))
    heldout = single.heldout_metrics()
    one = single.run_iteration(0).metrics
    assert {k for k in two[0] if k.startswith("eval_") or k == "memory_eval_gb"} == set(heldout) and "eval_tiny-geneval.strict" in heldout
    assert all(two[0][k] == pytest.approx(v, abs=1e-6) for k, v in deterministic(heldout).items())
    assert "eval_tiny-geneval" in two[1] and "eval_tiny-geneval" not in two[2]  # the resumed launch has eval_every 0
    depth_keys = [k for k in one if "/depth_" in k]
    assert depth_keys and {k for k in two[0] if "/depth_" in k} == set(depth_keys)
    assert all(two[0][k] == pytest.approx(one[k], rel=1e-4, abs=1e-6) for k in depth_keys)
    assert (two_process_run["run"] / "report.html").is_file() and (two_process_run["run"] / "samples" / "eval-iter-000001.png").is_file()


def test_the_main_process_alone_logs_the_grids_to_tensorboard(two_process_run):
    """The first launch logged to TensorBoard: one event file, each grid once per iteration it was saved."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((two_process_run["run"] / "logs").rglob("events.out.tfevents.*"))
    assert len(files) == 1
    events = EventAccumulator(str(files[0]), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("samples/train")] == [0, 1] and [e.step for e in events.Images("samples/held_out")] == [0, 1]


def test_the_main_process_alone_logs_to_wandb_and_swanlab_and_the_resumed_launch_continues_their_runs(two_process_run):
    """Both launches logged every metric of metrics.jsonl (the processes' reduced values) to one W&B offline run and
    one SwanLab local run, written by process 0 only: the first launch, the resumed one and its final evaluation, each a
    session under the run's one id."""
    from tracker_files import swanlab_scalars, wandb_history

    run = two_process_run["run"]
    identity = json.loads((run / "trackers.json").read_text())["id"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ids, history = wandb_history(run)
    assert ids == [identity] * 3  # process 1 wrote none
    by_step: dict = {}
    for row in history:
        by_step.setdefault(row.get("_step"), {}).update(row)
    ids, scalars, _ = swanlab_scalars(run)
    assert ids == [identity] * 3 and any(key.startswith("final_eval/trained/") for key, _ in scalars)
    assert [row["iteration"] for row in metrics] == [0, 1, 2]
    for row in metrics:
        for key, value in row.items():
            if key != "iteration" and isinstance(value, float) and math.isfinite(value):
                assert by_step[row["iteration"]][key] == pytest.approx(value, rel=1e-6), key
                assert scalars[(key, row["iteration"])] == pytest.approx(value, rel=1e-6), key


def test_ctrl_c_on_one_process_stops_both_after_the_same_iteration(tiny_model_dir, tmp_path):
    """SIGINT reaches process 0 only, during iteration 0's update: both processes finish the
    iteration, save one checkpoint together and stop (no process waits for the other)."""
    run = tmp_path / "run"
    args = ["train", "tiny-chain", *_overrides(tiny_model_dir, run, PER_PROCESS), "iterations=4", "final_eval=false"]
    result = launch_two(None, ["sigint", "0", *args], program=[str(TESTS / "killed_run.py")])
    assert result.returncode != 0 and result.stderr.count("branchdiff: interrupted after 1 of ") == 2, result.stderr[-3000:]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000000"]


@pytest.mark.slow  # a release check (~20–45 s of subprocesses); python -m pytest -m slow
def test_a_frozen_rank_ends_the_job_with_one_line_naming_it_and_the_run_resumes_exactly(two_process_run, tmp_path):
    """Rank 1 stops itself (SIGSTOP) at the start of iteration 2: rank 0's heartbeat watch names it
    after collective_timeout, ends it and exits 2; the launch ends well before accelerate's own
    30-minute default. The last checkpoint (iteration 1) is intact, and `--resume latest` on two
    processes ends with the LoRA of the module's uninterrupted run (iterations 0-2)."""
    run = tmp_path / "run"
    args = ["train", "tiny-chain", *_overrides(two_process_run["model_dir"], run, PER_PROCESS), "final_eval=false", "collective_timeout=8"]
    start = time.monotonic()
    frozen = launch_two(None, ["sigstop", "2", *args, "iterations=3"], program=[str(TESTS / "killed_run.py")], timeout=240)
    elapsed = time.monotonic() - start
    assert frozen.returncode != 0, frozen.stderr[-3000:]
    lines = [line for line in frozen.stderr.replace("\r", "\n").splitlines() if line.startswith("branchdiff: error: ")]
    assert len(lines) == 1, frozen.stderr[-3000:]
    assert re.match(r"branchdiff: error: process rank 1 \(pid \d+ on .+, silent for \d+ s, last in iteration 2\) stopped responding "
                    r"for more than collective_timeout = 8 s, so the job ends; the newest complete checkpoint, .+/iter-000001, is intact; ", lines[0])
    assert elapsed < 120, elapsed
    from branchdiff.runtime import checkpoint

    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["iter-000000", "iter-000001"]
    assert checkpoint.verify(run / "checkpoints" / "iter-000001")[1] is None
    lora = run / "checkpoints" / "iter-000001" / "pytorch_lora_weights.safetensors"
    lora.write_bytes(lora.read_bytes()[:1000])  # and then its newest checkpoint is damaged: both processes fall back alike
    resumed = launch_two(None, [*args, "iterations=3", "--resume", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count(f"branchdiff: skipping checkpoint {run / 'checkpoints' / 'iter-000001'}: damaged") == 1  # said once
    assert (run / "checkpoints" / ".damaged-000001").is_dir()
    _assert_same_lora(run, two_process_run["run"])


def _assert_same_lora(run: Path, reference: Path) -> None:
    mine, theirs = (load_file(folder / "lora" / "pytorch_lora_weights.safetensors") for folder in (run, reference))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_full_disk_on_one_process_stops_both_at_the_checkpoint_and_keeps_the_last_one(two_process_run, tmp_path):
    from branchdiff.runtime import checkpoint

    """Process 0's writes into iteration 1's checkpoint fail (ENOSPC): both processes stop together
    at once (no collective left waiting), process 0 with the full-disk line, the staging folder is
    removed and checkpoint 0 kept, whole."""
    run = tmp_path / "run"
    # collective timeouts far above the launch's own time (19 s idle, 32 s beside two busy processes, more on a loaded CI machine):
    # a process left waiting on a collective would hold the launch past 300 s
    args = ["train", "tiny-chain", *_overrides(two_process_run["model_dir"], run, PER_PROCESS), "final_eval=false", "collective_timeout=300"]
    start = time.monotonic()
    stopped = launch_two(None, ["enospc", "1", *args, "iterations=3"], program=[str(TESTS / "killed_run.py")], timeout=400)
    assert stopped.returncode != 0 and time.monotonic() - start < 150, stopped.stderr[-3000:]  # far below the 300 s timeouts
    lines = [line for line in stopped.stderr.replace("\r", "\n").splitlines() if line.startswith("branchdiff: error: ")]
    # process 0's line and process 1's; the launcher ends the other process when the first exits, so under load either may be missing
    first_words = sorted(line.split(" ")[2] for line in lines)
    assert first_words in (["could"], ["another"], ["another", "could"]), lines
    for line in lines:  # (a long tmp path is shortened in the middle of a line: its start and end are checked)
        assert line.startswith(("branchdiff: error: could not write ", "branchdiff: error: another process could not write its part of checkpoint "))
        assert " intact" in line and line.endswith("continue with --resume latest"), line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000000"]
    assert checkpoint.verify(run / "checkpoints" / "iter-000000")[1] is None  # resuming from it: test_faults.py, and the frozen-rank test above


# LoRA with GRPO on two processes: two_process_run; on every layer: test_finetune.py
MODES = {"full": ["model.finetune=full"], "nft-lora": ["train.loss=nft"], "guard-lora": ["train.loss=grpo-guard"],
         "layertuning-lora": ["train.loss=grpo-layertuning"], "awm-lora": ["train.loss=awm"], "dgpo-lora": ["train.loss=dgpo"],
         "dgpo-ema-lora": ["train.loss=dgpo", "dgpo.reference=ema"],
         "dppo-lora": ["train.loss=dppo"], "dpo-lora": ["train.loss=dpo"],
         "median-lora": ["advantage.baseline=median", "tree.splits=[[0,3]]"],
         "median-lower-lora": ["advantage.baseline=median-lower", "tree.splits=[[0,2]]"], "sft-lora": ["train.loss=sft"],
         "dpo-offline-lora": ["train.loss=dpo-offline"], "overlap-lora": ["reward_overlap=true", "sampling.max_batch=3"],
         "nft-block-cache-lora": ["train.loss=nft", "sampling.block_cache=0.999"]}  # above every change of the tiny model


def _rates(mode: list[str]) -> list[str]:
    rate = "train.learning_rate=1e-3" if "model.finetune=full" in mode else "train.learning_rate=1e-2"
    return [rate, "train.lr_schedule=linear", "train.ema_decay=0.5"]


def _mode_arguments(model_dir: Path, run: Path, mode: list[str]) -> list[str]:
    return ["train", "tiny-chain", *_overrides(model_dir, run, PER_PROCESS), *mode, *_rates(mode), "final_eval=false", "logging.sample_every=0"]


EVAL = ["eval", "--prompts", "tiny:held_out", "--rewards", "tiny-geneval,rewards_for_tests:Redness", "--images-per-prompt", "2", "--steps", "3"]


@pytest.fixture(scope="module")
def mode_runs(tiny_model_dir, tmp_path_factory):
    """Every mode trained for two iterations on two processes, and full fine-tuning once more stopped after
    its first iteration and resumed, and `branchdiff eval`: all in one launch (tests/sharded_runs.py, DDP)."""
    base = tmp_path_factory.mktemp("modes")
    plan = [["ddp", [*_mode_arguments(tiny_model_dir, base / name, mode), "iterations=2"]] for name, mode in MODES.items()]
    resumed = _mode_arguments(tiny_model_dir, base / "full-resumed", MODES["full"])
    plan += [["ddp", [*resumed, "iterations=1"]], ["ddp", [*resumed, "iterations=2", "--resume", "latest"]]]
    # last: `eval` ends the process group as it finishes
    plan.append(["ddp", [*EVAL, "--model", str(tiny_model_dir), "--out", str(base / "eval"), "--json", str(base / "eval.json")]])
    (base / "runs.json").write_text(json.dumps(plan))
    done = launch_two(None, [str(base / "runs.json")], program=[str(TESTS / "sharded_runs.py")])
    assert done.returncode == 0, done.stderr[-3000:]
    return base


def _export(run: Path, full: bool) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted((run / ("transformer" if full else "lora")).glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("name", list(MODES))
def test_full_finetuning_trains_on_two_processes_like_one(tiny_model_dir, mode_runs, tmp_path, name):
    """Two processes (DDP over every weight of the denoiser, or over LoRA with each objective): the update
    equals one process's on both processes' prompts (to 1% of its size: Adam's first step is about
    lr·sign(g)), and full fine-tuning stopped after its first iteration and resumed on two processes
    ends with the same export, bit for bit. (LoRA resumes: the frozen-rank test above.) The learning
    rate decays linearly (iteration 1 at half the rate) in every run, and the export is the weights'
    moving average (saved by one process, loaded by both on the resume). DiffusionNFT (LoRA) draws its
    training terms by global prompt key, so two processes train what one does; GRPO-Guard recovers each
    edge's rollout mean from the noise at its global address; LayerTuning-RL's best paths are per
    prompt, so they are the same however the prompts are split. AWM, DGPO and online DPO draw their
    terms by global prompt key too, and DGPO's group statistic and DPO's pairs are per prompt, which
    one process holds whole (DGPO's moving reference follows the same optimizer steps on both); DPPO recovers rollout means as GRPO-Guard does; the median baseline's
    pivots are per (prompt, depth); SFT and offline DPO draw their rows as prompts are and their noise
    levels by each row's global slot. Scoring overlapped with the rollout (one prompt a part) scores each
    process's parts in its own worker. DiffusionNFT's rollouts with the first-block cache skip every forward after
    the roots' (a threshold every change falls under, so that one and two processes, whose forwards hold different
    rows, decide alike): a skipped row's output depends on its own latent and its parent's cache only."""
    mode = MODES[name]
    full = "model.finetune=full" in mode
    trained_two = _export(mode_runs / name, full)
    if full:  # every weight saved by one process and loaded by both: a resume ends with the same export
        resumed = _export(mode_runs / "full-resumed", full)
        assert resumed.keys() == trained_two.keys() and all(torch.equal(resumed[k], trained_two[k]) for k in resumed)
    single = Trainer(load_config("tiny-chain", [*_overrides(tiny_model_dir, tmp_path / "single", 2 * PER_PROCESS), *mode, *_rates(mode),
                                                "iterations=2"]))

    def trained() -> dict[str, torch.Tensor]:  # the parameters the run trains, by their name in the denoiser
        return {k: v.detach().clone() for k, v in single.adapter.denoiser.named_parameters() if full or "lora_" in k}

    base = trained()
    for iteration in range(2):
        single.run_iteration(iteration)
    with single.evaluated_weights():
        trained_one = trained()
    names = sorted(trained_one)
    one = torch.cat([trained_one[k].flatten() - base[k].flatten() for k in names])
    twos = torch.cat([_exported_as(trained_two, k).flatten() - base[k].flatten() for k in names])
    assert (one - twos).norm() < 1e-2 * one.norm() and one.norm() > 0


def _exported_as(exported: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A trained parameter's tensor in an export: the denoiser's own name, or the LoRA export's."""
    if name in exported:
        return exported[name]
    return exported["transformer." + name.replace(".default", "")]


def test_eval_gives_the_same_numbers_on_two_processes(tiny_model_dir, mode_runs, tmp_path):
    """`branchdiff eval` shards prompts over two processes and gathers once: its summary and per-image
    scores equal the one-process run's."""
    assert main([*EVAL, "--model", str(tiny_model_dir), "--out", str(tmp_path / "one"), "--json", str(tmp_path / "one.json")]) == 0
    one_summary, two_summary = (json.loads(path.read_text())["summary"] for path in (tmp_path / "one.json", mode_runs / "eval.json"))
    assert one_summary == two_summary and one_summary["all"]["tiny-geneval"]["images"] == 72
    assert (tmp_path / "one" / "scores.csv").read_text() == (mode_runs / "eval" / "scores.csv").read_text()


@pytest.mark.slow  # release only: keeps the suite under 15 minutes on 2 cores
def test_tiny_flux_trains_with_the_tree_preset_on_two_processes(tmp_path):
    """The flux-hps-branch preset (20 steps, k = 2 at 0, 3, 6, 9, guidance embedding, gradient
    checkpointing) on a tiny FLUX pipeline saved to disk, two processes, two iterations: the LoRA is
    identical on both ranks after every update, the ranks draw different prompts, and the run
    exports a LoRA the FLUX pipeline loads."""
    from tiny_pipelines import load_pipeline, save_pipeline

    model = save_pipeline("flux", tmp_path / "flux")
    records = tmp_path / "records"
    records.mkdir()
    run = tmp_path / "run"
    overrides = [f"model.path={model}", "model.resolution=32", "model.dtype=float32", "model.offload=false", f"output_dir={run}",
                 "reward=rewards_for_tests:Redness", "prompts.train=tiny:train", "prompts.per_iteration=1", "iterations=2", "final_eval=false",
                 "logging.report_to=none", "train.mixed_precision=no", "train.learning_rate=1e-2", "logging.checkpoint_every=1"]
    result = launch_two(records, ["train", "flux-hps-branch", *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    record = {(rank, it): torch.load(records / f"rank{rank}-iter{it}.pt", weights_only=True) for rank in (0, 1) for it in range(2)}
    for iteration in range(2):
        a, b = _lora(record[0, iteration]), _lora(record[1, iteration])
        assert a.keys() == b.keys() and len(a) > 0
        assert all(torch.equal(a[k], b[k]) for k in a), iteration
        ids = [set(record[rank, iteration]["prompt_ids"].tolist()) for rank in (0, 1)]
        assert not ids[0] & ids[1]
        assert len(record[0, iteration]["parent"]) == 1 + 2 * 3 + 4 * 3 + 8 * 3 + 16 * 11  # one 16-leaf tree: 219 nodes (203 forwards)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in _lora(record[0, 1]).items() if "lora_B" in k)  # it trained
    pipe = load_pipeline("flux", model)
    pipe.load_lora_weights(str(run / "lora"))
    assert any("lora" in name for name, _ in pipe.transformer.named_parameters())


@pytest.mark.slow  # release only: keeps the suite under 15 minutes on 2 cores
@pytest.mark.parametrize("family", ["wan", "wan-i2v"])
def test_tiny_wan_trains_videos_on_two_processes(tmp_path, family):
    """A video family on two processes: a tiny Wan pipeline (5 frames; image-to-video: from a JSONL naming each prompt's
    first frame), a tree, an image reward scoring every 2nd frame; the LoRA is identical on both ranks after every
    update, the ranks draw different prompts, and the exported LoRA loads into the family's pipeline."""
    import json

    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from tiny_pipelines import build_wan, build_wan_i2v

    (build_wan_i2v("2.1") if family == "wan-i2v" else build_wan()).save_pretrained(tmp_path / "wan", safe_serialization=True)
    data = []
    if family == "wan-i2v":
        rows = []
        for index in range(4):
            Image.new("RGB", (32, 16), (60 * index, 200 - 40 * index, 90)).save(tmp_path / f"frame-{index}.png")
            rows.append(json.dumps({"prompt": f"a shape moving {index}", "image": f"frame-{index}.png"}))
        (tmp_path / "firsts.jsonl").write_text("\n".join(rows) + "\n")
        data = [f"prompts.train={tmp_path / 'firsts.jsonl'}"]
    records = tmp_path / "records"
    records.mkdir()
    run = tmp_path / "run"
    overrides = [f"model.family={family}", f"model.path={tmp_path / 'wan'}", "model.resolution=[16,32]", "model.frames=5", "model.finetune=lora",
                 f"output_dir={run}", "reward={name: rewards_for_tests:Redness, frames: 2}", "prompts.per_iteration=1", "iterations=2",
                 "sampling.num_steps=3", "tree.roots=2", "tree.splits=[[0,2]]", "final_eval=false", "logging.report_to=none",
                 "train.learning_rate=5e-2", "logging.checkpoint_every=1", *data]
    result = launch_two(records, ["train", "tiny-chain", *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    record = {(rank, it): torch.load(records / f"rank{rank}-iter{it}.pt", weights_only=True) for rank in (0, 1) for it in range(2)}
    for iteration in range(2):
        a, b = _lora(record[0, iteration]), _lora(record[1, iteration])
        assert a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[k], b[k]) for k in a), iteration
        assert not set(record[0, iteration]["prompt_ids"].tolist()) & set(record[1, iteration]["prompt_ids"].tolist())
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in _lora(record[0, 1]).items() if "lora_B" in k)  # it trained
    pipe = (WanImageToVideoPipeline if family == "wan-i2v" else WanPipeline).from_pretrained(tmp_path / "wan")
    pipe.load_lora_weights(str(run / "lora"))
    assert any("lora" in name for name, _ in pipe.transformer.named_parameters())
