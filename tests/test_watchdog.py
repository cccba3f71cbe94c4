"""The heartbeat watch's rules on hand-written heartbeat files (the whole path, a rank stopped by
SIGSTOP under `accelerate launch`, is in test_multiprocess.py)."""

from __future__ import annotations

import json

import pytest

from branchdiff.runtime import watchdog
from branchdiff.runtime.watchdog import Heartbeat, backend_timeout


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(watchdog.time, "monotonic", clock)
    return clock


def beat(heartbeat: Heartbeat, rank: int, at: float, state: str = "running", job: str = "job-1", activity: str = "iteration 3") -> None:
    (heartbeat.folder / f"rank-{rank}.json").write_text(json.dumps({"job": job, "pid": 100 + rank, "ppid": 1, "host": "node", "state": state,
                                                                   "activity": activity, "time": at}))


def test_a_peer_is_silent_once_its_heartbeat_has_not_changed_for_the_timeout(tmp_path, clock):
    watch = Heartbeat(tmp_path, rank=0, world=4, timeout=30, newest_checkpoint=lambda: tmp_path / "iter-000003", job="job-1")
    watch.folder.mkdir()
    beat(watch, 1, at=5.0)  # will go quiet
    beat(watch, 2, at=5.0)  # keeps beating
    beat(watch, 3, at=5.0, state="ended")  # finished its run: nobody waits for it
    assert watch.silent() == {}  # first look: the clock starts now for every peer
    clock.now += 29
    beat(watch, 2, at=6.0)
    assert watch.silent() == {}
    clock.now += 2  # rank 1 unchanged for 31 s > 30; rank 2 changed 2 s ago
    silent = watch.silent()
    assert list(silent) == [1] and silent[1]["quiet"] == pytest.approx(31)
    line = watch.line(silent)
    assert line.startswith("process rank 1 (pid 101 on node, silent for 31 s, last in iteration 3) stopped responding for more than "
                           "collective_timeout = 30 s, so the job ends; ")
    assert f"the newest complete checkpoint, {tmp_path / 'iter-000003'}, is intact" in line


def test_heartbeats_of_another_launch_are_not_this_jobs(tmp_path, clock):
    """A file left by an earlier launch (killed while running) must not make a slow starter look silent."""
    watch = Heartbeat(tmp_path, rank=0, world=2, timeout=10, newest_checkpoint=lambda: None, job="job-2")
    watch.folder.mkdir()
    beat(watch, 1, at=1.0, job="job-1")
    watch.silent()
    clock.now += 100
    assert watch.peers() == {} and watch.silent() == {}


def test_a_collective_timeout_is_explained_with_the_silent_rank_or_the_diverging_one(tmp_path, clock):
    watch = Heartbeat(tmp_path, rank=0, world=2, timeout=10, newest_checkpoint=lambda: None, job="job-1")
    watch.folder.mkdir()
    watch.activity = "iteration 4"
    beat(watch, 1, at=1.0, activity="the checkpoint of iteration 3")
    assert watch.explain(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None  # not a collective's failure
    from branchdiff.errors import ConfigError

    assert watch.explain(ConfigError("the config differs ... (keys that may change: collective_timeout)")) is None  # regression
    explained = watch.explain(RuntimeError("[gloo] Timed out waiting 20000ms for recv operation to complete"))
    assert str(explained).startswith("process rank 1 (pid 101 on node, silent for 0 s, last in the checkpoint of iteration 3)")
    assert "no checkpoint was written yet" in str(explained)


def test_the_backend_waits_longer_than_the_heartbeat_watch():
    assert backend_timeout(600) == 900 and backend_timeout(8) == 18
    assert all(backend_timeout(t) > t for t in (0.5, 8, 60, 3600))


def test_a_rank_whose_process_ended_on_this_machine_is_named_at_once(tmp_path):
    """A rank killed mid-run drops its connections, so the survivors' collective fails at once ("Connection reset by peer"):
    the line named no rank. A peer on this machine whose process has ended (gone, or a zombie its launcher has not yet
    collected) is named; one that lives, or one on another machine, is not."""
    import os
    import socket
    import subprocess
    import sys

    watch = Heartbeat(tmp_path, rank=0, world=3, timeout=10, newest_checkpoint=lambda: tmp_path / "iter-000001", job="job-1")
    watch.folder.mkdir()
    watch.activity = "iteration 2"
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while not watchdog.process_ended(zombie.pid):  # it exits and stays a zombie until waited for
        pass
    host = socket.gethostname()
    for rank, pid, where in ((1, zombie.pid, host), (2, os.getpid(), host)):
        (watch.folder / f"rank-{rank}.json").write_text(json.dumps({"job": "job-1", "pid": pid, "ppid": 1, "host": where, "state": "running",
                                                                   "activity": "iteration 2", "time": 1.0}))
    explained = str(watch.explain(RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:44971: Connection reset by peer")))
    assert explained.startswith(f"process rank 1 (pid {zombie.pid} on {host}, last in iteration 2) ended while the others waited for it at a "
                                "collective, so the job ends; "), explained
    assert f"{tmp_path / 'iter-000001'}, is intact" in explained and "rank 2" not in explained
    zombie.wait()
    assert watchdog.process_ended(zombie.pid) and not watchdog.process_ended(os.getpid())
    (watch.folder / "rank-1.json").write_text(json.dumps({"job": "job-1", "pid": zombie.pid, "ppid": 1, "host": "another-machine",
                                                         "state": "running", "activity": "iteration 2", "time": 1.0}))
    assert "ended while" not in str(watch.explain(RuntimeError("Connection reset by peer")))  # another machine's process is not looked at
