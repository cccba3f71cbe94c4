"""The run directory a training run owns: claimed before anything is written, one run at a time.

`claim(run_dir, resume)` (the first process only, before the model loads) creates the folder if
needed, checks that it can be written, and takes an advisory lock (`fcntl.flock`) on
`RUN_DIR/.lock` that the process holds until it exits: a second run on the same folder stops at
once with one line naming the holder's pid and host. The operating system drops the lock of a
process that died, so a stale lock file is simply taken over. A new run refuses a folder that
already holds a run (metrics or checkpoints) unless it resumes, and the claim is checked before the
model loads: when anything fails before the run writes its first file, `RunDirectory.abandon`
removes the folder again if the claim created it. Once claimed, what the writes of a killed run
left behind (`storage.clean_leftovers`) is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import TextIO

from branchdiff.errors import UserError
from branchdiff.runtime import storage

LOCK_FILE = ".lock"
HEARTBEATS = ".heartbeat"  # branchdiff/runtime/watchdog.py's folder


class RunDirectory:
    """A claimed run directory: holds the lock while the process lives."""

    def __init__(self, path: Path, created: bool, created_lock: bool, handle: TextIO) -> None:
        self.path, self.created, self.created_lock = path, created, created_lock
        self._handle: TextIO | None = handle  # None once released
        handle.seek(0)
        self._previous_holder = handle.read()  # the lock file's text before this claim, restored by `abandon`

    def release(self) -> None:
        """Drop the lock (the file stays for the next run to lock)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def abandon(self) -> None:
        """Undo the claim: remove what it created (the lock file, the folder when it made it and
        nothing else is in it), then release. A run that locked the file meanwhile sees it gone and
        locks a new one (`claim` checks that the file it locked is still the one at the path); a lock
        file that was there before gets its old text back."""
        if self._handle is not None and self.created_lock:
            (self.path / LOCK_FILE).unlink(missing_ok=True)
        elif self._handle is not None:
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.write(self._previous_holder)
        self.release()
        if self.created and {p.name for p in self.path.iterdir()} <= {HEARTBEATS}:  # what other processes of the launch may have begun
            shutil.rmtree(self.path, ignore_errors=True)


def holds_a_run(path: Path) -> bool:
    """Whether `path` holds a run's metrics or checkpoints."""
    return (path / "metrics.jsonl").exists() or (path / "checkpoints").exists()


def _lock(handle: TextIO) -> bool:
    """Take the exclusive lock without waiting; False when another process holds it."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: no advisory lock
        return True
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(handle: TextIO, wait: float = 2.0) -> str:
    """Who holds the lock, from the lock file's text; a holder that has just taken it writes it
    within moments, so the text is read again for up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        handle.seek(0)
        try:
            owner = json.loads(handle.read() or "{}")
            return f"pid {owner['pid']} on {owner['host']}, since {owner['started']}"
        except (ValueError, KeyError, TypeError):
            if time.monotonic() > deadline:
                return "a process that has not written its pid yet"
            time.sleep(0.05)


def _open_locked(path: Path) -> tuple[TextIO, bool, bool]:
    """(handle of RUN_DIR/.lock, whether this call created the file, whether it holds the lock);
    retried when the file it locked was removed or replaced meanwhile."""
    lock = path / LOCK_FILE
    while True:
        created = not lock.exists()
        handle = lock.open("a+")
        if not _lock(handle):
            return handle, created, False
        try:
            same = os.fstat(handle.fileno()).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle, created, True
        handle.close()


def claim(path: Path, resume: bool) -> RunDirectory:
    """Create (if needed) and lock `path` for this run; refuse a folder in use, one that cannot be
    written, and (without `resume`) one that already holds a run."""
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle, created_lock, locked = _open_locked(path)
    except OSError as error:
        raise UserError(f"output_dir {path} is not writable ({error.strerror or error}); pass output_dir= a folder you can write to") from None
    if not locked:
        holder = _holder(handle)
        handle.close()
        raise UserError(f"output_dir {path} is in use by another run ({holder}); wait for it to end or stop it, or pass another output_dir=")
    run = RunDirectory(path, created, created_lock, handle)
    if not resume and holds_a_run(path):
        run.abandon()
        raise UserError(f"output_dir {path} already holds a run (metrics.jsonl or checkpoints/); continue it with --resume latest, "
                        "or pass another output_dir=")
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
        handle.flush()
    except OSError as error:
        run.abandon()
        raise UserError(f"output_dir {path} is not writable ({error.strerror or error}); pass output_dir= a folder you can write to") from None
    for folder in (path, path / "samples"):  # what a killed run's writes left (the lock says no other run is writing)
        storage.clean_leftovers(folder)
    return run
