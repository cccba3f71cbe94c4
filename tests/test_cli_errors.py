"""CLI bad input: exit status 2, one `branchdiff: error:` line, and nothing already written is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from branchdiff.cli import main

PREFIX = "branchdiff: error: "


def error_line(capsys) -> str:
    """The single `branchdiff: error:` line on stderr; it must be the last line written there."""
    captured = capsys.readouterr()
    lines = [line for line in captured.err.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(PREFIX)]
    assert len(errors) == 1, captured.err
    assert lines[-1] == errors[0], captured.err
    assert captured.out == ""
    return errors[0]


def only_line(capsys) -> str:
    """Stderr is exactly one line, `branchdiff: error: ...` (no model was loaded, so no progress bars)."""
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith(PREFIX), captured.err
    assert captured.out == ""
    return captured.err.rstrip("\n")


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and directory (None) under root."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory left by an earlier run: config, metrics, one checkpoint."""
    run = tmp_path / "run"
    (run / "checkpoints" / "iter-000001").mkdir(parents=True)
    (run / "checkpoints" / "iter-000001" / "trainer_state.json").write_text('{"iteration": 1}')
    (run / "checkpoints" / "iter-000001" / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (run / "metrics.jsonl").write_text('{"iteration": 0, "reward_mean": 0.25}\n{"iteration": 1, "reward_mean": 0.5}\n')
    (run / "config.yaml").write_text("output_dir: earlier\niterations: 2\n")
    return run


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["iteratons=3"], "override 'iteratons=3': unknown key 'iteratons'; did you mean iterations?"),
        (["tree.rots=2"], "override 'tree.rots=2': unknown key 'tree.rots'; did you mean tree.roots?"),
        (["sampling.sde=flw"], "override 'sampling.sde=flw': 'sampling.sde' = 'flw' is not allowed; allowed: dance, flow, cps, ddim, ode (did you mean 'flow'?)"),
        (["iterations=0"], "override 'iterations=0': 'iterations' = 0 is out of range; it must be > 0"),
        (["tree.splits=[[50,2]]"], "'tree.splits' = [[50, 2]]: split step 50 is outside 0..9 (num_steps = 10)"),
        # found by tests/test_fuzz.py: 10²² steps exhausted memory building the schedule (the kernel killed the process)
        (["sampling.num_steps=10000000000000000000000"],
         "override 'sampling.num_steps=10000000000000000000000': 'sampling.num_steps' = 10000000000000000000000 is out of range; it must be in [1, 1000]"),
    ],
)
def test_bad_override_exits_2_with_one_line(capsys, overrides, expected):
    assert main(["train", *overrides]) == 2
    assert only_line(capsys) == PREFIX + expected


def test_bad_override_after_a_preset(capsys):
    assert main(["train", "tiny-chain", "iterations=2", "iterations=abc"]) == 2
    assert only_line(capsys) == PREFIX + "override 'iterations=abc': 'iterations' = 'abc' has the wrong type; expected int"


def test_override_without_equals_after_a_preset(capsys):
    assert main(["train", "tiny-chain", "iterations"]) == 2
    assert only_line(capsys) == PREFIX + "override 'iterations' is not of the form key=value (e.g. tree.roots=4)"


def test_missing_preset_suggests(capsys):
    assert main(["train", "tiny-chian"]) == 2
    line = only_line(capsys)
    assert line.startswith(PREFIX + "no preset or file 'tiny-chian'; did you mean tiny-chain")


