"""The papers' benchmarks (branchdiff/evaluation/benchmarks.py, docs/benchmarks.md) and the public data they read
(branchdiff/data/datasets.py): data sets fetched from a local stand-in of GitHub's raw file server, checked by their
pins, a cut or changed download and an offline machine each one line before any model loads; every named benchmark
evaluated end to end on the tiny model with stand-in scorers; the protocols and their sources; a killed evaluation
resumed without sampling again. Nothing reaches the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from branchdiff.cli import main
from branchdiff.data import datasets
from branchdiff.data.datasets import DataSet, RemoteFile, cached_path, digests
from branchdiff.errors import UserError
from conftest import TINY_CLIP  # the tiny detector and CLIP of conftest's geneval_parts

TESTS = Path(__file__).parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Quiet(SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args: object) -> None:
        type(self).requests.append(self.path)


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A local server standing in for raw.githubusercontent.com (BRANCHDIFF_DATA_MIRROR), the data root in tmp_path, and
    `add(name, {path: bytes})` registering a data set of those files, pinned to their bytes, that the server serves."""
    mirror = tmp_path / "mirror"
    Quiet.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(mirror)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("BRANCHDIFF_DATA_MIRROR", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("BRANCHDIFF_DATA", str(tmp_path / "data"))

    def add(name: str, files: dict[str, bytes], serve: bool = True) -> DataSet:
        pinned = []
        for path, data in files.items():
            if serve:
                (mirror / "owner" / "repo" / COMMIT / path).parent.mkdir(parents=True, exist_ok=True)
                (mirror / "owner" / "repo" / COMMIT / path).write_bytes(data)
            blob, sha256 = digests(data)
            pinned.append(RemoteFile(path, blob, sha256))
        entry = DataSet("owner/repo", COMMIT, tuple(pinned), "MIT (test)", f"the test set {name}")
        monkeypatch.setitem(datasets.DATASETS, name, entry)
        return entry

    yield add, mirror
    server.shutdown()
    server.server_close()


def test_a_data_set_is_fetched_checked_and_kept_and_never_fetched_twice(served, tmp_path):
    add, _ = served
    add("test-set", {"prompts/test.txt": b"a red car\na blue bird\n"})
    path = cached_path("test-set", "test.txt")
    assert path == tmp_path / "data" / "test-set" / "test.txt" and path.read_bytes() == b"a red car\na blue bird\n"
    assert not list(path.parent.glob("*.partial*")) and len(Quiet.requests) == 1
    assert cached_path("test-set", "test.txt") == path and len(Quiet.requests) == 1  # checked, not fetched again


def test_the_processes_of_a_launch_fetching_at_once_each_end_with_the_checked_file(served, tmp_path):
    """Every process of a launch reads the prompt set: they fetched into one FILE.partial, truncating each other's (a false
    "cut download", the file deleted) or renaming it from under one another (a traceback)."""
    from concurrent.futures import ThreadPoolExecutor

    add, _ = served
    data = b"".join(b"prompt %d with some words in it\n" % i for i in range(20000))
    add("test-set", {"prompts/big.txt": data})
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: cached_path("test-set", "big.txt"), range(4)))
    assert all(path.read_bytes() == data for path in paths) and not list(paths[0].parent.glob("*.partial*"))


def test_a_changed_or_cut_download_is_refused_and_nothing_is_kept(served, tmp_path):
    """The served bytes no longer match the pins (a file changed at its source, a download cut short): one line naming the
    URL, what was expected and the folder; neither the file nor its .partial is left to be read."""
    add, mirror = served
    entry = add("test-set", {"prompts/test.txt": b"a red car\na blue bird\n"})
    (mirror / "owner" / "repo" / COMMIT / "prompts" / "test.txt").write_bytes(b"a red car\n")  # cut short
    with pytest.raises(UserError) as caught:
        cached_path("test-set", "test.txt")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"data set test-set: {entry.url(entry.files[0])} gave 10 bytes that do not match the pinned file")
    assert f"put the file test.txt (SHA-256 {entry.files[0].sha256}) from {entry.url(entry.files[0])} into {tmp_path / 'data' / 'test-set'}" in line
    assert not (tmp_path / "data" / "test-set").exists() or not list((tmp_path / "data" / "test-set").iterdir())


