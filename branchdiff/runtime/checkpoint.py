"""Checkpoint folders of a run: atomic publication, crash clean-up, self-checks, and the resume check.

A checkpoint is written into `.staging-<iteration>` and published as `iter-<iteration>` by renames
only: an existing `iter-<iteration>` is first renamed to `.replaced-<iteration>`, the staging folder
takes its name, and the replaced one is deleted. A crash at any point leaves either the old or the
new checkpoint under its name, or the old one under `.replaced-*`, which `clean_interrupted` puts back.

A checkpoint proves itself: `manifest.json`, written last, lists every file with its size and
SHA-256, and `verify` checks them and every field of `trainer_state.json` before anything is
loaded. `select` picks the checkpoint to resume: a named one must pass; `latest` takes the newest
that passes and says which newer ones it skipped and why. Checkpoints of branchdiff before the
manifest (no `format` in their state) are read without it, with a notice.

A resumed run must be the run that was saved: every config key must match the checkpoint's, except
the keys of `RESUMABLE_KEYS`, which only say how long to run, where and what to log or evaluate,
and when to give up
(`iterations` only while `prune.active_fraction` is 1: otherwise it moves where pruning stops).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from branchdiff.errors import CheckpointError, ConfigError

PREFIX = "iter-"
STAGING = ".staging-"
REPLACED = ".replaced-"
PRUNED = ".pruned-"
DAMAGED = ".damaged-"  # a checkpoint `--resume latest` skipped, set aside for inspection
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
FORMAT = 2  # trainer_state.json's format: 2 = with a manifest
RESUMABLE_KEYS = (
    "iterations", "output_dir", "final_eval", "eval_every", "logging.*", "prompts.eval", "prompts.eval_seeds",
    "sampling.max_batch", "sampling.exact", "train.max_skipped_steps", "collective_timeout",
    "train.gradient_checkpointing", "model.offload", "eval_rewards", "prompts.eval_guidance", "watch.*",
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


def newest(directory: Path) -> Path | None:
    """The newest published checkpoint under `directory`, or None."""
    found = checkpoints(directory) if directory.is_dir() else []
    return found[-1] if found else None


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


def write_state(path: Path, iteration: int, config: dict, num_processes: int, run_state: dict) -> None:
    """The trainer's state beside accelerate's files: the last complete iteration (the tracker's
    step), the config, the process count and the run's counters (`run_state`)."""
    state = {"format": FORMAT, "iteration": iteration, "config": config, "num_processes": num_processes, "run_state": run_state}
    (path / STATE_FILE).write_text(json.dumps(state))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(path: Path) -> None:
    """`manifest.json`: every file of the checkpoint folder with its size and SHA-256; written last."""
    files = {str(f.relative_to(path)): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST}
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))


def _whole(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def state_problem(state: object) -> str | None:
    """What is wrong with a parsed trainer_state.json, or None: every field present (format 2;
    older states may lack the later ones) and of its type."""
    if not isinstance(state, dict):
        return f"holds {type(state).__name__}, not a mapping"
    fields = {"iteration": (lambda v: _whole(v, 0), "an integer ≥ 0"), "config": (lambda v: isinstance(v, dict), "a mapping"),
              "num_processes": (lambda v: _whole(v, 1), "an integer ≥ 1"), "run_state": (lambda v: isinstance(v, dict), "a mapping"),
              "format": (lambda v: _whole(v, 1), "an integer ≥ 1")}
    required = fields if "format" in state else ("iteration",)
    for name, (valid, expected) in fields.items():
        if name not in state:
            if name in required:
                return f"field '{name}' is missing"
            continue
        if not valid(state[name]):
            return f"field '{name}' = {json.dumps(state[name])[:40]} is not {expected}"
    for counter in ("skipped_in_a_row", "optimizer_steps"):
        count = state.get("run_state", {}).get(counter, 0)
        if not _whole(count, 0):
            return f"field 'run_state.{counter}' = {json.dumps(count)[:40]} is not an integer ≥ 0"
    watch = state.get("run_state", {}).get("watch", {})
    numbers = lambda values: isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)  # noqa: E731
    if not (isinstance(watch, dict) and set(watch) <= {"train", "gold"} and numbers(watch.get("train", []))
            and numbers(watch.get("gold", [])) and len(watch.get("train", [])) == len(watch.get("gold", []))):
        return f"field 'run_state.watch' = {json.dumps(watch)[:40]} is not the reward-hacking watch's state"
    return None


