"""An evaluation's scores kept as they are made, so that a killed evaluation continues where it stopped (`branchdiff eval`;
docs/benchmarks.md).

Each process appends a line per finished prompt to `OUT/records/rank-R.jsonl` ({"prompt": index, "scores": {name: [one
value per image]}}) after that chunk's images are written, flushed to disk. `OUT/records/evaluation.json` holds what the
scores are of (`fingerprint`): the settings, the rewards, and what the weights and the prompt set hold (each file's size
and modification time, the prompts' own text), not only their names, so a LoRA re-exported at the same path or an
edited prompt file starts the evaluation over instead of reporting the old one's scores.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from branchdiff.runtime import storage


def content_identity(path: str | Path | None) -> list[Any] | None:
    """What a file or folder holds, cheaply: (relative path, size, modification time in ns) of each file under it, sorted."""
    if path is None:
        return None
    path = Path(path)
    if path.is_file():
        stat = path.stat()
        return [[path.name, stat.st_size, stat.st_mtime_ns]]
    if path.is_dir():
        return [[str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(path.rglob("*")) if f.is_file()]
    return None


def prompts_digest(prompts: list[str], metadata: list[dict]) -> str:
    """SHA-256 of a prompt set's text and metadata, in order (records are keyed by prompt index)."""
    return hashlib.sha256(json.dumps([prompts, metadata], sort_keys=True, default=str).encode()).hexdigest()


def resumable(out_dir: Path, fingerprint: dict, state: Any) -> Path:
    """The folder of an evaluation's score records under `out_dir`: kept when it holds an evaluation of the same
    `fingerprint` (a killed evaluation continues), emptied for another (and said). `state`: the processes (accelerate's
    PartialState); the main one decides, the others wait for it."""
    folder = out_dir / "records"
    written = folder / "evaluation.json"
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    if state.is_main_process:
        if written.is_file() and written.read_text() != text:
            print(f"eval: {out_dir} holds an evaluation of other settings, weights or prompts; its scores are replaced", file=sys.stderr)
            for old in folder.glob("rank-*.jsonl"):
                old.unlink()
        elif written.is_file() and any(folder.glob("rank-*.jsonl")):
            print(f"eval: continuing the evaluation in {out_dir} (prompts already scored are not sampled again)", file=sys.stderr)
        folder.mkdir(parents=True, exist_ok=True)
        storage.write_text(written, text)
    state.wait_for_everyone()
    return folder


class ScoreRecords:
    """One process's score records (module doc); `done` reads every process's."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.path = folder, folder / f"rank-{rank}.jsonl"

    def done(self, images_per_prompt: int, names: list[str]) -> dict[int, dict[str, list[float]]]:
        """The prompts every process recorded whole (every score, every image), by index; a line cut off by a kill is skipped
        (its prompt is made again)."""
        found: dict[int, dict[str, list[float]]] = {}
        for path in sorted(self.folder.glob("rank-*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    prompt, scores = int(row["prompt"]), row["scores"]
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(scores, dict) and all(len(scores.get(name) or []) == images_per_prompt for name in names):
                    found[prompt] = {name: [float(v) for v in scores[name]] for name in names}
        return found

    def append(self, prompts: dict[int, dict[str, list[float]]]) -> None:
        """Each prompt's scores as a line, after a newline where a kill cut the last line off (so that no record joins it)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        cut = self.path.is_file() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n")
        with self.path.open("a") as handle:
            handle.write(("\n" if cut else "") + "".join(json.dumps({"prompt": key, "scores": scores}) + "\n" for key, scores in prompts.items()))
            handle.flush()
            os.fsync(handle.fileno())
