"""What the benchmarks share to show their results: a table, aligned for the terminal or in Markdown,
a curve with its interval band on a log-2 axis, and the files a benchmark writes (its plot, a Markdown
page, the JSON)."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from pathlib import Path


def table(header: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    """`rows` under `header`: a Markdown table, or columns padded to their widest cell."""
    if markdown:
        return "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows])
    widths = [max(len(row[i]) for row in [header, *rows]) + 2 for i in range(len(header))]
    return "\n".join("".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows])


def band(axes, grid: list[int], entry: dict, label: str, xlabel: str, ylabel: str, **style) -> None:
    """`entry["mean"]` against `grid` with its 95% band `entry["ci"]` ([low, high] per point), x on a log-2 scale."""
    line, = axes.plot(grid, entry["mean"], label=label, **style)
    axes.fill_between(grid, [low for low, _ in entry["ci"]], [high for _, high in entry["ci"]], color=line.get_color(), alpha=0.12)
    axes.set_xscale("log", base=2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)


def write_outputs(out_dir: Path, stem: str, heading: str, command: str, body: str, plot: Callable[[Path], None], result: dict,
                  json_path: Path | None) -> None:
    """out_dir/<stem>.png (drawn by `plot`) and out_dir/<stem>.md (heading, the command, date and cores, the
    plot, `body`); `result` as strict JSON (NaN written as null) to `json_path` if given; prints where it wrote."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(out_dir / f"{stem}.png")
    (out_dir / f"{stem}.md").write_text(
        f"# {heading}\n\n{command}\n\n{datetime.datetime.now().isoformat(timespec='minutes')}, {len(os.sched_getaffinity(0))} CPU cores\n\n"
        f"![{stem}]({stem}.png)\n\n{body}\n")
    if json_path:
        write_json(json_path, result, nan_as_null=True)
    print(f"wrote {out_dir / f'{stem}.md'}, {out_dir / f'{stem}.png'}" + (f", {json_path}" if json_path else ""))


def write_json(path: Path, result: object, nan_as_null: bool = False) -> None:
    """`result` as indented JSON in `path`, its folders made (the command line checked before the benchmark ran that they can be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1)
    path.write_text(text.replace("NaN", "null") if nan_as_null else text)


def print_result(text: str, result: dict, json_path: Path | None) -> dict:
    """Print a benchmark's table `text` and write `result` as JSON to `json_path` if given (saying where); returns `result`."""
    print(text)
    if json_path:
        write_json(json_path, result)
        print(f"wrote {json_path}")
    return result
