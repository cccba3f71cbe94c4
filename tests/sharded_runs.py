"""Several `branchdiff train` (or `eval`) runs in one `accelerate launch` (the two-process start-up paid once):
`python sharded_runs.py RUNS.json`, RUNS.json a list of [mode, [CLI arguments]] with mode "fsdp"
(the launcher's FSDP settings, e.g. from the packaged fsdp config), "fsdp-offload" (those with the
shards in CPU memory) or "ddp" (ACCELERATE_USE_FSDP off for that run). Between runs accelerate's state is reset and the process group kept: each run's
`end_training` only closes its trackers, and the group is destroyed after the last. Exits with the first failing run's status."""

import json
import os
import sys
from pathlib import Path

import torch.distributed
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from branchdiff.cli import main

if os.environ.get("BRANCHDIFF_TEST_SMALL_EDIT_AREAS"):  # the tiny Qwen-Image-Edit's source areas (tests/tiny_pipelines.py)
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    from tiny_pipelines import SMALL_EDIT_AREAS

    for name, value in SMALL_EDIT_AREAS.items():
        setattr(pipeline_qwenimage_edit_plus, name, value)


def finish_trackers(self: Accelerator) -> None:
    for tracker in self.trackers:
        tracker.finish()


Accelerator.end_training = finish_trackers  # the next run reuses the process group
launched_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false")
launched_offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false")
for mode, arguments in json.loads(Path(sys.argv[1]).read_text()):
    os.environ["ACCELERATE_USE_FSDP"] = launched_fsdp if mode.startswith("fsdp") else "false"
    os.environ["FSDP_OFFLOAD_PARAMS"] = "true" if mode == "fsdp-offload" else launched_offload
    AcceleratorState._reset_state()
    status = main(arguments)
    if status:
        sys.exit(status)
if torch.distributed.is_initialized():  # (`branchdiff eval` destroys it itself)
    torch.distributed.destroy_process_group()  # as `end_training` would have: no gloo worker outlives the group
