"""statistic.csv: the per-round table of every tensor written (SPEC §5).

One file per round directory, with `HEADER` as its first line. Rows are appended in batches by
the writer through an atomic replace of the file (`SafeTree.append_lines`), so a killed process
leaves only complete lines behind.
"""
from __future__ import annotations

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


def format_records(records: Iterable[tuple]) -> str:
    """CSV text of rows given as records: the first nine cells as text, then the shape (a
    sequence of ints), the statistics ((max, min, mean, norm) floats, or None for `N/A`) and
    the Tensor Path. The same text `csv.writer` makes of the formatted cells, made faster:
    this runs for every row of a dump (on the writer thread, off the model's path)."""
    lines = []
    cells: dict = {}   # text cell -> its csv form (names repeat from row to row)
    shapes: dict = {}  # shape -> "AxBxC"
    # Statistics tuples are shared between the rows of the same values (a view, the next
    # kernel's input): each is formatted once. Keyed by id: `records` keeps them all alive.
    numbers: dict = {id(None): _NA_STATS}
    for r in records:
        head = cells.get(r[:9])
        if head is None:
            head = cells[r[:9]] = ",".join(map(_cell, r[:9]))
        shape = shapes.get(r[9])
        if shape is None:
            shape = shapes[r[9]] = "x".join(map(str, r[9]))
        st = r[10]
        stats = numbers.get(id(st))
        if stats is None:
            stats = numbers[id(st)] = f"{format_number(st[0])},{format_number(st[1])}," \
                                      f"{format_number(st[2])},{format_number(st[3])}"
        lines.append(f"{head},{shape},{stats},{_cell(r[11])}\n")
    return "".join(lines)
