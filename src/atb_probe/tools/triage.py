"""Statistics first: compare's verdict from the few tensors that can change it.

A full comparison reads every `.bin` of both dumps; the verdict (divergence.judge) depends on
much less. It is the first op, in execution order, whose outputs cross while its inputs do not,
and once such an op is found, no op that finished after it can change it. So the triage walks
the dump in execution order, one *unit* at a time (a layer-level op execution with every op
inside it: one layer of one round, or of one request's slice of a round), and

* skips a unit whose every tensor pair *agrees* by its statistics: both sides have statistics
  in statistic.csv (`task: statistics` or `all`), the same shape, and Max, Min, Mean and Norm
  equal within `tolerance` (relative; 0, the default, asks for identical values; an infinite
  statistic, an attention mask's -inf, must be the same infinity, and a NaN never agrees). Its
  rows are compared by statistics, from the csv, and no file is opened;
* reads every tensor of any other unit (a pair whose statistics differ, or that statistics
  cannot decide: no statistics (`task: tensor`), a derived or token-cut tensor, a tensor joined
  from ranks, shapes that differ), exactly as the full comparison does;
* reads back from every unit it reads whose layer-level op's inputs do not match (or could
  not be compared): the difference came in from before, so the unit before is read too, even
  when its statistics agree, and so on back to a unit whose inputs match (the *margin*);
* stops as soon as the judge over the units walked so far has an op whose outputs cross and
  whose inputs are clean, and no unit not yet walked has an op that finished before it: the
  verdict is settled, and its op sits in a unit whose inputs were read and match;
* leaves the units after the stop unread: their rows carry their statistics where the csv has
  them, or no data, with a note; they are not judged (the verdict is already settled).

What it promises. With no statistics in the dump (`task: tensor`), every unit up to the verdict
is read, so the verdict is the full comparison's. With statistics, a unit is skipped only when
statistics say its tensors are the same; two tensors with identical max, min, mean and norm can
still differ element by element (a permutation, a transposed square weight, errors that cancel
in every sum): such a difference is missed unless it also changes the statistics of a tensor
elsewhere in its unit, or reaches the inputs of a unit that is read. A `tolerance` above 0
skips units that differ by float noise (a rerun on a non-deterministic device) and misses
more; `compare --full` reads everything.
When no op crosses with clean inputs, the walk reads every unit whose statistics do not agree,
so a comparison of two implementations (noise in every tensor) costs what a full one costs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..statcsv import is_empty_shape
from .comparison import PairMode, PairResult, RefPair, TensorRef
from .divergence import Finding, OpRows, Verdict, is_unknown, judge
from .metrics import stats_metrics

AGREED_NOTE = "not read: both sides' statistics agree (--full reads the data)"
AFTER_NOTE = "not read: after the verdict (--full reads the data)"


@dataclass(frozen=True, slots=True)
class TriageReport:
    """What the triage read: the pairs and units it read of all there were."""

    pairs: int                   # tensor pairs of the comparison
    read: int                    # ... whose data was read
    units: int                   # layer-level op executions (and request slices) walked over
    units_read: int
    units_agreed: int            # skipped: every pair's statistics agree
    stopped: bool                # the verdict was settled before the end of the dump
    tolerance: float

    def text(self) -> str:
        """`read the data of 120 of 4512 tensor pairs (3 of 96 layer-level ops; ...)`."""
        rest = ("stopped at the verdict" if self.stopped else "walked to the end")
        return (f"read the data of {self.read} of {self.pairs} tensor pairs ({self.units_read} "
                f"of {self.units} layer-level op executions; {self.units_agreed} skipped as "
                f"their statistics agree; {rest}); --full reads all")


class OpSpan(Protocol):
    """A compared op pair of compare.py: its places in the work and its rows."""

    indices: list[int]

    def rows(self, rows: list[PairResult]) -> OpRows: ...


@dataclass(slots=True)
class Triaged:
    rows: list[PairResult]       # one per pair of the work
    verdict: Verdict
    report: TriageReport


def agree(pair: RefPair, tolerance: float = 0.0) -> bool:
    """Whether the statistics of both sides say the pair is the same tensor (see the module
    docstring); two empty tensors of one shape agree."""
    g, t = pair.golden, pair.target
    if g.shape != t.shape:
        return False
    if is_empty_shape(g.shape):
        return True
    if not (_plain(g) and _plain(t)):
        return False
    return all(_close(a, b, tolerance) for a, b in zip(g.stats, t.stats))


def _plain(ref: TensorRef) -> bool:
    """A tensor whose statistics are its own, from the csv."""
    return ref.stats is not None and ref.cut is None and not ref.parts and ref.pieces is None


def _close(a: float, b: float, tolerance: float) -> bool:
    """Equal, or finite and within `tolerance` of each other; a NaN never agrees."""
    return a == b or (math.isfinite(a) and math.isfinite(b)
                      and abs(a - b) <= tolerance * max(abs(a), abs(b)))


def unread_row(pair: RefPair, note: str) -> PairResult:
    """The row of a pair whose data is not read: compared by its statistics where both sides
    have them, else without data; `note` says why it was not read."""
    row = PairResult(pair.golden, pair.target, pair.match, note=note)
    if is_empty_shape(pair.golden.shape) and is_empty_shape(pair.target.shape):
        row.note = "empty tensor"    # as compare_pair says: nothing to read
        return row
    g, t = pair.golden.stats, pair.target.stats
    row.golden_stats, row.target_stats = g, t
    if g is not None and t is not None:
        row.mode = PairMode.STATISTICS
        row.diffs = stats_metrics(g, t)
    return row


@dataclass(slots=True)
class _Unit:
    """A layer-level op execution: its ops (places in execution order) and its pairs."""

    first: int                   # the place of its first op
    ops: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    agreed: bool = True
    read: bool = False


def triage(work: list[RefPair], spans: list[OpSpan], alone: list[OpRows],
           read: Callable[[list[int]], list[PairResult]],
           finish: Callable[[int, PairResult], None], tolerance: float = 0.0,
           advance: Callable[[int], None] | None = None) -> Triaged:
    """The verdict of `spans` (and of the target-only ops `alone`) from the units that can
    change it. `read(indices)`: the compared rows of those pairs of `work`, their data read;
    `finish(index, row)`: completes a row (its request, its judgement) before it is judged.
    Units are read one at a time (the pairs of a large one are compared by several workers),
    so what is read does not depend on the number of jobs."""
    rows = [unread_row(p, AGREED_NOTE if agree(p, tolerance) else AFTER_NOTE) for p in work]
    for i, row in enumerate(rows):
        finish(i, row)
    entries: list[OpSpan | OpRows] = list(spans) + list(alone)
    first_rows = [e.rows(rows) if not isinstance(e, OpRows) else e for e in entries]
    sequence = sorted(range(len(entries)), key=lambda j: first_rows[j].finished)
    units = _units(sequence, first_rows, entries, work, tolerance)
    unit_of = {j: u for u, unit in enumerate(units) for j in unit.ops}
    place = {j: p for p, j in enumerate(sequence)}
    done = [False] * len(work)

    def take(k: int) -> bool:
        """Read unit k; whether a row of it crosses."""
        indices = [i for i in units[k].indices if not done[i]]
        units[k].read = True
        for i, row in zip(indices, read(indices) if indices else []):
            finish(i, row)
            rows[i] = row
            done[i] = True
        if advance:
            advance(len(indices))
        return any(rows[i].diverged for i in units[k].indices)

    def back(k: int) -> bool:
        """Read the units before unit k back to one whose layer-level op's inputs match (the
        margin); whether a row of them crosses."""
        crossed = False
        while k > 0 and not units[k - 1].read and not inputs_match(k):
            k -= 1
            crossed = take(k) or crossed
        return crossed

    def verdict(upto: int) -> Verdict:
        """The judge over the units before `upto` (in execution order)."""
        return judge(entries[j] if isinstance(entries[j], OpRows) else entries[j].rows(rows)
                     for j in sequence if unit_of[j] < upto)

    def margin() -> Verdict:
        """The settled verdict once the units before the finding's are read back to one whose
        layer-level op's inputs match (see the module docstring)."""
        while True:
            v = verdict(u)
            found = clean_place(v) if v.finding is None or v.finding.inputs_clean \
                or v.finding.then_clean else place_of(v.finding)
            if found is None or not back(unit_of[sequence[found]]):
                return v

    def inputs_match(k: int) -> bool:
        """Whether the inputs of unit k's layer-level op were compared and none crosses: then
        nothing that came into the unit from before it differs."""
        layer = next((j for j in units[k].ops if not isinstance(entries[j], OpRows)
                      and "/" not in first_rows[j].op_path), None)
        if layer is None:        # the layer-level op itself was not dumped
            return False
        inputs = entries[layer].rows(rows).inputs
        return bool(inputs) and not any(r.diverged or is_unknown(r) for r in inputs)

    def clean_place(v: Verdict) -> int | None:
        """The place of the verdict's op that crosses with clean inputs, if it has one."""
        f = v.finding
        clean = f if f is not None and f.inputs_clean else (f and f.then_clean)
        return None if clean is None else place_of(clean)

    def place_of(f: Finding) -> int:
        key = (f.round_index, f.op_path, f.request, f.positions)
        return next(place[j] for j in sequence if (
            first_rows[j].round_index, first_rows[j].op_path, first_rows[j].request,
            first_rows[j].positions) == key)

    u, result = 0, None
    while u < len(units) and result is None:
        unit = units[u]
        u += 1
        if unit.agreed:
            continue
        crossed = take(u - 1)
        if not back(u - 1) and not crossed:
            continue        # nothing read crosses: no op of it can be the finding
        found = clean_place(verdict(u))
        if found is not None and (u == len(units) or found < units[u].first):
            result = margin()
    stopped = result is not None and u < len(units)
    if result is None:       # walked to the end: a finding whose inputs differ is traced back
        result = margin()
    if advance:
        advance(sum(not d for d in done))
    report = TriageReport(len(work), sum(done), len(units), sum(x.read for x in units),
                          sum(x.agreed for x in units), stopped, tolerance)
    return Triaged(rows, result, report)


def _units(sequence: list[int], first_rows: list[OpRows], entries: list,
           work: list[RefPair], tolerance: float) -> list[_Unit]:
    """The units of the ops in execution order, in the order their first ops finished."""
    by_key: dict[tuple, _Unit] = {}
    seen: set[int] = set()
    for p, j in enumerate(sequence):
        op = first_rows[j]
        key = (op.round_index, op.request, op.positions, op.op_path.split("/", 1)[0])
        unit = by_key.get(key)
        if unit is None:
            unit = by_key[key] = _Unit(p)
        unit.ops.append(j)
        for i in getattr(entries[j], "indices", ()):
            if i not in seen:
                seen.add(i)
                unit.indices.append(i)
                unit.agreed = unit.agreed and agree(work[i], tolerance)
    return list(by_key.values())

