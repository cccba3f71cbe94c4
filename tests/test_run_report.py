"""`branchdiff report`: RUN_DIR/report.html from a fake run (metrics with a cut-off last line,
per-depth keys, held-out evaluations, explore keys, eval.json, sample grids with and without row
captions), a partial run, an empty one and a directory that is no run; the figures it embeds (the
final evaluation's point, legends clear of every axes); the pure helpers against direct
computations; and headless Chromium rendering the page (skipped without the Debian package chromium)."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from matplotlib.figure import Figure
from PIL import Image

from branchdiff.cli import main
from branchdiff.report import run_report
from branchdiff.report.figures import base_level, grid_captions, moving_average, png_data_uri, save_grid
from branchdiff.report.run_data import columns, read_metrics, reward_components
from branchdiff.report.run_report import evenly_spaced, write_report

ITERATIONS = 40
EVAL_EVERY = 4  # held-out evaluation (and its grid) every 4 iterations: 10 grids, more than the 8 shown
SAMPLE_EVERY = 10  # training grids at 0, 10, 20, 30 and the last iteration
DEPTHS = 4
ATTRIBUTES = ("strict", "count", "color", "shape", "position")
SECTIONS = ("rewards", "heldout", "benchmarks", "advantages", "cost", "update", "explore", "samples")
HELD_OUT_PROMPTS = ["a red cube left of a blue sphere", "two green cones", 'a photo of a cat & a <dog> "inside"']
CAPTIONED_TRAINING = (30, ITERATIONS - 1)  # training grids saved with their prompts; the others are older, uncaptioned grids
FINAL_LABEL = "final evaluation (eval.json)"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def metrics_row(i: int, rng: np.random.Generator, iterations: int = ITERATIONS, full: bool = True) -> dict:
    """A realistic metrics line of iteration i (the keys of branchdiff/training/metrics.py; `full`: with
    held-out evaluations, per-depth statistics and explore)."""
    progress = i / iterations
    noise = lambda scale: scale * float(rng.standard_normal())  # noqa: E731
    row = {"iteration": i, "reward_mean": 0.6 + 0.2 * progress + noise(0.03), "reward_std": 0.1 + noise(0.01),
           "tiny-geneval": 0.6 + 0.2 * progress + noise(0.03), "hpsv2.1": 0.25 + 0.02 * progress + noise(0.005),
           "tiny-geneval_failed": 0, "tiny-geneval_nonfinite": 0,
           **{f"accuracy_{a}": min(1.0, 0.3 + 0.4 * progress + noise(0.05)) for a in ATTRIBUTES},
           "reward_zero_spread_fraction": 0.1, "reward_group_std": 0.1 + noise(0.01), "groups_dropped": 0,
           "nfe_rollout": 504, "nfe_rollout_computed": 480, "nfe_trained": 120, "edges_trained": 176,
           "rollout_seconds": 0.7 + noise(0.05), "reward_seconds": 0.08, "train_seconds": 0.4 + noise(0.02),
           "loss": noise(1e-8), "clip_fraction": 0.01 * progress, "kl": 1e-5 * progress, "logprob_check": 0.0 if i == 0 else 1e-7,
           "grad_norm": 3e-4 + noise(1e-5), "optimizer_steps": 1, "steps_skipped": 0}
    if not full:
        return row
    for d in range(1, DEPTHS + 1):
        row |= {f"advantage_std/depth_{d}": 1.0 / d + noise(0.05), f"advantage_abs_mean/depth_{d}": 0.8 / d + noise(0.05),
                f"edges_trained/depth_{d}": 2 ** d * 8}
    row |= {"memory_rollout_gb": 1.5 + noise(0.01), "memory_reward_gb": 1.2, "memory_train_gb": 2.5 + noise(0.02)}
    row |= {"explore_spearman_kept": 0.8 + noise(0.05), "explore_kendall_kept": 0.6 + noise(0.05), "explore_topk_overlap_kept": 0.7,
            "explore_pool_nfe": 1024, "explore_regen_nfe": 504, "explore_regen_seconds": 0.3}
    if i % 10 == 0:
        row["explore_spearman_pool"] = 0.7 + noise(0.05)
    if i % EVAL_EVERY == 0:
        row |= {"eval_tiny-geneval": 0.55 + 0.2 * progress, "eval_tiny-geneval.strict": 0.2 + 0.3 * progress,
                "eval_tiny-geneval.count": 0.6 + 0.1 * progress, "eval_seconds": 1.5, "memory_eval_gb": 1.8}
    if i == 5:
        row["kl"] = float("nan")  # written as NaN, as json.dumps does
    return row


def write_metrics(run, iterations: int = ITERATIONS, full: bool = True) -> list[dict]:
    """metrics.jsonl of `iterations` lines plus the start of a line a crash cut off; the rows."""
    rng = np.random.default_rng(0)
    rows = [metrics_row(i, rng, iterations, full) for i in range(iterations)]
    cut = json.dumps(metrics_row(iterations, rng, iterations, full))[:30]
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + cut)
    return rows


def write_grid(path, seed: int) -> None:
    """A grid as grids were saved before row captions: a PNG without text chunks."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (66, 130, 3), dtype=np.uint8)).save(path)


