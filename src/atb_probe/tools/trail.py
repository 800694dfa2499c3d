"""Where the NaN/Inf of a layer-level op's output came from, within that op (`scan`).

A dump records tensors, not the edges between them: which earlier output an op read is not
written down. But a tensor's statistics (or, read from its data, its max and min) are the same
wherever it appears, so an op's input is taken to be the latest earlier output with the same
dtype and statistics: the last op that made those values. From a non-finite output of the
layer-level op, the trail goes back that way, output to the op that made it (the deepest one:
a module's output is its last child's), then to that op's non-finite inputs, and on, until it
reaches ops whose non-finite outputs came from finite inputs (they made the value) or from the
layer-level op's own inputs (the value came from before). Non-finite values off the trail never
reached the layer's output: a `where` or a `masked_fill` dropped them, or a softmax turned a
-inf mask into zeros.

A value that no earlier output shows whole and that is no input of the layer was written in
place through a view (`x[..., 0] = inf` records only the view the kernel wrote): it is taken to
come from the latest earlier op whose output held the same kind of value (NaN, +inf or -inf at
the same end); where no op did, the op that read it is where it appeared (a constant made
outside any kernel, `torch.tensor(inf)`). Values that are equal by chance (two
all-NaN tensors of one dtype) can send the trail to the wrong earlier op; it then still ends at
an op that made non-finite values, and the scan names the earliest such op on it. Where a
statistic on the way is unknown, `follow` says the trail cannot be followed, and the scan falls
back to the first non-finite op of the layer.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from ..layout import Side


@dataclass(slots=True)
class Trail:
    """The ops a layer-level op's non-finite outputs came through."""

    starts: list[int] = field(default_factory=list)  # output rows where it starts, in order
    ops: set[str] = field(default_factory=set)       # op paths on it (the layer-level op too)


def follow(rows: list, bad: list[bool], layer: str) -> Trail | None:
    """The trail back from the non-finite outputs of layer-level op `layer`, through its rows
    (`scan.Seen`, one execution, in execution order; `bad[i]`: row i holds NaN/Inf that
    counts, masks aside), or None when it cannot be followed to its starts."""
    made: dict[tuple, list[int]] = {}   # signature -> output rows of the ops below the layer
    made_bad: list[int] = []            # those of them in `bad`
    inputs: dict[str, list[int]] = {}   # op path -> its input rows
    entering: set[tuple] = set()        # signatures of the layer's own inputs
    for i, seen in enumerate(rows):
        op = seen.op_path
        if seen.io == Side.INPUT:
            inputs.setdefault(op, []).append(i)
            if op == layer and seen.stats is not None:
                entering.add(signature(seen))
        elif op != layer and seen.stats is not None:
            made.setdefault(signature(seen), []).append(i)
            if bad[i]:
                made_bad.append(i)

    def maker(sig: tuple, before: int, below: str | None = None) -> int | None:
        """The latest output row before `before` with signature `sig` (of an op below `below`)."""
        found = made.get(sig, ())
        k = bisect.bisect_left(found, before)
        while k > 0:
            k -= 1
            if below is None or rows[found[k]].op_path.startswith(below + "/"):
                return found[k]
        return None

    def writer(at: int) -> int | None:
        """The latest output row before row `at` that holds its kind of NaN/Inf: what wrote
        it in place."""
        kind = _extremes(rows[at].stats)
        k = bisect.bisect_left(made_bad, at)
        while k > 0:
            k -= 1
            if _extremes(rows[made_bad[k]].stats) & kind:
                return made_bad[k]
        return None

    def deepest(at: int) -> int:
        """The row of the deepest op that made the values of output row `at`."""
        sig = signature(rows[at])
        while True:
            below = maker(sig, at, rows[at].op_path)
            if below is None:
                return at
            at = below

    trail = Trail()
    trail.ops.add(layer)
    todo = [i for i, seen in enumerate(rows) if bad[i] and seen.op_path == layer
            and seen.io == Side.OUTPUT]
    done: set[int] = set()
    while todo:
        at = todo.pop()
        if rows[at].stats is None:
            return None
        sig = signature(rows[at])
        source = maker(sig, at)
        if source is None:
            if sig in entering and rows[at].op_path == layer:  # the layer passed an input on
                trail.starts.append(at)
                continue
            source = writer(at)
            if source is None:
                if rows[at].io == Side.INPUT:  # appeared here: `at` is an input of its op
                    trail.starts.append(_output_of(rows, at))
                    continue
                return None
        source = deepest(source)
        if source in done:
            continue
        done.add(source)
        op = rows[source].op_path
        trail.ops.add(op)
        bad_inputs = [i for i in inputs.get(op, []) if bad[i]]
        if not bad_inputs:
            trail.starts.append(source)  # made from finite inputs
        for i in bad_inputs:
            if rows[i].stats is None:
                return None
            sig = signature(rows[i])
            if maker(sig, i) is None and sig in entering:
                trail.starts.append(source)  # read a value that came into the layer
            else:
                todo.append(i)
    trail.starts = sorted(set(trail.starts))
    return trail


def signature(seen) -> tuple:
    """What identifies a tensor's values across rows: its dtype and statistics (NaN equal to
    NaN)."""
    return (seen.dtype,) + tuple("nan" if math.isnan(v) else v for v in seen.stats)


def _extremes(stats) -> set[str]:
    """The non-finite ends of a tensor's values: `nan`, `+inf` (its max), `-inf` (its min)."""
    if math.isnan(stats.max) or math.isnan(stats.min):
        return {"nan"}
    ends = set()
    if stats.max == math.inf:
        ends.add("+inf")
    if stats.min == -math.inf:
        ends.add("-inf")
    return ends


def _output_of(rows: list, at: int) -> int:
    """The first output row of the op whose input row `at` is (`at` itself if it has none)."""
    op = rows[at].op_path
    for i in range(at + 1, len(rows)):
        if rows[i].op_path == op and rows[i].io == Side.OUTPUT:
            return i
    return at
