"""CLI bad input: exit status 2, one `branchdiff: error:` line, and nothing already written is touched."""

from __future__ import annotations

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
        (["sampling.sde=flw"], "override 'sampling.sde=flw': 'sampling.sde' = 'flw' is not allowed; allowed: dance, flow, cps (did you mean 'flow'?)"),
        (["iterations=0"], "override 'iterations=0': 'iterations' = 0 is out of range; it must be > 0"),
        (["tree.splits=[[50,2]]"], "'tree.splits' = [[50, 2]]: split step 50 is outside 0..9 (num_steps = 10)"),
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
    assert line.startswith(PREFIX + "no preset or file 'tiny-chian'; presets: ") and "did you mean tiny-chain" in line


def test_bad_key_in_yaml_file_names_file_and_line(capsys, tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("iterations: 3\ntree:\n  rots: 2\n")
    assert main(["train", str(path)]) == 2
    assert only_line(capsys) == PREFIX + f"{path}:3: unknown key 'tree.rots'; did you mean tree.roots?"


@pytest.mark.parametrize(
    "bad",
    [
        "iteratons=3",
        "tree.roots=2.5",
        "train.learning_rate=-1",
        "tree.splits=[[50,2]]",  # passed load_config before the fix: config.yaml was overwritten, logs/ created
        "prune.depths=[0]",
    ],
)
def test_bad_config_touches_nothing_already_written(capsys, run_dir, tiny_model_dir, bad):
    # model.path points at a loadable model, so only config validation stands between the
    # command and the run directory
    before = snapshot(run_dir)
    assert main(["train", f"output_dir={run_dir}", f"model.path={tiny_model_dir}", bad, "--resume", "latest"]) == 2
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
    assert error_line(capsys) == PREFIX + f"--resume {bogus}: {bogus} is not a checkpoint (no trainer_state.json)"
    assert snapshot(run_dir) == before


def test_eval_missing_prompt_file(capsys, tiny_model_dir):
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", "/nonexistent.txt", "--seeds", "1", "--steps", "1"]) == 2
    assert error_line(capsys) == PREFIX + "prompt source '/nonexistent.txt' is neither tiny:train, tiny:held_out, tiny:all nor an existing file"


def test_eval_missing_model(capsys, tmp_path):
    missing = tmp_path / "no-model"
    assert main(["eval", "--model", str(missing), "--prompts", "tiny:held_out"]) == 2
    assert error_line(capsys).startswith(PREFIX + f"no tiny model at {missing}: expected {missing}/transformer/config.json")


def test_argparse_usage_errors_exit_2(capsys):
    # argparse's own errors exit (SystemExit) instead of returning, after a usage line
    with pytest.raises(SystemExit) as caught:
        main(["eval", "--steps", "many"])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "branchdiff eval: error: argument --steps: invalid int value: 'many'"


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