def write_captioned_grid(path, seed: int, prompts: list[str], per_prompt: int = 2) -> None:
    """A grid of `per_prompt` 8×8 images a row, one row a prompt, saved with the prompts as row captions."""
    images = torch.rand(len(prompts) * per_prompt, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    save_grid(images, path, nrow=per_prompt, row_captions=prompts)


def training_prompts(i: int) -> list[str]:
    """The random training prompts of iteration i's grid: one longer than a caption shows, one with HTML's special characters."""
    return [f"iteration {i}: " + "a very long prompt about a tiny yellow cylinder on a table " * 2, f'<b>{i} bold</b> & "quoted"']


def summary(mean: float) -> dict:
    return {"mean": mean, "std": 0.1, "images": 96, "nonfinite": 0}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A run directory with every input, and its metrics rows."""
    run = tmp_path_factory.mktemp("full") / "run"
    rows = write_metrics(run)
    config = {"output_dir": str(run), "iterations": ITERATIONS, "reward": ["tiny-geneval", "hpsv2.1"],
              "model": {"family": "tiny", "path": None}, "tree": {"roots": 1, "splits": [[0, 2], [1, 2], [2, 2], [3, 2]]},
              "sampling": {"num_steps": 10, "sde": "flow"}, "train": {"learning_rate": 0.001}, "explore": {"mode": "seeds"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    evaluation = {"prompts": "tiny:held_out", "images_per_prompt": 8, "scales": {"tiny-geneval": "partial credit in [0, 1]"},
                  "after_iteration": ITERATIONS - 1,
                  "base": {"all": {"tiny-geneval": summary(0.55), "tiny-geneval.strict": summary(0.2)}, "photo": {"tiny-geneval": summary(0.5)}},
                  "trained": {"all": {"tiny-geneval": summary(0.75), "tiny-geneval.strict": summary(0.5)}, "photo": {"tiny-geneval": summary(0.7)}}}
    (run / "eval.json").write_text(json.dumps(evaluation))
    for i in range(0, ITERATIONS, EVAL_EVERY):
        write_captioned_grid(run / "samples" / f"eval-iter-{i:06d}.png", i, HELD_OUT_PROMPTS)
    for i in [*range(0, ITERATIONS, SAMPLE_EVERY), ITERATIONS - 1]:
        if i in CAPTIONED_TRAINING:
            write_captioned_grid(run / "samples" / f"iter-{i:06d}.png", 1000 + i, training_prompts(i), per_prompt=4)
        else:
            write_grid(run / "samples" / f"iter-{i:06d}.png", 1000 + i)
    return run, rows


def capture_figures(patch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures the report embeds from now on, each after it was turned into its PNG."""
    figures: list[Figure] = []

    def capture(figure: Figure) -> str:
        uri = png_data_uri(figure)
        figures.append(figure)
        return uri

    patch.setattr(run_report, "png_data_uri", capture)
    return figures


@pytest.fixture(scope="module")
def written_report(full_run):
    """The full run's report, written once for the tests that read it, and the figures it embeds."""
    with pytest.MonkeyPatch.context() as patch:
        figures = capture_figures(patch)
        return write_report(full_run[0]), figures


@pytest.fixture(scope="module")
def full_report(written_report):
    return written_report[0]


@pytest.fixture(scope="module")
def report_figures(written_report):
    return written_report[1]


@dataclass
class Shown:
    """A <figure> of the page: its image's alt, its caption's own text and the items of its list."""

    alt: str | None = None
    caption: str = ""
    items: list[str] = field(default_factory=list)


class Page(HTMLParser):
    """Of an HTML page: the h2 ids; for each <img>, (section id, class, alt, src); the <figure>s; and
    each table as (section id, rows of cell texts)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images: list[tuple[str | None, str, str, str]] = []
        self.figures: list[Shown] = []
        self.tables: list[tuple[str | None, list[list[str]]]] = []
        self.open: list[str] = []  # the elements the parser is in, of those it follows
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        section = self.sections[-1] if self.sections else None
        if tag == "h2" and attributes.get("id"):
            self.sections.append(attributes["id"])
        if tag == "img":
            self.images.append((section, attributes.get("class"), attributes.get("alt"), attributes.get("src")))
            if "figure" in self.open:
                self.figures[-1].alt = attributes.get("alt")
        if tag == "figure":
            self.figures.append(Shown())
        if tag == "li" and "figure" in self.open:
            self.figures[-1].items.append("")
        if tag == "table":
            self.tables.append((section, []))
        if tag == "tr":
            self.tables[-1][1].append([])
        if tag in ("td", "th"):
            self.tables[-1][1][-1].append("")
        if tag in ("figure", "figcaption", "li", "td", "th"):
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.open:
            del self.open[len(self.open) - 1 - self.open[::-1].index(tag):]

    def handle_data(self, data: str) -> None:
        inner = self.open[-1] if self.open else None
        if inner == "li" and "figure" in self.open:
            self.figures[-1].items[-1] += data
        elif inner == "figcaption":
            self.figures[-1].caption += data
        elif inner in ("td", "th"):
            self.tables[-1][1][-1][-1] += data

    def table(self, last_header: str) -> list[list[str]]:
        """The rows of the table whose header ends with `last_header`, the header left out."""
        return next(rows[1:] for _, rows in self.tables if rows and rows[0][-1] == last_header)


def decode(src: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(src.removeprefix("data:image/png;base64,"), validate=True)))
    image.load()
    return image


# ---------------------------------------------------------------- the page
def test_a_full_run_gives_one_self_contained_page_with_every_section(full_run, full_report):
    (run, rows), path = full_run, full_report
    assert path == run / "report.html"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "eval.json", "metrics.jsonl", "report.html", "samples"]  # no temporary file
    text = path.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text), "the page must not load anything"
    assert "<script" not in text and "<link" not in text and "@import" not in text and "url(" not in text
    page = Page(text)
    assert page.sections == list(SECTIONS)
    assert "not recorded" not in text and "could not be drawn" not in text  # every input is there and every plot drew
    for _section, kind, alt, src in page.images:
        assert src.startswith("data:image/png;base64,") and alt and kind in ("plot", "grid")
        assert decode(src).size[0] > 0
    plots = {section for section, kind, _, _ in page.images if kind == "plot"}
    assert plots == set(SECTIONS) - {"samples", "benchmarks"}  # a table, where the run scored a benchmark
    alts = [alt for _, _, alt, _ in page.images]
    assert {"reward curves", "held-out evaluation", "advantage heatmaps by depth", "explore ranking agreement", "peak memory per phase"} <= set(alts)
    assert page.table("peak over the run (GiB)") == [["rollout", f"{max(r['memory_rollout_gb'] for r in rows):.3f}"], ["reward", "1.200"],
                                   ["train", f"{max(r['memory_train_gb'] for r in rows):.3f}"], ["eval", "1.800"]]
    # 10 held-out grids: 8 shown, first and last included; the 3 newest training grids
    held_out = [alt for _, kind, alt, _ in page.images if kind == "grid" and alt.startswith("held-out")]
    training = [alt for _, kind, alt, _ in page.images if kind == "grid" and alt.startswith("training")]
    shown = [int(alt.rsplit(" ", 1)[1]) for alt in held_out]
    assert len(shown) == 8 and shown == sorted(shown) and shown[0] == 0 and shown[-1] == ITERATIONS - EVAL_EVERY
    assert training == [f"training samples, iteration {i}" for i in (20, 30, ITERATIONS - 1)]
    grid = next(src for _, kind, _, src in page.images if kind == "grid")  # held-out, iteration 0
    assert base64.b64decode(grid.removeprefix("data:image/png;base64,")) == (run / "samples" / "eval-iter-000000.png").read_bytes()
    # header: run facts, the final reward against the base model's
    assert f"{ITERATIONS} iterations logged" in text and f"last iteration {ITERATIONS - 1}" in text
    assert f"vs base {rows[0]['reward_mean']:.4g} (iteration 0)" in text
    assert "<details><summary>config.yaml</summary>" in text and "learning rate" in text
    # eval.json: a base / trained / difference table per prompt group
    assert "<h3>all</h3>" in text and "<h3>photo</h3>" in text and "+0.3" in text


def shows_captions(figure: Shown, captions: list[str]) -> bool:
    """Whether the figure lists each caption, in order, whole or cut (an ellipsis ending it) to at most 80 characters."""
    return len(figure.items) == len(captions) and all(
        len(item) <= 80 and (item == caption or (item.endswith("…") and caption.startswith(item[:-1])))
        for item, caption in zip(figure.items, captions))


def check_captions(page: Page) -> None:
    """Every grid figure of `page` is captioned with its iteration and, when saved with them, its prompts."""
    grids = [f for f in page.figures if f.alt and f.alt.startswith(("held-out samples", "training samples"))]
    assert len(grids) == 8 + 3
    for figure in grids:
        iteration = int(figure.alt.rsplit(" ", 1)[1])
        assert figure.caption == f"iteration {iteration}"
        if figure.alt.startswith("held-out"):
            assert figure.items == HELD_OUT_PROMPTS
        elif iteration in CAPTIONED_TRAINING:
            assert shows_captions(figure, training_prompts(iteration)) and figure.items[0] != training_prompts(iteration)[0]  # cut
        else:
            assert figure.items == []  # a grid saved without captions


def check_final_row(page: Page, rows: list[dict]) -> None:
    """The held-out section's table: base, last in-training and final value of each held-out score."""
    table = page.table(FINAL_LABEL)
    last = ITERATIONS - EVAL_EVERY
    assert table == [
        ["tiny-geneval", f"{rows[0]['eval_tiny-geneval']:.4g}", f"{rows[last]['eval_tiny-geneval']:.4g} at {last}", f"0.75 at {ITERATIONS}"],
        ["tiny-geneval.strict", "0.2", f"{rows[last]['eval_tiny-geneval.strict']:.4g} at {last}", f"0.5 at {ITERATIONS}"],
        ["tiny-geneval.count", "0.6", f"{rows[last]['eval_tiny-geneval.count']:.4g} at {last}", "–"],  # not in eval.json
    ]


def test_grids_list_the_prompts_of_their_rows(full_report):
    page = Page(full_report.read_text())
    check_captions(page)
    text = full_report.read_text()
    assert "&lt;b&gt;30 bold&lt;/b&gt; &amp; &quot;quoted&quot;" in text and "<b>30" not in text  # escaped
    assert grid_captions(full_report.parent / "samples" / "iter-000020.png") is None  # the fixture's uncaptioned grid


def test_the_final_evaluation_follows_the_heldout_curves(full_run, full_report, report_figures):
    (_, rows), page = full_run, Page(full_report.read_text())
    check_final_row(page, rows)
    assert f"after the update of iteration {ITERATIONS - 1}, at {ITERATIONS}" in full_report.read_text()
    heldout = next(f for f in report_figures if any(ax.get_title() == "eval_tiny-geneval" for ax in f.axes))
    stars = {ax.get_title(): [line.get_xydata().tolist() for line in ax.get_lines() if line.get_label() == FINAL_LABEL] for ax in heldout.axes}
    assert stars == {"eval_tiny-geneval": [[[ITERATIONS, 0.75]]], "eval_tiny-geneval.strict": [[[ITERATIONS, 0.5]]], "eval_tiny-geneval.count": []}
    assert FINAL_LABEL in [text.get_text() for text in heldout.legends[0].get_texts()]


@pytest.mark.parametrize("after_iteration", [13, None])
def test_the_final_evaluation_lies_after_the_iteration_eval_json_names(tmp_path, monkeypatch, after_iteration):
    run = tmp_path / "run"
    write_metrics(run, iterations=12)  # evaluations at 0, 4 and 8
    evaluation = {"base": {"all": {"tiny-geneval.strict": summary(0.2)}}, "trained": {"all": {"tiny-geneval.strict": summary(0.5)}}}
    if after_iteration is not None:
        evaluation["after_iteration"] = after_iteration
    (run / "eval.json").write_text(json.dumps(evaluation))
    figures = capture_figures(monkeypatch)
    page = Page(write_report(run).read_text())
    x = 14 if after_iteration is not None else 12  # after the update of iteration 13, else of the last logged, 11
    axes = next(ax for f in figures for ax in f.axes if ax.get_title() == "eval_tiny-geneval.strict")
    assert [line.get_xydata().tolist() for line in axes.get_lines() if line.get_label() == FINAL_LABEL] == [[[x, 0.5]]]
    assert ["tiny-geneval.strict", "0.2", "0.4 at 8", f"0.5 at {x}"] in page.table(FINAL_LABEL)


def test_no_legend_covers_an_axes_or_leaves_the_figure(report_figures):
    legends = 0
    for figure in report_figures:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        for legend in [*figure.legends, *(ax.get_legend() for ax in figure.axes if ax.get_legend())]:
            box = legend.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= figure.bbox.width and box.y1 <= figure.bbox.height
            for ax in figure.axes:
                assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
                assert not ax.get_title() or not box.overlaps(ax.title.get_window_extent(renderer)), ax.get_title()
            legends += 1
    # on top of small multiples: rewards, signal, held-out, update; above axes: per-depth means, the two cost plots, memory, explore
    assert legends == 4 + 5


def test_a_failed_write_keeps_the_old_page(tmp_path, monkeypatch):
    run = tmp_path / "run"
    rows = write_metrics(run, iterations=3, full=False)
    old = write_report(run).read_text()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))  # the page would change

    class Refused(Exception):
        pass

    def refuse(*args: object) -> None:
        raise Refused

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(Refused):
        write_report(run)
    assert (run / "report.html").read_text() == old and sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report.html"]


