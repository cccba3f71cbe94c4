"""Errors a user fixes, and how their messages stay short.

The CLI prints each error as one line `branchdiff: error: ...` and exits with 2. User text inside a
message (a prompt, a value, a reward's own error) is quoted through `quote` or `one_line`, and the
whole line is capped by `bounded` in the middle, so the fix at its end always shows.
"""

from __future__ import annotations

from pathlib import Path

MAX_QUOTE = 40  # characters of user text (a prompt, a file line) a message quotes
MAX_LINE = 600  # characters of an error line; longer lines lose their middle


class UserError(Exception):
    """A problem with the run's input or environment, described in one line with its fix."""


class ConfigError(ValueError):
    """A configuration problem (a key, a value, a preset), described in one line."""


class CheckpointError(UserError):
    """A checkpoint could not be written (full disk) or read (damaged, foreign)."""


class RunStopped(UserError):
    """Training stopped on purpose after a checkpoint: no signal left (non-finite rewards or gradients)."""


def checkpoint_kept(newest: Path | None) -> str:
    """What a line about a stopped run says of its checkpoints."""
    return f"the newest complete checkpoint, {newest}, is intact" if newest else "no checkpoint was written yet"


def read_utf8(path: Path, fix: str = "save the file as UTF-8") -> str:
    """The text of a UTF-8 file (a leading byte-order mark dropped); a byte that is not UTF-8 raises
    one line naming the file, the line and the byte, and `fix`."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte {data[error.start]:#04x}); {fix}") from None


def one_line(text: object, limit: int = 500) -> str:
    """`text` with every run of whitespace (newlines included) collapsed to one space, cut at `limit`."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def quote(text: object, limit: int = MAX_QUOTE) -> str:
    """`repr(text)` of at most `limit` characters of it, elided in the middle: 'two red ci…the left'."""
    text = str(text)
    if len(text) > limit:
        head = (limit + 1) // 2
        text = text[:head] + "…" + text[len(text) - (limit - head) :]
    return repr(text)


def bounded(line: str, limit: int = MAX_LINE) -> str:
    """`line` of at most `limit` characters: the start and the end (where the fix is) kept, the middle elided."""
    if len(line) <= limit:
        return line
    tail = limit // 3
    return line[: limit - tail - 3] + " … " + line[len(line) - tail :]


OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


class OutOfMemory(UserError):
    """The device or the machine ran out of memory."""


def is_out_of_memory(error: BaseException) -> bool:
    """Python's MemoryError, torch.OutOfMemoryError (CUDA), or the CPU allocator's 'can't allocate memory'."""
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and any(w in str(error).lower() for w in OUT_OF_MEMORY_WORDS))


def out_of_memory(error: BaseException, where: str, fix: str) -> OutOfMemory:
    """The one line for an allocation that failed `where`, with what to lower (`fix`)."""
    reason = one_line(error, 160) or type(error).__name__
    return OutOfMemory(f"out of memory {where} ({reason}); {fix}")
