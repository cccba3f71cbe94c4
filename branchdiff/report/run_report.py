"""A run's report: RUN_DIR/report.html, one self-contained page (plots and sample grids embedded as
base64 PNGs; no script, no external CSS, font or image) that opens offline.

Built from what the run directory holds (branchdiff/report/run_data.py reads it); only metrics.jsonl
is required. A section whose inputs are absent says "not recorded in this run", and a section that
fails to draw says so in place: the trainer rebuilds the report at checkpoints and must not
stop for it.

This module is the page: the sections and `write_report`. The figures, curves and grid images it
embeds are drawn with branchdiff/report/figures.py. The base model's level of a curve is its value at
iteration 0 (`figures.base_level`); the final evaluation (eval.json) is a point after the held-out
curves, at the updates it followed (`Run.final_x`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from html import escape
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import LogLocator, NullLocator

from branchdiff.objectives.registry import OBJECTIVES, objective_class
from branchdiff.report.figures import (
    Column,
    base_level,
    draw_curve,
    grid_captions,
    grid_data_uri,
    new_figure,
    png_data_uri,
    small_multiples,
    smoothing_window,
    title_and_legend,
    video_data_uri,
)
from branchdiff.report.html import STYLE, dotted_get, evenly_spaced, finite_mean, fmt, img, missing, note, table
from branchdiff.report.run_data import DEPTH_KEY, Grid, Run, read_run, reward_components, sample_grids
from branchdiff.runtime import storage

PHASES = ("rollout_seconds", "reward_seconds", "train_seconds", "eval_seconds")
NFE_KEYS = ("nfe_rollout", "nfe_rollout_computed", "nfe_trained")
MEMORY_KEYS = ("memory_rollout_gb", "memory_reward_gb", "memory_train_gb", "memory_eval_gb")
EVAL_GRIDS = 8  # held-out grids shown, evenly spaced, first and last included
TRAIN_GRIDS = 3  # newest training grids shown
LOGPROB_FLOOR = 1e-12  # exact zeros of logprob_check drawn here on the log axis
CAPTION_CHARS = 80  # a grid row's caption (its prompt) is cut to this many characters
FINAL_LABEL = "final evaluation (eval.json)"

def _update_curve(ax: Axes, key: str, column: Column) -> None:
    """An update statistic; logprob_check on a log axis, exact zeros at LOGPROB_FLOOR, with the 1e-6 line."""
    if key != "logprob_check":
        draw_curve(ax, key, column)
        return
    iterations, values = column
    ax.set_title(key, fontsize=9)
    ax.semilogy(iterations, np.maximum(values, LOGPROB_FLOOR), lw=1.2, color="C0", label="per iteration")
    ax.axhline(1e-6, ls=":", color="C3", lw=1, label="1e-6")
    ax.yaxis.set_major_locator(LogLocator(numticks=5))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)


def _panels(run: Run, keys: list[str], alt: str, draw: Callable[[Axes, str, Column], None] = draw_curve) -> str:
    """Small multiples of the run's `keys` as an <img>."""
    return img(png_data_uri(small_multiples(run.columns, keys, draw)), alt)


