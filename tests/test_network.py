"""Every network client against a server that takes the connection and never answers
(tests/conftest.py's `silent_server`): the hub while a model or a reward's weights load, a reward
server, the experiment trackers. Each ends the command with one line within a bounded time
(`branchdiff push`'s hub: tests/test_push.py)."""

from __future__ import annotations

import re
import time

from branchdiff.cli import main
from branchdiff.runtime import hub

PREFIX = "branchdiff: error: "


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
