"""Every network client against a server that takes the connection and never answers
(tests/conftest.py's `silent_server`): the hub while a model or a reward's weights load, a reward
server, the experiment trackers. Each ends the command with one line within a bounded time
(`branchdiff push`'s hub: tests/test_push.py)."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from branchdiff.cli import main
from branchdiff.runtime import hub

PREFIX = "branchdiff: error: "
QUICK = ["iterations=1", "prompts.per_iteration=1", "tree.roots=2", "sampling.num_steps=3", "final_eval=false", "logging.sample_every=0"]


@pytest.fixture
def hub_waits(monkeypatch) -> list[float]:
    """The waits huggingface_hub's retries ask for between tries, recorded instead of slept."""
    from huggingface_hub.utils import _http

    waits: list[float] = []
    clock = SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    clock.sleep = waits.append
    monkeypatch.setattr(_http, "time", clock)
    return waits


def one_line(capsys) -> str:
    """Stderr's last line, the only `branchdiff: error:` line, without its prefix."""
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1].startswith(PREFIX) and sum(line.startswith(PREFIX) for line in lines) == 1 and "Traceback" not in err, err
    return lines[-1][len(PREFIX):]


def test_a_hub_that_never_answers_while_a_model_loads_is_one_line(silent_server, hub_at, monkeypatch, tmp_path, capsys):
    """diffusers asks the hub for the model's info with no timeout (it waited forever), and lets the
    HTTP client's timeout through: both bounded now, the line names the hub and its wait."""
    hub_at(silent_server)
    monkeypatch.setattr(hub, "HUB_TIMEOUT", 1.0)
    start = time.monotonic()
    assert main(["sample", "--family", "sd3", "--model", "someone/not-cached", "--prompt", "a red circle", "--resolution", "64",
                 "--out", str(tmp_path / "out")]) == 2
    assert time.monotonic() - start < 30
    assert re.match(re.escape(f"model.path='someone/not-cached' could not be loaded as a StableDiffusion3Pipeline (not in the local hub cache, "
                              f"and the hub at {silent_server} did not answer within 1 s); pass model.path= a local diffusers folder"), one_line(capsys))
    assert not (tmp_path / "out").exists()


def test_a_hub_that_never_answers_while_prompts_download_is_one_line(silent_server, hub_at, hub_waits, monkeypatch, tmp_path, capsys):
    """HPDv2's prompts come by hf_hub_download, as a reward's weights do: huggingface_hub's own retries
    (6 tries, 23 s apart in all: its waits are recorded here, not slept), each wait at most HUB_TIMEOUT (its metadata
    retry's 60 s too)."""
    hub_at(silent_server)
    monkeypatch.setattr(hub, "HUB_TIMEOUT", 1.0)
    monkeypatch.setenv("BRANCHDIFF_DATA", str(tmp_path / "data"))
    start = time.monotonic()
    assert main(["train", "tiny-chain", "prompts.train=hpdv2:anime", f"output_dir={tmp_path / 'run'}"]) == 2
    assert sum(hub_waits) == 23 and time.monotonic() - start < 90 - 23
    assert one_line(capsys).startswith(f"HPDv2 prompts {tmp_path / 'data' / 'hpdv2' / 'anime.json'} not found and not fetched from the hub")
    assert not (tmp_path / "run").exists()

def test_a_reward_server_that_never_answers_is_one_line_before_the_run_writes(silent_server, tmp_path, capsys):
    """RemoteReward's own timeout and retries (branchdiff/rewards/remote.py) bound its first request, /health."""
    run = tmp_path / "run"
    start = time.monotonic()
    assert main(["train", "tiny-chain", f"output_dir={run}", f"reward={{remote: {silent_server}, kwargs: {{timeout: 0.5, retries: 1, backoff: 0.1}}}}",
                 "logging.report_to=none", *QUICK]) == 2
    assert time.monotonic() - start < 60
    assert one_line(capsys) == f"reward server {silent_server}/health did not answer within 0.5 s (2 attempts)"
    assert not run.exists()

@pytest.fixture
def fresh_wandb():
    """wandb with no session: it keeps the settings the first use in a process read (the offline tests')."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def _silent_tracker_line(name: str, environment: dict[str, str], tmp_path, monkeypatch, capsys, within: float) -> str:
    """A short run logging to tracker `name` (its settings in `environment`) whose server never answers: exit 2
    within `within` seconds; the line."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(f"{name.upper()}_MODE", raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    start = time.monotonic()
    assert main(["train", "tiny-chain", f"output_dir={tmp_path / 'run'}", f"logging.report_to={name}", *QUICK]) == 2
    assert time.monotonic() - start < within
    return one_line(capsys)


def test_a_wandb_server_that_never_answers_ends_the_run_with_one_line(silent_server, fresh_wandb, tmp_path, monkeypatch, capsys):
    """W&B's own bound (init_timeout, here WANDB_INIT_TIMEOUT=2) runs out on its first request (the run's
    resume status); its CommError was a traceback."""
    environment = {"WANDB_BASE_URL": silent_server, "WANDB_API_KEY": "local-" + "k" * 40, "WANDB_INIT_TIMEOUT": "2", "WANDB_SILENT": "true"}
    assert re.fullmatch(rf"logging.report_to: wandb did not start \(.*{silent_server}.*\); check the network connection and its server, log offline "
                        r"with WANDB_MODE=offline \(upload later with `wandb sync`\), or use logging.report_to=tensorboard; the run folder is "
                        r"kept: run the same command again", _silent_tracker_line("wandb", environment, tmp_path, monkeypatch, capsys, 120))


@pytest.mark.slow  # SwanLab's own bound, 6 requests of 10 s, cannot be shortened: about 80 s
def test_a_swanlab_server_that_never_answers_ends_the_run_with_one_line(silent_server, tmp_path, monkeypatch, capsys):
    environment = {"SWANLAB_API_HOST": f"{silent_server}/api", "SWANLAB_WEB_HOST": silent_server, "SWANLAB_API_KEY": "k" * 21}
    assert re.fullmatch(r"logging.report_to: swanlab did not start \(.*\); check the network connection and its server, log offline with "
                        r"SWANLAB_MODE=offline \(upload later with `swanlab sync`\) or local, or use logging.report_to=tensorboard; the run "
                        r"folder is kept: run the same command again", _silent_tracker_line("swanlab", environment, tmp_path, monkeypatch, capsys, 180))
