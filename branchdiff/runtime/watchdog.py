"""No hung jobs: with several processes, each one beats a heartbeat, and a process that stops
beating for `collective_timeout` seconds ends the job with one line naming it.

Every process runs a daemon thread that writes `RUN_DIR/.heartbeat/rank-R.json` (pid, parent pid,
host, what the process is doing, the time) every `period` seconds and reads the others'. A process
that is stopped (SIGSTOP, a debugger), frozen or gone without ending its run stops beating; when a
peer's heartbeat is older than the timeout, every live process prints the line
(`silent_rank_line`), kills the silent process when it is its sibling on this machine (a stopped
process runs no handler of its own), and exits with status 2. The last checkpoint stays intact:
checkpoints are published by renames only, so a job ended at any moment keeps the newest one.

The process group's own timeout (`backend_timeout`: a little longer than `collective_timeout`, so
that a frozen rank is named by the heartbeats first) is the second line of defence, for a rank that
beats but never arrives (a deadlock): a collective that waits past it raises in the waiting process
(gloo; NCCL's watchdog aborts it), and `explain` turns that into the same line, naming the ranks whose heartbeats are stale or whose last
activity differs from this process's. A rank on another machine whose folder is not shared never
shows a heartbeat here and is never called silent by the heartbeat check.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from branchdiff.errors import UserError, checkpoint_kept, one_line

FOLDER = ".heartbeat"


def backend_timeout(collective_timeout: float) -> float:
    """Seconds torch.distributed's collectives wait before they fail: the heartbeat threshold plus a
    margin of half of it (at least 10 s), so that the heartbeat watch, which can name the rank, fires first."""
    return collective_timeout + max(10.0, collective_timeout / 2)


class CollectiveTimeout(UserError):
    """A process stopped responding; the job ended."""


def _read(path: Path) -> dict | None:
    try:
        beat = json.loads(path.read_text())
        return beat if isinstance(beat, dict) and isinstance(beat.get("time"), (int, float)) else None
    except (OSError, ValueError):
        return None


class Heartbeat:
    """This process's heartbeat and its watch over the others' (module doc)."""

    def __init__(self, run_dir: Path, rank: int, world: int, timeout: float, newest_checkpoint: Callable[[], Path | None],
                 job: str) -> None:
        self.folder = run_dir / FOLDER
        self.job = job  # the same on every process of this launch: heartbeats left by an earlier launch are ignored
        self.rank, self.world, self.timeout = rank, world, timeout
        self.period = min(max(timeout / 10, 0.2), 10.0)
        self.newest_checkpoint = newest_checkpoint
        self.activity = "starting"
        self._writing = threading.Lock()  # the main thread (`doing`) and the watch both beat
        self._seen: dict[int, tuple[float, float]] = {}  # rank → (its last heartbeat's time, when it changed on this clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="branchdiff-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._beat("running")
        self._thread.start()
        return self

    def doing(self, activity: str) -> None:
        """What this process does now ("iteration 5"), beaten at once: the line names it when the process goes silent."""
        self.activity = activity
        self._beat("running")

    def stop(self) -> None:
        """This process ends its run normally: it no longer beats, and nobody waits for it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._beat("ended")

    def _beat(self, state: str) -> None:
        beat = {"job": self.job, "pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname(), "state": state,
                "activity": self.activity, "time": time.time()}
        tmp = self.folder / f".rank-{self.rank}.tmp"
        with self._writing:
            try:
                tmp.write_text(json.dumps(beat))
                os.replace(tmp, self.folder / f"rank-{self.rank}.json")
            except OSError:  # a full disk must not stop the watch; the writers report it
                pass

    def peers(self) -> dict[int, dict]:
        """The other ranks' last heartbeats of this launch that can be read from here."""
        beats = {r: _read(self.folder / f"rank-{r}.json") for r in range(self.world) if r != self.rank}
        return {r: beat for r, beat in beats.items() if beat is not None and beat.get("job") == self.job}

    def silent(self) -> dict[int, dict]:
        """Peers still running whose heartbeat has not changed for longer than the timeout, on this
        machine's clock (the peers' clocks are never compared with it); each with `quiet`, the seconds."""
        now = time.monotonic()
        quiet = {}
        for rank, beat in self.peers().items():
            seen = self._seen.get(rank)
            if seen is None or seen[0] != beat["time"]:
                self._seen[rank] = (beat["time"], now)
            elif beat.get("state") == "running" and now - seen[1] > self.timeout:
                quiet[rank] = {**beat, "quiet": now - seen[1]}
        return quiet

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._beat("running")
            silent = self.silent()
            if silent:
                tqdm.write(f"branchdiff: error: {self.line(silent)}", file=sys.stderr)  # clears a progress bar first
                sys.stderr.flush()
                self._end_siblings(silent)
                os._exit(2)

    def _end_siblings(self, silent: dict[int, dict]) -> None:
        """SIGKILL the silent processes that run on this machine under the same launcher."""
        for beat in silent.values():
            if beat.get("host") == socket.gethostname() and beat.get("ppid") == os.getppid() and isinstance(beat.get("pid"), int):
                try:
                    os.kill(beat["pid"], signal.SIGKILL)
                except OSError:
                    pass

    def line(self, silent: dict[int, dict]) -> str:
        """The one line: who is silent, for how long, doing what; the intact checkpoint; the fix."""
        who = "; ".join(f"rank {r} (pid {b.get('pid')} on {b.get('host')}, silent for {b.get('quiet', 0):.0f} s, last in {b.get('activity')})"
                        for r, b in sorted(silent.items()))
        return (f"process {who} stopped responding for more than collective_timeout = {self.timeout:g} s, so the job ends; "
                f"{checkpoint_kept(self.newest_checkpoint())}; "
                "find why it stalled (a stopped or frozen process, a hung device), then continue with --resume latest "
                "(raise collective_timeout= if it was only slow)")

    def explain(self, error: BaseException) -> CollectiveTimeout | None:
        """A collective's failure as the one line (`explain_failure`), naming the ranks on this machine whose process has
        ended (a rank killed or crashed: its connection dropped, so the collective failed at once), else the silent ranks,
        else the ranks last seen doing something else than this one. A rank on another machine that died is not named
        here (its process cannot be looked at from this one): its own machine's output says so."""
        if not is_collective_failure(error):
            return explain_failure(error, self.newest_checkpoint())
        here = socket.gethostname()
        ended = {r: b for r, b in self.peers().items() if b.get("state") == "running" and b.get("host") == here and process_ended(b.get("pid"))}
        if ended:
            who = "; ".join(f"rank {r} (pid {b.get('pid')} on {b.get('host')}, last in {b.get('activity')})" for r, b in sorted(ended.items()))
            return CollectiveTimeout(f"process {who} ended while the others waited for it at a collective, so the job ends; "
                                     f"{checkpoint_kept(self.newest_checkpoint())}; its own output says why it ended (killed, out of "
                                     "memory, an error), then continue with --resume latest")
        silent = self.silent() or {r: b for r, b in self.peers().items() if b.get("activity") != self.activity}
        if silent:
            return CollectiveTimeout(self.line(silent))
        return explain_failure(error, self.newest_checkpoint())


def process_ended(pid: object) -> bool:
    """Whether the process `pid` of this machine has ended: gone, or a zombie its launcher has not yet collected."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (macOS): alive as far as can be told
        return False
    return state in ("Z", "X")


def is_collective_failure(error: BaseException) -> bool:
    """Whether an exception is a collective that timed out or lost its peer: a RuntimeError of
    torch.distributed's (gloo, NCCL) saying so; never one of branchdiff's own one-line errors."""
    if not isinstance(error, RuntimeError) or isinstance(error, UserError):
        return False
    text = str(error).lower()
    return any(word in text for word in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe"))


def explain_failure(error: BaseException, newest_checkpoint: Path | None) -> CollectiveTimeout | None:
    """A collective's failure as one line when no heartbeat names the rank (before the watch starts,
    or a rank that beats but never arrives); None for any other error."""
    if not is_collective_failure(error):
        return None
    return CollectiveTimeout(f"a collective failed after waiting for another process ({one_line(error, 200)}); "
                             f"{checkpoint_kept(newest_checkpoint)}; check the other processes' output (the first error there is "
                             "the cause), then continue with --resume latest")
