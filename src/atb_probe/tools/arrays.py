"""A dumped tensor's values for the analysis tools, read with as little work per file as the
`.bin` format allows (see binfile.py for the format).

`compare` and `scan` read every tensor of a dump once, and most tensors of a layer dump are small:
opening a file twice and reading its header twice costs more than the metrics of the tensor
itself. Here a file is opened once; its first page holds the header and, for small tensors, the
whole payload; larger payloads are read straight into the array (`np.fromfile`). Reference
files (filter_level 1) are followed to the bytes they name. bf16 is widened to float32 (exact: a
shift); dtypes numpy lacks otherwise (fp8) go through torch, as `TensorRecord.load` does.

A caller that reads tensor after tensor and lets go of each before the next (compare reads the
two sides of one pair) passes a `ReadBuffer`: payloads are read into its memory rather than into
a new array each time, whose page faults cost more than the copy itself for the large tensors.
"""
from __future__ import annotations

import os

import numpy as np

from ..binfile import MAX_HEADER_BYTES, BinFormatError, parse_header
from .dumpreader import NoData
from ..binread import HeaderOnlyError, load_numpy, resolve

FIRST_READ = 1 << 16   # one read covers the header and the payload of most layer-level tensors


class ReadBuffer:
    """Memory reused by the reads of one caller: the array `load_values` returns with it is valid
    until the next read into the same buffer."""

    def __init__(self):
        self._raw = np.empty(0, np.uint8)
        self._wide = np.empty(0, np.uint32)

    def raw(self, nbytes: int) -> np.ndarray:
        if self._raw.size < nbytes:
            self._raw = np.empty(max(nbytes, 2 * self._raw.size), np.uint8)
        return self._raw[:nbytes]

    def wide(self, count: int) -> np.ndarray:
        if self._wide.size < count:
            self._wide = np.empty(max(count, 2 * self._wide.size), np.uint32)
        return self._wide[:count]


def load_values(path: str | None, buffer: ReadBuffer | None = None) -> np.ndarray:
    """The values of the `.bin` at `path` as a numpy array; `NoData` says why there are none.
    With `buffer`, the array may live in the buffer's memory (see `ReadBuffer`)."""
    if path is None:
        raise NoData("no .bin file (Tensor Path is N/A: task=statistics, or a file the probe "
                     "could not write)")
    try:
        return _read(path, buffer)
    except HeaderOnlyError:
        raise NoData("header-only file (filter_level 2): statistics only") from None
    except FileNotFoundError:
        raise NoData(f"{path} does not exist") from None
    except (BinFormatError, OSError) as exc:
        raise NoData(f"unreadable: {exc}") from None


def _read(path: str, buffer: ReadBuffer | None = None) -> np.ndarray:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(min(size, FIRST_READ))
        if b"\n$End=1\n" not in head and len(head) < min(size, MAX_HEADER_BYTES):
            head += f.read(MAX_HEADER_BYTES - len(head))
        header = parse_header(head, size)
        raw = header.dtype.numpy_name or {1: "<u1", 2: "<u2"}[header.dtype.itemsize]
        if header.is_reference:
            data_path, data_header = resolve(path, header)
            if data_header.nbytes != header.numel * header.dtype.itemsize:
                raise BinFormatError(f"{path}: reference target {data_path} holds "
                                     f"{data_header.nbytes} bytes, not {header.numel} elements")
            array = _payload_of(data_path, data_header, raw, buffer)
        elif header.payload_offset + header.nbytes <= len(head):
            array = np.frombuffer(head, dtype=raw, count=header.numel,
                                  offset=header.payload_offset)
        else:
            array = _payload(f, path, header, raw, buffer)
    if header.dtype.numpy_name is not None:
        return array.reshape(header.dims)
    if header.dtype.torch_name == "bfloat16":
        # bf16 is the upper half of a float32: widening is a shift, exact and torch-free.
        wide = buffer.wide(array.size) if buffer is not None else None
        return np.left_shift(array, 16, dtype=np.uint32, out=wide).view(np.float32) \
            .reshape(header.dims)
    return load_numpy(path)


def _payload_of(path: str, header, raw: str, buffer: ReadBuffer | None) -> np.ndarray:
    with open(path, "rb", buffering=0) as f:
        return _payload(f, path, header, raw, buffer)


def _payload(f, path: str, header, raw: str, buffer: ReadBuffer | None) -> np.ndarray:
    """The payload at the header's offset of the open file `f`, into `buffer` if given."""
    f.seek(header.payload_offset)
    if buffer is None:
        array = np.fromfile(f, dtype=raw, count=header.numel)
    else:
        itemsize = np.dtype(raw).itemsize
        memory = buffer.raw(header.numel * itemsize)
        view, got = memoryview(memory), 0
        while got < memory.size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
        array = memory[:got - got % itemsize].view(raw)
    if array.size != header.numel:
        raise BinFormatError(f"{path}: payload shorter than its header says")
    return array
