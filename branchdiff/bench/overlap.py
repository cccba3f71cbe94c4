"""`branchdiff bench overlap`: a run whose reward is a server as slow as the rollout, its scoring sequential
(`reward_overlap: false`) and overlapped with the rollout (`reward_overlap: true`), side by side; with
`--replicas N`, a run whose reward is twice as slow as the rollout, served by one replica and by N
(`reward: {remote: [URL1, ..., URLN]}`, both overlapped), side by side (`bench_replicas`).

The server (its own process on the loopback, as a judge on another machine would be) serves the built-in
task's verifier behind a delay per image, so that scoring an iteration's images takes as long as the
iteration's rollout: the delay follows the median sequential rollout measured so far (the first,
untimed iteration sets it). The two modes train the same run from the same start, iteration by
iteration in turns (sequential k, then overlapped k, under the same delay), so that a slower or faster
spell of the machine falls on both; the table gives the median seconds per iteration and per phase, the
median of the iterations' ratios sequential ÷ overlapped with its range, and whether every leaf reward
of every iteration is the same bit for bit (the rollouts are `sampling.exact`, so the parts' trees equal
the whole's; branchdiff/training/overlap.py).
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from branchdiff.bench.tables import write_json
from branchdiff.errors import UserError
from branchdiff.rewards.remote import RemoteReward, RemoteRewardError
from branchdiff.rewards.server import serve
from branchdiff.rewards.tiny_geneval import TinyGenEval

# The MixGRPO-like chain of the tiny task: 16 prompts of 4 chains, SDE and training on 1 of 10 steps, so the
# update is short beside the rollout (a window of 1–4 steps of 16–25 in MixGRPO's runs). One prompt a part.
BASE = ["prompts.per_iteration=16", "tree.roots=4", "tree.mix_window=1", "sampling.max_batch=4", "sampling.exact=true",
        "train.optimizer_every=64", "final_eval=false", "eval_every=0", "logging.report_to=none", "logging.sample_every=0",
        "logging.checkpoint_every=1000"]
PHASES = ("seconds", "rollout_seconds", "decode_seconds", "reward_seconds", "train_seconds")


class Delayed:
    """The built-in verifier answering after `seconds_per_image` (shared with the bench, which sets it) per image:
    a judge of a set latency."""

    name = "tiny-geneval (delayed)"
    scale = TinyGenEval.scale
    higher_is_better = True
    device = torch.device("cpu")

    def __init__(self, seconds_per_image) -> None:  # a multiprocessing Value of doubles
        self.seconds_per_image, self.inner = seconds_per_image, TinyGenEval()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        time.sleep(self.seconds_per_image.value * len(prompts))
        return self.inner(images, prompts, metadata)


def _serve_delayed(port: int, seconds_per_image) -> None:
    serve(Delayed(seconds_per_image), port=port, log_level="warning")


SERVER_START_SECONDS = 600.0  # how long the bench waits for the servers it started (each imports torch and the verifier: minutes on a loaded machine)


@contextmanager
def _delayed_servers(context, ports: list[int], seconds_per_image) -> Iterator[list[str]]:
    """The delayed verifier served on each of `ports`, each in a process of its own, until the block ends; yields their URLs
    once every one answers."""
    servers = [context.Process(target=_serve_delayed, args=(port, seconds_per_image), daemon=True) for port in ports]
    for server in servers:
        server.start()
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        wait_until_serving(servers, urls, SERVER_START_SECONDS)
        yield urls
    finally:
        for server in servers:
            server.terminate()
            server.join()


def wait_until_serving(servers: list, urls: list[str], timeout: float) -> None:
    """Wait until each of the reward servers this bench started (`servers[i]`, a process, serving `urls[i]`) answers /health.
    One line, naming the server, when one's process ends first or none answers within `timeout` seconds: these servers are
    the bench's own, so the line says what became of them (not to start one)."""
    deadline = time.monotonic() + timeout
    waiting = dict(zip(urls, servers))
    while waiting:
        for url, server in list(waiting.items()):
            if not server.is_alive():
                raise UserError(f"bench overlap: the reward server it started for {url} ended (exit status {server.exitcode}) before it "
                                "answered; its output above says why (a port taken by another program, a failed import)")
            try:
                RemoteReward(url, retries=0, timeout=5.0)  # asks /health once
            except RemoteRewardError:
                continue
            del waiting[url]
        if waiting and time.monotonic() > deadline:
            raise UserError(f"bench overlap: the reward server it started for {next(iter(waiting))} is running but did not answer within "
                            f"{timeout:.0f} s (each starts by importing torch and the verifier, slow on a loaded machine); run it again "
                            "when the machine is less busy")
        if waiting:
            time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _trainer(url: str | list[str], overlap: bool, iterations: int, output: Path, overrides: list[str]):
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    remote = f"'{url}'" if isinstance(url, str) else "[" + ", ".join(f"'{u}'" for u in url) + "]"
    return Trainer(load_config("tiny-chain-window", [*BASE, f"output_dir={output}", f"iterations={iterations}", f"reward={{remote: {remote}}}",
                                                     f"reward_overlap={str(overlap).lower()}", *overrides]))


def _iteration(trainer, iteration: int) -> dict:
    """Seconds, phases and leaf rewards of one iteration."""
    start = time.perf_counter()
    result = trainer.run_iteration(iteration)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, **{k: result.metrics[k] for k in PHASES[1:]},
            "leaf_rewards": result.node_rewards[result.rollout.tree.leaf_index].tolist()}