# ---------------------------------------------------------------- sections
def _header(run: Run) -> str:
    parts = [f"{len(run.iterations)} iterations logged"]
    if len(run.iterations):
        parts.append(f"last iteration {run.iterations[-1]:.0f}")
    if "reward_mean" in run.columns:
        iterations, rewards = run.columns["reward_mean"]
        finite, base = rewards[np.isfinite(rewards)], base_level(iterations, rewards)
        if len(finite):
            window = min(smoothing_window(len(rewards)), len(finite))
            final = float(finite[-window:].mean())
            text = f"final reward_mean {final:.4g} (mean of the last {window} logged)"
            parts.append(text + (f" vs base {base:.4g} (iteration 0): {final - base:+.4g}" if base is not None else ""))
    base_means = run.means("base")
    for score, trained in run.means("trained").items():  # the held-out result, less noisy than one batch of training prompts
        if score in base_means:
            parts.append(f"held-out {score} {base_means[score]:.3f} → {trained:.3f}")
    parts.append("generated " + time.strftime("%Y-%m-%d %H:%M:%S"))
    if run.config_text is None:
        facts = missing("config.yaml")
    else:
        c = run.config or {}
        body = [["family", str(dotted_get(c, "model.family"))], ["model.path", str(dotted_get(c, "model.path"))],
                ["iterations", str(dotted_get(c, "iterations"))], ["reward", str(dotted_get(c, "reward"))],
                ["tree", f"{dotted_get(c, 'tree.roots')} roots, splits {dotted_get(c, 'tree.splits')}"],
                ["sampling steps", f"{dotted_get(c, 'sampling.num_steps')} "
                                   f"({'ODE' if dotted_get(c, 'sampling.sde') == 'ode' else str(dotted_get(c, 'sampling.sde')) + ' SDE'})"],
                ["objective", str(dotted_get(c, "train.loss") or "grpo")],
                ["learning rate", str(dotted_get(c, "train.learning_rate"))], ["explore", str(dotted_get(c, "explore.mode"))]]
        facts = table(["config", "value"], body) + f"<details><summary>config.yaml</summary><pre>{escape(run.config_text)}</pre></details>"
    nav = "".join(f'<a href="#{i}">{t}</a>' for i, t, _ in SECTIONS)
    return f"<h1>branchdiff run {escape(run.run_dir.resolve().name)}</h1><p>{escape(' · '.join(parts))}</p>{facts}<nav>{nav}</nav>"


def _rewards(run: Run) -> str:
    mean = run.aligned("reward_mean")
    # a single component equals reward_mean: drawn once
    components = [k for k in reward_components(list(run.columns)) if not np.array_equal(run.aligned(k), mean, equal_nan=True)]
    accuracies = sorted((k for k in run.columns if k.startswith("accuracy_")), key=lambda k: (k != "accuracy_strict", k))
    keys = run.has("reward_mean", *components, *accuracies)
    if not keys:
        return missing("Rewards")
    html = _panels(run, keys, "reward curves", partial(draw_curve, base=True))
    signal = run.has("reward_zero_spread_fraction", "reward_group_std")
    signal += [k for k in run.has("groups_dropped") if np.nansum(run.columns[k][1])]
    if signal:
        html += ("<p>Signal: the fraction of groups whose rewards do not spread (they train nothing), "
                 "the mean within-group std, and dropped groups when there were any.</p>")
        html += _panels(run, signal, "reward signal")
    return html


def _heldout_curve(x: int | None, finals: dict[str, float], ax: Axes, key: str, column: Column) -> None:
    """A held-out curve `eval_<score>` with its base level and the final evaluation of the score (eval.json)
    as a star at `x`."""
    draw_curve(ax, key, column, smooth=False, markers=True, base=True)
    score = key.removeprefix("eval_")
    if x is not None and score in finals:
        ax.plot([x], [finals[score]], ls="none", marker="*", ms=11, color="C3", label=FINAL_LABEL)


def _heldout_table(run: Run, keys: list[str]) -> str:
    """Base, last in-training and final evaluation of each held-out score, with their iterations."""
    x, base_means, finals = run.final_x(), run.means("base"), run.means("trained")
    body = []
    for score in dict.fromkeys([*(k.removeprefix("eval_") for k in keys), *finals]):
        iterations, values = run.columns.get(f"eval_{score}", (np.zeros(0), np.zeros(0)))
        base = base_level(iterations, values)
        base = base_means.get(score) if base is None else base  # the same evaluation of the base model
        last = f"{fmt(values[-1])} at {iterations[-1]:.0f}" if len(values) else "–"
        body.append([score, fmt(base), last, f"{fmt(finals[score])} at {x}" if score in finals and x is not None else "–"])
    text = "x counts the updates before an evaluation: the one logged at iteration i ran before that iteration's update"
    if finals and x is not None:
        after = run.after_iteration()
        text += (f", the final one (★, eval.json) after the update of iteration {after}, at {x}" if after is not None
                 else f", the final one (★, eval.json) after the last logged iteration (eval.json does not say which), at {x}")
    evaluated = run.evaluation or {}
    if evaluated.get("resolution") or evaluated.get("frames"):  # eval.resolution / eval.frames: not the training's size
        size = evaluated.get("resolution")
        text += "; the evaluations sample at " + ", ".join([*([f"{size[0]} × {size[1]}"] if size else []),
                                                            *([f"{evaluated['frames']} frames"] if evaluated.get("frames") else [])])
    return f"<p>{escape(text)}.</p>" + table(["held-out score", "base (iteration 0)", "last in training", FINAL_LABEL], body)


