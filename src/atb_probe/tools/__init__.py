"""The command line's subcommands, one module each, and what they share."""
from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """A closed set of strings (Python 3.11's `enum.StrEnum`, for 3.10): a member compares, hashes
    and prints as its text, so it goes into output as it is."""

    __str__ = str.__str__
    __format__ = str.__format__


def size_text(n) -> str:
    """A byte count for people: `512 B`, `1.5 KiB`, `3.2 GiB`."""
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