def test_offline_or_a_damaged_copy_is_one_line_and_a_damaged_copy_is_fetched_again(served, tmp_path, monkeypatch, closed_port):
    add, _ = served
    entry = add("test-set", {"prompts/test.txt": b"a red car\na blue bird\n"})
    path = cached_path("test-set", "test.txt")
    path.write_bytes(b"a red car\na blue bi")  # a copy damaged in place
    assert cached_path("test-set", "test.txt").read_bytes() == b"a red car\na blue bird\n" and len(Quiet.requests) == 2
    path.write_bytes(b"a red car\n")
    monkeypatch.setenv("BRANCHDIFF_DATA_MIRROR", closed_port)
    with pytest.raises(UserError, match=rf"^data set test-set: {closed_port}/owner/repo/{COMMIT}/prompts/test.txt could not be fetched \(.*\); "
                                        rf"put the file test.txt \(SHA-256 {entry.files[0].sha256}\) from .* into {path.parent}$"):
        cached_path("test-set", "test.txt")
    assert path.read_bytes() == b"a red car\n"  # the damaged copy is never read as the set: it stays until replaced
    with pytest.raises(UserError, match=r"does not match its pins \(a partial or changed copy\); run branchdiff data fetch test-set"):
        cached_path("test-set", "test.txt", fetch=False)


def test_a_pin_is_gits_own_blob_id(tmp_path):
    data = "a photo of a cat\nun café\n".encode()
    (tmp_path / "file.txt").write_bytes(data)
    assert digests(data)[0] == subprocess.run(["git", "hash-object", str(tmp_path / "file.txt")], capture_output=True, text=True).stdout.strip()


def test_the_data_commands_fetch_and_list(served, capsys):
    add, _ = served
    add("test-set", {"prompts/test.txt": b"a red car\n", "prompts/train.txt": b"a blue bird\n"})
    assert main(["data", "list"]) == 0
    assert "test-set: the test set test-set" in capsys.readouterr().out
    assert main(["data", "fetch", "test-set"]) == 0
    assert "test-set: 2 file(s) checked in" in capsys.readouterr().out
    assert main(["data", "list"]) == 0
    listed = capsys.readouterr().out
    assert "test.txt" in listed and listed.count(" ok") >= 2
    assert main(["data", "fetch", "test-set", "nosuch"]) == 2  # every name checked before anything downloads
    assert capsys.readouterr().err.strip().startswith("branchdiff: error: no data set 'nosuch'; known: ")


def test_a_run_whose_prompt_set_cannot_be_fetched_stops_before_the_model_loads(served, closed_port, monkeypatch, tmp_path, capsys):
    import branchdiff.training.recipe

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded before the prompt set was checked")

    monkeypatch.setattr(branchdiff.training.recipe, "load_adapter", loaded)
    monkeypatch.setenv("BRANCHDIFF_DATA_MIRROR", closed_port)
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", "prompts.train=flow-grpo-pickscore:train", f"output_dir={run}", "logging.report_to=none"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("branchdiff: error: data set flow-grpo-pickscore: ") and "train.txt" in error and not run.exists()


