"""statistic.csv: the per-round table of every tensor written (SPEC §5); request_statistic.csv,
the same statistics per request of a round holding several (SPEC §9); and derived_statistic.csv,
the statistics of sums of an op's tensors that another implementation computes as one tensor
(capture/sums.py), with the same columns as request_statistic.csv.

One file per round directory, with `HEADER` (`REQUEST_HEADER`) as its first line. The recorder
hands rows over as side tuples (below), one per op side; the writer formats them
(`format_sides`, `format_request_sides`) and appends them in batches through an atomic replace
of the file (`SafeTree.append_lines`), so a killed process leaves only complete lines behind.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping, NamedTuple

from .stats_cell import READY, unpack, values

FILE_NAME = "statistic.csv"  # one per round directory
COLUMNS = ("Device and PID", "Execution Count", "Op Name", "Op Type", "Op Id", "Input/Output",
           "Index", "Dtype", "Format", "Shape", "Max", "Min", "Mean", "Norm", "Tensor Path")
HEADER = ",".join(COLUMNS) + "\n"
NA = "N/A"
# The statistics of each request's slice of a tensor that has the round's token dimension
# (tokens.py): statistic.csv's columns (Shape the slice's, Tensor Path N/A), then the request.
REQUEST_FILE_NAME = "request_statistic.csv"
REQUEST_COLUMNS = COLUMNS + ("Request",)
REQUEST_HEADER = ",".join(REQUEST_COLUMNS) + "\n"
# The statistics of a sum of two tensors of one op side (capture/sums.py), over the whole sum
# (Request empty) and over each request's tokens when request_statistic.csv is written: Index
# names the tensors added (`0+1`), Tensor Path is N/A.
DERIVED_FILE_NAME = "derived_statistic.csv"


def format_number(value: float | None) -> str:
    """A statistic as text: the shortest round-trip repr (`nan`, `inf`, `-inf` included),
    `N/A` when absent."""
    if type(value) is float:
        return repr(value)
    if value is None:
        return NA
    return repr(float(value)) if isinstance(value, float) else str(value)


_NA_STATS = ",".join((NA, NA, NA, NA))


def _cell(text: str) -> str:
    """A csv cell as `csv.writer` writes it by default: quoted only when it must be (a
    comma, a quote or a line break in it)."""
    # `in` scans a str in C: several times faster than asking a set of these characters.
    if "," not in text and '"' not in text and "\n" not in text and "\r" not in text:
        return text
    return '"' + text.replace('"', '""') + '"'


# The rows of one side (inputs or outputs) of one op execution travel from the recorder to the
# writer as one flat tuple of strings and cells, a side record: the `HEAD_CELLS` cells every row
# of the side shares (Device and PID, Execution Count, Op Name, Op Type, Op Id, Input/Output),
# then `ROW_CELLS` per row: Index, Dtype, Shape (as written, "AxB"), its statistics cell
# (stats_cell.py) or None, its Tensor Path cell (`tensor_path_cell`) or None (no file: N/A).
# Flat tuples, not record classes: Python's garbage collector stops tracking an exact tuple of
# strings and bytearrays at its first collection (nested tuples take one collection per level),
# and many rows wait for the writer at once (see stats_cell.py). In request_statistic.csv's side
# records the last cell of a row is its request (a str) instead of a Tensor Path.
HEAD_CELLS, ROW_CELLS = 6, 5

# A Tensor Path cell: a bytearray (untracked by the garbage collector, like the statistics
# cells) of one state byte and the file's path below the round folder in UTF-8. The writer
# marks it missing when it does not write the file, and the row then says N/A.
_NAMED, _MISSING = 0, 1
_NAMED_BYTE = bytearray((_NAMED,))  # bytearray + bytes is a new bytearray


def tensor_path_cell(in_round: str) -> bytearray:
    """The Tensor Path cell of a row whose file is `in_round` (relative to its round folder)."""
    return _NAMED_BYTE + in_round.encode("utf-8", "surrogateescape")


def mark_missing(cell: bytearray) -> None:
    """The file of this Tensor Path cell was not written: its row says N/A."""
    cell[0] = _MISSING


def side_rows(side: tuple) -> int:
    """The number of rows in a side record."""
    return (len(side) - HEAD_CELLS) // ROW_CELLS


def _head(side: tuple) -> str:
    """The csv text of a side record's head cells (the first six of each of its rows)."""
    head = ",".join(side[:HEAD_CELLS])
    if head.count(",") != HEAD_CELLS - 1 or '"' in head or "\n" in head or "\r" in head:
        head = ",".join(map(_cell, side[:HEAD_CELLS]))  # a cell needs quotes
    return head


