"""The ATB `.bin` tensor file: writer of headers and a defensive reader (SPEC §5).

A file is ASCII `key=value` lines followed by the raw little-endian C-order payload::

    $Version=1.0
    $Object.Count=1
    $Object.Length=<payload bytes>
    format=2
    dtype=<code>                 (see dtypes.py)
    dims=<d0>,<d1>,...
    $Object.data=0,<payload bytes>
    $End=1
    <payload>

Two payload-less variants exist, both with `$Object.Count=0` and `$Object.Length=0`:

* a *reference* file carries `data=<path relative to the round directory>` naming the file that
  holds the bytes (filter_level 1: the same bytes were already written in this layer execution);
* a *header-only* file (filter_level 2 kernels) carries `data=` naming itself.

The reader never trusts the header: sizes are checked against the file's real length before any
allocation, and every inconsistency raises `BinFormatError` with a message saying what is wrong.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .dtypes import BY_CODE, DType

FORMAT_ND = 2
MAX_HEADER_BYTES = 64 * 1024
MAX_DIMS = 64


class BinFormatError(ValueError):
    """A `.bin` file that does not follow the ATB format."""


def encode_header(dtype_code: int, dims: tuple[int, ...] | list[int], nbytes: int,
                  fmt: int = FORMAT_ND) -> bytes:
    """The header of a file whose payload of `nbytes` bytes follows it."""
    return (
        "$Version=1.0\n"
        "$Object.Count=1\n"
        f"$Object.Length={nbytes}\n"
        f"format={fmt}\n"
        f"dtype={dtype_code}\n"
        f"dims={','.join(str(int(d)) for d in dims)}\n"
        f"$Object.data=0,{nbytes}\n"
        "$End=1\n"
    ).encode("ascii")


def encode_reference(dtype_code: int, dims: tuple[int, ...] | list[int], target: str,
                     fmt: int = FORMAT_ND) -> bytes:
    """A payload-less file whose bytes live in `target` (relative to the round directory)."""
    if "\n" in target:
        raise ValueError("reference target must be a single line")
    return (
        "$Version=1.0\n"
        "$Object.Count=0\n"
        "$Object.Length=0\n"
        f"format={fmt}\n"
        f"dtype={dtype_code}\n"
        f"dims={','.join(str(int(d)) for d in dims)}\n"
        f"data={target}\n"
        "$End=1\n"
    ).encode("utf-8")


@dataclass(frozen=True)
class BinHeader:
    """What a `.bin` header says; `payload_offset` is where the payload starts in the file."""

    dtype: DType
    dims: tuple[int, ...]
    fmt: int
    nbytes: int
    payload_offset: int
    data_ref: str | None  # `data=` target of a reference or header-only file, else None

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def is_reference(self) -> bool:
        return self.data_ref is not None


def parse_header(raw: bytes, file_size: int) -> BinHeader:
    """Parse and validate the header at the start of `raw` for a file of `file_size` bytes."""
    end = raw.find(b"$End=1\n")
    if end < 0:
        raise BinFormatError("no '$End=1' line in the first "
                             f"{min(len(raw), MAX_HEADER_BYTES)} bytes: not an ATB .bin file "
                             "or a truncated header")
    offset = end + len(b"$End=1\n")
    try:
        text = raw[:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BinFormatError(f"header is not text: {exc}") from None
    fields: dict[str, str] = {}
    for line in text.split("\n"):
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise BinFormatError(f"header line without '=': {line[:80]!r}")
        fields[key] = value
    for key in ("$Object.Count", "$Object.Length", "dtype", "dims"):
        if key not in fields:
            raise BinFormatError(f"header lacks '{key}'")
    count = _int_field(fields, "$Object.Count")
    length = _int_field(fields, "$Object.Length")
    code = _int_field(fields, "dtype")
    fmt = _int_field(fields, "format") if "format" in fields else FORMAT_ND
    if code not in BY_CODE:
        raise BinFormatError(f"unknown dtype code {code}")
    dtype = BY_CODE[code]
    dims_text = fields["dims"].strip()
    if dims_text:
        parts = dims_text.split(",")
        if len(parts) > MAX_DIMS:
            raise BinFormatError(f"{len(parts)} dims (at most {MAX_DIMS})")
        try:
            dims = tuple(int(p) for p in parts)
        except ValueError:
            raise BinFormatError(f"dims is not a list of integers: {dims_text[:80]!r}") from None
    else:
        dims = ()
    if any(d < 0 for d in dims):
        raise BinFormatError(f"negative dimension in dims={dims_text[:80]}")
    numel = math.prod(dims)
    if count == 0:
        if length != 0:
            raise BinFormatError("$Object.Count=0 but $Object.Length is not 0")
        ref = fields.get("data")
        if not ref:
            raise BinFormatError("$Object.Count=0 without a 'data=' line")
        return BinHeader(dtype, dims, fmt, 0, offset, ref)
    if count != 1:
        raise BinFormatError(f"$Object.Count={count}: only single-object files are supported")
    if length < 0:
        raise BinFormatError(f"negative $Object.Length={length}")
    if numel * dtype.itemsize != length:
        raise BinFormatError(f"dims {dims} x {dtype.csv_name} need {numel * dtype.itemsize} "
                             f"bytes but $Object.Length={length}")
    if "$Object.data" in fields:
        start, _, size = fields["$Object.data"].partition(",")
        try:
            start_i, size_i = int(start), int(size)
        except ValueError:
            raise BinFormatError("malformed $Object.data") from None
        if start_i != 0 or size_i != length:
            raise BinFormatError(f"$Object.data={start_i},{size_i} disagrees with "
                                 f"$Object.Length={length}")
    if file_size - offset != length:
        raise BinFormatError(f"payload is {file_size - offset} bytes but the header says {length}"
                             " (truncated or trailing data)")
    return BinHeader(dtype, dims, fmt, length, offset, None)


def _int_field(fields: dict[str, str], key: str) -> int:
    value = fields[key].strip()
    if not value.lstrip("-").isdigit() or len(value) > 20:
        raise BinFormatError(f"{key} is not an integer: {value[:40]!r}")
    return int(value)


def read_header(path: str | os.PathLike) -> BinHeader:
    """Read and validate the header of the file at `path`."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(MAX_HEADER_BYTES)
    return parse_header(raw, size)


def read_payload(path: str | os.PathLike, header: BinHeader | None = None) -> bytes:
    """The payload bytes of a data-holding file (not of a reference)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if header is None:
            header = parse_header(f.read(MAX_HEADER_BYTES), size)
        if header.is_reference:
            raise BinFormatError(f"{path} is a reference to {header.data_ref!r}, not data")
        f.seek(header.payload_offset)
        data = f.read(header.nbytes)
    if len(data) != header.nbytes:
        raise BinFormatError(f"{path}: payload shorter than its header says")
    return data
