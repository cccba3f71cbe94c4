"""Scoring overlapped with the rollout (`reward_overlap`, branchdiff/training/overlap.py): the parts, the same
images, rewards, advantages and update as sequential scoring bit for bit under `sampling.exact` (a tree run, a
group reward and the normalising combiner included), rewards equal to scoring the same images without it,
each part scored while the next grows, a failure in the worker as the reward's one line, the setting's
conflict with explore, and the benchmark at a tiny size. Two processes: tests/test_multiprocess.py's
`overlap-lora` mode."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from branchdiff.cli import main
from branchdiff.errors import ConfigError
from branchdiff.rewards.multi import RewardError
from branchdiff.settings.load import load_config
from branchdiff.training.overlap import overlap_parts
from branchdiff.training.recipe import Trainer
from rewards_for_tests import Redness  # tests/ is on sys.path

TWO = "[rewards_for_tests:Redness, {name: group-rank, weight: 0.5, kwargs: {reward: rewards_for_tests:Darkness}}]"


def _trainer(model_dir, out, overlap: bool, *extra: str) -> Trainer:
    return Trainer(load_config(None, [
        f"model.path={model_dir}", f"output_dir={out}", "iterations=2", "seed=3", f"reward={TWO}", "reward_combine=normalize_then_sum",
        "prompts.per_iteration=3", "tree.roots=1", "tree.splits=[[0, 2], [1, 2]]", "sampling.num_steps=3", "sampling.max_batch=4",
        "train.minibatch=4", "model.finetune=lora", "train.learning_rate=1e-2", "final_eval=false", "logging.report_to=none",
        f"reward_overlap={str(overlap).lower()}", *extra]))


def test_parts_are_whole_prompts_filling_the_batch_with_their_leaves():
    assert overlap_parts(5, 4, 8) == [[0, 1], [2, 3], [4]]
    assert overlap_parts(3, 16, 8) == [[0], [1], [2]]  # a prompt's leaves exceed a batch: one prompt a part
    assert overlap_parts(2, 4, 64) == [[0, 1]]  # one part: nothing to overlap


def test_overlapped_scoring_trains_exactly_as_sequential_under_exact_sampling(tiny_model_dir, tmp_path):
    sequential, overlapped = (_trainer(tiny_model_dir, tmp_path / str(o), o, "sampling.exact=true") for o in (False, True))
    for iteration in range(2):  # the second iteration starts from the first's update
        a, b = sequential.run_iteration(iteration), overlapped.run_iteration(iteration)
        assert torch.equal(a.leaf_images, b.leaf_images) and torch.equal(a.node_rewards, b.node_rewards)
        assert torch.equal(a.node_advantages, b.node_advantages) and a.metrics["loss"] == b.metrics["loss"]
        assert a.metrics["reward_group-rank"] == b.metrics["reward_group-rank"] and a.metrics["nfe_rollout"] == b.metrics["nfe_rollout"]
    weights = lambda t: {k: v for k, v in t.adapter.denoiser.named_parameters() if "lora_" in k}  # noqa: E731
    assert all(torch.equal(weights(sequential)[k], weights(overlapped)[k]) for k in weights(sequential))


def test_without_exact_sampling_the_rewards_are_those_of_its_own_images(tiny_model_dir, tmp_path):
    result = _trainer(tiny_model_dir, tmp_path / "run", True, "reward=rewards_for_tests:Redness", "reward_combine=sum_then_normalize").run_iteration(0)
    tree = result.rollout.tree
    prompts = [result.prompts[p] for p in tree.prompt[tree.leaf_index].tolist()]
    assert torch.equal(result.node_rewards[tree.leaf_index].float(), Redness()(result.leaf_images, prompts))


class Recorded:
    """Redness that records when each call starts and ends, and fails on its `fail_on`-th call."""

    name = "recorded"
    scale = "redness"
    calls: list[tuple[float, float]] = []
    fail_on = 0

    def __call__(self, images, prompts, metadata):
        start = time.perf_counter()
        if len(Recorded.calls) + 1 == Recorded.fail_on:
            raise RuntimeError("judge crashed\nwith a second line")
        time.sleep(0.3)
        Recorded.calls.append((start, time.perf_counter()))
        return Redness()(images, prompts)


def test_each_part_is_scored_while_the_next_grows_in_a_worker(tiny_model_dir, tmp_path, monkeypatch):
    import branchdiff.training.overlap as overlap

    Recorded.calls, Recorded.fail_on = [], 0
    threads, grown, scoring = set(), [], threading.Event()
    original, grow = Recorded.__call__, overlap.grow_prompts

    def recorded(self, *args):
        threads.add(threading.current_thread().name)
        scoring.set()
        return original(self, *args)

    def grow_after_the_first_part_is_being_scored(*args, **kwargs):
        # the second part waits (up to 10 s) for the first part's scoring to start, as a slow rollout would: a worker
        # started late by the scheduler cannot lose the race, and sequential scoring (which starts only after the
        # rollout) still fails the order asserted below
        if grown:
            scoring.wait(10)
        out = grow(*args, **kwargs)
        grown.append(time.perf_counter())
        return out

    monkeypatch.setattr(Recorded, "__call__", recorded)
    monkeypatch.setattr(overlap, "grow_prompts", grow_after_the_first_part_is_being_scored)
    result = _trainer(tiny_model_dir, tmp_path / "run", True, "reward=test_overlap:Recorded").run_iteration(0)
    assert len(Recorded.calls) == len(grown) == 3 and all(name.startswith("branchdiff-reward") for name in threads)  # a part a prompt, in the worker
    assert Recorded.calls[0][0] < grown[1] < grown[2]  # the first part was being scored while the second grew
    assert all(end <= start for (_, end), (start, _) in zip(Recorded.calls, Recorded.calls[1:]))  # one worker: in order
    hidden, waited = result.metrics["reward_overlapped_seconds"], result.metrics["reward_seconds"]
    assert hidden > 0 and hidden + waited >= 0.3 * 3  # the scoring's three 0.3 s calls: partly behind the rollout, the rest waited for


def test_a_failure_in_the_worker_stops_the_run_with_the_rewards_one_line(tiny_model_dir, tmp_path, capsys):
    Recorded.calls, Recorded.fail_on = [], 2
    with pytest.raises(RewardError, match=r"reward 'test_overlap:Recorded' failed on a batch of 4 images .*judge crashed with a second line"):
        _trainer(tiny_model_dir, tmp_path / "run", True, "reward=test_overlap:Recorded").run_iteration(0)
    Recorded.calls, Recorded.fail_on = [], 1
    assert main(["train", "tiny-chain", f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'cli'}", "reward=test_overlap:Recorded",
                 "reward_overlap=true", "iterations=1", "prompts.per_iteration=2", "tree.roots=2", "sampling.num_steps=2", "sampling.max_batch=2",
                 "final_eval=false", "logging.report_to=none"]) != 0
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.startswith("branchdiff: error")]
    assert len(lines) == 1 and "judge crashed with a second line" in lines[0] and "Traceback" not in error, error


def test_overlap_with_explore_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"'reward_overlap' scores parts of a plain rollout .*explore.mode=seeds .*use reward_overlap=false"):
        load_config("tiny-chain", ["reward_overlap=true", "explore.mode=seeds"])


def test_the_benchmark_runs_and_its_rewards_are_identical_at_a_tiny_size(tmp_path):
    from branchdiff.bench.overlap import bench_overlap

    result = bench_overlap(tmp_path / "overlap.json", iterations=1, overrides=["prompts.per_iteration=2", "sampling.num_steps=3"])
    assert result["rewards_identical"] and result["images"] == 8 and (tmp_path / "overlap.json").is_file()
    assert set(result["table"]) == {"sequential", "overlapped"} and result["ratio"] > 0


def test_the_replicas_benchmark_runs_and_its_rewards_are_identical_at_a_tiny_size(tmp_path):
    from branchdiff.bench.overlap import bench_replicas

    result = bench_replicas(tmp_path / "replicas.json", 2, iterations=1, overrides=["prompts.per_iteration=2", "sampling.num_steps=3"])
    assert result["rewards_identical"] and result["images"] == 8 and result["replicas"] == 2 and (tmp_path / "replicas.json").is_file()
    assert set(result["table"]) == {"1 replica", "2 replicas"} and result["ratio"] > 0


def test_the_benchmarks_own_servers_are_waited_on_and_what_became_of_them_is_said():
    """`bench overlap --replicas 2` on a loaded machine gave up after about 2 minutes of retries with "is `branchdiff serve-reward`
    running there?" — about servers the user never started. It waits on the processes it started: one that ends is named
    with its exit status at once, one that runs without answering is named once its time is up."""
    import multiprocessing
    import sys

    from branchdiff.bench.overlap import wait_until_serving
    from branchdiff.errors import UserError

    context = multiprocessing.get_context("spawn")
    ended, silent = context.Process(target=sys.exit, args=(3,)), context.Process(target=time.sleep, args=(30,), daemon=True)
    for process in (ended, silent):
        process.start()
    ended.join()
    with pytest.raises(UserError, match=r"^bench overlap: the reward server it started for http://127.0.0.1:7 ended \(exit status 3\) before "
                                        r"it answered; its output above says why"):
        wait_until_serving([silent, ended], ["http://127.0.0.1:9", "http://127.0.0.1:7"], 60)  # nothing listens on either port
    started = time.monotonic()
    with pytest.raises(UserError, match=r"^bench overlap: the reward server it started for http://127.0.0.1:9 is running but did not answer "
                                        r"within 2 s .*; run it again when the machine is less busy$"):
        wait_until_serving([silent], ["http://127.0.0.1:9"], 2)
    assert time.monotonic() - started < 20
    silent.kill()
    silent.join()
