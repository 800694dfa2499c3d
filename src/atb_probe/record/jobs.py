"""What the recorder hands the writer: one record type per kind of file, nothing else.

Paths are relative to the dump root, as `layout` builds them. A job is complete when it is
queued: the writer never asks the capture side for anything, and the only thing it may wait for
is the job's `ready` (an object with a `wait()` method, a `Landed`: the copy of an accelerator
tensor, or of device statistics, to host memory, seen through by the capture side's landing
thread), after which every byte and cell it holds is final. Pure; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TensorFileJob:
    """A `.bin` file made of `chunks` (its header bytes, then buffers the writer may keep).
    `row_path`: the Tensor Path cell of the statistic.csv row that names this file
    (`statcsv.tensor_path_cell`), marked missing when the file is not written; None for a file
    no row names."""

    rel_dir: str
    name: str
    chunks: list
    size: int              # accounted bytes
    ready: object = None   # None, or what to wait for before reading the buffers
    row_path: bytearray | None = None


@dataclass(slots=True)
class JsonJob:
    """A JSON document (op_param.json, a structure file), serialised on the writer thread."""

    rel_dir: str
    name: str
    doc: object
    size: int = 4096       # accounted bytes


@dataclass(slots=True)
class RowsJob:
    """statistic.csv rows, as side records (statcsv.py), for the file `rel_dir/name`, a new
    file starting with `header`. `ready`: None, or what to wait for before their statistics
    cells are read. `requests`: request_statistic.csv's side records."""

    rel_dir: str
    name: str
    sides: list
    header: str
    size: int              # accounted bytes
    ready: object = None
    requests: bool = False
