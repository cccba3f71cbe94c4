"""Experiment trackers (`logging.report_to`: tensorboard, wandb, swanlab, none, or a list) through
Accelerate's trackers: the run's config, every metric of metrics.jsonl at its iteration, the sample
grids (an image, or a video's grid as a GIF) and the final evaluation (`final_eval/<model>/<score>`).

A run keeps one id (RUN/trackers.json), so a resumed run continues the same W&B / SwanLab run
(`resume: allow`) and TensorBoard purges what the earlier session logged after its last checkpoint.
Offline: W&B with `WANDB_MODE=offline` (RUN/logs/wandb/offline-run-*, `wandb sync` uploads them),
SwanLab with `SWANLAB_MODE=offline` (RUN/logs/swanlab/run-*, `swanlab sync`) or `local` (the same files, read
by `swanlab watch RUN/logs/swanlab`; needs `swanlab[dashboard]`). Their files live under RUN/logs; the main
process alone writes them. Online without credentials is refused before anything is written
(`check_credentials`); a tracker whose server is out of reach ends the run with one line once the
library's own bounds run out (W&B: `init_timeout`, 90 s, WANDB_INIT_TIMEOUT; SwanLab: 10 s a request,
5 retries).
"""

from __future__ import annotations

import json
import secrets
import string
import tempfile
from pathlib import Path
from typing import Any

import torch

from branchdiff.errors import ConfigError, UserError, one_line
from branchdiff.runtime import storage

IDS_FILE = "trackers.json"
OFFLINE = {"wandb": "WANDB_MODE=offline (upload later with `wandb sync`)",
           "swanlab": "SWANLAB_MODE=offline (upload later with `swanlab sync`) or local"}  # the online trackers, and how each logs offline


def check_installed(names: list[str]) -> None:
    """Refuse a tracker whose package is missing, before anything is written."""
    import importlib.util

    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"logging.report_to includes {name}, whose package is not installed: pip install {name} "
                              "(or pip install \"branchdiff-rl[track]\"), or leave it out")


def check_credentials(names: list[str]) -> None:
    """Refuse W&B or SwanLab online without credentials, before anything is written: without a
    terminal their init stops the run once its folder is written, and with one it asks for a key."""
    for name, ready in (("wandb", _wandb_ready), ("swanlab", _swanlab_ready)):
        if name in names and not ready():
            key = f"{name.upper()}_API_KEY"
            raise ConfigError(f"logging.report_to includes {name}, which logs online and finds no credentials here (no {key}, no `{name} login`): "
                              f"run `{name} login` or set {key}, log offline with {OFFLINE[name]}, or use logging.report_to=tensorboard")


def _wandb_ready() -> bool:
    """W&B logs offline (or is disabled), or finds credentials where wandb.init looks: the environment,
    `wandb login`'s netrc, its settings files. Read afresh, with neither a prompt nor the network, and
    without wandb's session (which keeps the first settings a process reads)."""
    import os

    import wandb
    from wandb.sdk.lib import wbauth

    settings = wandb.Settings(settings_system=str(Path(os.environ.get("WANDB_CONFIG_DIR", "~/.config/wandb")).expanduser() / "settings"))
    settings.update_from_system_settings()  # `wandb offline`, `wandb login --host`
    settings.update_from_env_vars(dict(os.environ))
    if settings.mode in ("offline", "dryrun", "disabled"):
        return True
    host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
    return bool(settings.api_key or settings.identity_token_file or wbauth.session_credentials(host=host) or wbauth.read_netrc_auth(host=host))


def _swanlab_ready() -> bool:
    """SwanLab logs locally, offline (or is disabled), or finds a key: SWANLAB_API_KEY or `swanlab login`'s."""
    import swanlab

    settings = swanlab.Settings()  # the environment and the saved login, as swanlab.init reads them
    return settings.mode != "online" or settings.api_key is not None


