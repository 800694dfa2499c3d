"""statistic.csv text: the fast formatter of per-side records writes exactly what `csv.writer`
would."""
from __future__ import annotations

import csv
import io
import math

import pytest
from hypothesis import given, settings, strategies as st

from atb_probe.stats_cell import fill, new_cell, new_serial
from atb_probe.statcsv import (NA, STAT_COLUMNS, Stats, format_number,
                              format_request_sides, format_sides, is_empty_shape, mark_missing, parse_shape, parse_stats, shape_cell,
                              tensor_path_cell)

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | \
    st.sampled_from(['a,b', '"q"', 'line\nbreak', 'cr\r', '', ' lead', 'N/A'])
FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=64)
DTYPE = st.sampled_from(["float", "float16", "bf16", "int64", "bool", "complex64"])
# The last item is the tensor file's path below the round folder, or None for no file.
RECORD = st.tuples(*([TEXT] * 7), DTYPE, TEXT, st.lists(st.integers(0, 10 ** 6), max_size=5).map(tuple),
                   st.none() | st.tuples(FLOAT, FLOAT, FLOAT, FLOAT), st.none() | TEXT)
ROUND = "/dump/data/0_1/3"  # the round folder the rows' tensor paths are below


def ready(stats: tuple) -> bytearray:
    """Statistics as the recorder hands them over: a filled cell."""
    cell = new_cell(new_serial())
    fill(cell, stats)
    return cell


def _sides(records) -> list:
    """The records as side tuples, consecutive records with the same first six cells in one."""
    sides = []
    for r in records:
        row = (r[6], r[7], shape_cell(r[9]), None if r[10] is None else ready(r[10]),
               None if r[11] is None else tensor_path_cell(r[11]))
        if sides and sides[-1][:6] == r[:6]:
            sides[-1] += row
        else:
            sides.append(r[:6] + row)
    return sides


def _reference(records) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for r in records:
        stats = [NA] * 4 if r[10] is None else [format_number(v) for v in r[10]]
        writer.writerow([*r[:6], r[6], r[7], "nd", "x".join(str(d) for d in r[9]), *stats,
                         _path(r)])
    return buf.getvalue()


@settings(max_examples=300, deadline=None)
@given(st.lists(RECORD, max_size=6))
def test_records_format_as_csv_writer_does(records):
    records = [r[:8] + ("nd",) + r[9:] for r in records]  # Format is always nd
    text = format_sides(_sides(records), ROUND)
    if not any("\r" in cell for r in records for cell in (*r[:9], _path(r))):
        assert text == _reference(records)  # (csv.writer leaves a lone \r unquoted; we quote)
    parsed = list(csv.reader(io.StringIO(text, newline="")))
    assert len(parsed) == len(records)
    for row, r in zip(parsed, records):
        assert row[:9] == list(r[:9]) and row[14] == _path(r)
        if r[10] is not None:
            for cell, value in zip(row[10:14], r[10]):
                assert (math.isnan(value) and cell == "nan") or float(cell) == value


@settings(max_examples=300, deadline=None)
@given(st.lists(RECORD, max_size=6))
def test_request_records_format_as_csv_writer_does(records):
    # request_statistic.csv: the last cell of a row is its request, after Tensor Path N/A.
    records = [r[:8] + ("nd",) + r[9:11] + (r[11] or "",) for r in records]
    sides = []
    for r in records:
        row = (r[6], r[7], shape_cell(r[9]), None if r[10] is None else ready(r[10]), r[11])
        if sides and sides[-1][:6] == r[:6]:
            sides[-1] += row
        else:
            sides.append(r[:6] + row)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for r in records:
        stats = [NA] * 4 if r[10] is None else [format_number(v) for v in r[10]]
        writer.writerow([*r[:8], "nd", "x".join(map(str, r[9])), *stats, NA, r[11]])
    text = format_request_sides(sides)
    if not any("\r" in cell for r in records for cell in (*r[:9], r[11])):
        assert text == buf.getvalue()
    parsed = list(csv.reader(io.StringIO(text, newline="")))
    assert [row[:9] + row[14:] for row in parsed] == \
        [list(r[:9]) + [NA, r[11]] for r in records]


def _path(record) -> str:
    return NA if record[11] is None else f"{ROUND}/{record[11]}"


def test_a_row_whose_file_was_not_written_says_na():
    named, missing = tensor_path_cell("0_Linear/after/outtensor0.bin"), \
        tensor_path_cell("0_Linear/after/outtensor1.bin")
    mark_missing(missing)
    side = ("0_1", "3", "Linear", "Linear", "0", "output", "0", "float", "4", None, named,
            "1", "float", "4", None, missing)
    lines = format_sides([side], ROUND).splitlines()
    assert lines[0].endswith(f",{ROUND}/0_Linear/after/outtensor0.bin")
    assert lines[1].endswith(",N/A")


def test_numbers_round_trip_and_name_special_values():
    assert [format_number(v) for v in (0.1, -0.0, 1e-300, float("inf"), -float("inf"))] == \
        ["0.1", "-0.0", "1e-300", "inf", "-inf"]
    assert format_number(float("nan")) == "nan" and format_number(None) == NA


@given(st.lists(st.integers(0, 10 ** 9), max_size=6).map(tuple))
def test_a_shape_cell_reads_back_as_the_dimensions_it_was_written_from(dims):
    cell = shape_cell(dims)
    assert parse_shape(cell) == dims
    assert is_empty_shape(cell) == (0 in dims)


@pytest.mark.parametrize("cell", ["?", "4x", "x4", "4 x 2", "4,2", "²", "N/A"])
def test_text_that_is_no_shape_cell_is_refused_and_never_empty(cell):
    with pytest.raises(ValueError, match="not a Shape cell"):
        parse_shape(cell)
    assert not is_empty_shape(cell)


@given(st.tuples(FLOAT, FLOAT, FLOAT, FLOAT))
def test_statistics_cells_read_back_as_the_values_written(values):
    row = dict(zip(STAT_COLUMNS, map(format_number, values)))
    stats = parse_stats(row)
    assert isinstance(stats, Stats)
    for got, want in zip(stats, values):
        assert got == want or (math.isnan(got) and math.isnan(want))


def test_statistics_that_are_not_there_read_as_none():
    assert parse_stats(dict.fromkeys(STAT_COLUMNS, NA)) is None      # task=tensor
    assert parse_stats({"Max": "1.0", "Min": "0.0"}) is None          # another table
