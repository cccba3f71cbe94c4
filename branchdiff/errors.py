"""Errors a user fixes, and how their messages stay short.

The CLI prints each error as one line `branchdiff: error: ...` and exits with 2. User text inside a
message (a prompt, a value, a reward's own error) is quoted through `quote` or `one_line`, and the
whole line is capped by `bounded` in the middle, so the fix at its end always shows.
"""

from __future__ import annotations

from pathlib import Path
from types import FrameType

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


TORCH_FIX = ("reinstall torch and torchvision together from one index (without a GPU: pip install --force-reinstall torch torchvision "
             "--index-url https://download.pytorch.org/whl/cpu, as README's set-up), and pip check names any other package at a "
             "version that does not fit; --debug shows the traceback")


def failed_import(error: BaseException) -> str | None:
    """The line for a dependency that failed to import (torch, torchvision, diffusers, transformers,
    open_clip, ...: an error raised while an installed package's module ran, or a module not found):
    the package, the torch and torchvision found, the innermost cause and `TORCH_FIX` — pip mixing a
    CPU torch with a CUDA torchvision reached the user as transformers' `Could not import module
    'BloomPreTrainedModel'`. None for any other error, and for the ImportError lines branchdiff raises
    itself (they name their own fix)."""
    from importlib import metadata

    frames = _frames(error)
    if getattr(error, "name", None) is None and frames and _module_of(frames[-1]).startswith("branchdiff"):
        return None
    chain = _causes(error)
    running = [_module_of(frame).partition(".")[0] for link in chain for frame in _frames(link) if frame.f_code.co_name == "<module>"]
    missing = [str(link.name).partition(".")[0] for link in chain if isinstance(link, ImportError) and link.name]
    running, missing = [name for name in running if name != "branchdiff"], [name for name in missing if name != "branchdiff"]
    if not running and not missing:
        return None
    owners = metadata.packages_distributions()
    package = next((name for name in reversed(running) if name in owners), missing[-1] if missing else None)
    if package is None:
        return None
    root = chain[-1]
    found = ", ".join(_installed(name) for name in dict.fromkeys(["torch", "torchvision", *owners.get(package, [])]))
    return f"importing {package} failed: {one_line(root, 200)} ({type(root).__name__}); found {found}; {TORCH_FIX}"


def _causes(error: BaseException) -> list[BaseException]:
    """`error`, then what it was raised from (or while handling), down to the innermost: outer to inner."""
    chain = [error]
    while True:
        link = chain[-1].__cause__ or (None if chain[-1].__suppress_context__ else chain[-1].__context__)
        if link is None or link in chain:
            return chain
        chain.append(link)


def _frames(error: BaseException) -> list[FrameType]:
    """The frames `error` passed through, from the one that caught it to the one that raised it."""
    frames: list[FrameType] = []
    step = error.__traceback__
    while step is not None:
        frames.append(step.tb_frame)
        step = step.tb_next
    return frames


def _module_of(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _installed(distribution: str) -> str:
    """`name version` as pip installed it, or `name (not installed)`."""
    from importlib import metadata

    try:
        return f"{distribution} {metadata.version(distribution)}"
    except metadata.PackageNotFoundError:
        return f"{distribution} (not installed)"
