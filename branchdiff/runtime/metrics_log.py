"""metrics.jsonl: one JSON object per iteration, appended as the run goes, cut back on resume.

- `append(path, metrics)`: one line, through `storage.append_line` (never half a line, even on a
  full disk).
- `read(path)`: every line checked: a JSON object whose `iteration` is an integer ≥ 0. Only the
  last line may be cut off (a crash while it was written); it is dropped. Anything else stops with
  one line naming `path:line` and the fix. (The report reads the file leniently instead:
  branchdiff/report/run_data.py.)
- `truncate(path, last_iteration)`: keep the lines up to a checkpoint's iteration, rewritten
  atomically, so a resumed run writes the later ones again instead of twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from branchdiff.errors import UserError, read_utf8
from branchdiff.runtime import storage


def append(path: Path, metrics: dict) -> None:
    """One iteration's metrics as one line."""
    storage.append_line(path, json.dumps(metrics))


def read(path: Path) -> list[tuple[int, str]]:
    """(iteration, line) of every complete line of a metrics.jsonl."""
    text = read_utf8(path, "delete that line (the run rewrites the lines after its checkpoint) and resume again")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                continue  # the last line, cut off by a crash
            raise UserError(f"{path}:{number}: not a JSON object ({line[:40]!r}); delete that line and resume again") from None
        if not isinstance(row, dict) or "iteration" not in row:
            raise UserError(f"{path}:{number}: field 'iteration' is missing; delete that line and resume again")
        iteration = row["iteration"]
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise UserError(f"{path}:{number}: field 'iteration' = {json.dumps(iteration)[:40]} is not an integer ≥ 0; "
                            "delete that line and resume again")
        rows.append((iteration, line))
    return rows


def truncate(path: Path, last_iteration: int) -> None:
    """Keep only the lines of iterations ≤ `last_iteration`."""
    if path.is_file():
        kept = "".join(line + "\n" for iteration, line in read(path) if iteration <= last_iteration)
        storage.write_text(path, kept)
