"""Scoring that overlaps the rollout (`reward_overlap: true`; docs/rewards.md): the iteration's prompts
are grown in parts, and while part k + 1 rolls out, part k's leaves, decoded, are scored in a worker
thread. A slow reward (a judge on another machine, a reward server) then costs an iteration

    max(rollout, reward) + one part's reward    instead of    rollout + reward,

so with n parts and a reward as slow as the rollout, 2n / (n + 1) times less (1.6× at 4 parts, 1.8×
at 8). A reward served by several replicas (docs/reward-server.md) scores as many parts at once as it has replicas
answering. A part holds as many whole prompts as fill the sampler's `max_batch` with their leaves (at
least one), so the leaf level keeps full forwards; every group lies inside one part, so a group
reward and the combiners see the groups they see in one call.

The rewards are those of scoring the same images in one call: the parts' rewards are put back in leaf order
(whatever order they finish in), and a reward of one image does not depend on the others of its call. The rollout is
the whole one bit for bit under `sampling.exact` (each node's noise comes from its address, and exact
forwards do not depend on the batch), and so are the images where decoding does not depend on its batch
(a VAE's narrower last chunk may change a GPU decode in the last bits); without `exact` a narrower part
may differ in the last bits, as any change of `max_batch` does. A reward that fails in the worker stops the iteration
with its own one-line error as soon as the rollout loop sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext

import torch

from branchdiff.core.engine import NoiseAddress, SamplerSettings
from branchdiff.core.rollout import Rollout, empty_rollout, grow_prompts
from branchdiff.core.tree import Tree
from branchdiff.models.base import ModelAdapter, PromptEmbeds
from branchdiff.rewards.multi import RewardBatch, join_batches
from branchdiff.runtime.threads import DaemonPool
from branchdiff.schedulers.schedule import Schedule

ScorePart = Callable[[torch.Tensor, torch.Tensor], RewardBatch]  # (images (L_k, 3, H, W), their leaf rows (L_k,)) → the part's rewards


def overlap_parts(num_prompts: int, leaves_per_prompt: int, max_batch: int) -> list[list[int]]:
    """Consecutive prompts in parts of max(1, ⌊max_batch / leaves per prompt⌋)."""
    size = max(1, max_batch // max(1, leaves_per_prompt))
    return [list(range(start, min(start + size, num_prompts))) for start in range(0, num_prompts, size)]


def _score_without_grad(score: ScorePart, images: torch.Tensor, rows: torch.Tensor) -> tuple[RewardBatch, tuple[float, float]]:
    """The part's rewards and when its scoring started and ended (`time.perf_counter`)."""
    start = time.perf_counter()
    with torch.no_grad():  # grad mode is per thread: set it in the worker
        batch = score(images, rows)
    return batch, (start, time.perf_counter())


def covered_before(spans: list[tuple[float, float]], end: float) -> float:
    """Seconds of the union of the intervals `spans` that lie before `end` (parts scored at once counted once)."""
    covered, reached = 0.0, -float("inf")
    for start, stop in sorted(spans):
        start, stop = max(start, reached), min(stop, end)
        if stop > start:
            covered += stop - start
        reached = max(reached, min(stop, end))
    return covered


def _raise_first_failure(pending: list[Future]) -> None:
    for future in pending:
        if future.done() and future.exception() is not None:
            future.result()


def grow_and_score(adapter: ModelAdapter, tree: Tree, embeds: PromptEmbeds, schedule: Schedule, settings: SamplerSettings,
                   address: NoiseAddress, parts: list[list[int]], score: ScorePart,
                   autocast: Callable[[], AbstractContextManager] = nullcontext,
                   parallel_calls: int = 1) -> tuple[Rollout, torch.Tensor, RewardBatch, dict[str, float]]:
    """The rollout of `tree`, its leaf images (L, 3, H, W) in leaf order and their rewards, grown part by
    part (`parts`: prompt indices, grown under `autocast`, decoded outside it as a whole rollout is) with each
    part scored by `score` in a worker while the next grows (`parallel_calls` parts at once: a reward served by replicas);
    and the seconds spent: `rollout_seconds` (growing), `decode_seconds`, `reward_seconds` (waiting for the
    scores after the last part grew) and `reward_overlapped_seconds` (scoring hidden behind the rollout)."""
    rollout = empty_rollout(adapter, tree, schedule)
    leaf_prompts = tree.prompt[tree.leaf_index]  # (L,)
    seconds = {"rollout_seconds": 0.0, "decode_seconds": 0.0}
    images, rows, pending = [], [], []
    worker = DaemonPool(parallel_calls, "branchdiff-reward")  # a daemon: an aborted run does not wait for a stalled judge's answer
    try:
        for part in parts:
            start = time.perf_counter()
            with autocast():
                grow_prompts(rollout, adapter, embeds, settings, address, part)
            decoded = time.perf_counter()
            seconds["rollout_seconds"] += decoded - start
            part_rows = torch.isin(leaf_prompts, torch.tensor(part)).nonzero().flatten()  # (L_k,) this part's leaves
            images.append(adapter.decode(rollout.latents[tree.leaf_index[part_rows]]))
            rows.append(part_rows)
            seconds["decode_seconds"] += time.perf_counter() - decoded
            pending.append(worker.submit(_score_without_grad, score, images[-1], part_rows))
            _raise_first_failure(pending)
        waiting = time.perf_counter()
        scored = [future.result() for future in pending]  # in order; the first failure is raised
    finally:
        worker.shutdown()  # never waits: a stop or failure does not wait for a slow judge's answer
    seconds["reward_seconds"] = time.perf_counter() - waiting
    seconds["reward_overlapped_seconds"] = covered_before([span for _, span in scored], waiting)  # scoring hidden behind the rollout
    order = torch.argsort(torch.cat(rows))  # leaf order, whatever the parts' order
    return rollout, torch.cat(images)[order], join_batches([batch for batch, _ in scored], order), seconds
