"""Statistics cells: where the max, min, mean and norm of one state of a tensor's values wait
for the statistic.csv rows that show them.

The recorder hands a row a cell as soon as it sees the tensor; the cell fills when its batch is
computed (capture/stats_compute.py), on an accelerator when the landing thread has seen the
batch's copy to the host land (the rows' `Landed`, which the writer waits on), and the writer
reads it when it formats the row (`values`). Pure: no torch.

Rows wait for the writer for a while (a round, then the writer's delay), so many of them are
alive at once. A cell is therefore a `bytearray` (struct `_CELL`: max, min, mean and norm as
float64, the serial of the queue it waits in, its state), not an object of a
class: a bytearray is not tracked by Python's garbage collector, and an exact tuple made only of
cells, strings and ints (a statistic.csv row, see statcsv.py) stops being tracked at its first
collection. Tracked objects that live for a round get promoted to the oldest generation, and
enough of them make Python run a full collection over every object of the user's process
(about 200 ms with transformers loaded).
"""
from __future__ import annotations

import itertools
import struct

# A cell's state, its last byte: filled, never to be filled (an empty tensor: the row says N/A),
# pending in a queue, on its way from a device.
READY, NO_VALUES, QUEUED, DEVICE = 0, 1, 2, 3
_CELL = struct.Struct("=4dqB")
pack = _CELL.pack_into  # pack(cell, 0, max, min, mean, norm, serial, state)
unpack = _CELL.unpack_from  # unpack(cell) -> (max, min, mean, norm, serial, state)
_SERIAL = struct.Struct("=q")
_serial_of = _SERIAL.unpack_from
_SERIAL_AT = 32
_QUEUED = bytearray(_CELL.size)
_QUEUED[-1] = QUEUED
_serials = itertools.count(1)  # queues (next() is atomic under the GIL)

EMPTY = bytearray(_CELL.size)  # the statistics of every empty tensor: N/A
EMPTY[-1] = NO_VALUES


def new_serial() -> int:
    """A number that names a queue in its cells."""
    return next(_serials)


def new_cell(serial: int) -> bytearray:
    """A cell pending in the queue numbered `serial`."""
    cell = bytearray(_QUEUED)
    _SERIAL.pack_into(cell, _SERIAL_AT, serial)
    return cell


def waits_in(cell: bytearray) -> int:
    """The serial of the queue a `QUEUED` cell waits in."""
    return _serial_of(cell, _SERIAL_AT)[0]


def fill(cell: bytearray, stats: tuple) -> None:
    """Store (max, min, mean, norm) in `cell`: it is `READY`."""
    pack(cell, 0, stats[0], stats[1], stats[2], stats[3], 0, READY)


def values(cell: bytearray | None):
    """(max, min, mean, norm) of a cell, or None for N/A (an empty tensor, a statistic that
    was never computed)."""
    if cell is None or cell[-1] != READY:
        return None
    return unpack(cell)[:4]