def test_the_cli_prints_the_page(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")  # a run that has not logged yet
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.html")


def test_a_partial_run_says_what_was_not_recorded(tmp_path):
    run = tmp_path / "partial"
    write_metrics(run, iterations=12, full=False)
    text = write_report(run).read_text()
    page = Page(text)
    assert page.sections == list(SECTIONS) and "could not be drawn" not in text
    for what in ("Held-out evaluation during training", "The final evaluation (eval.json)", "Per-depth advantage statistics",
                 "Held-out sample grids (samples/eval-iter-*.png)", "Training sample grids (samples/iter-*.png)", "config.yaml",
                 "Peak memory per phase"):
        assert f"{what} not recorded in this run." in text
    assert "Explore not recorded in this run: explore was off." in text
    assert {s for s, kind, _, _ in page.images} == {"rewards", "cost", "update"}


def test_an_empty_or_broken_run_still_renders(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0, "reward_mean"')  # the first line, cut off
    (run / "config.yaml").write_text("iterations: [unclosed\n")
    (run / "eval.json").write_text('{"base": ')
    write_grid(run / "samples" / "iter-000000.png", 0)
    (run / "samples" / "iter-000010.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    text = write_report(run).read_text()
    assert Page(text).sections == list(SECTIONS) and "No iteration logged yet" in text
    assert "could not be drawn" not in text and "unreadable" in text  # the half-written grid
    (run / "eval.json").write_bytes(b'{"base": "caf\xe9"}')  # not UTF-8: a report must not stop the run that rebuilds it
    assert "No iteration logged yet" in write_report(run).read_text()


def test_a_directory_without_metrics_is_refused(tmp_path, capsys):
    message = f"{tmp_path} is not a run directory (no metrics.jsonl); pass the output_dir of branchdiff train"
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(message)}$"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"branchdiff: error: {message}"]
    assert not (tmp_path / "report.html").exists()


# ---------------------------------------------------------------- helpers
def test_metrics_lines_cut_off_are_skipped_and_nan_kept(full_run):
    run, rows = full_run
    read = read_metrics(run / "metrics.jsonl")
    assert [r["iteration"] for r in read] == list(range(ITERATIONS))
    assert math.isnan(read[5]["kl"]) and read[7] == json.loads(json.dumps(rows[7]))


def test_base_level_is_the_value_at_iteration_zero(full_run):
    _, rows = full_run
    logged = columns(rows)
    assert base_level(*logged["reward_mean"]) == rows[0]["reward_mean"]
    assert base_level(*logged["eval_tiny-geneval.strict"]) == rows[0]["eval_tiny-geneval.strict"] == 0.2
    iterations, values = logged["eval_tiny-geneval.strict"]
    assert list(iterations) == list(range(0, ITERATIONS, EVAL_EVERY))  # only the lines that log it
    assert base_level(*columns(rows[1:])["reward_mean"]) is None  # a resumed run's log without iteration 0
    assert base_level(*columns([{"iteration": 0, "kl": float("nan")}])["kl"]) is None


def test_reward_components_are_the_unclaimed_keys(full_run):
    _, rows = full_run
    assert reward_components(list(columns(rows))) == ["tiny-geneval", "hpsv2.1"]
    prefixed = ["reward_mean", "reward_tiny-geneval", "reward_tiny-geneval_failed", "reward_tiny-geneval_nonfinite",
                "accuracy_strict", "explore_spearman_kept", "edges_trained/depth_2"]  # the trainer's earlier key names
    assert reward_components(prefixed) == ["reward_tiny-geneval"]


def test_every_key_a_training_iteration_logs_is_claimed_but_its_reward():
    """Regression: `learning_rate` (logged since the schedule landed) was drawn as a reward component.
    The keys are a real iteration's, pinned in tests/data/pinned/ (test_pinned_runs.py)."""
    rows = json.loads((Path(__file__).parent / "data" / "pinned" / "mix-lora-kl.json").read_text())["metrics"]
    assert "learning_rate" in rows[0] and reward_components(list(rows[0])) == ["reward_tiny-geneval"]


@pytest.mark.parametrize("window", [1, 2, 3, 7])
def test_moving_average_is_the_trailing_mean_of_finite_values(window):
    values = np.random.default_rng(window).normal(size=30)
    values[[4, 5, 17]] = np.nan
    expected = []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1): i + 1]
        recent = recent[np.isfinite(recent)]
        expected.append(recent.mean() if len(recent) else np.nan)
    np.testing.assert_allclose(moving_average(values, window), expected, rtol=1e-12, equal_nan=True)


