"""`branchdiff bench overlap`: a run whose reward is a server as slow as the rollout, its scoring sequential
(`reward_overlap: false`) and overlapped with the rollout (`reward_overlap: true`), side by side.

The server (its own process on the loopback, as a judge on another machine would be) serves the built-in
task's verifier behind a fixed delay per image; the delay is set so that scoring an iteration's images
takes as long as the iteration's rollout, measured first with the verifier in process. Each mode then trains the same run from the same start for the
same iterations; the table gives the median seconds per iteration and per phase, the ratio sequential
÷ overlapped, and whether every leaf reward of every iteration is the same bit for bit (the rollouts are
`sampling.exact`, so the parts' trees equal the whole's; branchdiff/training/overlap.py).
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from branchdiff.rewards.remote import RemoteReward
from branchdiff.rewards.server import serve
from branchdiff.rewards.tiny_geneval import TinyGenEval

# The MixGRPO-like chain of the tiny task: 16 prompts of 4 chains, SDE and training on 1 of 10 steps, so the
# update is short beside the rollout (a window of 1–4 steps of 16–25 in MixGRPO's runs). One prompt a part.
BASE = ["prompts.per_iteration=16", "tree.roots=4", "tree.mix_window=1", "sampling.max_batch=4", "sampling.exact=true",
        "train.optimizer_every=64", "final_eval=false", "eval_every=0", "logging.report_to=none", "logging.sample_every=0",
        "logging.checkpoint_every=1000"]


class Delayed:
    """The built-in verifier answering after `seconds_per_image` per image: a judge of a set latency."""

    name = "tiny-geneval (delayed)"
    scale = TinyGenEval.scale
    higher_is_better = True
    device = torch.device("cpu")

    def __init__(self, seconds_per_image: float) -> None:
        self.seconds_per_image, self.inner = seconds_per_image, TinyGenEval()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        time.sleep(self.seconds_per_image * len(prompts))
        return self.inner(images, prompts, metadata)


def _serve_delayed(port: int, seconds_per_image: float) -> None:
    serve(Delayed(seconds_per_image), port=port, log_level="warning")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _train(reward: str, overlap: bool, iterations: int, output: Path, overrides: list[str]) -> list[dict]:
    """Seconds, phases and leaf rewards of each iteration of one run scored by `reward` (a config value)."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    config = load_config("tiny-chain-window", [*BASE, f"output_dir={output}", f"iterations={iterations}", f"reward={reward}",
                                               f"reward_overlap={str(overlap).lower()}", *overrides])
    trainer = Trainer(config)
    rows = []
    for iteration in range(iterations):
        start = time.perf_counter()
        result = trainer.run_iteration(iteration)
        seconds = time.perf_counter() - start
        tree = result.rollout.tree
        rows.append({"seconds": seconds, **{k: result.metrics[k] for k in ("rollout_seconds", "decode_seconds", "reward_seconds", "train_seconds")},
                     "leaf_rewards": result.node_rewards[tree.leaf_index].tolist()})
    return rows


def bench_overlap(json_path: Path | None, iterations: int = 3, overrides: list[str] | None = None) -> dict:
    """The side-by-side measurement of the module doc; returns the table and the ratio."""
    overrides = list(overrides or [])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from a second thread; the scoring worker and the server then have a core
    try:
        return _bench(json_path, iterations, overrides)
    finally:
        torch.set_num_threads(threads)


def _bench(json_path: Path | None, iterations: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        calibration = _train("tiny-geneval", False, 2, Path(folder) / "calibration", overrides)[-1]  # the second: warmed up
        images = len(calibration["leaf_rewards"])
        seconds_per_image = calibration["rollout_seconds"] / images  # scoring an iteration takes a rollout's time
        port = _free_port()
        server = multiprocessing.get_context("spawn").Process(target=_serve_delayed, args=(port, seconds_per_image), daemon=True)
        server.start()
        try:
            url = f"http://127.0.0.1:{port}"
            RemoteReward(url, retries=8, backoff=0.5)  # waits until it answers /health
            runs = {mode: _train(f"{{remote: '{url}'}}", mode == "overlapped", iterations, Path(folder) / mode, overrides)
                    for mode in ("sequential", "overlapped")}
        finally:
            server.terminate()
            server.join()
    table = {mode: {key: statistics.median(row[key] for row in rows) for key in ("seconds", "rollout_seconds", "decode_seconds", "reward_seconds",
                                                                              "train_seconds")} for mode, rows in runs.items()}
    identical = all(a["leaf_rewards"] == b["leaf_rewards"] for a, b in zip(runs["sequential"], runs["overlapped"]))
    ratio = table["sequential"]["seconds"] / table["overlapped"]["seconds"]
    print(f"reward overlap: a reward server as slow as the rollout ({seconds_per_image * 1000:.1f} ms an image, {images} images an iteration, "
          f"calibrated rollout {calibration['rollout_seconds']:.2f} s); median of {iterations} iterations")
    print(f"{'scoring':<12}{'iteration s':>13}{'rollout s':>11}{'decode s':>10}{'reward wait s':>15}{'train s':>9}")
    for mode, row in table.items():
        print(f"{mode:<12}{row['seconds']:>13.2f}{row['rollout_seconds']:>11.2f}{row['decode_seconds']:>10.3f}{row['reward_seconds']:>15.2f}"
              f"{row['train_seconds']:>9.2f}")
    print(f"sequential ÷ overlapped, seconds per iteration: {ratio:.2f}; leaf rewards identical bit for bit: {identical}")
    result = {"table": table, "ratio": ratio, "rewards_identical": identical, "seconds_per_image": seconds_per_image, "images": images,
              "iterations": iterations}
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    return result
