"""statistic.csv: the per-round table of every tensor written (SPEC §5).

One file per round directory, with `HEADER` as its first line. Rows are appended in batches by
the writer through an atomic replace of the file (`SafeTree.append_lines`), so a killed process
leaves only complete lines behind.
"""
from __future__ import annotations

import csv
import io
import math
from typing import Iterable, Sequence

COLUMNS = ("Device and PID", "Execution Count", "Op Name", "Op Type", "Op Id", "Input/Output",
           "Index", "Dtype", "Format", "Shape", "Max", "Min", "Mean", "Norm", "Tensor Path")
HEADER = ",".join(COLUMNS) + "\n"
NA = "N/A"


def format_number(value: float | None) -> str:
    """A statistic as text: the shortest round-trip repr, `N/A` when absent."""
    if value is None:
        return NA
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def format_rows(rows: Sequence[Sequence[str]]) -> str:
    """CSV text for rows of already formatted cells (quoted only where a cell needs it)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows(rows)
    return buf.getvalue()


_NA_STATS = (NA, NA, NA, NA)


def format_records(records: Iterable[tuple]) -> str:
    """CSV text of rows given as records: the first nine cells as text, then the shape (a
    tuple of ints), the statistics ((max, min, mean, norm) floats, or None for `N/A`) and the
    Tensor Path. Formatting is left to the writer thread, off the model's path."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows(
        (*r[:9], "x".join(map(str, r[9])),
         *(_NA_STATS if r[10] is None else map(format_number, r[10])), r[11])
        for r in records)
    return buf.getvalue()
