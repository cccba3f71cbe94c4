"""`branchdiff bench curves --merge`: several `bench curves` results of the same budget and grid, each over its own seeds
(a benchmark split over cores or machines with `--first-seed`), as one result; and the check of each file before anything
merges (one line naming the file and what is wrong with it).

Files written before iteration budgets are read too: their keys (`minutes`, `grid_minutes`) under today's (`budget`,
`grid`), and each evaluation's iterations, which they did not record, estimated at each run's constant rate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from branchdiff.bench.curves import (
    CLOCKS,
    TIME_CLOCKS,
    axis_title,
    format_equal,
    format_ratios,
    format_significance,
    format_table,
    plot_curves,
    summarize_runs,
)
from branchdiff.bench.tables import write_json
from branchdiff.errors import UserError


def merge_results(paths: list[Path], out_dir: Path, json_path: Path | None, reference: str | None = None) -> dict:
    """One result of several `bench curves` runs of the same grid and clock, each over its own seeds (a benchmark split
    over the cores, `--first-seed`): every variant's seeds in the files' order, the intervals, ratios and tests
    recomputed on all of them; written as `bench_curves` writes its own (curves.md, curves.png, `json_path`)."""
    if len({path.resolve() for path in paths}) < len(paths):
        twice = next(path for index, path in enumerate(paths) if path.resolve() in {p.resolve() for p in paths[:index]})
        raise UserError(f"bench curves --merge: {twice} is named twice; its seeds would count twice (each file once)")
    results = [read_result(path) for path in paths]
    first = results[0]
    for path, result in zip(paths, results):
        if (result["budget"], result["grid"], result["clock"]) != (first["budget"], first["grid"], first["clock"]):
            raise UserError(f"{path}: another budget, grid or clock than {paths[0]}; merge runs of the same --minutes or --iterations, "
                            "--points and --clock")
    runs: dict[str, list[dict]] = {}
    seen: dict[tuple[str, str], Path] = {}  # (variant, a seed's number or a run's own numbers): the file that holds it
    for path, result in zip(paths, results):
        seed_ids = result.get("seed_ids")
        for name, v in result["variants"].items():
            for index, strict in enumerate(v["strict"]):
                iterations = v["iterations"][index]
                # a seed is known by its number where the file records it, and always by its run's own numbers (an older
                # file holds no seed numbers: the same run there and in a newer file is caught by its numbers)
                keys = [json.dumps([strict, iterations, v["eval_minutes"]["wall"][index]]), *([f"seed {seed_ids[index]}"] if seed_ids else [])]
                for key in keys:
                    if (name, key) in seen:
                        which = key if key.startswith("seed ") else "a run"
                        raise UserError(f"bench curves --merge: {which} of variant {name} is in both {seen[name, key]} and {path}; merge files "
                                        "of different seeds (each run's --first-seed), each seed once")
                    seen[name, key] = path
                rates = v.get("run_seconds_per_iteration") or {c: [v["seconds_per_iteration"][c]] * len(v["strict"]) for c in TIME_CLOCKS}
                runs.setdefault(name, []).append({  # an older file's runs have its mean rate: their total kept
                    "strict": strict, "iterations": iterations, "eval_minutes": {c: v["eval_minutes"][c][index] for c in TIME_CLOCKS},
                    "eval_iterations": v["eval_iterations"][index], "seconds": {c: rates[c][index] * iterations for c in TIME_CLOCKS}})
    seeds = min(len(r) for r in runs.values())
    reference = reference or first["reference"]
    if reference not in runs:
        raise UserError(f"bench curves --merge --reference {reference}: no such variant in the files merged ({', '.join(runs)}); name one of them")
    shape_note = first["notes"]["shape"]
    # seeds pair across variants where every file holds every variant, each with as many runs (a run's seeds in order)
    paired = all(set(r["variants"]) == set(runs) and len({len(v["strict"]) for v in r["variants"].values()}) == 1 for r in results)
    merged = summarize_runs(first["budget"], seeds, first["grid"], runs, 0, None, first["clock"], reference, paired=paired)
    if all("seed_ids" in r for r in results) and all(set(r["variants"]) == set(runs) for r in results):
        merged["seed_ids"] = [seed for r in results for seed in r["seed_ids"]]
    merged["notes"] = {**first["notes"], **{k: v for k, v in merged["notes"].items() if k.startswith(("time_to_", "coarse_grid"))},
                       "shape": shape_note, "merged": f"seeds of {', '.join(str(p) for p in paths)}, in that order",
                       "machine": "; ".join(str(r["notes"].get("machine", "")) for r in results)}
    estimated = [str(path) for path, r in zip(paths, results) if "eval_iterations" in r["notes"]]
    if estimated:
        merged["notes"]["eval_iterations"] = f"{', '.join(estimated)}: {ESTIMATED_ITERATIONS}"
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(merged, out_dir / "curves.png")
    (out_dir / "curves.md").write_text(
        f"# Held-out strict accuracy against {axis_title(merged['clock'])}, merged\n\n`branchdiff bench curves --merge "
        f"{','.join(str(p) for p in paths)} --reference '{reference}' --out {out_dir}`\n\n![curves](curves.png)\n\n"
        f"{format_table(merged, markdown=True)}\n\n{format_ratios(merged)}\n\n{format_significance(merged)}\n\n{format_equal(merged)}\n\n"
        + "".join(f"- {key}: {note}\n" for key, note in merged["notes"].items() if isinstance(note, str)))
    if json_path:
        write_json(json_path, merged)
    print(format_table(merged))
    print(format_ratios(merged))
    print(format_significance(merged))
    print(format_equal(merged))
    return merged


def read_result(path: Path) -> dict:
    """A `bench curves` JSON result, checked before anything is merged: one line naming the file and what is wrong with it
    (missing, empty, not JSON, not a result, a variant without its per-seed scores or with numbers where lists belong)."""
    if not path.is_file():
        raise UserError(f"bench curves --merge: {path} " + ("is a folder" if path.is_dir() else "does not exist") + "; give the JSON files "
                        "that bench curves --json wrote")
    text = path.read_text(errors="replace")
    if not text.strip():
        raise UserError(f"bench curves --merge: {path} is empty; give the JSON file that bench curves --json wrote")
    try:
        result = json.loads(text)
    except ValueError as error:
        raise UserError(f"bench curves --merge: {path} is not JSON ({error}); a run cut short leaves no file: run its seeds again") from None
    problem = _result_problem(_renamed(result))
    if problem:
        raise UserError(f"bench curves --merge: {path} is not a bench curves result: {problem}")
    return _with_eval_iterations(result)


ESTIMATED_ITERATIONS = ("each evaluation's iterations estimated at the run's own constant rate (the run's iterations × the budget "
                        "clock's minutes at the evaluation / at its last; the file predates their record)")


def _renamed(result: object) -> object:
    """A result written before iteration budgets (`minutes`, `grid_minutes`) under today's keys (`budget`, `grid`, `unit`)."""
    if isinstance(result, dict) and "grid" not in result and "grid_minutes" in result:
        result["grid"], result["unit"] = result.pop("grid_minutes"), "minutes"
        if "minutes" in result:
            result["budget"] = result.pop("minutes")
    return result


