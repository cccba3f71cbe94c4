"""Peak memory of each phase of an iteration (rollout, reward, train; eval when it runs), logged as
`memory_<phase>_gb` (GiB, the largest process's) and drawn in the run report.

On a GPU it is CUDA's peak of allocated tensor memory during the phase
(`torch.cuda.reset_peak_memory_stats` before it, `max_memory_allocated` after: what the caching
allocator handed to tensors, not what `nvidia-smi` shows, which adds the cache and the CUDA context).
On the CPU it is the process's peak resident set size during the phase: Linux's VmHWM after
resetting it through /proc/self/clear_refs; where that reset is not possible, the peak since the
process started (`PhaseMemory.per_phase` is False: each phase's figure is then the run's peak so far).
"""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

GIB = 2**30
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


def _reset_rss_peak() -> bool:
    """Reset the process's peak RSS (Linux: write 5 to /proc/self/clear_refs); False where not possible."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _rss_peak_bytes() -> int:
    """The process's peak RSS: VmHWM from /proc/self/status, else getrusage's ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", STATUS.read_text(), flags=re.M)
        if found:
            return int(found.group(1)) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PhaseMemory:
    """Measures the peak memory of named phases on `device` (a CUDA device, or the CPU's RSS)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.per_phase = self.cuda or _reset_rss_peak()

    @contextmanager
    def phase(self, name: str, into: dict[str, float]) -> Iterator[None]:
        """Run the block and put its peak in `into["memory_<name>_gb"]` (GiB)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.per_phase:
            _reset_rss_peak()
        yield
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _rss_peak_bytes()
        into[f"memory_{name}_gb"] = peak / GIB
