"""Ctrl-C pressed twice ends the process at once.

`abort_now` leaves without unwinding: no exception that a weakref callback or a compiler's cleanup could
swallow ("Exception ignored in ..."), no interpreter teardown (whose final garbage collection of a loaded
model and its caches took seconds to over a minute on a loaded machine). What is already published stays
as it is: checkpoints and run files are written under a temporary name and renamed (`storage`), so none is
ever half-written, and metrics.jsonl is appended a whole line at a time.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

ABORT_STATUS = 130  # a process ended by Ctrl-C (128 + SIGINT)


def abort_now(line: str) -> None:
    """Print `branchdiff: line` on stderr, flush, and end the process with status 130."""
    print(f"\nbranchdiff: {line}", file=sys.stderr)
    exit_now(ABORT_STATUS)


def exit_now(status: int) -> None:
    """Flush stdout and stderr and end the process with `status`, without unwinding or the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(status)


def abort_on_next_interrupt(line: str) -> None:
    """From now on, a SIGINT ends the process at once with `line` (a command that is already stopping: its
    clean-up and the interpreter's teardown are not waited for)."""
    signal.signal(signal.SIGINT, lambda signum, frame: abort_now(line))


def abort_after_the_first_interrupt(line: str) -> Callable[[], None]:
    """From now on, the first SIGINT raises KeyboardInterrupt (the command stops and cleans up) and arms `abort_on_next_interrupt`:
    a second one, pressed while that clean-up waits (a thread joined, a server stopped), ends the process at once. Returns a
    function putting the previous handler back (a command that ended without an interrupt). Outside the main thread: nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)

    def first(signum: int, frame: object) -> None:
        abort_on_next_interrupt(line)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first)

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)

    return restore