def test_bad_key_in_yaml_file_names_file_and_line(capsys, tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("iterations: 3\ntree:\n  rots: 2\n")
    assert main(["train", str(path)]) == 2
    assert only_line(capsys) == PREFIX + f"{path}:3: unknown key 'tree.rots'; did you mean tree.roots?"


@pytest.mark.parametrize(
    "bad",
    [
        ["iteratons=3"],
        ["tree.roots=2.5"],
        ["train.learning_rate=-1"],
        ["tree.splits=[[50,2]]"],  # passed load_config before the fix: config.yaml was overwritten, logs/ created
        ["prune.depths=[0]"],
        # configurations that trained nothing passed load_config before (the model was loaded, then the run went on)
        ["tree.splits=[]"],  # the preset's one root per prompt, no split: a group of one
        ["train.train_steps_fraction=0.05"],  # no trainable step
        ["sampling.sde=cps", "sampling.noise_level=2"],  # cps's std is 0 at a = 2
        ["sampling.sde=cps", "tree.splits=[[0, 2], [9, 2]]"],  # cps at the last step: identical children
    ],
)
def test_bad_config_touches_nothing_already_written(capsys, run_dir, tiny_model_dir, bad):
    # model.path points at a loadable model, so only config validation stands between the
    # command and the run directory
    before = snapshot(run_dir)
    assert main(["train", f"output_dir={run_dir}", f"model.path={tiny_model_dir}", *bad, "--resume", "latest"]) == 2
    assert only_line(capsys).startswith(PREFIX)
    assert snapshot(run_dir) == before


def test_bad_config_touches_nothing_in_the_brief_form(capsys, run_dir):
    before = snapshot(run_dir)
    assert main(["train", f"output_dir={run_dir}", "iteratons=3"]) == 2
    assert only_line(capsys) == PREFIX + "override 'iteratons=3': unknown key 'iteratons'; did you mean iterations?"
    assert snapshot(run_dir) == before


def test_resume_latest_without_checkpoint_default_model(capsys, tmp_path):
    """Builds the Trainer with the built-in model: without assets/tiny the model load fails first.
    Either way: exit 2 and a single error line, and the metrics already written are untouched."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    assert main(["train", f"output_dir={run}", "--resume", "latest"]) == 2
    line = error_line(capsys)
    assert f"--resume latest: no checkpoint under {run / 'checkpoints'}" in line or "no tiny model at" in line, line
    assert (run / "metrics.jsonl").read_text() == '{"iteration": 0}\n'


def test_resume_latest_without_checkpoint(capsys, tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    (run / "checkpoints" / ".staging-000003").mkdir(parents=True)  # an interrupted save is not a checkpoint
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 5}\n')
    before = snapshot(run)
    assert main(["train", f"output_dir={run}", f"model.path={tiny_model_dir}", "--resume", "latest"]) == 2
    assert error_line(capsys) == PREFIX + f"--resume latest: no checkpoint under {run / 'checkpoints'}"
    assert snapshot(run) == before


def test_resume_from_a_directory_that_is_not_a_checkpoint(capsys, run_dir, tiny_model_dir):
    before = snapshot(run_dir)
    bogus = run_dir / "checkpoints"
    assert main(["train", f"output_dir={run_dir}", f"model.path={tiny_model_dir}", "--resume", str(bogus)]) == 2
    assert error_line(capsys) == PREFIX + f"--resume {bogus}: {bogus} is not a checkpoint (no trainer_state.json); pass a folder under {bogus} or latest"
    assert snapshot(run_dir) == before


def test_eval_missing_prompt_file(capsys, tiny_model_dir):
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", "/nonexistent.txt", "--seeds", "1", "--steps", "1"]) == 2
    assert error_line(capsys) == PREFIX + "prompt source '/nonexistent.txt' is neither tiny:train, tiny:held_out, tiny:all, tiny-video:train, tiny-video:held_out, tiny-video:all, hpdv2[:style], geneval, drawbench, hpdv2-test, hpd-train, flow-grpo-geneval:train, flow-grpo-geneval:test, flow-grpo-ocr:train, flow-grpo-ocr:test, flow-grpo-pickscore:train, flow-grpo-pickscore:test nor an existing file"


def test_eval_missing_model(capsys, tmp_path):
    missing = tmp_path / "no-model"
    assert main(["eval", "--model", str(missing), "--prompts", "tiny:held_out"]) == 2
    assert error_line(capsys).startswith(PREFIX + f"no tiny model at {missing}: expected {missing}/transformer/config.json")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["eval", "--steps", "many"], "eval: argument --steps: invalid int value: 'many'; see branchdiff eval --help"),
        (["trian"], "argument command: invalid choice: 'trian' (choose from 'train', 'config', 'sample', 'eval', 'rewards', 'data', 'serve-reward', 'plan', 'push', 'families', 'accelerate-config', 'bench', 'report'); see branchdiff --help"),
        ([], "the following arguments are required: command; see branchdiff --help"),
        (["sample", "--seeds", "2"], "sample: the following arguments are required: --out; see branchdiff sample --help"),
        (["sample", "--prompt"], "sample: argument --prompt: expected one argument; see branchdiff sample --help"),
        (["bench", "trees"], "bench: argument which: invalid choice: 'trees' (choose from 'tree', 'explore', 'curves', 'search', 'reward-server', 'overlap', "
         "'cache', 'proxies', 'hacking'); see branchdiff bench --help"),
        (["sample", "--steps", "1000001", "--out", "x"], "sample: argument --steps: must be in [1, 1000], got 1000001; see branchdiff sample --help"),
        (["eval", "--bogus", "1"], "eval: unrecognized arguments: --bogus 1; see branchdiff eval --help"),
        (["train", "--resmue", "latest"], "train: unrecognized arguments: --resmue; see branchdiff train --help"),
    ],
)
def test_argparse_errors_are_one_line_and_exit_2(capsys, argv, expected):
    # before: argparse printed its usage block, then `branchdiff eval: error: ...`, and raised SystemExit
    assert main(argv) == 2
    assert only_line(capsys) == PREFIX + expected


@pytest.mark.parametrize("argv, usage", [(["--help"], "usage: branchdiff [-h]"), (["train", "--help"], "usage: branchdiff train [-h]"),
                                         (["eval", "-h"], "usage: branchdiff eval [-h]")])
def test_help_still_prints_help_and_exits_0(capsys, argv, usage):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(usage) and captured.err == ""


def test_version_prints_the_installed_distributions_version(capsys, monkeypatch):
    """`branchdiff --version` said "the following arguments are required: command"; it prints the version
    pip installed (branchdiff-rl's metadata), and says so where the package runs without being installed."""
    import importlib.metadata

    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr() == (f"branchdiff {importlib.metadata.version('branchdiff-rl')}\n", "")

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == "branchdiff (version unknown: the distribution branchdiff-rl is not installed here; pip install -e .)\n"


BENCHMARKS = {"tree": ("branchdiff.bench.iteration", "bench_tree"), "explore": ("branchdiff.bench.iteration", "bench_explore"),
              "curves": ("branchdiff.bench.curves", "bench_curves"), "search": ("branchdiff.bench.search", "bench_search"),
              "sampler": ("branchdiff.bench.sampler", "bench_sampler"), "reward-server": ("branchdiff.bench.reward_server", "bench_reward_server"),
              "overlap": ("branchdiff.bench.overlap", "bench_overlap"), "cache": ("branchdiff.bench.block_cache", "bench_cache"),
              "proxies": ("branchdiff.bench.proxies", "build_proxies"), "hacking": ("branchdiff.bench.hacking", "bench_hacking"),
              "hacking-merge": ("branchdiff.bench.hacking", "merge_hacking")}


@pytest.fixture
def benchmarks(monkeypatch) -> dict[str, list]:
    """Every benchmark's function replaced by one that records its arguments (a real one runs for minutes)."""
    import importlib

    calls: dict[str, list] = {}
    for name, (module, function) in BENCHMARKS.items():
        monkeypatch.setattr(importlib.import_module(module), function, lambda *a, _name=name, **k: calls.setdefault(_name, []).append((a, k)))
    return calls


@pytest.mark.parametrize("argv, expected", [
    (["bench", "tree", "--sampler"], "bench tree: --sampler is an option of bench search, not of bench tree; see branchdiff bench search --help"),
    (["bench", "explore", "--repeats", "2"], "bench explore: --repeats is an option of bench tree and bench cache, not of bench explore; see branchdiff bench tree --help"),
    (["bench", "search", "--minutes=1"], "bench search: --minutes is an option of bench curves, not of bench search; see branchdiff bench curves --help"),
    (["bench", "reward-server", "--json", "x.json", "--seeds", "2"],
     "bench reward-server: --seeds is an option of bench curves, bench search, bench proxies and bench hacking, not of bench reward-server; "
     "see branchdiff bench curves --help"),
    (["bench", "tree", "--variants", "chain", "--task", "tiny-video"],
     "bench tree: --task is an option of bench curves, bench search, bench cache, bench proxies and bench hacking, not of bench tree; see "
     "branchdiff bench curves --help"),
    (["bench", "search", "--images", "2", "prompts.per_iteration=2"],
     "bench search: key=value overrides (prompts.per_iteration=2) are taken by bench tree, bench explore, bench curves, bench overlap, bench cache "
     "and bench hacking, "
     "not by bench search; "
     "see branchdiff bench tree --help"),
    (["bench", "search", "--temperature", "2"],
     "bench search: --temperature is λ of the reward-tilted target of bench search --sampler; add --sampler or leave --temperature out"),
    (["bench", "search", "--sampler", "--task", "mixture"],
     "bench search: --task is an option of bench search's best-reward benchmark, not of --sampler (its testbeds and seeds 0..n−1); leave one of them out"),
    (["bench", "search", "--sampler", "--prices", "tiny"],
     "bench search: --prices is an option of bench search's best-reward benchmark, not of --sampler (its testbeds and seeds 0..n−1); "
     "leave one of them out"),
    (["bench", "search", "--task", "mixture", "--prices", "h100"],
     "bench search --prices: unknown price set(s) h100; allowed: call-as-row, tiny, sd35-pickscore-512, flux-hps-1024, wan-1.3b-videoalign"),
    (["bench", "search", "--sampler", "--first-seed", "2"],
     "bench search: --first-seed is an option of bench search's best-reward benchmark, not of --sampler (its testbeds and seeds 0..n−1); "
     "leave one of them out"),
    (["bench", "tree", "--bogus"], "bench tree: unrecognized arguments: --bogus; see branchdiff bench tree --help"),
    (["bench", "cache", "--thresholds", "0.1,high"], "bench cache --thresholds 0.1,high: give comma-separated numbers, e.g. 0.1,0.2"),
    (["bench", "--sampler", "search"], "bench search: --sampler goes after the benchmark's name: branchdiff bench search --sampler; "
                                       "see branchdiff bench search --help"),
    # degenerate values started a whole benchmark, wrote an empty table, or failed at the end
    (["bench", "curves", "--merge", ""], "bench curves --merge '' names no file; give the JSON results to merge, comma-separated (e.g. --merge "
                                         "seeds-0-2.json,seeds-3-4.json)"),
    (["bench", "curves", "--merge", ",,"], "bench curves --merge ',,' names no file; give the JSON results to merge, comma-separated (e.g. --merge "
                                           "seeds-0-2.json,seeds-3-4.json)"),
    (["bench", "curves", "--variants", ""], "--variants '' names no variant; give comma-separated names (e.g. --variants chain,mix), or leave "
                                            "--variants out for the benchmark's default set"),
    (["bench", "tree", "--variants", ",,"], "--variants ',,' names no variant; give comma-separated names (e.g. --variants chain,mix), or leave "
                                            "--variants out for the benchmark's default set"),
    (["bench", "curves", "--reference", "nosuch"], "bench curves --reference nosuch: not one of the variants run (chain, branch, branch_pruned, "
                                                   "mix, explore_seeds, explore_tree); name one of them, or add it to --variants"),
    (["bench", "curves", "--variants", "mix,awm", "--reference", "chain"], "bench curves --reference chain: not one of the variants run (mix, "
                                                                           "awm); name one of them, or add it to --variants"),
    # an iteration budget beside a time one, or a budget given to a merge (which runs nothing), was not ignored but is named
    (["bench", "curves", "--iterations", "100", "--clock", "wall"], "bench curves --iterations 100 --clock wall: an iteration budget has no clock "
     "(each run records both clocks' minutes anyway); leave --clock out, or give --minutes instead of --iterations"),
    (["bench", "curves", "--minutes", "2", "--iterations", "100"], "bench curves: argument --iterations: not allowed with argument --minutes; "
                                                                   "see branchdiff bench curves --help"),
    (["bench", "curves", "--merge", "a.json", "--minutes", "3"], "bench curves --merge: --minutes sets the budget of a run, and --merge runs "
                                                                 "nothing (the files keep their own budget); leave --minutes out"),
    (["bench", "hacking"], "bench hacking needs --reward, the proxy to train on: e.g. --reward '{name: tiny-partial, kwargs: {terms: [count, "
                           "color]}}' or a learned proxy of branchdiff bench proxies (docs/hacking.md)"),
    (["bench", "hacking", "--merge", "a.json", "--reward", "tiny-partial"], "bench hacking --merge: --reward names the proxy of a run, and "
                                                                            "--merge runs nothing (the files keep theirs); leave --reward out"),
    (["bench", "hacking", "--reward", "{name: tiny-partial, weight: x}"], "bench hacking --reward '{name: tiny-partial, weight: x}': 'reward' "
     "entry {'name': 'tiny-partial', 'weight': 'x'}: weight must be a finite number; give a reward's name or a mapping, e.g. --reward "
     "'{name: tiny-partial, kwargs: {terms: [count, color]}}'"),
    (["bench", "hacking", "--reward", "tiny-partial", "--variants", "none,kl:train.kl_beta"], "mitigation 'kl:train.kl_beta': 'train.kl_beta' "
                                                                                            "is not key=value; write name:key=value:key=value"),
    (["bench", "proxies", "--sizes", "64,x"], "bench proxies --sizes '64,x': give comma-separated whole numbers of samples, each at least 2, "
                                              "e.g. 64,256,1024"),
    (["bench", "cache", "--thresholds", ""], "bench cache --thresholds '' names no threshold; give one or more in (0, 1), e.g. --thresholds 0.1,0.3"),
    (["bench", "cache", "--json", "/sys/bench.json"], "--json /sys/bench.json: cannot write in /sys (Permission denied); pass --json a file in a "
                                                      "folder you can write to"),
    (["bench", "search", "--out", "/sys/bench-out"], "--out /sys/bench-out: cannot write in /sys (Permission denied); pass --out a folder you "
                                                     "can write to"),
])
def test_an_option_of_another_benchmark_is_refused_naming_the_one_that_takes_it(argv, expected, benchmarks, capsys):
    """`bench tree --sampler` (an option of bench search) was ignored and the whole tree benchmark ran: one
    parser held every benchmark's options."""
    assert main(argv) == 2
    assert only_line(capsys) == PREFIX + expected
    assert benchmarks == {}


def test_bench_cache_refuses_thresholds_it_cannot_use_and_a_cache_override_before_any_work(capsys):
    """`bench cache ... sampling.block_cache=abc` ran with the bad value silently replaced (the header printed it); a threshold
    of 1 or more, which the setting refuses, ran too."""
    for argv, expected in ((["bench", "cache", "--thresholds", "0.2,1.5"], "bench cache --thresholds 0.2,1.5: give one or more thresholds, each "
                            "in (0, 1) as sampling.block_cache takes them, e.g. 0.1,0.3 (the uncached rollout, 0, is always measured)"),
                           (["bench", "cache", "sampling.block_cache=abc"], "bench cache sampling.block_cache=abc: the benchmark sets "
                            "sampling.block_cache itself, to each of --thresholds in turn; give the values as --thresholds (e.g. --thresholds 0.3)")):
        assert main(argv) == 2
        assert only_line(capsys) == PREFIX + expected


def test_a_benchmarks_json_and_out_are_checked_before_it_runs_and_out_defaults_outside_docs(benchmarks, tmp_path, capsys, monkeypatch):
    """`--json` on a folder failed only after the whole benchmark, and one in a missing folder too (bench cache): a folder is
    refused at once, a missing one is made. `--out` defaulted to docs/, so the reproduce commands of docs/curves.md, run from
    the repository's root, overwrote it: it defaults to runs/bench-<name>/."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "cache", "--json", str(tmp_path)]) == 2
    assert only_line(capsys) == f"{PREFIX}--json {tmp_path} is a folder; pass --json the path of a file (e.g. {tmp_path / 'result.json'})"
    (tmp_path / "a-file").write_text("")
    assert main(["bench", "tree", "--json", "a-file/b.json"]) == 2
    assert only_line(capsys) == f"{PREFIX}--json a-file/b.json: a-file is a file, not a folder; pass --json a file in a folder you can write to"
    assert benchmarks == {}
    for argv in (["bench", "curves"], ["bench", "search"], ["bench", "search", "--sampler"]):
        assert main(argv) == 0
    assert [call[0][3] for call in (benchmarks["curves"][0], benchmarks["search"][0], benchmarks["sampler"][0])] == [
        Path("runs/bench-curves"), Path("runs/bench-search"), Path("runs/bench-sampler")]


def test_every_option_of_a_benchmark_reaches_it(benchmarks, tmp_path, capsys):
    """Each benchmark's own options, and overrides before and after them, reach its function."""
    out, json_path = tmp_path / "out", tmp_path / "b.json"
    runs = [["bench", "tree", "a.b=1", "--json", str(json_path), "--repeats", "2", "--variants", "chain,tree", "c.d=2"],
            ["bench", "explore", "--json", str(json_path), "a.b=1"],
            ["bench", "curves", "--minutes", "0.5", "--seeds", "2", "--out", str(out), "--variants", "chain,mix", "--reference", "mix",
             "--task", "tiny-video", "--points", "3", "--eval-images", "2", "--clock", "modelled", "--first-seed", "3", "a.b=1"],
            ["bench", "curves", "--iterations", "120", "--seeds", "2", "--out", str(out), "--variants", "mix,guard", "--reference", "mix"],
            ["bench", "search", "--images", "4", "--seeds", "2", "--out", str(out), "--variants", "dts", "--task", "mixture", "--first-seed", "3",
             "--target-seed", "123", "--prices", "tiny, call-as-row"],
            ["bench", "search", "--sampler", "--temperature", "2", "--images", "4", "--seeds", "1", "--out", str(out), "--variants", "smc"],
            ["bench", "reward-server", "--json", str(json_path)],
            ["bench", "overlap", "--iterations", "2", "a.b=1", "--json", str(json_path)],
            ["bench", "proxies", "--task", "tiny-video", "--sizes", "8,16", "--seeds", "2", "--steps", "5", "--out", str(out)],
            ["bench", "hacking", "--reward", "{name: tiny-partial, kwargs: {terms: [count]}}", "--iterations", "20", "--seeds", "2", "--points", "3",
             "--variants", "none,kl:train.kl_beta=0.1", "--ensemble", "a,b", "--eval-images", "2", "--kl-chains", "3", "--best-of-n", "8",
             "--task", "tiny-video", "--first-seed", "4", "--out", str(out), "a.b=1"],
            ["bench", "hacking", "--merge", "x.json,y.json", "--out", str(out)]]
    for argv in runs:
        assert main(argv) == 0, capsys.readouterr().err
    assert benchmarks == {
        "tree": [((json_path, 2, ["a.b=1", "c.d=2"], ["chain", "tree"]), {})],
        "explore": [((json_path,), {"extra_overrides": ["a.b=1"]})],
        "curves": [((0.5, 2, None, out, 3, ["chain", "mix"], 2, ["a.b=1"], "modelled", "mix", "tiny-video", 3), {}),
                   ((120, 2, None, out, 7, ["mix", "guard"], 4, [], "iterations", "mix", "tiny", 0), {})],
        "search": [((4, 2, None, out, ["dts"]), {"task": "mixture", "first_seed": 3, "target_seed": 123, "prices": ["tiny", "call-as-row"]})],
        "sampler": [((4, 1, None, out), {"samplers": ["smc"], "temperature": 2.0})],
        "reward-server": [((json_path,), {})],
        "overlap": [((json_path, 2, ["a.b=1"]), {})],
        "proxies": [(("tiny-video", [8, 16], 2, out, None, 5), {})],
        "hacking": [(('{"name": "tiny-partial", "kwargs": {"terms": ["count"]}}', 20, 2, None, out, 3, ["none", "kl:train.kl_beta=0.1"], ["a", "b"],
                      2, 3, 8, ["a.b=1"], "tiny-video", 4), {})],
        "hacking-merge": [(([Path("x.json"), Path("y.json")], out, None), {})]}


BROKEN_VISION = {  # a package whose import fails as torchvision's did where pip had mixed a CPU torch with a CUDA torchvision
    "visionops/__init__.py": "from visionops import _meta_registrations\n",
    "visionops/_meta_registrations.py": "def register_meta(op):\n    raise RuntimeError(f'operator torchvision::{op} does not exist')\n\n\n"
                                        "register_meta('nms')\n",
    "visionops-0.24.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: visionops\nVersion: 0.24.0\n",
    "visionops-0.24.0.dist-info/top_level.txt": "visionops\n",
}


def lazy_import(module: str, name: str):
    """`name` of `module` imported as transformers' lazy module imports it: a failure becomes a RuntimeError
    saying to look up, and that a ModuleNotFoundError naming only the class."""
    import importlib

    try:
        try:
            return getattr(importlib.import_module(module), name)
        except Exception as error:
            raise RuntimeError(f"Failed to import {module} because of the following error (look up to see its traceback):\n{error}") from error
    except RuntimeError as error:
        raise ModuleNotFoundError(f"Could not import module '{name}'. Are this object's requirements defined correctly? Set the logging "
                                  "verbosity to DEBUG for the original import error.") from error


@pytest.mark.parametrize("how", ["lazy", "direct"])
def test_a_dependency_that_fails_to_import_is_one_line_naming_it_the_versions_and_the_fix(how, tmp_path, monkeypatch, capsys, tiny_model_dir):
    """`train` said only `Could not import module 'BloomPreTrainedModel'` (transformers' lazy import; the cause, `operator
    torchvision::nms does not exist`, showed only with --debug), and a RuntimeError raised by a direct import was a
    traceback. The line names the package that failed, the torch and torchvision installed, the innermost cause and the fix."""
    import importlib
    import importlib.metadata

    for name, text in BROKEN_VISION.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    load = (lambda *a, **k: lazy_import("visionops", "BloomPreTrainedModel")) if how == "lazy" else (lambda *a, **k: importlib.import_module("visionops"))
    monkeypatch.setattr("branchdiff.training.recipe.load_adapter", load)
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"model.path={tiny_model_dir}", f"output_dir={run}", "logging.report_to=none"]) == 2
    versions = {name: importlib.metadata.version(name) for name in ("torch", "torchvision")}
    assert error_line(capsys) == (
        f"{PREFIX}importing visionops failed: operator torchvision::nms does not exist (RuntimeError); found torch {versions['torch']}, "
        f"torchvision {versions['torchvision']}, visionops 0.24.0; reinstall torch and torchvision together from one index (without a GPU: "
        "pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cpu, as README's set-up), and "
        "pip check names any other package at a version that does not fit; --debug shows the traceback")
    assert not run.exists()


