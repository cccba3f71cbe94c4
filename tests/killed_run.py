"""`branchdiff train` that stops itself at a chosen point, for the crash tests:
`python killed_run.py POINT N CLI_ARGS...`, POINT one of
- `optimizer_step`: SIGKILL on entering the N-th optimizer step (1-based: mid-iteration after N - 1 steps);
- `write_state`: SIGKILL on the N-th checkpoint's trainer_state.json write (accelerate's files are
  already in the staging folder, the checkpoint is not published);
- `sigint`: SIGINT (Ctrl-C) to itself at the start of the update of iteration N, on process 0 only;
- `sigstop`: SIGSTOP to itself at the start of iteration N, on process 1 only (a frozen rank);
- `rankkill`: SIGKILL to itself at the start of iteration N, on process 1 only (a rank that dies);
- `eval_records`: SIGKILL to itself once `branchdiff eval` has recorded its N-th chunk of scores;
- `enospc`: on process 0 only, accelerate's file writes into the N-th iteration's checkpoint fail
  with ENOSPC, as on a full disk (process 1 writes its part).
Under `accelerate launch` every process runs this script.
"""

import os
import signal
import sys
import time

import torch

from branchdiff.cli import main
from branchdiff.runtime import checkpoint
from branchdiff.training.recipe import Trainer

point, target = sys.argv[1], int(sys.argv[2])
calls = 0


def counted(function, when):
    """`function` that first counts its calls and runs `when()` on the target-th one."""

    def wrapper(*args, **kwargs):
        global calls
        calls += 1
        if calls == target:
            when(*args)
        return function(*args, **kwargs)

    return wrapper


def sigkill(*args) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if point == "optimizer_step":
    torch.optim.AdamW.step = counted(torch.optim.AdamW.step, sigkill)
elif point == "write_state":
    checkpoint.write_state = counted(checkpoint.write_state, sigkill)
elif point == "sigint":
    from branchdiff.objectives.grpo import ClippedGRPO

    plan = ClippedGRPO.plan

    def interrupted_plan(self, rollout, embeds, signal_, address):  # as the iteration's update begins
        if address.iteration == target and os.environ.get("RANK", "0") == "0":
            os.kill(os.getpid(), signal.SIGINT)
        return plan(self, rollout, embeds, signal_, address)

    ClippedGRPO.plan = interrupted_plan
elif point == "sigstop":
    run_iteration = Trainer.run_iteration

    def frozen_run_iteration(self, iteration, *args, **kwargs):
        if iteration == target and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        return run_iteration(self, iteration, *args, **kwargs)

    Trainer.run_iteration = frozen_run_iteration
elif point == "rankkill":
    run_iteration = Trainer.run_iteration

    def dying_run_iteration(self, iteration, *args, **kwargs):
        if iteration == target and os.environ.get("RANK") == "1":
            if os.environ.get("KILLED_AT"):  # when it died, for the survivors' time to end
                with open(os.environ["KILLED_AT"], "w") as stamp:
                    stamp.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return run_iteration(self, iteration, *args, **kwargs)

    Trainer.run_iteration = dying_run_iteration
elif point == "enospc":
    import errno

    import accelerate.checkpointing

    save = accelerate.checkpointing.save

    def full_disk(obj, path, *args, **kwargs):
        if os.environ.get("RANK") == "0" and f"staging-{target:06d}" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(obj, path, *args, **kwargs)

    accelerate.checkpointing.save = full_disk
elif point == "eval_records":  # an evaluation killed after recording its N-th chunk of scores
    from branchdiff.evaluation import evaluate

    evaluate.ScoreRecords.append = counted(evaluate.ScoreRecords.append, lambda *args: None)

    def killed_after(self, prompts):
        recorded(self, prompts)
        if calls == target:  # `counted` has counted this call
            os.kill(os.getpid(), signal.SIGKILL)

    recorded, evaluate.ScoreRecords.append = evaluate.ScoreRecords.append, killed_after
else:
    raise SystemExit(f"unknown point {point!r}")
sys.exit(main(sys.argv[3:]))