def _with_eval_iterations(result: dict) -> dict:
    """A checked result whose runs lack their iterations at each evaluation (a file older than that record), given them
    estimated at each run's constant rate (ESTIMATED_ITERATIONS; its last evaluation is its last iteration), with a note."""
    for v in result["variants"].values():
        if "eval_iterations" not in v:
            result["notes"]["eval_iterations"] = ESTIMATED_ITERATIONS
            v["eval_iterations"] = [[total * minutes / run[-1] if run[-1] > 0 else 0.0 for minutes in run[:-1]] + [total]
                                    for total, run in zip(v["iterations"], v["eval_minutes"][result["clock"]])]
    return result


def _numbers(value: object, length: int | None = None) -> bool:
    """`value` is a list (of `length` items, where given) of finite numbers."""
    return (isinstance(value, list) and (length is None or len(value) == length)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value))


def _result_problem(result: object) -> str:
    """What makes `result` unusable as a `bench curves` result ("" when it is one)."""
    if not isinstance(result, dict):
        return f"it holds a {type(result).__name__}, not an object"
    missing = [key for key in ("budget", "grid", "clock", "reference", "variants") if key not in result]
    if missing:
        return f"no {', '.join(repr(key) for key in missing)}"
    grid = result["grid"]
    if not _numbers(grid) or len(grid) < 2 or result["clock"] not in CLOCKS:
        return "'grid' must be a list of two or more numbers and 'clock' one of " + ", ".join(CLOCKS)
    variants = result["variants"]
    if not isinstance(variants, dict) or not variants:
        return "'variants' must map each variant's name to its runs, and it holds none"
    for name, v in variants.items():
        if not isinstance(v, dict):
            return f"variant {name!r} is a {type(v).__name__}, not an object"
        strict = v.get("strict")
        if not isinstance(strict, list) or not strict or not all(_numbers(run, len(grid)) for run in strict):
            return f"variant {name!r} has no per-seed scores ('strict': a list per seed of {len(grid)} numbers, one per grid point)"
        seeds = len(strict)
        if not _numbers(v.get("iterations"), seeds):
            return f"variant {name!r}: 'iterations' must hold one number per seed ({seeds})"
        minutes, rates, runs_rates = v.get("eval_minutes"), v.get("seconds_per_iteration"), v.get("run_seconds_per_iteration")
        if (not isinstance(minutes, dict) or not all(isinstance(minutes.get(c), list) and len(minutes[c]) == seeds
                                                     and all(_numbers(run, len(grid)) for run in minutes[c]) for c in TIME_CLOCKS)):
            return (f"variant {name!r}: 'eval_minutes' must hold, for each clock ({', '.join(TIME_CLOCKS)}), a list per seed of {len(grid)} "
                    "numbers")
        if not isinstance(rates, dict) or not all(_numbers([rates.get(c)]) for c in TIME_CLOCKS):
            return f"variant {name!r}: 'seconds_per_iteration' must hold a number for each clock ({', '.join(TIME_CLOCKS)})"
        if "eval_iterations" in v and (not isinstance(v["eval_iterations"], list) or len(v["eval_iterations"]) != seeds
                                       or not all(_numbers(run, len(grid)) for run in v["eval_iterations"])):
            return f"variant {name!r}: 'eval_iterations' must hold a list per seed of {len(grid)} numbers"
        if runs_rates is not None and (not isinstance(runs_rates, dict) or not all(_numbers(runs_rates.get(c), seeds) for c in TIME_CLOCKS)):
            return f"variant {name!r}: 'run_seconds_per_iteration' must hold, for each clock ({', '.join(TIME_CLOCKS)}), a number per seed"
        if "eval_iterations" not in v and result["clock"] == "iterations":
            return f"variant {name!r}: no 'eval_iterations' (an iteration budget's runs record them)"
    seed_ids = result.get("seed_ids")
    if seed_ids is not None and (not isinstance(seed_ids, list) or len(set(map(str, seed_ids))) != len(seed_ids)
                                 or any(len(v["strict"]) != len(seed_ids) for v in variants.values())):
        return "'seed_ids' must list each variant's seeds once, as many as its runs"
    return ""
