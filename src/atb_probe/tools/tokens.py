"""Reading what a round says of its tokens: `tokens.json` (its token layout) and
`request_statistic.csv` (each token tensor's statistics per request). docs/format.md describes
both; atb_probe/tokens.py holds the records the probe writes them from, and this module reads
them back into the same records for compare.

A tokens.json the tools cannot read (not JSON, a key missing, a span outside the token
dimension) is a `LayoutError`: compare then pairs rounds by number and says why.
"""
from __future__ import annotations

import csv
import json
import os

from .. import layout
from ..statcsv import REQUEST_COLUMNS, REQUEST_FILE_NAME, Stats, parse_stats
from ..tokens import Arrangement, Prompt, RequestSpan, Source, TokenLayout


class LayoutError(Exception):
    """A tokens.json that is not the documented document."""


def read_layout(round_path: str) -> TokenLayout | None:
    """The token layout of the round folder `round_path`; None when it has no tokens.json."""
    path = os.path.join(round_path, layout.TOKENS_JSON)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{path}: {exc}") from None
    try:
        return layout_of(doc)
    except LayoutError as exc:
        raise LayoutError(f"{path}: {exc}") from None


def layout_of(doc) -> TokenLayout:
    """The `TokenLayout` a tokens.json document describes (`TokenLayout.doc` read back)."""
    try:
        tokens, rows = _count(doc["tokens"]), _count(doc["rows"])
        source, arrangement = Source(doc["source"]), Arrangement(doc["layout"])
        requests = tuple(_span(r, tokens, rows) for r in doc["requests"])
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"not a token layout ({type(exc).__name__}: {exc})") from None
    if arrangement is Arrangement.FLAT and rows != 1:
        raise LayoutError(f"a flat layout has one row, not {rows}")
    return TokenLayout(source, arrangement, tokens, rows, requests)


def _count(value) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def _span(doc: dict, tokens: int, rows: int) -> RequestSpan:
    row, start, stop = _count(doc["row"]), _count(doc["start"]), _count(doc["stop"])
    if row >= rows or not start <= stop <= tokens:
        raise ValueError(f"request {doc['request']!r}: span [{start}, {stop}) of row {row} is "
                         f"outside {rows} row(s) of {tokens} tokens")
    head = doc["prompt_head"]
    if not isinstance(head, list):
        raise TypeError(f"prompt_head {head!r} is not a list")
    prompt = Prompt(_count(doc["prompt_len"]), tuple(_count(i) for i in head),
                    str(doc["prompt_hash"]))
    return RequestSpan(str(doc["request"]), row, start, stop, _count(doc["position"]), prompt)


def read_request_stats(round_path: str, name: str = REQUEST_FILE_NAME
                       ) -> dict[tuple[str, str, str, str], Stats]:
    """request_statistic.csv of a round (or another file of its columns, `name`:
    derived_statistic.csv) as {(Op Id, Input/Output, Index, Request): stats}; empty when the
    round has none. Rows without statistics are left out."""
    path = os.path.join(round_path, name)
    out: dict[tuple[str, str, str, str], Stats] = {}
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except OSError:
        return out
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return out
        names = list(REQUEST_COLUMNS) if len(header) == len(REQUEST_COLUMNS) else header
        for cells in reader:
            if len(cells) != len(names):
                continue  # a line a killed writer left half-written
            row = dict(zip(names, cells))
            stats = parse_stats(row)
            if stats is not None and "Request" in row:
                out[(row["Op Id"], row["Input/Output"], row["Index"], row["Request"])] = stats
    return out