def _watch(run: Run) -> str:
    """The reward-hacking watch: the training reward since each evaluation against the gold score,
    on two axes, the evaluations that flagged divergence marked."""
    if "watch_reward" not in run.columns:
        return ""
    figure, (ax,) = new_figure(7, 3)
    iterations, reward = run.columns["watch_reward"]
    ax.plot(iterations, reward, marker="o", ms=3, color="C0", label="training reward since the evaluation before")
    gold_axis = ax.twinx()
    gold_axis.tick_params(labelsize=7)
    gold_iterations, gold = run.columns["watch_gold"]
    gold_axis.plot(gold_iterations, gold, marker="s", ms=3, color="C1", label="held-out gold score")
    flagged_iterations, flags = run.columns.get("watch_diverging", (np.zeros(0), np.zeros(0)))
    hit = np.isin(gold_iterations, flagged_iterations[flags > 0])
    gold_axis.plot(gold_iterations[hit], gold[hit], ls="none", marker="x", ms=10, mew=2, color="C3", label="divergence flagged")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    title_and_legend(ax, "reward-hacking watch: training reward (left) against held-out gold (right)", (gold_axis,))
    count = int(np.nansum(flags))
    verdict = (f"Divergence flagged at {count} evaluation(s): the training reward rose while the gold score fell."
               if count else "No divergence flagged: the gold score did not fall while the training reward rose.")
    return f"<p>{escape(verdict)}</p>" + img(png_data_uri(figure), "reward-hacking watch")


def _heldout(run: Run) -> str:
    keys = [k for k in run.columns if k.startswith("eval_") and not k.endswith("_seconds")]
    draw = partial(_heldout_curve, run.final_x(), run.means("trained"))
    if keys:
        html = "<p>Mean scores on the fixed held-out prompts and seeds, of the policy each iteration's rollouts came from.</p>"
        html += _panels(run, keys, "held-out evaluation", draw)
    else:
        html = missing("Held-out evaluation during training")
    html += _watch(run)
    if keys or run.means("trained"):
        html += _heldout_table(run, keys)
    evaluation = run.evaluation
    if evaluation is None:
        return html + missing("The final evaluation (eval.json)")
    html += (f"<p>Final evaluation: prompts {escape(str(evaluation.get('prompts')))}, "
             f"{escape(str(evaluation.get('images_per_prompt')))} images per prompt, the same noise for both models.</p>")
    base, trained = evaluation.get("base") or {}, evaluation.get("trained") or {}
    for group in base:
        body = []
        for score in {**base[group], **trained.get(group, {})}:
            b, t = base[group].get(score, {}), trained.get(group, {}).get(score, {})
            diff = f"{t['mean'] - b['mean']:+.4g}" if "mean" in b and "mean" in t else "–"
            body.append([score, f"{fmt(b.get('mean'))} ± {fmt(b.get('std'))}", f"{fmt(t.get('mean'))} ± {fmt(t.get('std'))}",
                         diff, str(t.get("images", b.get("images", "–"))), f"{b.get('nonfinite', 0)} / {t.get('nonfinite', 0)}"])
        html += f"<h3>{escape(group)}</h3>" + table(["score", "base", "trained", "trained − base", "images", "non-finite (base / trained)"], body)
    return html + "".join(f"<p>{escape(k)}: {escape(str(v))}</p>" for k, v in (evaluation.get("scales") or {}).items())