# ---------------------------------------------------------------- every benchmark on the tiny model
FIXTURES = {  # a data set's files, small, in the source's format
    "geneval": {"prompts/evaluation_metadata.jsonl": "".join(json.dumps(row) + "\n" for row in [
        {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
        {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}], "prompt": "a photo of two dogs"},
        {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"}]).encode()},
    "flow-grpo-ocr": {"dataset/ocr/test.txt": b'A sign that says "OPEN"\nA mug printed with "hello world"\n'},
    "flow-grpo-pickscore": {"dataset/pickscore/test.txt": b"a cat on a sofa\na castle at dusk\n"},
    "drawbench": {"prompts/drawbench.json": json.dumps(["A red colored car.", "A black colored dog."]).encode()},
}
STAND_IN = "rewards_for_tests:Shifted"  # one per score, each its own offset
CLASSES = json.loads((TESTS / "data" / "geneval_verdicts.json").read_text())["classes"]  # GenEval's 80, the tiny detector's labels
FIXTURES["geneval"]["evaluation/object_names.txt"] = "\n".join(CLASSES).encode() + b"\n"


@pytest.mark.parametrize("name", ["geneval", "ocr", "pickscore", "drawbench", "hpdv2"])
def test_every_benchmark_evaluates_end_to_end_on_the_tiny_model(name, served, geneval_parts, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Its prompts fetched and checked, its scores (tiny stand-ins, one per score in its order) and its table in the papers'
    layout, with a paper's rows where there are some; the JSON holds the table."""
    from branchdiff.evaluation.benchmarks import BENCHMARKS
    from branchdiff.evaluation.paper_tables import PAPERS

    add, _ = served
    chosen = BENCHMARKS[name]
    data_set = {"geneval": "geneval", "ocr": "flow-grpo-ocr", "pickscore": "flow-grpo-pickscore", "drawbench": "drawbench"}.get(name)
    if data_set:
        add(data_set, FIXTURES[data_set])
    else:  # HPDv2's styles, where the hub download would put them
        for style in ("anime", "concept-art", "paintings", "photo"):
            (tmp_path / "data" / "hpdv2").mkdir(parents=True, exist_ok=True)
            (tmp_path / "data" / "hpdv2" / f"{style}.json").write_text(json.dumps([f"{style} of a cat", f"{style} of a harbour"]))
    scorers = "[" + ", ".join(f"{{name: {STAND_IN}, kwargs: {{offset: {k}}}}}" for k in range(len(chosen.rewards))) + "]"
    compare = next(iter(PAPERS.get(name, {})), None)
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tiny_model_dir), "--benchmark", name, "--rewards", scorers, "--out", str(out), "--steps", "2",
            "--json", str(tmp_path / "summary.json"), *(["--compare", compare] if compare else [])]
    if name == "geneval":  # GenEval's own scorer on a tiny random detector and CLIP (its classes from the fetched set)
        argv[argv.index("--rewards") + 1] = (f"[{{name: geneval, kwargs: {{detector: '{geneval_parts / 'detector'}', clip: {TINY_CLIP}, "
                                             f"clip_checkpoint: '{geneval_parts / 'clip.pt'}', detector_shortest_edge: 64}}}}]")
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("model"))
    assert all(title in header for _, title in chosen.columns), header
    assert f"{name}: no paper's protocol for the tiny family: its own settings" in printed
    table = json.loads((out / "benchmark.json").read_text())
    assert table["benchmark"] == name and table["table"]["all"]
    if compare:
        assert all(f"{model} [paper]" in printed for model in PAPERS[name][compare].rows)
    rows = len((out / "scores.csv").read_text().splitlines()) - 1
    prompts = {"geneval": 3, "ocr": 2, "pickscore": 2, "drawbench": 2, "hpdv2": 8}[name]
    assert rows == prompts * chosen.images_per_prompt.value  # the benchmark's images per prompt, whatever the family
    if name == "hpdv2":
        assert set(table["table"]) == {"all", "anime", "concept-art", "paintings", "photo"}


def test_a_protocol_is_the_papers_for_its_family_with_a_source_for_every_value():
    """Flow-GRPO's SD3.5 Medium evaluation (40 steps, CFG 4.5, 512², 4 images of each GenEval prompt, its Euler ODE), GenEval's
    own generator for SD 1.5 (50 steps, scale 9, 4 images, the pipeline's scheduler); none for FLUX."""
    import argparse
    from dataclasses import fields

    from branchdiff.cli.evaluate import _benchmark
    from branchdiff.evaluation.benchmarks import BENCHMARKS, protocol_settings

    settings, protocol = protocol_settings("geneval", "sd3")
    assert settings == {"prompts": "geneval", "rewards": "geneval", "images_per_prompt": 4, "steps": 40, "guidance": 4.5, "resolution": 512,
                        "solver": "training"} and protocol.paper.startswith("Flow-GRPO")
    assert protocol_settings("geneval", "sd15")[0] | {} == {"prompts": "geneval", "rewards": "geneval", "images_per_prompt": 4, "steps": 50,
                                                           "guidance": 9.0, "solver": "release"}
    assert protocol_settings("pickscore", "flux") == ({"prompts": "flow-grpo-pickscore:test", "rewards": "pickscore", "images_per_prompt": 1}, None)
    tabled = (Path(__file__).parents[1] / "docs" / "benchmarks.md").read_text()
    for chosen in BENCHMARKS.values():  # every value says where it was read, and docs/benchmarks.md tables it with that source
        for found in [chosen.images_per_prompt, *(getattr(p, f.name) for p in chosen.protocols.values() for f in fields(p) if f.name != "paper")]:
            assert "@" in found.source or "arXiv" in found.source, found
            assert all(part.strip() in tabled for part in found.source.split(";")), found.source
    args = argparse.Namespace(benchmark="geneval", compare=None, prompts=None, family="sd3", weights=None, steps=20, guidance=None,
                              resolution=None, images_per_prompt=None, solver=None, rewards=None)
    _benchmark(args)
    assert (args.steps, args.guidance, args.resolution, args.images_per_prompt, args.rewards) == (20, 4.5, 512, 4, "geneval")  # given wins


@pytest.mark.parametrize("extra, expected", [
    (["--compare", "flow-grpo"], "--compare names a paper whose rows stand beside a benchmark's: give --benchmark too"),
    (["--benchmark", "geneval", "--prompts", "tiny:held_out"], "--prompts with --benchmark geneval: the benchmark's prompts are geneval"),
    (["--benchmark", "nosuch"], "--benchmark nosuch: no such benchmark; known: geneval, ocr, pickscore, drawbench, hpdv2"),
    (["--benchmark", "geneval", "--compare", "nosuch"], "--compare nosuch: no rows of that paper on benchmark geneval; known: flow-grpo"),
    (["--benchmark", "drawbench", "--rewards", "pickscore"], "--rewards with --benchmark drawbench: give 5 reward(s), one per score in its order"),
])
def test_bad_benchmark_options_are_one_line_before_the_model_loads(extra, expected, served, tiny_model_dir, tmp_path, monkeypatch, capsys):
    import branchdiff.cli.common

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(branchdiff.cli.common, "load_model", loaded)
    add, _ = served
    add("drawbench", FIXTURES["drawbench"])
    assert main(["eval", "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"), *extra]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"branchdiff: error: {expected}"), error


