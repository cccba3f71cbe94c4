"""Errors a user fixes: the CLI prints each as one line `branchdiff: error: ...` and exits with 2."""


class UserError(Exception):
    """A problem with the run's input or environment, described in one line with its fix."""


class CheckpointError(UserError):
    """A checkpoint could not be written (full disk) or read (damaged, foreign)."""


class RunStopped(UserError):
    """Training stopped on purpose after a checkpoint: no signal left (non-finite rewards or gradients)."""