def _advantages(run: Run) -> str:
    by_kind: dict[str, dict[int, str]] = {}
    for key in run.columns:
        if match := DEPTH_KEY.match(key):
            by_kind.setdefault(match[1], {})[int(match[2])] = key
    if not by_kind:
        return missing("Per-depth advantage statistics")
    depths = sorted({d for keys in by_kind.values() for d in keys})

    def matrix(kind: str) -> np.ndarray:  # (depths, R), NaN where not logged
        return np.stack([run.aligned(by_kind.get(kind, {}).get(d, "")) for d in depths])

    kinds = [k for k in ("advantage_std", "advantage_abs_mean") if k in by_kind]
    html = ""
    if kinds:
        figure, axes = new_figure(9.4, 2.3 * len(kinds) + 0.2, len(kinds))
        for ax, kind in zip(axes, kinds):
            mesh = ax.pcolormesh(run.iterations, depths, np.ma.masked_invalid(matrix(kind)), shading="nearest", cmap="viridis")
            figure.colorbar(mesh, ax=ax, pad=0.01)
            ax.set_title(f"{kind} by child depth", fontsize=9)
            ax.set(xlabel="iteration", ylabel="depth", yticks=depths)
        html += img(png_data_uri(figure), "advantage heatmaps by depth")
    figure, (left, right) = new_figure(9.4, 2.6, 1, 2)
    for offset, kind in zip((-0.2, 0.2), kinds):
        left.bar(np.array(depths) + offset, finite_mean(matrix(kind), 1), width=0.4, label=kind)
    title_and_legend(left, "mean over the run")
    if "edges_trained" in by_kind:
        right.bar(depths, finite_mean(matrix("edges_trained"), 1), color="C2")
    right.set_title("edges trained per iteration (mean)", fontsize=9)
    for ax in (left, right):
        ax.set(xlabel="depth", xticks=depths)
    return html + img(png_data_uri(figure), "per-depth means over the run and edges trained per depth")


def _cost(run: Run) -> str:
    nfe = run.has(*NFE_KEYS, *(k for k in run.columns if k.startswith("explore_") and k.endswith("_nfe")))
    phases = run.has(*PHASES)
    if not nfe and not phases:
        return missing("Cost (NFE and time)")
    figure, (left, right) = new_figure(9.4, 2.8, 1, 2)
    for key in nfe:
        left.plot(*run.columns[key], lw=1.2, label=key)
    seconds = np.nan_to_num(np.stack([run.aligned(k) for k in phases])) if phases else np.zeros((0, len(run.iterations)))
    if phases:
        right.stackplot(run.iterations, seconds, labels=phases, alpha=0.8)
    title_and_legend(left, "network evaluations per iteration")
    title_and_legend(right, "seconds per iteration (stacked)")
    for ax in (left, right):
        ax.set_xlabel("iteration")
    html = img(png_data_uri(figure), "network evaluations and time per iteration")
    totals, count = seconds.sum(axis=1), len(run.iterations)
    wall = float(totals.sum())
    body = [[k, f"{t:.1f}", f"{t / count:.3g}", f"{t / wall:.0%}" if wall else "–"] for k, t in zip(phases, totals)]
    body.append(["total of the timed phases", f"{wall:.1f}", f"{wall / count:.3g}", "100%" if wall else "–"])
    body += [[k, f"{np.nansum(run.columns[k][1]):.0f}", fmt(finite_mean(run.columns[k][1])), ""] for k in nfe]
    html += table(["over the logged iterations", "total", "per iteration", "share of time"], body)
    return html + "<p>Seconds are the slowest process's; checkpoints, sample grids and this report are not timed.</p>" + _memory(run)


