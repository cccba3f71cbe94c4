"""`logging.report_to` (branchdiff/training/trackers.py): a W&B offline run and a SwanLab local run
log what metrics.jsonl holds, step by step, the sample grids and the final evaluation; a resumed run
continues the same tracker run. The trackers' own files are read back with their own readers
(tests/tracker_files.py); tests/test_multiprocess.py checks the same under two processes."""

from __future__ import annotations

import json
import math

import pytest

from branchdiff.cli import main

pytest.importorskip("wandb")
pytest.importorskip("swanlab")

from tracker_files import swanlab_scalars, wandb_history  # noqa: E402


@pytest.mark.slow  # a release check: tests/test_multiprocess.py logs the metrics, the resume and the final evaluation to both trackers
# in the suite, tests/test_tiny_video.py a run's grids
def test_wandb_offline_and_swanlab_local_log_the_metrics_grids_and_evaluation_and_resume_continues_them(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_MODE", "local")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    common = ["tiny-chain", f"output_dir={run}", "logging.report_to=[tensorboard,wandb,swanlab]", "logging.sample_every=1",
              "logging.checkpoint_every=1", "prompts.eval_seeds=1"]
    assert main(["train", *common, "iterations=2", "final_eval=false"]) == 0
    assert main(["train", *common, "iterations=3", "--resume", "latest"]) == 0  # one more iteration, then the final evaluation
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    identity = json.loads((run / "trackers.json").read_text())["id"]

    ids, history = wandb_history(run)
    assert set(ids) == {identity} and len(ids) == 3  # two training sessions and the final evaluation's, one W&B run
    by_step = {}
    for row in history:
        by_step.setdefault(row.get("_step"), {}).update(row)
    for row in metrics:
        logged = by_step[row["iteration"]]
        for key, value in row.items():
            if key != "iteration" and isinstance(value, float) and math.isfinite(value):
                assert logged[key] == pytest.approx(value, rel=1e-6), key
    assert by_step[0]["samples/train/_type"] == "images/separated" and by_step[2]["samples/train/count"] == 1  # each iteration's grid
    final = json.loads((run / "eval.json").read_text())
    assert by_step[3]["final_eval/trained/tiny-geneval.strict"] == pytest.approx(final["trained"]["all"]["tiny-geneval.strict"]["mean"])

    ids, scalars, media = swanlab_scalars(run)
    assert set(ids) == {identity} and len(ids) == 3
    for row in metrics:
        for key, value in row.items():
            if key != "iteration" and isinstance(value, float) and math.isfinite(value):
                assert scalars[(key, row["iteration"])] == pytest.approx(value, rel=1e-6), key
    assert "samples/train" in media and ("final_eval/base/tiny-geneval", 3) in scalars


def test_a_tracker_that_is_not_installed_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"output_dir={run}", "logging.report_to=wandb"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("branchdiff: error: logging.report_to includes wandb, whose package is not installed: pip install wandb (or pip install "
                   "\"branchdiff-rl[track]\"), or leave it out") and not run.exists()


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A HOME without `wandb login`'s or `swanlab login`'s files, an environment without keys or modes,
    and a working folder without W&B's settings."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_CONFIG_DIR", "WANDB_BASE_URL", "NETRC",
                 "SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_SAVE_DIR"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.mark.parametrize("tracker,line", [
    ("wandb", "logging.report_to includes wandb, which logs online and finds no credentials here (no WANDB_API_KEY, no `wandb login`): run "
              "`wandb login` or set WANDB_API_KEY, log offline with WANDB_MODE=offline (upload later with `wandb sync`), or use "
              "logging.report_to=tensorboard"),
    ("swanlab", "logging.report_to includes swanlab, which logs online and finds no credentials here (no SWANLAB_API_KEY, no `swanlab login`): "
                "run `swanlab login` or set SWANLAB_API_KEY, log offline with SWANLAB_MODE=offline (upload later with `swanlab sync`) or "
                "local, or use logging.report_to=tensorboard"),
])
def test_a_tracker_online_without_credentials_is_one_line_before_anything_is_written(no_credentials, tmp_path, capsys, tracker, line):
    """W&B raised UsageError (SwanLab RuntimeError) once config.yaml, trackers.json and .lock were written."""
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"output_dir={run}", f"logging.report_to=[tensorboard,{tracker}]"]) == 2
    assert capsys.readouterr().err == f"branchdiff: error: {line}\n"
    assert not run.exists()


def test_a_tracker_with_credentials_or_offline_is_let_through(no_credentials, monkeypatch):
    """`wandb login`'s netrc entry, WANDB_MODE=offline, SWANLAB_API_KEY, SWANLAB_MODE=local: each is enough."""
    from urllib.parse import urlsplit

    import wandb

    from branchdiff.training.trackers import check_credentials

    netrc = no_credentials / ".netrc"
    netrc.write_text(f"machine {urlsplit(wandb.Settings().base_url).hostname}\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    check_credentials(["wandb"])
    netrc.unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_API_KEY", "k" * 21)
    check_credentials(["wandb", "swanlab"])
    monkeypatch.delenv("SWANLAB_API_KEY")
    monkeypatch.setenv("SWANLAB_MODE", "local")
    check_credentials(["swanlab"])


def test_the_old_tensorboard_key_names_its_replacement(capsys):
    assert main(["train", "tiny-chain", "logging.tensorboard=false"]) == 2
    assert "renamed logging.report_to: tensorboard (the default), wandb, swanlab or none" in capsys.readouterr().err