def run_id(run_dir: Path) -> str:
    """The run's tracker id: made at the first launch (RUN/trackers.json), read back on resume."""
    path = run_dir / IDS_FILE
    if path.is_file():
        return json.loads(path.read_text())["id"]
    alphabet = string.ascii_lowercase + string.digits
    identity = "".join(secrets.choice(alphabet) for _ in range(21))
    storage.write_text(path, json.dumps({"id": identity}) + "\n")
    return identity


def init_kwargs(names: list[str], run_dir: Path, identity: str, start_iteration: int, config: dict) -> dict[str, dict[str, Any]]:
    """Each tracker's keyword arguments: the run's id and name, files under RUN/logs, the config."""
    logs = run_dir / "logs"
    kwargs: dict[str, dict[str, Any]] = {
        # TensorBoard drops the events of steps ≥ purge_step that an earlier session wrote after its last checkpoint
        "tensorboard": {"purge_step": start_iteration},
        "wandb": {"dir": str(logs), "id": identity, "resume": "allow", "name": run_dir.name, "config": config},
        "swanlab": {"logdir": str(logs / "swanlab"), "id": identity, "resume": "allow", "experiment_name": run_dir.name, "config": config},
    }
    if "wandb" in names:
        logs.mkdir(parents=True, exist_ok=True)
    return {name: kwargs[name] for name in names}


def start(accelerator, names: list[str], run_dir: Path, start_iteration: int, config: dict) -> None:
    """Start the trackers on the main process (Accelerate logs from there)."""
    if not names:
        return
    identity = run_id(run_dir) if accelerator.is_main_process else ""
    accelerator.trackers = []  # a second start (the final evaluation's) replaces the finished ones
    try:
        accelerator.init_trackers("branchdiff", init_kwargs=init_kwargs(names, run_dir, identity, start_iteration, config))
    except Exception as error:  # each library raises its own types
        library = type(error).__module__.partition(".")[0]
        if library not in OFFLINE:
            raise
        raise UserError(f"logging.report_to: {library} did not start ({one_line(error, 200)}); check the network connection and its "
                        f"server, log offline with {OFFLINE[library]}, or use logging.report_to=tensorboard; the run folder is kept: "
                        "run the same command again") from None


def log_grid(accelerator, names: list[str], tag: str, grid: torch.Tensor, step: int) -> None:
    """A sample grid into every tracker: (3, H, W) as an image, (F, 3, H, W) as a playing GIF."""
    from branchdiff.report.tensorboard import add_grid, gif_bytes
    from branchdiff.rewards.base import to_uint8

    for name in names:
        if name == "tensorboard":
            add_grid(accelerator.get_tracker(name, unwrap=True), tag, grid, step)
            continue
        if grid.dim() == 3:
            accelerator.get_tracker(name).log_images({tag: [to_uint8(grid).permute(1, 2, 0).numpy()]}, step=step)
            continue
        with tempfile.NamedTemporaryFile(suffix=".gif", delete=False) as handle:  # the libraries take a GIF by path
            handle.write(gif_bytes(grid))
        module = __import__(name)
        accelerator.get_tracker(name).log({tag: module.Video(handle.name)}, step=step)
        Path(handle.name).unlink(missing_ok=True)


def final_evaluation(comparison: dict[str, dict[str, float]]) -> dict[str, float]:
    """The final evaluation's means as metrics: final_eval/<model>/<score>."""
    return {f"final_eval/{model}/{score}": value for model, scores in comparison.items() for score, value in scores.items()}


def finish(accelerator) -> None:
    """Flush and close the trackers, on a stop too, leaving the processes connected (unlike
    `accelerator.end_training`) for the export and the final evaluation. A full disk here is not a
    second error: the run reports the first, and TensorBoard's readers skip a last record cut short."""
    try:
        for tracker in accelerator.trackers:
            tracker.finish()
    except Exception as error:  # each library raises its own types
        if not storage.is_disk_full(error, Path(accelerator.project_dir or ".")):
            raise