def _memory(run: Run) -> str:
    """Peak memory of each phase per iteration (branchdiff/runtime/memory.py) and its maximum over the run."""
    keys = run.has(*MEMORY_KEYS)
    if not keys:
        return missing("Peak memory per phase")
    figure, (ax,) = new_figure(7, 2.6)
    for key in keys:
        iterations, values = run.columns[key]
        ax.plot(iterations, values, lw=1.2, marker="." if key == "memory_eval_gb" else None, label=key.removeprefix("memory_"))
    ax.set(xlabel="iteration", ylabel="GiB")
    title_and_legend(ax, "peak memory per phase (the largest process's)")
    planned = _planned_peaks(run.run_dir)
    body = [[key.removeprefix("memory_").removesuffix("_gb"), f"{np.nanmax(run.columns[key][1]):.3f}"] for key in keys]
    head = ["phase", "peak over the run (GiB)"]
    if planned:
        head.append(f"estimated peak (branchdiff plan on {planned['gpu']}, GiB)")
        peaks = dict(planned["phase_peaks_gib"])
        peaks["train"] = max(peaks.get("train", 0.0), peaks.get("optimizer", 0.0))  # the measured train phase holds the optimizer step
        body = [[*row, f"{peaks[row[0]]:.3f}" if row[0] in peaks else "–"] for row in body]
    note = ("" if planned else " The launch writes branchdiff plan's estimate of each phase beside them (RUN/plan.json) on CUDA devices.")
    return (img(png_data_uri(figure), "peak memory per phase") + table(head, body)
            + "<p>On a GPU: CUDA's peak of allocated tensor memory in the phase; on the CPU: the process's peak resident set "
              f"size in the phase (branchdiff/runtime/memory.py).{note}</p>")


def _planned_peaks(run_dir: Path) -> dict | None:
    """RUN/plan.json (written at a CUDA launch, branchdiff/training/fit.py), or None."""
    path = run_dir / "plan.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _update_keys(run: Run) -> list[str]:
    """The statistics of the run's objective (`train.loss`; its counts are drawn with the NFE), the
    gradient norm and the skipped steps."""
    loss = dotted_get(run.config, "train.loss") or "grpo"
    kinds = objective_class(loss).metric_kinds if loss in OBJECTIVES else {}  # a run of a loss this version does not have: none
    return [key for key, kind in kinds.items() if kind != "count"] + ["grad_norm", "steps_skipped"]


def _update(run: Run) -> str:
    wanted = _update_keys(run)
    keys = run.has(*wanted)
    if not keys:
        return missing("Update statistics")
    html = ("<p>logprob_check is max |log p<sub>train</sub> − log p<sub>rollout</sub>| at the first inner step, where the "
            f"ratio is exactly 1 before the first update: it should be ~1e-6 or below (exact zeros drawn at {LOGPROB_FLOOR:g}).</p>"
            if "logprob_check" in keys else "")
    html += _panels(run, keys, "update statistics: " + ", ".join(keys), _update_curve)
    absent = [k for k in wanted if k not in keys]
    return html + (missing(", ".join(absent)) if absent else "")


def _explore(run: Run) -> str:
    keys = [k for k in run.columns if k.startswith("explore_")]
    if not keys:
        return note("Explore not recorded in this run: explore was off.")
    agreement = [k for k in keys if any(w in k for w in ("spearman", "kendall", "top"))]
    html = ""
    if agreement:
        figure, (ax,) = new_figure(7, 3)
        for key in agreement:
            ax.plot(*run.columns[key], lw=1.0, marker="o", ms=2.5, label=key)
        title_and_legend(ax, "explorer vs policy: ranking agreement")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        html += img(png_data_uri(figure), "explore ranking agreement")
    body = [[k, fmt(finite_mean(run.columns[k][1]))] for k in keys if k not in agreement]
    return html + (table(["explore metric", "mean over the run"], body) if body else "")


def _cut(text: str) -> str:
    """`text` cut to at most CAPTION_CHARS characters, an ellipsis ending a cut one."""
    return text if len(text) <= CAPTION_CHARS else text[:CAPTION_CHARS - 1] + "…"


def _figures(grids: list[Grid], alt: str) -> str:
    """The grids as figures captioned with their iteration and, when the grid stores them, its rows'
    captions (prompts) in a numbered list."""
    html = ""
    for iteration, path in grids:
        uri = grid_data_uri(path)
        image = img(uri, f"{alt}, iteration {iteration}", "grid") if uri else note(f"{path.name} unreadable")
        playing = video_data_uri(path.with_suffix(".mp4"))  # a video family's grid, playing (the strip shows its frames)
        if playing:
            image += (f'<video class="grid" title="{escape(alt)}, iteration {iteration}" src="{playing}" autoplay loop muted '
                      'playsinline controls></video>')
        rows = "".join(f"<li>{escape(_cut(caption))}</li>" for caption in grid_captions(path) or [])
        html += f"<figure>{image}<figcaption>iteration {iteration}{f'<ol>{rows}</ol>' if rows else ''}</figcaption></figure>"
    return html