def bench_overlap(json_path: Path | None, iterations: int = 9, overrides: list[str] | None = None) -> dict:
    """The side-by-side measurement of the module doc; returns the table and the ratio."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from a second thread; the scoring worker and the server then have a core
    try:
        return _bench(json_path, iterations, list(overrides or []))
    finally:
        torch.set_num_threads(threads)


def _bench(json_path: Path | None, iterations: int, overrides: list[str]) -> dict:
    context = multiprocessing.get_context("spawn")
    seconds_per_image = context.Value("d", 0.0)
    modes = ("sequential", "overlapped")
    with _delayed_servers(context, [_free_port()], seconds_per_image) as (url,), tempfile.TemporaryDirectory() as folder:
        trainers = {mode: _trainer(url, mode == "overlapped", iterations + 1, Path(folder) / mode, overrides) for mode in modes}
        runs = _in_turns(trainers, iterations, seconds_per_image, 1.0)  # scoring an iteration takes a rollout's time
    heading = (f"reward overlap: a reward server as slow as the rollout (last {seconds_per_image.value * 1000:.1f} ms an image, {{images}} "
               f"images an iteration); median of {iterations} iterations a mode, run in turns")
    result = _summarise(runs, "scoring", heading, "sequential ÷ overlapped, seconds per iteration: {ratio}")
    result.update(seconds_per_image=seconds_per_image.value, iterations=iterations)
    if json_path:
        write_json(json_path, result)
    return result


def _in_turns(trainers: dict, iterations: int, seconds_per_image, slowness: float) -> dict[str, list[dict]]:
    """Iterations 0..`iterations` of each trainer, in turns (the first a warm-up that sets the delay), so that a slower or
    faster spell of the machine falls on every mode; after each turn the server's delay an image (a multiprocessing
    Value) is set so that scoring an iteration takes `slowness` × the first mode's median rollout so far."""
    runs: dict[str, list[dict]] = {mode: [] for mode in trainers}
    first = runs[next(iter(trainers))]
    rollouts = []
    for iteration in range(iterations + 1):
        for mode, trainer in trainers.items():
            runs[mode].append(_iteration(trainer, iteration))
        rollouts.append(first[-1]["rollout_seconds"])
        seconds_per_image.value = slowness * statistics.median(rollouts) / len(first[-1]["leaf_rewards"])
    return runs


def _summarise(runs: dict[str, list[dict]], what: str, heading: str, verdict: str) -> dict:
    """Two modes' runs (the first iteration a warm-up) as the printed table and the result: the median seconds per
    iteration and per phase of each mode, the iterations' ratios first mode ÷ second and their median, and whether every
    leaf reward of every iteration is the same bit for bit. `heading` may hold {images}; `verdict` holds {ratio}."""
    first, second = runs.values()
    identical = all(a["leaf_rewards"] == b["leaf_rewards"] for a, b in zip(first, second))
    table = {mode: {key: statistics.median(row[key] for row in rows[1:]) for key in PHASES} for mode, rows in runs.items()}
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(first[1:], second[1:])]
    ratio = statistics.median(ratios)
    images = len(first[-1]["leaf_rewards"])
    print(heading.format(images=images))
    print(f"{what:<12}{'iteration s':>13}{'rollout s':>11}{'decode s':>10}{'reward wait s':>15}{'train s':>9}")
    for mode, row in table.items():
        print(f"{mode:<12}{row['seconds']:>13.2f}{row['rollout_seconds']:>11.2f}{row['decode_seconds']:>10.3f}{row['reward_seconds']:>15.2f}"
              f"{row['train_seconds']:>9.2f}")
    spread = f"{ratio:.2f} (median of {len(ratios)}; {min(ratios):.2f}–{max(ratios):.2f})"
    print(f"{verdict.format(ratio=spread)}; leaf rewards identical bit for bit: {identical}")
    return {"table": table, "ratio": ratio, "ratios": ratios, "rewards_identical": identical, "images": images}

def bench_replicas(json_path: Path | None, replicas: int, iterations: int = 9, overrides: list[str] | None = None, slowness: float = 2.0) -> dict:
    """One replica against `replicas` of a reward server `slowness` times as slow as the rollout, both overlapped: each
    replica its own process serving the delayed verifier (one scoring worker each, as one GPU's server), the delay set
    after each iteration so that scoring an iteration's images on one replica takes `slowness` × the median rollout.
    The two runs train from the same start in turns, as `bench_overlap`'s modes; the ratio is one replica's seconds per
    iteration ÷ N replicas' (target ≥ 1.6 at N = 2), and the leaf rewards must be the same bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    context = multiprocessing.get_context("spawn")
    seconds_per_image = context.Value("d", 0.0)
    modes = {"1 replica": "one", f"{replicas} replicas": "all"}
    try:
        with _delayed_servers(context, [_free_port() for _ in range(replicas)], seconds_per_image) as urls, \
                tempfile.TemporaryDirectory() as folder:
            trainers = {mode: _trainer(urls[0] if which == "one" else urls, True, iterations + 1, Path(folder) / which, list(overrides or []))
                        for mode, which in modes.items()}
            runs = _in_turns(trainers, iterations, seconds_per_image, slowness)
    finally:
        torch.set_num_threads(threads)
    heading = (f"reward replicas: a reward server {slowness:g}× as slow as the rollout on one replica (last {seconds_per_image.value * 1000:.1f} "
               f"ms an image, {{images}} images an iteration), scoring overlapped; median of {iterations} iterations a mode, run in turns")
    result = _summarise(runs, "reward", heading, f"1 replica ÷ {replicas} replicas, seconds per iteration: {{ratio}} (target ≥ 1.6 at 2)")
    result.update(seconds_per_image=seconds_per_image.value, iterations=iterations, replicas=replicas, slowness=slowness)
    if json_path:
        write_json(json_path, result)
    return result
