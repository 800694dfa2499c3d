"""Each request's part of a round's tensors (request_statistic.csv, SPEC §9), worked out once
per round and tensor shape.

A round's token layout (tokens.py) says where each request's tokens lie along the token
dimension. Every tensor of one shape is cut the same way, and a serving engine's step holds
dozens of sides of a few shapes each, for every request of its batch: so the cut of a shape
(which slices, their Shape cells, whether they are one after another) is made at its first
tensor in the round and kept with the round (`RequestSlices`), and each later tensor of that
shape only gets its cells.

A slice of a contiguous host tensor is a run of its memory (`Cut.runs`, element offsets in
storage order), measured from the tensor itself (`StatsCache.fresh_runs`); any other tensor
is cut into views (`Cut.pieces`).
"""
from __future__ import annotations

from math import prod

import torch

from ..statcsv import shape_cell
from ..tokens import Arrangement, TokenLayout


class Cut:
    """How a tensor of one shape is cut per request: the requests' slices along its token
    dimension, or each request's row of a tensor with a row per request (the logits of each
    request's last token).

    `cells`: each slice's (Shape cell, request), in request order; `runs`: their (start, stop)
    element offsets in a contiguous tensor of this shape; `one_after_another`: the runs are of
    one length, each starting where the one before ends (`stats_compute._rows`)."""

    __slots__ = ("cells", "runs", "one_after_another", "_dim", "_starts", "_counts", "_rows")

    def __init__(self, cells: list, runs: list, dim: int, starts: list, counts: list,
                 rows: list | None):
        self.cells = cells
        self.runs = runs
        size = runs[0][1] - runs[0][0] if runs else 0
        self.one_after_another = len(runs) > 1 and size > 0 and all(
            run == (runs[0][0] + k * size, runs[0][0] + (k + 1) * size)
            for k, run in enumerate(runs))
        self._dim, self._starts, self._counts, self._rows = dim, starts, counts, rows

    def pieces(self, t: torch.Tensor) -> list:
        """The slices of `t` (a tensor of this cut's shape) as views, in request order."""
        dim, rows = self._dim, self._rows
        if rows is None:
            return [t.narrow(dim, start, n) for start, n in zip(self._starts, self._counts)]
        return [t.narrow(0, row, 1).narrow(dim, start, n)
                for row, start, n in zip(rows, self._starts, self._counts)]


class RequestSlices:
    """The cuts of one round's tensors, by shape (see the module docstring)."""

    __slots__ = ("layout", "_cuts")

    def __init__(self, layout: TokenLayout):
        self.layout = layout
        self._cuts: dict = {}

    def cut(self, shape: torch.Size, by_row: bool = False) -> Cut | None:
        """The cut of a tensor of `shape`, or None when it has no part per request: no token
        dimension, nor (with `by_row`, a layer-level op's tensor) a row per request."""
        key = (shape, by_row)
        try:
            return self._cuts[key]
        except KeyError:
            pass
        if len(self._cuts) >= 256:  # a round of many shapes: keep the table small
            self._cuts.clear()
        cut = self._cuts[key] = self._make(shape, by_row)
        return cut

    def _make(self, shape: torch.Size, by_row: bool) -> Cut | None:
        layout = self.layout
        spans = layout.requests
        dims = tuple(shape)
        if layout.has_token_dim(dims):
            counts = [span.stop - span.start for span in spans]
            if layout.arrangement is Arrangement.FLAT:
                rest = dims[1:]
                firsts = starts = [span.start for span in spans]
                cells = [(shape_cell((n, *rest)), span.request)
                         for span, n in zip(spans, counts)]
                dim, rows = 0, None
            else:
                # A request's tokens are one run of a contiguous tensor's memory.
                rest = dims[2:]
                seq = layout.tokens
                firsts = [span.row * seq + span.start for span in spans]
                starts = [span.start for span in spans]
                cells = [(shape_cell((1, n, *rest)), span.request)
                         for span, n in zip(spans, counts)]
                dim, rows = 1, [span.row for span in spans]
        elif by_row and layout.has_request_rows(dims):  # each request's row
            rows_of = layout.request_rows()
            firsts = starts = rows_of
            counts = [1] * len(rows_of)
            rest = dims[1:]
            text = shape_cell((1, *rest))
            cells = [(text, span.request) for span in spans]
            dim, rows = 0, None
        else:
            return None
        size = prod(rest)  # elements per token (per row)
        runs = [(first * size, (first + n) * size) for first, n in zip(firsts, counts)]
        return Cut(cells, runs, dim, starts, counts, rows)