def _benchmarks(run: Run) -> str:
    """Each benchmark `branchdiff eval --benchmark NAME --weights RUN` scored this run on (RUN/benchmarks/NAME.json): our
    row in the paper's layout, the compared paper's rows under it, and what the sampling changed from the paper's protocol."""
    files = sorted((run.run_dir / "benchmarks").glob("*.json"))
    if not files:
        return "<p>No benchmark scored this run yet: branchdiff eval --benchmark NAME --weights RUN adds its table here.</p>"
    html = ""
    for path in files:
        data = json.loads(path.read_text())
        columns = data["columns"]
        rows = [[data["label"] + ("" if group == "all" else f" ({group})"), *(fmt(values.get(score)) for score, _ in columns)]
                for group, values in data["table"].items()]
        compare = data.get("compare")
        if compare:
            rows += [[f"{model} [paper]", *(fmt(values.get(score)) for score, _ in columns)] for model, values in compare["rows"].items()]
        html += f"<h3>{escape(data['benchmark'])}</h3><p>{escape(data.get('about', ''))}</p>"
        html += table(["model", *(title for _, title in columns)], rows)
        protocol = data.get("protocol")
        said = [f"the protocol of {protocol['paper']}" if protocol else "no paper's protocol for this family: its own settings"]
        said += [f"differs: {', '.join(data['differs_from_protocol'])}"] if data.get("differs_from_protocol") else []
        said += [f"[paper]: {compare['source']}"] if compare else []
        html += f"<p>{escape('; '.join(said))}.</p>"
    return html


def _samples(run: Run) -> str:
    held_out, training = sample_grids(run.run_dir)
    html = "<h3>Held-out prompts across iterations</h3>"
    if held_out:
        html += f"<p>The same prompts and seeds at each evaluation ({len(held_out)} grids, at most {EVAL_GRIDS} shown).</p>"
        html += _figures(evenly_spaced(held_out, EVAL_GRIDS), "held-out samples")
    else:
        html += missing("Held-out sample grids (samples/eval-iter-*.png)")
    html += "<h3>Latest training leaves</h3>"
    if training:
        html += "<p>Leaves of the iteration's random training prompts, one row a prompt.</p>"
        html += _figures(training[-TRAIN_GRIDS:], "training samples")
    else:
        html += missing("Training sample grids (samples/iter-*.png)")
    return html


SECTIONS: list[tuple[str, str, Callable[[Run], str]]] = [
    ("rewards", "Rewards", _rewards), ("heldout", "Held-out evaluation", _heldout), ("benchmarks", "Benchmarks", _benchmarks),
    ("advantages", "Advantages by depth", _advantages), ("cost", "Cost", _cost), ("update", "Update", _update),
    ("explore", "Explore", _explore), ("samples", "Samples", _samples),
]


def _section(run: Run, section_id: str, title: str, build: Callable[[Run], str]) -> str:
    if not len(run.iterations) and section_id != "samples":
        body = note("No iteration logged yet: metrics not recorded in this run.")
    else:
        try:
            body = build(run)
        except Exception as error:  # a report must not stop the run that rebuilds it
            body = note(f"This section could not be drawn: {error!r}")
    return f'<section><h2 id="{section_id}">{title}</h2>{body}</section>'


def write_report(run_dir: Path) -> Path:
    """Write `run_dir/report.html` (module doc) atomically (`storage.write_text`) and return its path.
    Raises FileNotFoundError when `run_dir` has no metrics.jsonl."""
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    body = _header(run) + "".join(_section(run, *section) for section in SECTIONS)
    title = escape(run_dir.resolve().name)
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>branchdiff run {title}</title>'
            f"<style>{STYLE}</style></head><body>{body}</body></html>\n")
    return storage.write_text(run_dir / "report.html", page)