@pytest.mark.parametrize("length", [0, 1, 5, 8, 9, 10, 37, 500])
def test_evenly_spaced_keeps_first_and_last(length):
    items = list(range(length))
    chosen = evenly_spaced(items, 8)
    assert len(chosen) == min(length, 8) and chosen == sorted(set(chosen))
    if length:
        assert chosen[0] == 0 and chosen[-1] == length - 1


# ---------------------------------------------------------------- a browser
def test_headless_chromium_renders_the_page(full_run, full_report, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium not installed (Debian package chromium)")
    report = full_report
    expected = Page(report.read_text())
    flags = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120, check=True).stdout
    rendered = Page(dom)
    assert rendered.sections == list(SECTIONS)
    assert [(s, kind, alt) for s, kind, alt, _ in rendered.images] == [(s, kind, alt) for s, kind, alt, _ in expected.images]
    check_captions(rendered)  # the prompts as <li> under their grids
    check_final_row(rendered, full_run[1])
    assert f"after the update of iteration {ITERATIONS - 1}, at {ITERATIONS}" in dom
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,2400", report.as_uri()], capture_output=True, timeout=120, check=True)
    counts = {colour: n for n, colour in Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 24)}
    assert len(counts) > 1000  # the page with its images unreadable has ~600 colours (text antialiasing)
    assert counts.get((31, 119, 180), 0) > 1000  # matplotlib's first line colour (C0): the plots were drawn
