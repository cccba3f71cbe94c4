"""Real faults, not simulated ones: a full filesystem (a small tmpfs), a damaged checkpoint that
`--resume latest` falls back from, two runs started at once on one output_dir, and exported files
whose bytes must not depend on PYTHONHASHSEED. (A rank stopped by SIGSTOP is in test_multiprocess.py;
kills at any moment are in test_crash_resume.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from branchdiff.cli import main
from branchdiff.runtime import checkpoint

PREFIX = "branchdiff: error: "
LORA = "pytorch_lora_weights.safetensors"
SETTINGS = ["tiny-chain", "model.finetune=lora", "train.learning_rate=1e-3", "seed=3", "prompts.per_iteration=2", "tree.roots=3", "sampling.num_steps=3", "sampling.max_batch=8",
            "prompts.eval_seeds=1", "final_eval=false", "logging.checkpoint_every=1", "logging.checkpoints_total_limit=5",
            "logging.sample_every=0", "logging.report_to=none"]


def train_args(model: Path, run: Path, iterations: int, *extra: str) -> list[str]:
    return ["train", *SETTINGS, f"model.path={model}", f"output_dir={run}", f"iterations={iterations}", *extra]


def lora_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / LORA)


def assert_same_lora(a: Path, b: Path) -> None:
    first, second = lora_of(a), lora_of(b)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> Path:
    """The reference: the same 3 iterations, never stopped."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert main(train_args(tiny_model_dir, run, 3)) == 0
    return run


# ---------------------------------------------------------------- a full filesystem
@pytest.fixture
def small_filesystem(tmp_path):
    """A tmpfs mounted for the test (root, or the capability to mount, needed); unmounted after."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1400k", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root or CAP_SYS_ADMIN")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_stops_with_one_line_keeps_the_last_checkpoint_and_resumes_exactly(small_filesystem, tiny_model_dir, uninterrupted,
                                                                                           capsys):
    """1.4 MB hold the config, the first checkpoint (~840 kB), metrics and the report, not the second
    checkpoint: the run stops at it with the documented line, leaves nothing half-written, and after
    the filesystem grows `--resume latest` ends with the uninterrupted run's LoRA."""
    run = small_filesystem / "run"
    assert main(train_args(tiny_model_dir, run, 3)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    newest = run / "checkpoints" / "iter-000000"
    assert line.startswith(f"{PREFIX}could not write {run}/")
    assert "(No space left on device: " in line and " free, about " in line and " needed); " in line
    assert line.endswith(f"the newest complete checkpoint, {newest}, is intact; free disk space (or pass another output_dir=) "
                         "and continue with --resume latest")
    leftovers = [p.name for p in run.rglob("*") if p.name.startswith(".") and p.name not in (".lock",)]
    assert leftovers == []  # no staging folder, no temporary file
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["iter-000000"]
    assert checkpoint.verify(newest)[1] is None  # its manifest checks out
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] in ([0], [0, 1])  # whole lines only
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_filesystem)], check=True)
    assert main(train_args(tiny_model_dir, run, 3, "--resume", "latest")) == 0
    assert_same_lora(run / "lora", uninterrupted / "lora")
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


# ---------------------------------------------------------------- a damaged checkpoint
def test_resume_latest_falls_back_past_a_damaged_checkpoint_and_ends_as_if_never_stopped(tiny_model_dir, uninterrupted, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(tiny_model_dir, run, 2)) == 0
    damaged = run / "checkpoints" / "iter-000001"
    (damaged / LORA).write_bytes((damaged / LORA).read_bytes()[:1000])  # cut short
    capsys.readouterr()
    assert main(train_args(tiny_model_dir, run, 3, "--resume", "latest")) == 0
    err = capsys.readouterr().err
    assert f"branchdiff: skipping checkpoint {damaged}: damaged ({LORA} has 1000 bytes, the manifest says" in err
    # it says which checkpoint it continues from (it said nothing)
    assert f"branchdiff: resuming from {run / 'checkpoints' / 'iter-000000'}: 1 of 3 iterations done" in err
    assert_same_lora(run / "lora", uninterrupted / "lora")


