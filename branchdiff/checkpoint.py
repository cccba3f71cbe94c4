"""Checkpoint folders of a run: atomic publication, crash clean-up, and the resume check.

A checkpoint is written into `.staging-<iteration>` and published as `iter-<iteration>` by renames
only: an existing `iter-<iteration>` is first renamed to `.replaced-<iteration>`, the staging folder
takes its name, and the replaced one is deleted. A crash at any point leaves either the old or the
new checkpoint under its name, or the old one under `.replaced-*`, which `clean_interrupted` puts back.

A resumed run must be the run that was saved: every config key must match the checkpoint's, except
the keys of `RESUMABLE_KEYS`, which only say how long to run, where and what to log or evaluate,
and when to give up
(`iterations` only while `prune.active_fraction` is 1: otherwise it moves where pruning stops).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from branchdiff.config import ConfigError

PREFIX = "iter-"
STAGING = ".staging-"
REPLACED = ".replaced-"
PRUNED = ".pruned-"
STATE_FILE = "trainer_state.json"
RESUMABLE_KEYS = (
    "iterations", "output_dir", "final_eval", "eval_every", "logging.*", "prompts.eval", "prompts.eval_seeds",
    "sampling.max_batch", "sampling.exact", "train.max_skipped_steps",
)


def name(iteration: int) -> str:
    return f"{PREFIX}{iteration:06d}"


def _renamed(path: Path, old: str, new: str) -> Path:
    """`path` with its name's prefix `old` replaced by `new` (iter-000003 ↔ .staging-000003, ...)."""
    return path.with_name(new + path.name[len(old):])


def staging(final: Path) -> Path:
    """The folder a checkpoint is written into before `publish` gives it the name `final`."""
    return _renamed(final, PREFIX, STAGING)


def checkpoints(directory: Path) -> list[Path]:
    """Published checkpoints, oldest first."""
    return sorted(directory.glob(f"{PREFIX}*"))


def restore_replaced(directory: Path) -> None:
    """Put back a replaced checkpoint whose successor never got its name (a crash inside `publish`)."""
    for replaced in directory.glob(f"{REPLACED}*"):
        final = _renamed(replaced, REPLACED, PREFIX)
        if not final.exists():
            replaced.rename(final)


def clean_interrupted(directory: Path) -> None:
    """Undo what a crash during a save left: replaced checkpoints are restored (`restore_replaced`)
    or deleted, staging folders deleted."""
    restore_replaced(directory)
    for leftover in [*directory.glob(f"{STAGING}*"), *directory.glob(f"{REPLACED}*"), *directory.glob(f"{PRUNED}*")]:
        shutil.rmtree(leftover)


def publish(staging: Path, final: Path) -> None:
    """Give the complete checkpoint `staging` the name `final`, replacing any checkpoint there."""
    replaced = _renamed(final, PREFIX, REPLACED)
    if final.exists():
        final.rename(replaced)
    staging.rename(final)
    shutil.rmtree(replaced, ignore_errors=True)


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints; each loses its name first, so a crash mid-delete
    never leaves a half-deleted `iter-*` that looks like a checkpoint."""
    for old in checkpoints(directory)[:-keep]:
        doomed = _renamed(old, PREFIX, PRUNED)
        old.rename(doomed)
        shutil.rmtree(doomed)


def find(directory: Path, which: str) -> Path:
    """The checkpoint `which` names: "latest" or a path."""
    if which == "latest":
        found = checkpoints(directory)
        if not found:
            raise FileNotFoundError(f"--resume latest: no checkpoint under {directory}")
        return found[-1]
    path = Path(which)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"--resume {which}: {path} is not a checkpoint (no {STATE_FILE})")
    return path


def write_state(path: Path, iteration: int, config: dict, num_processes: int, run_state: dict) -> None:
    """The trainer's state beside accelerate's files: the last complete iteration (the tracker's
    step), the config, the process count and the run's counters (`run_state`)."""
    state = {"iteration": iteration, "config": config, "num_processes": num_processes, "run_state": run_state}
    (path / STATE_FILE).write_text(json.dumps(state))


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (json.JSONDecodeError, OSError) as error:
        raise FileNotFoundError(f"--resume: {path / STATE_FILE} is unreadable ({error}); resume from an older checkpoint") from None


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _resumable(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in RESUMABLE_KEYS)


def check_processes(saved: int | None, current: int, path: Path) -> None:
    """A run resumes on as many processes as it ran on: prompts per iteration are per process, and
    the prompt keys (hence the noise) follow the process layout."""
    if saved is not None and saved != current:
        raise ConfigError(f"--resume {path}: the run was trained on {saved} processes, this launch has {current}; "
                          f"resume with --num_processes {saved} (prompts.per_iteration is per process)")


def check_config(saved: dict, current: dict, path: Path) -> None:
    """Raise a one-line ConfigError naming the keys whose values differ from the checkpoint's. Keys
    only one side has (a newer or older version of branchdiff) are not compared."""
    old, new = _flatten(saved), _flatten(current)
    # pruning stops after prune.active_fraction·iterations: with a fraction below 1, a new length moves that point
    fixed_length = old.get("prune.active_fraction", 1.0) < 1.0
    differing = [k for k in sorted(old.keys() & new.keys())
                 if (not _resumable(k) or (k == "iterations" and fixed_length)) and old[k] != new[k]]
    if differing:
        shown = ", ".join(f"{k}: checkpoint {old[k]!r}, now {new[k]!r}" for k in differing[:4])
        more = f" (and {len(differing) - 4} more)" if len(differing) > 4 else ""
        raise ConfigError(f"--resume {path}: the config differs from the checkpoint's: {shown}{more}; "
                          f"resume with the run's config (keys that may change: {', '.join(RESUMABLE_KEYS)}) or start a new run")