def _manifest_problem(path: Path) -> str | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        expected = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except FileNotFoundError:
        return f"its {MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST} is unreadable"
    for name, (size, digest) in expected.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
        if _sha256(file) != digest:
            return f"{name} does not match its SHA-256 in the manifest"
    present = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name != MANIFEST}
    if present - set(expected):
        return f"{sorted(present - set(expected))[0]} is not in the manifest"
    return None


def verify(path: Path) -> tuple[dict | None, str | None]:
    """(state, None) for a checkpoint whose state and manifest check out, else (None, the problem)."""
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"it holds no {STATE_FILE}"
    except (OSError, ValueError) as error:
        return None, f"its {STATE_FILE} is unreadable ({type(error).__name__})"
    problem = state_problem(state)
    if problem:
        return None, f"{STATE_FILE}: {problem}"
    if state.get("format", 1) >= 2 or (path / MANIFEST).exists():
        problem = _manifest_problem(path)
        if problem:
            return None, problem
    return state, None


@dataclass
class Selected:
    path: Path  # the checkpoint folder to resume from
    state: dict  # its trainer_state.json, checked
    notices: list[str]  # what a user should know (newer checkpoints skipped, no manifest)
    skipped: list[Path]  # newer checkpoints that failed their check (`set_aside` them once every process has chosen)


def select(directory: Path, which: str) -> Selected:
    """The checkpoint `which` names ("latest" or a folder), checked by `verify`: `latest` falls back
    to the newest one that passes; a named one that fails is refused (`CheckpointError`)."""
    if which != "latest":
        path = Path(which)
        if not path.is_dir() or not ((path / STATE_FILE).is_file() or (path / MANIFEST).is_file()):
            raise FileNotFoundError(f"--resume {which}: {path} is not a checkpoint (no {STATE_FILE}); pass a folder under {directory} or latest")
        candidates = [path]
    else:
        candidates = list(reversed(checkpoints(directory)))
        if not candidates:
            raise FileNotFoundError(f"--resume latest: no checkpoint under {directory}")
    notices: list[str] = []
    skipped: list[Path] = []
    first_problem = ""
    for path in candidates:
        state, problem = verify(path)
        if problem is None and state is not None:
            if state.get("format", 1) < 2:
                notices.append(f"checkpoint {path} predates checkpoint manifests: its files are not verified")
            return Selected(path, state, notices, skipped)
        first_problem = first_problem or f"checkpoint {path} is damaged ({problem})"
        if which == "latest":
            notices.append(f"skipping checkpoint {path}: damaged ({problem}); set aside as {_renamed(path, PREFIX, DAMAGED).name}")
            skipped.append(path)
    if which != "latest":
        older = [p for p in checkpoints(directory) if p.name < candidates[0].name]
        hint = f"resume from an older one (--resume {older[-1]})" if older else "start a new run in another output_dir="
        raise CheckpointError(f"--resume: {first_problem}; {hint}")
    raise CheckpointError(f"--resume latest: every checkpoint under {directory} is damaged; the newest: {first_problem.removeprefix('checkpoint ')}; "
                          "start a new run in another output_dir=")


def set_aside(path: Path) -> None:
    """Rename a damaged checkpoint `.damaged-<iteration>`: kept for inspection, never again taken
    for the newest one (by a resume, a report of what is intact, or pruning)."""
    aside = _renamed(path, PREFIX, DAMAGED)
    shutil.rmtree(aside, ignore_errors=True)
    path.rename(aside)


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
    fraction = old.get("prune.active_fraction", 1.0)
    fixed_length = isinstance(fraction, (int, float)) and fraction < 1.0
    differing = [k for k in sorted(old.keys() & new.keys())
                 if (not _resumable(k) or (k == "iterations" and fixed_length)) and old[k] != new[k]]
    if differing:
        shown = ", ".join(f"{k}: checkpoint {old[k]!r}, now {new[k]!r}" for k in differing[:4])
        more = f" (and {len(differing) - 4} more)" if len(differing) > 4 else ""
        raise ConfigError(f"--resume {path}: the config differs from the checkpoint's: {shown}{more}; "
                          f"resume with the run's config (keys that may change: {', '.join(RESUMABLE_KEYS)}) or start a new run")