def test_a_killed_evaluation_resumes_where_it_stopped_without_sampling_again(tiny_model_dir, tmp_path, monkeypatch):
    """SIGKILL after the second chunk's scores are recorded (32 of 144 prompts): run again into the same folder, the
    evaluation samples the other 112 only and ends with the scores of an evaluation never killed."""
    from branchdiff.evaluation import evaluate

    argv = ["eval", "--model", str(tiny_model_dir), "--prompts", "tiny:all", "--images-per-prompt", "1", "--steps", "3"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1"}
    killed = subprocess.run([sys.executable, str(TESTS / "killed_run.py"), "eval_records", "2", *argv, "--out", str(tmp_path / "resumed")],
                            env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    records = (tmp_path / "resumed" / "records" / "rank-0.jsonl").read_text().splitlines()
    assert len(records) == 32
    sampled = []
    sample_ode = evaluate.sample_ode
    monkeypatch.setattr(evaluate, "sample_ode", lambda adapter, prompts, *a, **k: sampled.extend(prompts) or sample_ode(adapter, prompts, *a, **k))
    assert main([*argv, "--out", str(tmp_path / "resumed")]) == 0
    assert len(sampled) == 144 - 32
    monkeypatch.setattr(evaluate, "sample_ode", sample_ode)
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    scores = [(tmp_path / folder / "scores.csv").read_text() for folder in ("resumed", "whole")]
    assert scores[0] == scores[1] and len(scores[0].splitlines()) == 145


def test_an_evaluation_of_other_weights_or_prompts_at_the_same_path_starts_over(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The records were keyed by the weights' path: a model re-saved at the same path (a run exporting more) or an edited
    prompt file found every prompt "already scored" and printed the old table. What they hold is in the fingerprint."""
    import shutil

    from branchdiff.evaluation import evaluate
    from branchdiff.models.tiny import TinyAdapter

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one red circle on the left\ntwo blue squares at the top\n")
    sampled = []
    sample_ode = evaluate.sample_ode
    monkeypatch.setattr(evaluate, "sample_ode", lambda adapter, texts, *a, **k: sampled.extend(texts) or sample_ode(adapter, texts, *a, **k))
    argv = ["eval", "--model", str(model), "--prompts", str(prompts), "--images-per-prompt", "1", "--steps", "2", "--out", str(tmp_path / "out")]
    assert main(argv) == 0 and len(sampled) == 2
    assert main(argv) == 0 and len(sampled) == 2  # the same: nothing sampled again
    first = (tmp_path / "out" / "scores.csv").read_text()
    TinyAdapter.random(seed=7).save_pretrained(model)  # other weights at the same path
    assert main(argv) == 0 and len(sampled) == 4
    assert "holds an evaluation of other settings, weights or prompts; its scores are replaced" in capsys.readouterr().err
    assert (tmp_path / "out" / "scores.csv").read_text() != first
    prompts.write_text("one green triangle at the bottom\ntwo blue squares at the top\n")
    assert main(argv) == 0 and len(sampled) == 6


def test_a_record_cut_off_by_a_kill_costs_only_its_own_prompt(tmp_path):
    from branchdiff.evaluation.records import ScoreRecords

    records = ScoreRecords(tmp_path, 0)
    records.append({0: {"s": [0.5]}})
    with records.path.open("a") as handle:
        handle.write('{"prompt": 1, "scores": {"s": [0.')  # the kill
    records.append({2: {"s": [0.25]}})
    assert records.done(1, ["s"]) == {0: {"s": [0.5]}, 2: {"s": [0.25]}}


def test_a_runs_benchmark_table_lands_in_its_report_beside_the_papers_rows(served, tiny_model_dir, tmp_path, capsys):
    """`eval --benchmark NAME --weights RUN` keeps the table in RUN/benchmarks/NAME.json and rewrites the run's report, whose
    Benchmarks section sets our row (its values) beside the compared paper's."""
    add, _ = served
    add("flow-grpo-pickscore", FIXTURES["flow-grpo-pickscore"])
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"model.path={tiny_model_dir}", f"output_dir={run}", "iterations=1", "prompts.per_iteration=1",
                 "tree.roots=2", "sampling.num_steps=2", "final_eval=false", "logging.report_to=none", "model.compile=none"]) == 0
    assert main(["eval", "--weights", str(run), "--benchmark", "pickscore", "--rewards", f"[{STAND_IN}]", "--steps", "2",
                 "--compare", "flow-grpo", "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    kept = json.loads((run / "benchmarks" / "pickscore.json").read_text())
    report = (run / "report.html").read_text()
    section = report[report.index('<h2 id="benchmarks">'):]
    assert f"{kept['table']['all']['pickscore']:.4g}" in section and "SD3.5-M + Flow-GRPO [paper]" in section and "23.31" in section