# ---------------------------------------------------------------- two runs, one output_dir
def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "branchdiff.cli", *args], env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # a release check (~20–45 s of subprocesses); python -m pytest -m slow
def test_two_runs_started_at_once_on_one_output_dir_one_trains_the_other_stops(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    runs = [_cli(*train_args(tiny_model_dir, run, 3, f"seed={seed}")) for seed in (11, 12)]
    finished = [(process, *process.communicate(timeout=300)) for process in runs]
    codes = sorted(process.returncode for process, _, _ in finished)
    assert codes == [0, 2], [err[-2000:] for _, _, err in finished]
    (winner, _, _), (loser, _, loser_err) = sorted(finished, key=lambda item: item[0].returncode)
    line = loser_err.strip().splitlines()[-1]
    assert line.startswith(f"{PREFIX}output_dir {run} is in use by another run (pid {winner.pid} on ")
    seed = 11 if winner is runs[0] else 12
    assert f"seed: {seed}\n" in (run / "config.yaml").read_text()  # the winner's files only
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    for folder in checkpoint.checkpoints(run / "checkpoints"):
        state, problem = checkpoint.verify(folder)
        assert problem is None and state["config"]["seed"] == seed


def test_a_lock_left_by_a_dead_run_is_taken_over(tiny_model_dir, tmp_path):
    """A run that locked the folder and was killed (SIGKILL: no clean-up) leaves its lock file; the
    operating system released the lock with the process, so the next run takes it over."""
    run = tmp_path / "run"
    run.mkdir()
    holder = ("import fcntl, json, os, signal, sys\n"
              "handle = open(sys.argv[1], 'a+')\n"
              "fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
              "handle.write(json.dumps({'pid': os.getpid(), 'host': 'here', 'started': 'then'})); handle.flush()\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", holder, str(run / ".lock")], capture_output=True)
    assert killed.returncode == -9 and json.loads((run / ".lock").read_text())["pid"] > 0
    assert main(train_args(tiny_model_dir, run, 1)) == 0
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()


# ---------------------------------------------------------------- deterministic files
@pytest.mark.slow  # a release check (~20–45 s of subprocesses); python -m pytest -m slow
def test_exported_files_are_byte_identical_whatever_pythonhashseed(tiny_model_dir, tmp_path):
    """The LoRA export listed target_modules in set order, which depends on PYTHONHASHSEED."""
    outputs = []
    held_out = tmp_path / "held-out.txt"
    held_out.write_text("one red circle on the left\ntwo blue squares at the top\n")
    for hash_seed in ("1", "2"):
        run = tmp_path / f"run-{hash_seed}"
        process = _cli(*train_args(tiny_model_dir, run, 1, "final_eval=true", f"prompts.eval={held_out}"), env={"PYTHONHASHSEED": hash_seed})
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        outputs.append({name: (run / name).read_bytes() for name in (f"lora/{LORA}", "config.yaml", "eval.json",
                                                                     f"checkpoints/iter-000000/{LORA}")})
    first, second = outputs
    for name in first:
        assert first[name] == second[name].replace(b"run-2", b"run-1"), name


def _fill(mount: Path, leave: int) -> None:
    """Fill the filesystem at `mount` until about `leave` bytes are left."""
    free = shutil.disk_usage(mount).free
    (mount / "ballast").write_bytes(b"\0" * max(0, free - leave))


