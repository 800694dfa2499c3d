"""The `.bin` reader against hostile files (issue #6): truncated, oversized, inconsistent or
malicious headers are rejected with a clear `BinFormatError`, and the reader never allocates more
than the file holds."""
from __future__ import annotations

import math
import os
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atb_probe.binfile import (MAX_HEADER_BYTES, BinFormatError, encode_header,
                               encode_reference, parse_header, read_header, read_payload)
from atb_probe.dtypes import BY_CODE, DTYPES


def good_file(dims=(2, 3), code=0) -> bytes:
    dt = BY_CODE[code]
    payload = bytes(range(256)) * (math.prod(dims) * dt.itemsize // 256 + 1)
    payload = payload[:math.prod(dims) * dt.itemsize]
    return encode_header(code, dims, len(payload)) + payload


def header_lines(**replace) -> bytes:
    """A 2x3 float header (24 payload bytes) with some lines replaced (None: removed)."""
    lines = {"$Version": "1.0", "$Object.Count": "1", "$Object.Length": "24", "format": "2",
             "dtype": "0", "dims": "2,3", "$Object.data": "0,24", "$End": "1"}
    lines.update(replace)
    return "".join(f"{k}={v}\n" for k, v in lines.items() if v is not None).encode()


def reject(raw: bytes, size: int | None = None) -> str:
    with pytest.raises(BinFormatError) as info:
        parse_header(raw, len(raw) if size is None else size)
    return str(info.value)


def test_a_good_file_round_trips(tmp_path):
    data = good_file((4, 5), code=1)
    path = tmp_path / "t.bin"
    path.write_bytes(data)
    header = read_header(path)
    assert header.dims == (4, 5) and header.dtype.csv_name == "float16"
    assert read_payload(path) == data[header.payload_offset:]


def test_truncated_payload_is_rejected():
    data = good_file()
    for cut in range(1, 24):
        assert "truncated" in reject(data[:-cut])


def test_trailing_data_is_rejected():
    assert "trailing" in reject(good_file() + b"\0")


def test_every_truncation_of_the_header_is_rejected():
    data = good_file()
    end = data.index(b"$End=1\n") + len(b"$End=1\n")
    for cut in range(end):
        with pytest.raises(BinFormatError):
            parse_header(data[:cut], cut)


def test_missing_end_line_is_rejected_within_the_header_limit():
    raw = header_lines(**{"$End": None}) + b"x" * MAX_HEADER_BYTES + b"\n$End=1\n"
    assert "no '$End=1' line" in reject(raw)


@pytest.mark.parametrize("replace,message", [
    ({"dims": "100000,100000,100000"}, "need"),
    ({"dims": ",".join(["4294967295"] * 64)}, "need"),
    ({"dims": "9" * 5000}, "not a list of integers"),
    ({"dims": "1," * 100 + "1"}, "at most 64"),
    ({"dims": "-2,-12"}, "negative dimension"),
    ({"dims": "2,3_0"}, "not a list of integers"),
    ({"dims": "2,٣"}, "not a list of integers"),
    ({"$Object.Length": "-24"}, "negative $Object.Length"),
    ({"$Object.Length": "99999999999999999999999"}, "not an integer"),
    ({"$Object.Length": "--24"}, "not an integer"),
    ({"$Object.Length": "²4"}, "not an integer"),
    ({"$Object.Length": "48", "$Object.data": "0,48"}, "need"),
    ({"$Object.data": "0,25"}, "disagrees"),
    ({"$Object.data": "8,24"}, "disagrees"),
    ({"$Object.data": "zero"}, "malformed"),
    ({"$Object.Count": "2"}, "single-object"),
    ({"$Object.Count": "-1"}, "single-object"),
    ({"$Object.Count": None}, "lacks '$Object.Count'"),
    ({"$Version": None}, "lacks '$Version'"),
    ({"dtype": "5"}, "unknown dtype"),
    ({"dtype": "0x0"}, "not an integer"),
    ({"format": "-1"}, "negative format"),
    ({"dims": None}, "lacks 'dims'"),
])
def test_inconsistent_or_malicious_header_is_rejected(replace, message):
    raw = header_lines(**replace) + bytes(24)
    assert message in reject(raw)


def test_header_line_that_is_not_text_or_not_key_value_is_rejected():
    assert "not text" in reject(b"$Version=1.0\n\xff\xfe=1\n$End=1\n")
    assert "without 'key='" in reject(b"$Version=1.0\nhello\n$End=1\n")
    assert "repeats 'dims'" in reject(header_lines() .replace(b"dims=2,3\n",
                                                              b"dims=2,3\ndims=6\n") + bytes(24))


def test_reference_file_rules():
    ref = encode_reference(0, (2, 3), "0_Layer/after/outtensor0.bin")
    header = parse_header(ref, len(ref))
    assert header.is_reference and header.data_ref == "0_Layer/after/outtensor0.bin"
    assert "followed by 4 bytes" in reject(ref + b"\0\0\0\0")
    assert "without a 'data='" in reject(ref.replace(b"data=0_Layer/after/outtensor0.bin\n",
                                                     b""))
    assert "$Object.Length=5" in reject(ref.replace(b"$Object.Length=0", b"$Object.Length=5"))


def test_reader_refuses_a_reference_as_data(tmp_path):
    path = tmp_path / "r.bin"
    path.write_bytes(encode_reference(0, (2,), "x.bin"))
    with pytest.raises(BinFormatError, match="reference"):
        read_payload(path)


def test_a_huge_claim_in_a_tiny_file_allocates_nothing(tmp_path):
    path = tmp_path / "liar.bin"
    n = 1 << 40  # a terabyte
    path.write_bytes(encode_header(0, (n // 4,), n) + b"tiny")
    tracemalloc.start()
    try:
        with pytest.raises(BinFormatError, match="payload is 4 bytes"):
            read_payload(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_HEADER_BYTES


def test_a_stale_header_cannot_make_the_reader_allocate(tmp_path):
    """A header read before the file was swapped for a shorter one."""
    path = tmp_path / "t.bin"
    path.write_bytes(good_file((1000,)))
    header = read_header(path)
    path.write_bytes(good_file((2,)))
    with pytest.raises(BinFormatError, match="fewer than its header promises"):
        read_payload(path, header)


# -- fuzzing --------------------------------------------------------------------------------

DIMS = st.lists(st.integers(0, 6), max_size=4).map(tuple)


@st.composite
def mutated_files(draw) -> bytes:
    """A valid file, then a few byte-level and line-level mutations."""
    dt = draw(st.sampled_from(DTYPES))
    data = bytearray(good_file(draw(DIMS), dt.code))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "line", "append"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            i = draw(st.integers(0, len(data) - 1))
            del data[i:i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif op == "append":
            data += draw(st.binary(max_size=16))
        elif op == "line":
            key = draw(st.sampled_from([b"$Object.Length", b"$Object.Count", b"dims", b"dtype",
                                        b"$Object.data", b"format", b"data"]))
            value = draw(st.one_of(
                st.integers(-(1 << 70), 1 << 70).map(lambda n: str(n).encode()),
                st.lists(st.integers(-5, 1 << 40), max_size=70).map(
                    lambda ds: ",".join(map(str, ds)).encode()),
                st.binary(max_size=12)))
            data[0:0] = key + b"=" + value + b"\n"
    return bytes(data)


def check_parse(raw: bytes, size: int) -> None:
    """Either a header consistent with the file, or a BinFormatError; nothing else."""
    try:
        header = parse_header(raw, size)
    except BinFormatError as exc:
        assert str(exc) and len(str(exc)) < 400
        return
    assert 0 < header.payload_offset <= min(size, MAX_HEADER_BYTES)
    if header.is_reference:
        assert header.nbytes == 0 and size == header.payload_offset
    else:
        assert header.nbytes == header.numel * header.dtype.itemsize
        assert header.payload_offset + header.nbytes == size


@settings(max_examples=500, deadline=None)
@given(mutated_files())
def test_fuzzed_files_parse_consistently_or_are_rejected(raw):
    check_parse(raw, len(raw))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 1 << 62))
def test_random_bytes_with_any_file_size_never_crash_the_parser(raw, extra):
    check_parse(raw, len(raw) + extra)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutated_files())
def test_fuzzed_files_on_disk_read_back_exactly_their_payload(tmp_path, raw):
    path = tmp_path / "fuzz.bin"
    path.write_bytes(raw)
    try:
        header = read_header(path)
        payload = None if header.is_reference else read_payload(path, header)
    except BinFormatError:
        return
    if payload is not None:
        assert len(payload) == header.nbytes <= os.path.getsize(path)
        assert raw.endswith(payload) or not payload
