"""Checkpoint folders: publication by renames, crash clean-up, and the resume config check."""

from pathlib import Path

import pytest

from branchdiff.errors import ConfigError
from branchdiff.runtime import checkpoint
from branchdiff.settings.load import load_config, to_dict


def _folder(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "file").write_text(content)
    return path


def test_publish_replaces_an_existing_checkpoint_and_leaves_nothing_behind(tmp_path):
    """Regression: re-saving an iteration removed the old checkpoint before the new one had its name."""
    _folder(tmp_path / "iter-000003", "old")
    _folder(tmp_path / ".staging-000003", "new")
    checkpoint.publish(tmp_path / ".staging-000003", tmp_path / "iter-000003")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000003"]
    assert (tmp_path / "iter-000003" / "file").read_text() == "new"


def test_clean_interrupted_restores_or_drops_what_a_crash_left(tmp_path):
    _folder(tmp_path / "iter-000001", "one")
    _folder(tmp_path / ".replaced-000002", "two")  # crash between the two renames of publish
    _folder(tmp_path / ".replaced-000001", "stale one")  # crash after the second rename
    _folder(tmp_path / ".staging-000004", "half written")
    checkpoint.clean_interrupted(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000001", "iter-000002"]
    assert (tmp_path / "iter-000001" / "file").read_text() == "one"
    assert (tmp_path / "iter-000002" / "file").read_text() == "two"


def test_config_check_names_what_differs_and_ignores_what_may_change(tmp_path):
    saved = to_dict(load_config("tiny-chain"))
    resumable = to_dict(load_config("tiny-chain", ["iterations=500", "logging.sample_every=3", "sampling.exact=true"]))
    checkpoint.check_config(saved, resumable, tmp_path)
    changed = to_dict(load_config("tiny-chain", ["train.lora_rank=4", "seed=9"]))
    with pytest.raises(ConfigError) as error:
        checkpoint.check_config(saved, changed, tmp_path)
    assert str(error.value).startswith(f"--resume {tmp_path}: the config differs from the checkpoint's: seed: checkpoint 0, now 9, "
                                       "train.lora_rank: checkpoint 8, now 4; resume with the run's config")
    older = {**saved, "train": {k: v for k, v in saved["train"].items() if k != "kl_beta"}}  # a key a newer version added
    checkpoint.check_config(older, to_dict(load_config("tiny-chain")), tmp_path)


def test_resume_on_another_number_of_processes_is_refused(tmp_path):
    checkpoint.check_processes(None, 2, tmp_path)  # a checkpoint from before the count was stored
    checkpoint.check_processes(2, 2, tmp_path)
    with pytest.raises(ConfigError, match=r"trained on 2 processes, this launch has 1; resume with --num_processes 2"):
        checkpoint.check_processes(2, 1, tmp_path)


def test_pruning_renames_before_deleting(tmp_path):
    for i in range(3):
        _folder(tmp_path / checkpoint.name(i), str(i))
    checkpoint.prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000002"]
    _folder(tmp_path / ".pruned-000000", "half deleted")  # a crash inside prune
    checkpoint.clean_interrupted(tmp_path)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["iter-000002"] and len(list(tmp_path.iterdir())) == 1


def test_iterations_may_not_change_when_pruning_stops_at_a_fraction_of_them(tmp_path):
    saved = to_dict(load_config("tiny-chain", ["prune.active_fraction=0.5"]))
    with pytest.raises(ConfigError, match=r"iterations: checkpoint 60, now 120"):
        checkpoint.check_config(saved, to_dict(load_config("tiny-chain", ["prune.active_fraction=0.5", "iterations=120"])), tmp_path)
