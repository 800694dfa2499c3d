"""The command line's subcommands, one module each, and what they share."""
from __future__ import annotations

from ..enums import StrEnum  # noqa: F401  (the tools' modules import it from here)


def size_text(n) -> str:
    """A byte count for people: `512 B`, `1.5 KiB`, `3.2 GiB`."""
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
