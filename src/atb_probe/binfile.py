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

The reader never trusts the header: it must end with a `$End=1` line within `MAX_HEADER_BYTES`,
name each key once, hold plain decimal integers, and state sizes that agree with each other and
with the file's real length; only then is anything allocated. Every inconsistency raises
`BinFormatError` with a message saying what is wrong.
"""
from __future__ import annotations

import math
import os
import re
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
    """Parse and validate the header at the start of `raw` for a file of `file_size` bytes.

    Every size the header states is checked against the others and against `file_size`, so a
    caller that trusts the result never reads (or allocates) more than the file holds."""
    fields, offset = _fields_fast(raw) or _fields_line_by_line(raw)
    return _header_of(fields, offset, file_size)


def _fields_fast(raw: bytes) -> tuple[dict[str, str], int] | None:
    """The header's fields and the payload's offset, in one split, for a well-formed header
    (most files); None sends the header to `_fields_line_by_line`, whose errors say what is
    wrong."""
    if raw.startswith(b"$End=1\n"):
        return None
    end = raw.find(b"\n$End=1\n", 0, MAX_HEADER_BYTES)
    if end < 0:
        return None
    try:
        lines = raw[:end].decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return None
    fields = {}
    for line in lines:
        key, sep, value = line.partition("=")
        if not sep or not key or key in fields:
            return None
        fields[key] = value
    return fields, end + len(b"\n$End=1\n")


def _fields_line_by_line(raw: bytes) -> tuple[dict[str, str], int]:
    fields: dict[str, str] = {}
    pos = 0
    while True:
        nl = raw.find(b"\n", pos, MAX_HEADER_BYTES)
        if nl < 0:
            raise BinFormatError(f"no '$End=1' line in the first {min(len(raw), MAX_HEADER_BYTES)}"
                                 " bytes: a truncated header, or not an ATB .bin file")
        line_bytes, pos = raw[pos:nl], nl + 1
        if line_bytes == b"$End=1":
            break
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise BinFormatError(f"header line {len(fields) + 1} is not text") from None
        key, sep, value = line.partition("=")
        if not sep or not key:
            raise BinFormatError(f"header line without 'key=': {line[:80]!r}")
        if key in fields:
            raise BinFormatError(f"header repeats '{key}'")
        fields[key] = value
    return fields, pos


def _header_of(fields: dict[str, str], offset: int, file_size: int) -> BinHeader:
    for key in ("$Version", "$Object.Count", "$Object.Length", "dtype", "dims"):
        if key not in fields:
            raise BinFormatError(f"header lacks '{key}'")
    count = _int_field(fields, "$Object.Count")
    length = _int_field(fields, "$Object.Length")
    code = _int_field(fields, "dtype")
    fmt = _int_field(fields, "format") if "format" in fields else FORMAT_ND
    if code not in BY_CODE:
        raise BinFormatError(f"unknown dtype code {code}")
    if fmt < 0:
        raise BinFormatError(f"negative format code {fmt}")
    dtype = BY_CODE[code]
    dims = _dims(fields["dims"])
    payload = file_size - offset
    if count == 0:
        if length != 0:
            raise BinFormatError(f"$Object.Count=0 but $Object.Length={length}")
        ref = fields.get("data")
        if not ref:
            raise BinFormatError("$Object.Count=0 without a 'data=' line")
        if payload:
            raise BinFormatError(f"a payload-less header followed by {payload} bytes")
        return BinHeader(dtype, dims, fmt, 0, offset, ref)
    if count != 1:
        raise BinFormatError(f"$Object.Count={count}: only single-object files are supported")
    if length < 0:
        raise BinFormatError(f"negative $Object.Length={length}")
    need = math.prod(dims) * dtype.itemsize
    if need != length:
        raise BinFormatError(f"dims {_short_dims(dims)} x {dtype.csv_name} need {_short_int(need)}"
                             f" bytes but $Object.Length={length}")
    if "$Object.data" in fields:
        start, _, size = fields["$Object.data"].partition(",")
        if not (_UINT.fullmatch(start) and _UINT.fullmatch(size)):
            raise BinFormatError(f"malformed $Object.data={fields['$Object.data'][:40]!r}")
        if int(start) != 0 or int(size) != length:
            raise BinFormatError(f"$Object.data={start},{size} disagrees with "
                                 f"$Object.Length={length}")
    if payload != length:
        raise BinFormatError(f"payload is {payload} bytes but the header says {length}"
                             " (truncated or trailing data)")
    return BinHeader(dtype, dims, fmt, length, offset, None)


_INT = re.compile(r"-?[0-9]{1,19}")
_UINT = re.compile(r"[0-9]{1,19}")


def _int_field(fields: dict[str, str], key: str) -> int:
    value = fields[key].strip()
    if not _INT.fullmatch(value):
        raise BinFormatError(f"{key} is not an integer: {value[:40]!r}")
    return int(value)


def _dims(text: str) -> tuple[int, ...]:
    text = text.strip()
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > MAX_DIMS:
        raise BinFormatError(f"{len(parts)} dims (at most {MAX_DIMS})")
    dims = []
    for part in parts:
        part = part.strip()
        if not _INT.fullmatch(part):
            raise BinFormatError(f"dims is not a list of integers: {text[:80]!r}")
        if part.startswith("-"):
            raise BinFormatError(f"negative dimension in dims={text[:80]}")
        dims.append(int(part))
    return tuple(dims)


def _short_dims(dims: tuple[int, ...]) -> str:
    text = str(dims)
    return text if len(text) <= 80 else text[:77] + "..."


def _short_int(n: int) -> str:
    text = str(n)
    return text if len(text) <= 24 else f"about 10^{len(text) - 1}"


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
        if header.nbytes < 0 or header.payload_offset < 0 or \
                size - header.payload_offset < header.nbytes:
            # A header read earlier (or made up) that this file cannot back: do not allocate it.
            raise BinFormatError(f"{path}: the file holds {size} bytes, fewer than its header "
                                 f"promises ({header.payload_offset} + {header.nbytes})")
        f.seek(header.payload_offset)
        data = f.read(header.nbytes)
    if len(data) != header.nbytes:
        raise BinFormatError(f"{path}: payload shorter than its header says")
    return data
