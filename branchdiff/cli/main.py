"""`branchdiff COMMAND ...`: parse (branchdiff/cli/parser.py), run the command, and turn the library's
errors into one line.

Bad input ends with one line `branchdiff: error: ...` on stderr and exit status 2 (argparse's own
errors too, without its usage block; `--debug` shows the traceback instead); Ctrl-C exits with 130
(`train`: after a checkpoint). Nothing already written (checkpoints, metrics) is touched before the
configuration has been validated. A dependency that fails to import is one line too, naming the
package, the torch and torchvision installed and the fix. Every case is listed in docs/errors.md.
A check whose answer is no exits with 1, its output printed as usual (`plan`: the run does not fit).
Every hub request a command makes waits at most `HUB_TIMEOUT` seconds for the hub (branchdiff/runtime/hub.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from branchdiff.cli import data, evaluate, families, plan, push, rewards, sample, tools, train
from branchdiff.cli.parser import UsageError, build_parser, unrecognized

COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {  # a command's exit status: what it returns, else 0
    "train": train.cmd_train, "config": train.cmd_config, "sample": sample.cmd_sample, "eval": evaluate.cmd_eval,
    "rewards": rewards.cmd_rewards, "serve-reward": rewards.cmd_serve_reward, "accelerate-config": tools.cmd_accelerate_config,
    "bench": tools.cmd_bench, "report": tools.cmd_report, "families": families.cmd_families,
    "plan": plan.cmd_plan, "push": push.cmd_push, "data": data.cmd_data,
}


def main(argv: list[str] | None = None) -> int:
    """Run a command: exit 0, or the status the command returns (`plan`: 1 when the run does not fit).
    Bad input: one line `branchdiff: error: ...`, exit 2 (`--debug` anywhere on the command line
    re-raises with the traceback instead); Ctrl-C: exit 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [item for item in argv if item != "--debug"]
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if "overrides" in vars(args) and all("=" in item and not item.startswith("-") for item in extra):
            args.overrides = [*args.overrides, *extra]  # overrides may also follow --resume
        elif extra:
            raise UsageError(unrecognized(parser, args, extra))
    except UsageError as error:
        print(f"branchdiff: error: {error}", file=sys.stderr)
        return 2
    if not debug:
        _quiet_third_party_logs()
    from branchdiff.runtime.abort import ABORT_STATUS, abort_after_the_first_interrupt, abort_on_next_interrupt
    from branchdiff.runtime.hub import bound_hub_calls

    restore_interrupts = abort_after_the_first_interrupt("aborted by a second Ctrl-C")  # train's loop takes over while it runs
    try:
        bound_hub_calls()  # model and reward weights named by a hub id, HPDv2 prompts (push: its --timeout)
        status = COMMANDS[args.command](args)
    except KeyboardInterrupt as interrupt:
        if debug:
            raise
        # a KeyboardInterrupt's message is empty unless the run gave one (`Interrupted`: where its checkpoint is)
        print(f"branchdiff: {str(interrupt) or 'interrupted by Ctrl-C'}", file=sys.stderr)
        abort_on_next_interrupt("aborted by a second Ctrl-C")  # the clean-up and the interpreter's exit are not waited for
        return ABORT_STATUS
    except Exception as error:
        restore_interrupts()
        line = None if debug else _error_line(error, args.command)
        if line is None:
            raise
        print(f"branchdiff: error: {line}", file=sys.stderr)
        return 2
    restore_interrupts()
    return status or 0


def run() -> None:
    """The `branchdiff` command and `python -m branchdiff.cli`: `main` with the process's arguments, then its exit. A command
    stopped by Ctrl-C leaves at once (`abort.abort_now`'s exit, without the interpreter's teardown: its final garbage
    collection of a loaded model took seconds to a minute, in which a second Ctrl-C was the default's), its line already
    printed and everything it published whole."""
    from branchdiff.runtime.abort import ABORT_STATUS, exit_now

    status = main()
    if status == ABORT_STATUS:
        exit_now(status)
    sys.exit(status)


def _error_line(error: Exception, command: str) -> str | None:
    """The one line an error ends `command` with: a dependency that failed to import (first: the
    library's own classes may not import), an error the user fixes (docs/errors.md), or running out
    of memory; None for anything else, a bug, whose traceback is shown."""
    from branchdiff.errors import ConfigError, UserError, bounded, failed_import, is_out_of_memory, out_of_memory

    broken = failed_import(error)
    if broken is not None:
        return bounded(broken)
    from branchdiff.rewards.multi import RewardError
    from branchdiff.rewards.remote import RemoteRewardError

    if isinstance(error, (ConfigError, UserError, OSError, ValueError, ImportError, RewardError, RemoteRewardError)):
        return _one_line(error)
    if is_out_of_memory(error):
        return _one_line(out_of_memory(error, f"in branchdiff {command}", "use a smaller batch (fewer images per prompt or prompts), a "
                                       "smaller --resolution, --dtype bfloat16, or a device with more memory"))
    return None


# import-time notices about optional kernels; torch.compile for the CPU finding no CUDA runtime (a CUDA build of torch on a machine without a GPU)
NOISY_LOGGERS = ("torch.utils._pytree", "bitsandbytes", "diffusers.quantizers", "torch.utils.cpp_extension")


def _quiet_third_party_logs() -> None:
    """Hold back the notices optional dependencies print when they are imported (a missing optional
    kernel, a deprecated registration): they are not the user's to fix. `--debug` shows them."""
    import logging

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _one_line(error: BaseException) -> str:
    """The error's message on one line of at most `errors.MAX_LINE` characters; an OSError names its
    file (`[Errno 28] ...: 'path'`)."""
    from branchdiff.errors import bounded

    if isinstance(error, (NotADirectoryError, IsADirectoryError)) and error.filename:  # not a matter of space or permissions
        found, needed = ("a file", "a folder") if isinstance(error, NotADirectoryError) else ("a folder", "a file")
        return bounded(f"{error.filename}: a part of this path is {found} where {needed} is needed ({type(error).__name__}); "
                       "give a path whose folders are folders")
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return bounded(f"{error.strerror}{where} ({type(error).__name__}); free space or fix the path's permissions and run again")
    return bounded(" ".join(str(error).split()))
