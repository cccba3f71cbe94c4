"""Cross-process reductions: the only communication the training loop does besides DDP's gradients.

A prompt's tree lives on one process, so fusion and per-tree statistics need none.
What spans the batch goes through a `Collective`: batch-wide advantage normalisation, global width
pruning, the loss normaliser (the global count of trained edges) and the logged metrics. The pure
functions that take a collective default to `LOCAL`, the one-process identity, so one process and
many compute the same numbers: with P processes, the result equals the one-process computation on
the concatenation of every process's data in rank order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator, PartialState


class Collective(Protocol):
    num_processes: int

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over processes of a tensor of the same shape on every process."""

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise max over processes of a tensor of the same shape on every process."""

    def cat(self, values: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Concatenation along dim 0 over processes in rank order (lengths may differ), and the
        offset of this process's rows in it."""


class LocalCollective:
    """One process: every reduction is the identity."""

    num_processes = 1

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def max(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def cat(self, values: torch.Tensor) -> tuple[torch.Tensor, int]:
        return values, 0


LOCAL = LocalCollective()


class AcceleratorCollective:
    """Reductions over the processes of an `accelerate.Accelerator` (gloo on CPU, NCCL on GPU).
    Inputs may live on any device; results come back on the input's device."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator
        self.num_processes = accelerator.num_processes

    def _send(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.accelerator.device)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.num_processes == 1:
            return values
        return self.accelerator.reduce(self._send(values), "sum").to(values.device)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        if self.num_processes == 1:
            return values
        stacked = self.accelerator.gather(self._send(values).unsqueeze(0))  # (W, ...)
        return stacked.max(dim=0).values.to(values.device)

    def cat(self, values: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.num_processes == 1:
            return values, 0
        lengths = self.accelerator.gather(self._send(torch.tensor([len(values)]))).tolist()  # (W,)
        padded = self.accelerator.pad_across_processes(self._send(values), dim=0)  # (longest, ...)
        rows = self.accelerator.gather(padded).reshape(len(lengths), max(lengths), *values.shape[1:])  # (W, longest, ...)
        joined = torch.cat([rows[rank, :length] for rank, length in enumerate(lengths)])
        return joined.to(values.device), sum(lengths[: self.accelerator.process_index])


def disconnect(state: Accelerator | PartialState) -> None:
    """The end of a launch's communication: every process waits for the others (none is still in a
    collective), then the process groups are destroyed, so that no gloo or NCCL worker outlives
    them into the interpreter's exit (gloo aborts the process there). `state`: an `Accelerator`
    (its trackers are finished too) or accelerate's `PartialState`; with one process, only that."""
    state.wait_for_everyone()
    if hasattr(state, "end_training"):
        state.end_training()
    else:
        state.destroy_process_group()
