"""A reward served by several replicas of one reward server: `reward: {remote: [URL1, URL2, ...]}` (docs/reward-server.md).

A reward model slower than the rollout makes the rollout wait; N servers of the same reward (one per GPU) score a
batch N times as fast. `ReplicaReward` holds a `RemoteReward` client for each URL and splits each call's images into
the chunks one server would get (`chunk_size`), which its replicas' workers take from one queue in order, at most
`in_flight` requests in flight to each replica. The scores are put back in order, so they equal one server's bit for
bit (each chunk is scored alone, by the same reward). A group reward's server gets each group whole, one request a
group (`score_group`), on the next live replica.

A replica that does not answer (unreachable, a stall past its `timeout` and `retries`, a dropped connection, a busy
answer that outlasts its retries) is left out with a one-line notice on stderr and its chunk goes back to the queue
for the others; a replica found down when the client is built is left out the same way. The call stops, in one line
naming every replica's failure, only when every replica is down. An answer that says the reward itself failed (a 4xx,
a 500: the same on every replica) stops the call at once, as one server's would. The replicas must serve the same
reward: their `/health` must agree on its name, scale, direction, whether it scores videos and whether it scores
groups.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from branchdiff.errors import one_line
from branchdiff.rewards.remote import RemoteReward, RemoteRewardError

AGREED = ("name", "scale", "higher_is_better", "video", "group")  # what every replica's /health must say alike


class ReplicaReward:
    """The reward `urls` serve, scored by all of them (module doc). `in_flight`: requests at once to each replica;
    the other keyword arguments go to each replica's `RemoteReward` (timeout, retries, backoff, image_format,
    chunk_size, token_file)."""

    device = torch.device("cpu")

    def __init__(self, urls: list[str] | tuple[str, ...], in_flight: int = 2, **client: Any) -> None:
        if not isinstance(urls, (list, tuple)) or len(urls) < 1 or len(set(urls)) != len(urls):
            raise ValueError(f"remote reward replicas {urls!r}: give a list of distinct server URLs")
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"remote reward in_flight={in_flight!r} must be an integer ≥ 1 (requests at once to each replica)")
        self.urls, self.in_flight = list(urls), in_flight
        self.clients: list[RemoteReward] = []
        self.down: dict[str, str] = {}  # url: why it was left out
        self._lock = threading.Lock()
        self._turn = 0  # the replica the next call starts at
        for url in self.urls:
            try:
                self.clients.append(RemoteReward(url, **client))
            except RemoteRewardError as error:
                if not error.transport:
                    raise
                self._leave_out(url, str(error))
        if not self.clients:
            raise RemoteRewardError(self._all_down())
        first = self.clients[0]
        for other in self.clients[1:]:
            differ = [key for key in AGREED if first.health.get(key) != other.health.get(key)]
            if differ:
                pairs = ", ".join(f"{key}: {first.health.get(key)!r} and {other.health.get(key)!r}" for key in differ)
                raise ValueError(f"reward replicas {first.url} and {other.url} serve different rewards ({pairs}); give replicas of one reward")
        self.name, self.scale, self.higher_is_better, self.video = first.name, first.scale, first.higher_is_better, first.video
        self.chunk_size = first.chunk_size
        if first.health.get("group", False):
            self.score_group = self._score_group

    def _leave_out(self, url: str, why: str) -> None:
        with self._lock:
            if url in self.down:
                return
            self.down[url] = why
        print(f"branchdiff: reward replica {url} left out, the others score its share: {one_line(why, 300)}", file=sys.stderr)

    def _all_down(self) -> str:
        reasons = "; ".join(f"{url}: {one_line(why, 160)}" for url, why in self.down.items())
        return f"every reward replica is down ({len(self.down)} of {len(self.urls)}): {reasons}"

    def _run(self, tasks: list[Callable[[RemoteReward], torch.Tensor]]) -> list[torch.Tensor]:
        """Each task's result on some live replica, in the tasks' order (module doc)."""
        if not tasks:
            return []
        results: list[torch.Tensor | None] = [None] * len(tasks)
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for index in range(len(tasks)):
            todo.put(index)
        remaining = [len(tasks)]
        failure: list[BaseException] = []
        finished = threading.Event()

        def work(client: RemoteReward) -> None:
            while not finished.is_set() and client.url not in self.down:
                try:
                    index = todo.get(timeout=0.05)
                except queue.Empty:
                    continue
                try:
                    results[index] = tasks[index](client)
                except RemoteRewardError as error:
                    if not error.transport:
                        failure.append(error)
                        finished.set()
                        return
                    self._leave_out(client.url, str(error))
                    todo.put(index)  # another replica scores it
                    if all(c.url in self.down for c in self.clients):
                        failure.append(RemoteRewardError(self._all_down()))
                        finished.set()
                    return
                except BaseException as error:  # a malformed reply, or an error of this process: the call's own
                    failure.append(error)
                    finished.set()
                    return
                with self._lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        finished.set()

        live = [c for c in self.clients if c.url not in self.down]
        if not live:
            raise RemoteRewardError(self._all_down())
        with self._lock:  # each call starts at the next replica, so small calls (overlapped scoring's) are spread too
            turn, self._turn = self._turn % len(live), self._turn + 1
        live = live[turn:] + live[:turn]
        threads = [threading.Thread(target=work, args=(client,), name=f"replica-{client.url}", daemon=True) for _ in range(self.in_flight)
                   for client in live]
        for thread in threads:
            thread.start()
        finished.wait()
        if failure:
            raise failure[0]
        return [r for r in results if r is not None]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Scores (B,) float32 of images (B, 3, H, W) or videos (B, F, 3, H, W), as one replica's `__call__` gives them."""
        metadata = metadata or [{} for _ in prompts]
        spans = [(start, min(start + self.chunk_size, len(prompts))) for start in range(0, len(prompts), self.chunk_size)]
        tasks = [lambda client, a=a, b=b: client(images[a:b], prompts[a:b], metadata[a:b]) for a, b in spans]
        return torch.cat(self._run(tasks)) if tasks else torch.zeros(0)

    def _score_group(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        return self._run([lambda client: client.score_group(images, prompts, metadata)])[0]
