"""statistic.csv: the per-round table of every tensor written (SPEC §5).

One file per round directory, with `HEADER` as its first line. The recorder hands rows over as
`SideRows` records, one per op side; the writer formats them (`format_sides`) and appends them
in batches through an atomic replace of the file (`SafeTree.append_lines`), so a killed process
leaves only complete lines behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

FILE_NAME = "statistic.csv"  # one per round directory
COLUMNS = ("Device and PID", "Execution Count", "Op Name", "Op Type", "Op Id", "Input/Output",
           "Index", "Dtype", "Format", "Shape", "Max", "Min", "Mean", "Norm", "Tensor Path")
HEADER = ",".join(COLUMNS) + "\n"
NA = "N/A"


def format_number(value: float | None) -> str:
    """A statistic as text: the shortest round-trip repr (`nan`, `inf`, `-inf` included),
    `N/A` when absent."""
    if type(value) is float:
        return repr(value)
    if value is None:
        return NA
    return repr(float(value)) if isinstance(value, float) else str(value)


_NA_STATS = ",".join((NA, NA, NA, NA))
_SPECIAL = frozenset(',"\r\n')


def _cell(text: str) -> str:
    """A csv cell as `csv.writer` writes it by default: quoted only when it must be."""
    if _SPECIAL.isdisjoint(text):
        return text
    return '"' + text.replace('"', '""') + '"'


@dataclass(slots=True)
class SideRows:
    """The statistic.csv rows of one side (inputs or outputs) of one op execution.

    `head` holds the six cells every row of the side shares (Device and PID, Execution Count,
    Op Name, Op Type, Op Id, Input/Output); each of `rows` is (Index, Dtype, shape as a
    sequence of ints, statistics, Tensor Path). The statistics are an object whose `get()`
    returns (max, min, mean, norm) floats or None for `N/A` (the probe's `Stat`, filled when
    the writer formats the rows), or None."""

    head: tuple
    rows: list


def format_sides(sides: Iterable[SideRows]) -> str:
    """CSV text of the rows of `sides`: the same text `csv.writer` makes of the formatted
    cells, made faster: this runs for every row of a dump (on the writer thread, off the
    model's path)."""
    lines = []
    shapes: dict = {}  # shape -> "AxBxC"
    # Statistics are shared between the rows of the same values (a view, the next kernel's
    # input): each is formatted once. Keyed by id: `sides` keeps them all alive.
    numbers: dict = {id(None): _NA_STATS}
    for side in sides:
        head = ",".join(map(_cell, side.head))
        for index, dtype, dims, stat, path in side.rows:
            shape = shapes.get(dims)
            if shape is None:
                shape = shapes[dims] = "x".join(map(str, dims))
            stats = numbers.get(id(stat))
            if stats is None:
                st = stat.get()
                stats = numbers[id(stat)] = _NA_STATS if st is None else \
                    f"{format_number(st[0])},{format_number(st[1])}," \
                    f"{format_number(st[2])},{format_number(st[3])}"
            if not index.isdigit():
                index = _cell(index)
            lines.append(f"{head},{index},{dtype},nd,{shape},{stats},{_cell(path)}\n")
    return "".join(lines)