def _writers(folder: Path) -> dict:
    """Every kind of write a run makes, each through branchdiff's writers, about 600 kB each."""
    from safetensors.torch import save_file

    from branchdiff.report.figures import save_grid
    from branchdiff.runtime import metrics_log, storage

    tensor = torch.randn(150_000)
    return {
        "torch.save": lambda: storage.replace_file(folder / "optimizer.bin", lambda tmp: torch.save({"state": tensor}, tmp)),
        "safetensors": lambda: storage.replace_folder(folder / "lora", lambda staging: save_file({"w": tensor}, staging / LORA)),
        "png grid": lambda: save_grid(torch.rand(16, 3, 64, 64), folder / "grid.png", nrow=4),
        "text": lambda: storage.write_text(folder / "report.html", "x" * 600_000),
        "metrics line": lambda: metrics_log.append(folder / "metrics.jsonl", {"iteration": 1, "pad": "y" * 600_000}),
    }


@pytest.mark.parametrize("writer", ["torch.save", "safetensors", "png grid", "text", "metrics line"])
def test_every_writer_on_a_full_filesystem_raises_disk_full_and_keeps_the_old_file(small_filesystem, writer):
    """A write that does not fit (torch's zip writer, safetensors, PIL and plain files each fail in
    their own way) raises `DiskFull` naming the file, leaves no temporary file, and the previous
    version of the file is still there, whole."""
    from branchdiff.runtime import metrics_log
    from branchdiff.runtime.storage import DiskFull

    folder = small_filesystem / "run"
    folder.mkdir()
    old = {"optimizer.bin": b"old", "lora": None, "grid.png": b"old png", "report.html": b"old page", "metrics.jsonl": b'{"iteration": 0}\n'}
    for name, data in old.items():
        (folder / name).mkdir() if data is None else (folder / name).write_bytes(data)
    (folder / "lora" / LORA).write_bytes(b"old lora")
    _fill(small_filesystem, 200_000)
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with pytest.raises(DiskFull) as failure:
        _writers(folder)[writer]()
    assert "(No space left on device: " in str(failure.value) and str(folder) in str(failure.value)
    after = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == before  # no leftover, nothing changed
    assert [iteration for iteration, _ in metrics_log.read(folder / "metrics.jsonl")] == [0]


def test_what_a_killed_write_left_is_cleaned_when_the_folder_is_claimed_again(tiny_model_dir, tmp_path):
    """A process killed inside a write leaves `.NAME.tmp` or `.NAME.staging` (and, between the two
    renames of a folder, `.lora.replaced` without `lora`): the next run on the folder removes them
    and puts the replaced folder back."""
    run = tmp_path / "run"
    assert main(train_args(tiny_model_dir, run, 1)) == 0
    exported = (run / "lora" / LORA).read_bytes()
    (run / "lora").rename(run / ".lora.replaced")  # killed between replace_folder's renames
    (run / ".lora.staging").mkdir()
    (run / ".lora.staging" / LORA).write_bytes(b"half")
    (run / ".report.html.tmp").write_text("<html")
    (run / "samples").mkdir(exist_ok=True)
    (run / "samples" / ".eval-iter-000000.png.tmp").write_bytes(b"\x89PNG")
    assert main(train_args(tiny_model_dir, run, 1, "--resume", "latest")) == 0  # nothing left to train: it claims, then ends
    leftovers = sorted(p.name for p in [*run.iterdir(), *(run / "samples").iterdir()] if p.name.endswith((".tmp", ".staging", ".replaced")))
    assert leftovers == [] and (run / "lora" / LORA).read_bytes() == exported


def test_clean_leftovers_puts_a_replaced_folder_back_and_removes_the_rest(tmp_path):
    from branchdiff.runtime.storage import clean_leftovers

    (tmp_path / ".lora.replaced").mkdir()
    (tmp_path / ".lora.replaced" / LORA).write_bytes(b"old")  # its successor never got the name
    (tmp_path / "report.html").write_text("new")
    (tmp_path / ".report.html.replaced").write_text("older")  # its successor did: the old one goes
    (tmp_path / ".config.yaml.tmp").write_text("half")
    (tmp_path / ".lock").write_text("{}")  # not a leftover
    removed = clean_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == [".config.yaml.tmp", ".report.html.replaced"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "lora", "report.html"]
    assert (tmp_path / "lora" / LORA).read_bytes() == b"old"
