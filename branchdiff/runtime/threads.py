"""Worker threads that never keep the process alive: a run aborted by a second Ctrl-C, or stopped by an error,
exits at once even while a worker waits on a judge or a reward server that does not answer.

`concurrent.futures.ThreadPoolExecutor` joins its workers when the interpreter exits (and on leaving its `with`
block), so a worker blocked in a request held the process for the request's whole timeout and retries. `DaemonPool`
has the same `submit` and an ordered `map`, with daemon workers, and it never waits for them: leaving it (by
`shutdown` or its `with` block, normally or by an exception) cancels what has not started and returns.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonPool:
    """Up to `workers` daemon threads running submitted calls in submission order (threads start as calls arrive)."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, got {workers}")
        self.workers, self.name = workers, name
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()  # (future, call, arguments), or None: a worker stops
        self.threads: list[threading.Thread] = []
        self.pending: list[Future] = []

    def submit(self, call: Callable[..., T], *arguments: Any) -> Future:
        future: Future = Future()
        self.pending = [f for f in self.pending if not f.done()]
        self.pending.append(future)
        self.tasks.put((future, call, arguments))
        if len(self.threads) < min(self.workers, len(self.pending)):
            thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self.threads)}", daemon=True)
            thread.start()
            self.threads.append(thread)
        return future

    def map(self, call: Callable[..., T], *iterables: Iterable) -> list[T]:
        """`[call(*arguments) for arguments in zip(*iterables)]`, run on the workers; the first failure (in order) is raised
        and the calls not yet started are cancelled."""
        futures = [self.submit(call, *arguments) for arguments in zip(*iterables)]
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()

    def shutdown(self) -> None:
        """Cancel the calls not started and let each worker end after its current one, without waiting for it."""
        for future in self.pending:
            future.cancel()
        for _ in self.threads:
            self.tasks.put(None)

    def __enter__(self) -> DaemonPool:
        return self

    def __exit__(self, *exception: object) -> None:
        self.shutdown()

    def _work(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                return
            future, call, arguments = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call(*arguments)
            except BaseException as error:  # handed to the caller, whatever it is
                future.set_exception(error)
            else:
                future.set_result(result)