def format_sides(sides: Iterable[tuple], round_path: str = "") -> str:
    """CSV text of the rows of side records (see above), whose Tensor Paths are below
    `round_path` (the round folder's absolute path): the same text `csv.writer` makes of the
    formatted cells, made faster: this runs for every row of a dump (on the writer thread,
    off the model's path, but holding the GIL the model needs)."""
    lines = []
    add = lines.append
    prefix = round_path + "/"
    # Statistics are shared between the rows of the same values (a view, the next kernel's
    # input): each is formatted once. Keyed by id: `sides` keeps them all alive.
    numbers: dict = {id(None): _NA_STATS}
    known = numbers.get
    for side in sides:
        head = _head(side)
        end = len(side)
        at = HEAD_CELLS
        while at < end:  # most sides have one row: a slice per row beats zip over an iterator
            index, dtype, shape, stat, file = side[at:at + ROW_CELLS]
            at += ROW_CELLS
            stats = known(id(stat))
            if stats is None:
                st = values(stat)
                # repr: the shortest text that reads back as the same float (format_number)
                stats = numbers[id(stat)] = _NA_STATS if st is None else "%r,%r,%r,%r" % st
            if not index.isdigit():
                index = _cell(index)
            if file is None or file[0] == _MISSING:
                path = NA
            else:
                path = _cell(prefix + file[1:].decode("utf-8", "surrogateescape"))
            add(f"{head},{index},{dtype},nd,{shape},{stats},{path}\n")
    return "".join(lines)


def format_request_sides(sides: Iterable[tuple]) -> str:
    """CSV text of request_statistic.csv's (and derived_statistic.csv's) side records (see
    above)."""
    lines = []
    add = lines.append
    requests: dict = {}  # request -> its cell and N/A before it (a handful per call)
    for side in sides:
        head = _head(side)
        end = len(side)
        at = HEAD_CELLS
        while at < end:
            index, dtype, shape, stat, request = side[at:at + ROW_CELLS]
            at += ROW_CELLS
            # Each request's slice has statistics of its own: none to share between rows.
            stats = "%r,%r,%r,%r" % unpack(stat)[:4] if stat is not None and \
                stat[-1] == READY else _NA_STATS  # `values`, inline
            tail = requests.get(request)
            if tail is None:
                tail = requests[request] = f"{NA},{_cell(request)}\n"
            if not index.isdigit():
                index = _cell(index)
            add(f"{head},{index},{dtype},nd,{shape},{stats},{tail}")
    return "".join(lines)


_SHAPES: dict = {}  # torch.Size (or any tuple of ints) -> its Shape cell


def shape_cell(dims) -> str:
    """The Shape cell of a tensor of shape `dims`: "AxBxC"."""
    text = _SHAPES.get(dims)
    if text is None:
        if len(_SHAPES) >= 4096:  # prompts of every length: keep it bounded
            _SHAPES.clear()
        text = _SHAPES[dims] = "x".join(map(str, dims))
    return text


# -- cells read back (the tools) ----------------------------------------------------------------

_SHAPE_CELL = re.compile(r"\d+(?:x\d+)*", re.ASCII)


def parse_shape(cell: str) -> tuple[int, ...]:
    """The dimensions of a Shape cell as `shape_cell` writes it ("1x4x32" -> (1, 4, 32), "" -> ()
    for a scalar); ValueError for other text (the tools write `?` for a header they could not
    read)."""
    if not cell:
        return ()
    if _SHAPE_CELL.fullmatch(cell) is None:
        raise ValueError(f"not a Shape cell: {cell!r}")
    return tuple(map(int, cell.split("x")))


def is_empty_shape(cell: str) -> bool:
    """Whether a Shape cell is that of a tensor without elements (a dimension of 0); False for
    text that is no Shape cell."""
    try:
        return 0 in parse_shape(cell)
    except ValueError:
        return False


STAT_COLUMNS = ("Max", "Min", "Mean", "Norm")


class Stats(NamedTuple):
    """A tensor's statistics: the Max, Min, Mean and Norm (L2) cells of its row."""

    max: float
    min: float
    mean: float
    norm: float


def parse_stats(row: Mapping[str, str]) -> Stats | None:
    """The statistics of a row read by column title; None when a cell is N/A (task=tensor, an
    empty tensor) or missing."""
    try:
        return Stats(*(float(row[column]) for column in STAT_COLUMNS))
    except (KeyError, ValueError):
        return None