def test_branchdiffs_own_import_lines_are_kept(monkeypatch, capsys):
    """An ImportError branchdiff raises names its own fix (an optional package to install): left as it is."""
    def needs_bitsandbytes(*args, **kwargs):
        raise ImportError("train.optimizer=adamw8bit needs bitsandbytes: pip install 'branchdiff-rl[quant]'") from None

    monkeypatch.setitem(sys.modules["branchdiff.cli.main"].COMMANDS, "families", needs_bitsandbytes)
    assert main(["families"]) == 2
    assert only_line(capsys) == f"{PREFIX}train.optimizer=adamw8bit needs bitsandbytes: pip install 'branchdiff-rl[quant]'"


def test_console_script_argparse_error():
    script = Path(sys.executable).with_name("branchdiff")
    if not script.is_file():
        pytest.skip(f"console script not installed next to {sys.executable}")
    done = subprocess.run([str(script), "eval", "--steps", "many"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == PREFIX + "eval: argument --steps: invalid int value: 'many'; see branchdiff eval --help\n"


def test_console_script_bad_override(tmp_path):
    """The one subprocess test: the installed `branchdiff` script, exit status 2, one stderr line."""
    script = Path(sys.executable).with_name("branchdiff")
    if not script.is_file():
        pytest.skip(f"console script not installed next to {sys.executable}")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([str(script), "train", f"output_dir={run}", "iteratons=3"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == PREFIX + "override 'iteratons=3': unknown key 'iteratons'; did you mean iterations?\n"
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"] and (run / "metrics.jsonl").read_text() == "{}\n"


def test_overrides_may_follow_resume(capsys, tmp_path):
    # parsed as overrides (iteratons is then reported as unknown), not as unrecognized arguments
    assert main(["train", f"output_dir={tmp_path}", "--resume", "latest", "iteratons=3"]) == 2
    assert "unknown key 'iteratons'; did you mean iterations?" in error_line(capsys)


def test_documented_words_yaml_reads_as_booleans_are_accepted(capsys, run_dir):
    # before: 'train.mixed_precision' = False has the wrong type; expected str (YAML 1.1 reads no/off as booleans)
    before = snapshot(run_dir)
    assert main(["train", f"output_dir={run_dir}", "train.mixed_precision=no", "explore.mode=off", "final_eval=no"]) == 2
    assert only_line(capsys) == PREFIX + (f"output_dir {run_dir} already holds a run (metrics.jsonl or checkpoints/); "
                                          "continue it with --resume latest, or pass another output_dir=")
    assert snapshot(run_dir) == before


# ---------------------------------------------------------------- resume checks, through the CLI
def _run_args(model_dir: Path, run: Path, iterations: int, *extra: str) -> list[str]:
    """A tiny, fast run (as tests/test_trainer.py): 1 prompt × 2 chains of 2 steps, a checkpoint every iteration."""
    return [
        "train", "tiny-chain", f"model.path={model_dir}", f"output_dir={run}", f"iterations={iterations}", "seed=0",
        "reward=rewards_for_tests:Redness", "prompts.per_iteration=1", "tree.roots=2", "sampling.num_steps=2", "sampling.max_batch=8",
        "train.minibatch=4", "model.finetune=lora", "train.learning_rate=1e-3", "final_eval=false", "logging.checkpoint_every=1", "logging.sample_every=0", "logging.report_to=none", *extra,
    ]


def _iterations_run(monkeypatch) -> list[int]:
    """Record the iterations the trainer runs."""
    from branchdiff.training.recipe import Trainer

    seen: list[int] = []
    run_iteration = Trainer.run_iteration

    def recording(self, iteration, *args, **kwargs):
        seen.append(iteration)
        return run_iteration(self, iteration, *args, **kwargs)

    monkeypatch.setattr(Trainer, "run_iteration", recording)
    return seen


def test_resume_with_a_changed_lora_rank_is_refused_and_touches_nothing(capsys, tmp_path, tiny_model_dir):
    # before the resume check: a size-mismatch traceback from load_state, exit status 1
    from branchdiff.runtime.checkpoint import RESUMABLE_KEYS

    run = tmp_path / "run"
    assert main(_run_args(tiny_model_dir, run, 1)) == 0
    capsys.readouterr()
    before = snapshot(run)
    assert main([*_run_args(tiny_model_dir, run, 2, "train.lora_rank=4"), "--resume", "latest"]) == 2
    assert error_line(capsys) == PREFIX + (
        f"--resume {run / 'checkpoints' / 'iter-000000'}: the config differs from the checkpoint's: train.lora_rank: checkpoint 8, now 4; "
        f"resume with the run's config (keys that may change: {', '.join(RESUMABLE_KEYS)}) or start a new run")
    assert snapshot(run) == before


def test_resume_after_a_crash_inside_publish(capsys, tmp_path, tiny_model_dir, monkeypatch):
    """A crash inside `publish` of checkpoint 1 left it as .replaced-000001 (iter-000001 missing) next to
    its successor's .staging-000001: --resume latest puts checkpoint 1 back and continues after it, with
    more iterations than the run was started with; leftover staging folders do not survive the next save."""
    from branchdiff.training.recipe import Trainer

    run = tmp_path / "run"
    assert main(_run_args(tiny_model_dir, run, 2)) == 0
    checkpoints = run / "checkpoints"
    saved = snapshot(checkpoints / "iter-000001")
    (checkpoints / "iter-000001").rename(checkpoints / ".replaced-000001")
    (checkpoints / ".staging-000001").mkdir()
    (checkpoints / ".staging-000001" / "optimizer.bin").write_bytes(b"half")
    seen = _iterations_run(monkeypatch)
    save_checkpoint = Trainer.save_checkpoint

    def leftover_then_save(self, iteration):
        (checkpoints / ".staging-000007").mkdir(exist_ok=True)  # as if another save had been interrupted: the next save removes it
        save_checkpoint(self, iteration)

    monkeypatch.setattr(Trainer, "save_checkpoint", leftover_then_save)
    assert main([*_run_args(tiny_model_dir, run, 3), "--resume", "latest"]) == 0  # `iterations` may change: 2 → 3
    assert seen == [2]  # continued after checkpoint 1, not after the older iter-000000
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter-000001", "iter-000002"]
    assert snapshot(checkpoints / "iter-000001") == saved
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_sample_and_eval_refuse_a_size_or_missing_weights_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A size the folder's config files rule out, or `--weights` naming nothing a run trained, is
    refused before the pipeline loads (it loaded first), and a refused `sample` leaves no --out
    folder (it left an empty one)."""
    import branchdiff.models
    from tiny_pipelines import save_pipeline  # tests/ is on sys.path

    folder = save_pipeline("sd3", tmp_path / "sd3")

    def loaded(*args, **kwargs):
        raise AssertionError("the pipeline loaded before the input was checked")

    monkeypatch.setattr(branchdiff.models, "load_adapter", loaded)
    common = ["--family", "sd3", "--model", str(folder), "--steps", "1", "--images-per-prompt", "1"]
    for command in (["sample", "--prompt", "a red circle", "--out", str(tmp_path / "out")], ["eval", "--out", str(tmp_path / "out")]):
        assert main([*command, *common, "--resolution", "30x44"]) == 2  # the tiny pipeline's VAE factor 2 × patch 2
        assert error_line(capsys) == (f"{PREFIX}model.resolution=[30, 44] (height, width) is not possible for sd3: each side must be a "
                                      "multiple of 4 (e.g. [32, 44], or [44, 64] to keep its aspect ratio)")
        assert main([*command, *common, "--resolution", "32", "--weights", str(tmp_path / "runs" / "missing")]) == 2
        assert error_line(capsys).startswith(f"{PREFIX}no LoRA or fine-tuned denoiser at {tmp_path / 'runs' / 'missing'}; pass a run folder")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["tiny", "sd3"])
def test_loading_a_model_shows_no_progress_bars(family, tiny_model_dir, tmp_path, capsys):
    """`sample` printed diffusers' "Loading pipeline components" and transformers' "Loading weights" bars on stderr."""
    from tiny_pipelines import save_pipeline  # tests/ is on sys.path

    folder = save_pipeline("sd3", tmp_path / "sd3") if family == "sd3" else tiny_model_dir
    capsys.readouterr()  # what saving it printed
    assert main(["sample", "--family", family, "--model", str(folder), "--resolution", "32", "--steps", "1", "--images-per-prompt", "1",
                 "--prompt", "a red circle", "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "Loading" not in captured.err and "it/s" not in captured.err, captured.err
    assert captured.out.splitlines() == [str(tmp_path / "out" / "000-a_red_circle.png")]


@pytest.mark.parametrize("which", ["tree", "explore", "curves"])
def test_a_benchmarks_inputs_are_checked_before_any_model_loads(which, tmp_path, monkeypatch, capsys):
    """`bench tree prompts.train=missing.txt` built its first trainers (loading the model) before the prompt file
    was read: every variant's settings and inputs now pass the training preflight first."""
    import branchdiff.training.recipe

    def built(*args, **kwargs):
        raise AssertionError("a trainer was built before the benchmark's inputs were checked")

    monkeypatch.setattr(branchdiff.training.recipe.Trainer, "__init__", built)
    monkeypatch.chdir(tmp_path)  # a short path: a long one is shortened in the middle of the one-line error
    assert main(["bench", which, "prompts.train=missing.txt"]) == 2
    assert error_line(capsys).startswith(f"{PREFIX}prompt source 'missing.txt' is neither")


def test_a_destination_that_is_a_file_is_named_as_such_not_as_space_or_permissions(tmp_path, capsys):
    """`rewards convert videoalign SRC a-file` said "Not a directory: a-file (NotADirectoryError); free space or fix the path's
    permissions": it names the file; and any such error left to the generic line says what is wrong with the path."""
    from branchdiff.cli.main import _one_line

    (tmp_path / "a-file").write_text("")
    (tmp_path / "template.py").write_text("QUESTION = 'x'\n")
    assert main(["rewards", "convert", "videoalign", str(tmp_path), str(tmp_path / "a-file"), "--template", str(tmp_path / "template.py")]) == 2
    assert only_line(capsys) == f"{PREFIX}{tmp_path / 'a-file'} is a file; give a new folder to write the converted reward to"
    assert _one_line(NotADirectoryError(20, "Not a directory", "runs/a-file/x")) == (
        "runs/a-file/x: a part of this path is a file where a folder is needed (NotADirectoryError); give a path whose folders are folders")
    assert "free space" not in _one_line(IsADirectoryError(21, "Is a directory", "runs"))
