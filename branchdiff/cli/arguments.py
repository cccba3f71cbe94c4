"""argparse types: whole numbers with bounds, TCP ports, finite and positive numbers, fractions, image
sizes, files to write; each refuses bad text with a message argparse prints as one line."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def _whole(text: str) -> int:
    """An integer, or argparse's one-line refusal."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer ≥ `low` (and ≤ `high` when given)."""
    def whole(text: str) -> int:
        value = _whole(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}" if high is not None else f"must be ≥ {low}, got {value}")
        return value

    return whole


def port(text: str) -> int:
    """argparse type: a TCP port, 1 to 65535."""
    value = _whole(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is a whole number from 1 to 65535, got {value}")
    return value


def image_size(text: str) -> int | list[int]:
    """argparse type: H or HxW (H,W), each side a whole number of pixels in [8, 8192]."""
    sides = text.lower().replace(",", "x").split("x")
    try:
        values = [int(side) for side in sides]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(8 <= v <= 8192 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not an image size; give H (a square) or HxW, each in [8, 8192], e.g. 1024 or 768x1344")
    return values[0] if len(values) == 1 else values


def finite(text: str) -> float:
    """argparse type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    """argparse type: a finite number ≥ 0."""
    value = finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a finite number in (0, 1]."""
    value = finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def new_file_or_stdout(text: str) -> str:
    """argparse type: '-' (standard output) or the path of a file to write, in a folder that exists
    (nothing creates folders for it: a mistyped folder is refused, not made)."""
    if text == "-":
        return text
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the path of a file in it")
    if path.parent.exists() and not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {path.parent} is a file, not a folder; give a file in an existing folder")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist; create it first (mkdir -p {path.parent}) "
                                         "or give a file in an existing folder")
    return text
