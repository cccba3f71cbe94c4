"""Writes that never leave a partial file behind, and a full disk told apart from other failures.

The files a run writes go through one of these (checkpoints are folders staged the same way by
branchdiff/runtime/checkpoint.py; TensorBoard's event files and the heartbeats are the exceptions: a cut
last record is skipped by their readers):
- `replace_file(path, write)`: `write(tmp)` fills `.NAME.tmp` beside `path`, which then takes the
  name by `os.replace`; on any failure the temporary file is removed and `path` is as it was.
- `replace_folder(path, write)`: the same for a folder (the exported LoRA), through `.NAME.staging`.
- `append_line(path, text)`: one line appended; on failure the file is cut back to its old length.
The temporary names are fixed (one run owns its folder: branchdiff/runtime/run_dir.py), so what a killed
process leaves behind is found and removed by `clean_leftovers` when the next run claims the folder.

A failure that comes from a full disk is re-raised as `DiskFull`, whatever exception the writer
raised: torch's zip writer says "unexpected pos", safetensors "os error 28", PIL and Python raise
OSError(ENOSPC) (`is_disk_full`). `DiskFull` carries the path and what the write needed (known from
the size of what it replaces or writes, or at least the part it wrote before it failed), and
`DiskFull.line` turns it into the one line the CLI prints, with the space left once the failed
write's leftovers are gone (docs/errors.md, `full-disk`).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from branchdiff.errors import UserError, checkpoint_kept

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
FULL_WORDS = ("no space left on device", "disk quota exceeded", "os error 28", "storagefull", "unexpected pos", "file write failed")
HEADROOM = 1 << 20  # a failed write with less than this free (or less than it needed) counts as a full disk
LEFTOVER_SUFFIXES = (".tmp", ".staging", ".replaced")


class DiskFull(UserError):
    """A write failed because its filesystem is full."""

    def __init__(self, path: Path, needed: int | None, at_least: bool = False) -> None:
        super().__init__()
        self.path = path
        self.needed = needed  # bytes the write needed; None: unknown
        self.at_least = at_least  # `needed` counts only what was written before the failure

    def _space(self) -> str:
        """The space left now (after the failed write's leftovers are gone) and the space it needed."""
        free = f"No space left on device: {size_text(free_bytes(self.path))} free"
        if self.needed is None:
            return free
        return f"{free}, {'at least' if self.at_least else 'about'} {size_text(self.needed)} needed"

    def __str__(self) -> str:
        return f"could not write {self.path} ({self._space()}); free disk space (or pass another output_dir=) and run again"

    def line(self, newest_checkpoint: Path | None) -> str:
        """The documented line: what failed, the space, the intact checkpoint and how to go on."""
        go_on = "continue with --resume latest" if newest_checkpoint else "start the run again"
        return (f"could not write {self.path} ({self._space()}); {checkpoint_kept(newest_checkpoint)}; free disk space "
                f"(or pass another output_dir=) and {go_on}")


def size_text(count: int) -> str:
    """Bytes for a person: '512 B', '3.4 MB', '1.2 GB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def free_bytes(path: Path) -> int:
    """Space left on the filesystem of `path` (or of its nearest existing parent)."""
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return 0


def tree_size(path: Path) -> int:
    """Bytes of a file, or of every file below a folder (0 when absent)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def is_disk_full(error: BaseException, path: Path, needed: int = 0) -> bool:
    """Whether `error`, raised while writing `path`, comes from a full filesystem: an OSError with
    ENOSPC, EDQUOT or EFBIG anywhere in its chain, a message that says so, or less space left than
    the write needed (or than `HEADROOM`)."""
    for link in _chain(error):
        if isinstance(link, OSError) and link.errno in FULL_ERRNOS:
            return True
        if any(word in str(link).lower() for word in FULL_WORDS):
            return True
    return isinstance(error, (OSError, RuntimeError)) and free_bytes(path) < max(needed, HEADROOM)


@contextmanager
def disk_full_as_error(path: Path, needed: int = 0, partial: Path | None = None) -> Iterator[None]:
    """Re-raise a failure of the block that writes `path` as `DiskFull` when the disk is full.
    `needed`: the bytes the whole write takes, when known; else `partial`, where the write puts its
    bytes, gives at least what it needed (measured before the caller removes it). A `DiskFull` of one
    file inside the block becomes one about `path` and the whole write (a checkpoint, not its LoRA file)."""
    try:
        yield
    except Exception as error:
        if (error.path == path) if isinstance(error, DiskFull) else not is_disk_full(error, path, needed):
            raise
        _release(error)
        if needed:
            raise DiskFull(path, needed) from error
        written = tree_size(partial) if partial is not None else 0
        raise DiskFull(path, written or None, at_least=True) from error


def _release(error: BaseException) -> None:
    """Drop the local variables of the frames a failed write passed through, so the files they held
    open are closed and their space is free again when the line reports what is free."""
    frame = error.__traceback__
    while frame is not None:
        try:
            frame.tb_frame.clear()
        except RuntimeError:  # a frame still running (the one handling the error)
            pass
        frame = frame.tb_next


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _beside(path: Path, suffix: str) -> Path:
    """The fixed name of a temporary beside `path`: `.NAME<suffix>`."""
    return path.with_name(f".{path.name}{suffix}")


def replace_file(path: Path, write: Callable[[Path], None], needed: int = 0) -> Path:
    """Fill `path` through `write(tmp)` on a temporary file beside it, then rename it into place;
    a failure removes the temporary file and leaves `path` as it was (`DiskFull` on a full disk).
    `needed`: bytes the write takes, when known (else the old file's size, else what was written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _beside(path, ".tmp")
    try:
        with disk_full_as_error(path, needed or tree_size(path), partial=tmp):
            write(tmp)
            os.replace(tmp, path)
    finally:
        _remove(tmp)
    return path


def write_bytes(path: Path, data: bytes) -> Path:
    """`data` as the whole content of `path` (`replace_file`)."""
    def write(tmp: Path) -> None:
        tmp.write_bytes(data)

    return replace_file(path, write, len(data))


def write_text(path: Path, text: str) -> Path:
    """`text` in UTF-8 as the whole content of `path` (`replace_file`)."""
    return write_bytes(path, text.encode("utf-8"))


def replace_folder(path: Path, write: Callable[[Path], None]) -> Path:
    """A folder filled by `write(staging)` and renamed into place, replacing `path` whole; a failure
    removes the staging folder and leaves `path` as it was (`DiskFull` on a full disk)."""
    staging, replaced = _beside(path, ".staging"), _beside(path, ".replaced")
    _remove(staging)
    try:
        with disk_full_as_error(path, tree_size(path), partial=staging):
            staging.mkdir(parents=True)
            write(staging)
            if path.exists():
                path.rename(replaced)
            staging.rename(path)
    except BaseException:
        if replaced.exists() and not path.exists():
            replaced.rename(path)
        raise
    finally:
        _remove(staging)
        _remove(replaced)
    return path


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline to `path`; a failure cuts the file back to its old length, so it
    never ends in half a line (`DiskFull` on a full disk)."""
    data = (line + "\n").encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    length = path.stat().st_size if path.exists() else 0
    with disk_full_as_error(path, len(data)):
        try:
            with path.open("ab") as handle:
                handle.write(data)
        except BaseException:
            with path.open("r+b") as handle:
                handle.truncate(length)
            raise


def clean_leftovers(folder: Path) -> list[Path]:
    """Remove what writes cut short by a killed process left in `folder`: `.NAME.tmp`, `.NAME.staging`,
    and `.NAME.replaced`, which is first put back as NAME when NAME is missing (a kill between
    `replace_folder`'s two renames). Returns what was removed."""
    removed = []
    for leftover in sorted(folder.glob(".*")) if folder.is_dir() else []:
        suffix = next((s for s in LEFTOVER_SUFFIXES if leftover.name.endswith(s)), None)
        if suffix is None:
            continue
        original = folder / leftover.name[1 : -len(suffix)]
        if suffix == ".replaced" and not original.exists():
            leftover.rename(original)
            continue
        _remove(leftover)
        removed.append(leftover)
    return removed
