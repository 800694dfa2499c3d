"""`StrEnum`: the base of every closed set of words the probe and its tools write (a task, a
phase, a side, a compare mode...). Pure: no torch."""
from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """A closed set of strings (Python 3.11's `enum.StrEnum`, for 3.10): a member compares, hashes
    and prints as its text, so it goes into files and messages as it is."""

    __str__ = str.__str__
    __format__ = str.__format__
