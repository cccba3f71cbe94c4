"""A reward served by several replicas of one reward server: `reward: {remote: [URL1, URL2, ...]}` (docs/reward-server.md).

A reward model slower than the rollout makes the rollout wait; N servers of the same reward (one per GPU) score a
batch N times as fast. `ReplicaReward` holds a `RemoteReward` client for each URL and `in_flight` worker threads for
each, which take requests from one queue shared by every call, a request going to the least busy replica: at most
`in_flight` requests are in flight to a replica at any time, however many calls (overlapped scoring's parts,
`concurrency` of them at once) are waiting. A call's
images go in the chunks one server would get (`chunk_size`) and its scores are put back in order, so they equal one
server's bit for bit (each chunk is scored alone, by the same reward). A group reward's server gets each group whole,
one request a group (`score_group`).

A replica that does not answer (unreachable, a stall past its `timeout` and `retries`, a dropped connection, a busy
answer that outlasts its retries) is left out with a one-line notice on stderr and its request goes back to the queue
for the others; a replica found down when the client is built is left out the same way. A call stops, in one line
naming every replica's failure, only when every replica is down. An answer that says the reward itself failed (a 4xx,
a 500: the same on every replica) fails its call at once, as one server's would. The replicas must serve the same
reward: their `/health` must agree on its name, scale, direction, whether it scores videos and whether it scores
groups.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from tqdm.auto import tqdm

from branchdiff.errors import one_line
from branchdiff.rewards.remote import RemoteReward, RemoteRewardError, one_server_twice

AGREED = ("name", "scale", "higher_is_better", "video", "group")  # what every replica's /health must say alike


class ReplicaReward:
    """The reward `urls` serve, scored by all of them (module doc). `in_flight`: requests at once to each replica;
    the other keyword arguments go to each replica's `RemoteReward` (timeout, retries, backoff, image_format,
    chunk_size, token_file)."""

    device = torch.device("cpu")

    def __init__(self, urls: list[str] | tuple[str, ...], in_flight: int = 2, **client: Any) -> None:
        given = urls
        urls = [url.rstrip("/") if isinstance(url, str) else url for url in urls] if isinstance(urls, (list, tuple)) else []
        if len(urls) < 1 or len(set(urls)) != len(urls):
            raise ValueError(f"remote reward replicas {given!r}: give a list of distinct server URLs")
        twice = one_server_twice(urls) if all(isinstance(url, str) for url in urls) else None
        if twice:
            raise ValueError(f"remote reward replicas: {twice[0]} and {twice[1]} are one server (their hosts resolve to the same address); "
                             "list each replica once")
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"remote reward in_flight={in_flight!r} must be an integer ≥ 1 (requests at once to each replica)")
        self.urls, self.in_flight = list(urls), in_flight
        self.clients: list[RemoteReward] = []
        self.down: dict[str, str] = {}  # url: why it was left out
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a request queued or finished, or a replica left out
        self._requests: deque[tuple[Callable[[RemoteReward], torch.Tensor], Future]] = deque()  # shared by every call
        self._busy = dict.fromkeys(self.urls, 0)  # requests now in flight to each replica
        self._workers: list[threading.Thread] = []
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
        with self._changed:
            if url in self.down:
                return
            self.down[url] = why
            self._changed.notify_all()
        # on a line of its own above a training run's progress bar
        tqdm.write(f"branchdiff: reward replica {url} left out, the others score its share: {one_line(why, 300)}", file=sys.stderr)

    def _all_down(self) -> str:
        reasons = "; ".join(f"{url}: {one_line(why, 160)}" for url in self.urls if (why := self.down.get(url)) is not None)
        return f"every reward replica is down ({len(self.down)} of {len(self.urls)}): {reasons}"

    @property
    def parallel_calls(self) -> int:
        """Calls worth making at once: one per live replica (overlapped scoring scores as many parts at once, and a
        group reward as many groups)."""
        return max(1, len(self.urls) - len(self.down))

    def _start_workers(self) -> None:
        with self._lock:
            if self._workers:
                return
            for _ in range(self.in_flight):
                for client in self.clients:
                    if client.url not in self.down:
                        thread = threading.Thread(target=self._work, args=(client,), name=f"replica-{client.url}", daemon=True)
                        thread.start()
                        self._workers.append(thread)

    def _take(self, client: RemoteReward) -> tuple[Callable[[RemoteReward], torch.Tensor], Future] | None:
        """The next queued request for `client`'s replica, once it is among the least busy live replicas and below
        `in_flight` (so that two requests go to two idle replicas, not one); None once the replica is left out."""
        with self._changed:
            while True:
                if client.url in self.down:
                    return None
                least = min(self._busy[url] for url in self.urls if url not in self.down)
                if self._requests and self._busy[client.url] == least and least < self.in_flight:
                    self._busy[client.url] += 1
                    return self._requests.popleft()
                self._changed.wait()

    def _put(self, request: tuple[Callable[[RemoteReward], torch.Tensor], Future]) -> None:
        with self._changed:
            self._requests.append(request)
            self._changed.notify_all()

    def _work(self, client: RemoteReward) -> None:
        """Take requests from the shared queue while `client`'s replica answers (module doc); a worker that fails in
        itself leaves its replica out, so that no call waits on it."""
        try:
            self._serve(client)
        except BaseException as error:  # an error of this process outside a request (a request's own is settled in `_serve`)
            self._leave_out(client.url, f"its worker failed: {type(error).__name__}: {error}")
            self._fail_if_all_down()

    def _serve(self, client: RemoteReward) -> None:
        while (request := self._take(client)) is not None:
            task, future = request
            try:
                if not (future.running() or future.set_running_or_notify_cancel()):  # running: put back by a replica that went down
                    continue  # its call already ended
                future.set_result(task(client))
            except RemoteRewardError as error:
                if not error.transport:
                    future.set_exception(error)
                    continue
                self._leave_out(client.url, str(error))
                self._put(request)  # another replica scores it
            except BaseException as error:  # a malformed reply, or an error of this process: the call's own
                future.set_exception(error)
            finally:
                with self._changed:
                    self._busy[client.url] -= 1
                    self._changed.notify_all()
        self._fail_if_all_down()

    def _fail_if_all_down(self) -> None:
        """Once the last replica is left out, what is queued fails with the line naming every replica's failure."""
        if len(self.down) < len(self.urls):
            return
        with self._changed:
            left, self._requests = list(self._requests), deque()
        for _, future in left:
            if future.running() or future.set_running_or_notify_cancel():
                future.set_exception(RemoteRewardError(self._all_down()))

    def _run(self, tasks: list[Callable[[RemoteReward], torch.Tensor]]) -> list[torch.Tensor]:
        """Each task's result on some live replica, in the tasks' order (module doc)."""
        if len(self.down) == len(self.urls):
            raise RemoteRewardError(self._all_down())
        self._start_workers()
        futures: list[Future] = [Future() for _ in tasks]
        for task, future in zip(tasks, futures):
            self._put((task, future))
        try:
            results = []
            for future in futures:
                while True:
                    try:
                        results.append(future.result(timeout=0.5))
                        break
                    except FutureTimeout:
                        if len(self.down) == len(self.urls):  # the last one went down as this call queued its requests
                            raise RemoteRewardError(self._all_down()) from None
            return results
        finally:
            for future in futures:
                future.cancel()  # a failed call's requests not yet taken are skipped

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Scores (B,) float32 of images (B, 3, H, W) or videos (B, F, 3, H, W), as one replica's `__call__` gives them."""
        metadata = metadata or [{} for _ in prompts]
        spans = [(start, min(start + self.chunk_size, len(prompts))) for start in range(0, len(prompts), self.chunk_size)]
        tasks = [lambda client, a=a, b=b: client(images[a:b], prompts[a:b], metadata[a:b]) for a, b in spans]
        return torch.cat(self._run(tasks)) if tasks else torch.zeros(0)

    def _score_group(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        return self._run([lambda client: client.score_group(images, prompts, metadata)])[0]
