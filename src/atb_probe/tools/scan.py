"""`atb-probe scan DUMP [--json FILE]`: where the first NaN/Inf comes from, from one dump alone.

No golden run is needed. For every process and round the tensors are read in execution order
(statistic.csv's order: an op's inputs when it starts, its outputs when it ends, so a child op's
outputs come before its parent's), and the first NaN or Inf that reaches a layer-level op's
output is the finding: the op that made it is named, with whether its inputs were finite: when
they were, that op made the bad value; when they were not, the value came from before the first
dumped op (the model's inputs, or an op that was not dumped). With `save_child` this is the
deepest op that was dumped, a kernel inside a child inside a layer; its layer-level op is named
too.

A NaN/Inf that never reaches the layer-level op's output is *contained*: T5's relative-position
bucket takes `log(0) = -inf` and drops it with `where`. A layer-level op whose outputs are finite
contains every NaN/Inf of its children; in one whose outputs are not, the trail back from them
(trail.py) names the op where the value started, and NaN/Inf dropped beside it is contained.
Contained values are listed apart, per layer-level op execution, up to the round's finding
(after it, any NaN/Inf may come from it), and never change the exit status. Where a layer-level
op's outputs are not in the dump (`ids` chose a child only), every NaN/Inf below it counts.

Whether a tensor is finite is read from its statistics when the csv has them (`task:
statistics` or `all`: a NaN makes max and min NaN, an Inf makes one of them infinite), so a live
service dumped cheaply with `task: statistics` can be scanned; otherwise from the `.bin` data.
Integer and bool tensors are always finite and never read.

-inf is what attention masks are made of: PyTorch's scaled-dot-product attention turns a bool
mask into a float one with `scalar_tensor(-inf)` and `where`. So an output whose only non-finite
values are -inf is a *mask*, not a finding, when the op made it from no floating-point input at
all (a constant) or passed on the -inf of an input (`where`, an add of the mask); such ops are
counted apart. -inf made from finite inputs (an overflow, `log(0)`), and what an op makes from
it, is NaN/Inf like NaN and +inf. When judging whether a finding's inputs were finite, mask
inputs count as finite.

Growth warnings point at likely overflow sites before an Inf appears: ops whose largest output
magnitude is at least `growth` times the largest magnitude of their floating-point inputs *and*
at least `floor` in absolute terms. The floor keeps a healthy model's ordinary kernels off the
list: an `rsqrt` of a small variance in an RMSNorm turns 1e-4 into 100, a ×1e6 growth that is
no overflow risk at all. Warnings never change the exit status: 1 when a NaN/Inf reached a
layer-level op's output, 0 when none did, 2 on bad input.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from ..layout import Side
from ..statcsv import Stats, is_empty_shape
from . import StrEnum, extras
from .arrays import load_values
from .comparison import Role
from .dumpreader import DumpError, NoData, Process, Round, open_dump
from .jobs import default_jobs, progress_bar, worker_pool
from .metrics import max_abs
from .trail import follow, signature

FLOAT_DTYPES = frozenset({"float", "float16", "bf16", "double", "float8_e5m2", "float8_e4m3fn",
                          "float8_e8m0", "complex64", "complex128"})
GROWTH = 1000.0     # default: output max-abs at least this many times the inputs'
FLOOR = 1000.0      # default: and at least this large


@dataclass(frozen=True, slots=True)
class Settings:
    growth: float = GROWTH
    floor: float = FLOOR


@dataclass(slots=True)
class Seen:
    """One tensor as the scan sees it, in execution order."""

    name: str                    # `2_LlamaDecoderLayer/0_LlamaRMSNorm/output.0`
    io: Side
    dtype: str
    stats: Stats | None          # None: not known (no statistics, no data)

    @property
    def op_path(self) -> str:
        return self.name.rsplit("/", 1)[0]


class NonFiniteKind(StrEnum):
    """What non-finite values a tensor holds."""

    NAN = "NaN"
    INF = "Inf"                  # +inf (and maybe -inf)
    NEG_INF = "-Inf"             # -inf only: what masks are made of


@dataclass(slots=True)
class NonFinite:
    """The first op of a round whose output holds a NaN or an Inf."""

    op_path: str
    layer: str                   # its layer-level op: `3_LlamaDecoderLayer`
    tensor: str                  # the output: `<op path>/output.0`
    kind: NonFiniteKind          # NaN | Inf
    inputs_finite: bool | None   # None: not known
    bad_inputs: list[str] = field(default_factory=list)

    def summary(self, scanned: "RoundScan | None" = None) -> str:
        """One line for the console and the report."""
        where = f"round {scanned.round_index}, " if scanned is not None else ""
        head = f"first {self.kind}: {where}{self.op_path} ({self.tensor.rsplit('/', 1)[1]})"
        if self.op_path != self.layer:
            head += f", in layer {self.layer}"
        if self.inputs_finite:
            return f"{head}; its inputs are finite: this op made it"
        if self.inputs_finite is None:
            return f"{head}; whether its inputs were finite is not known (no data)"
        return (f"{head}; its inputs already hold NaN/Inf ({', '.join(self.bad_inputs[:3])}): "
                "it comes from before the first dumped op")


@dataclass(slots=True)
class Growth:
    """An op whose outputs are far larger than its inputs: a likely overflow site."""

    op_path: str
    layer: str
    tensor: str
    out_max_abs: float
    in_max_abs: float

    @property
    def ratio(self) -> float:
        return self.out_max_abs / self.in_max_abs

    def summary(self) -> str:
        return (f"{self.tensor}: max |x| {self.out_max_abs:.4g} from inputs of max |x| "
                f"{self.in_max_abs:.4g} (x{self.ratio:.3g})")


@dataclass(slots=True)
class Contained:
    """NaN/Inf inside one layer-level op execution that never reached its outputs."""

    layer: str                   # the layer-level op: `2_T5Block`
    op_path: str                 # the first op whose output held it
    tensor: str                  # that output: `<op path>/output.0`
    kind: NonFiniteKind
    ops: int                     # ops of that execution whose outputs held such values

    def summary(self) -> str:
        """One line for the console."""
        return (f"{self.kind} from {self.op_path} ({self.tensor.rsplit('/', 1)[1]}), "
                f"{self.ops} op(s): never reaches the output of {self.layer}")


@dataclass(slots=True)
class RoundScan:
    """What the scan found in one round of one process."""

    process: str
    round_index: int
    side: Role | None = None     # the side of the dumps compare ran the scan on
    tensors: int = 0
    unchecked: int = 0           # tensors with neither statistics nor data
    non_finite_ops: int = 0      # ops with a NaN/Inf output that counts (not contained, no mask)
    mask_ops: int = 0            # ops that build or pass on -inf masks
    first: NonFinite | None = None
    growth: list[Growth] = field(default_factory=list)
    contained: list[Contained] = field(default_factory=list)   # per layer-level op execution

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["side"] = self.side or ""
        for g, raw in zip(self.growth, doc["growth"]):
            raw["ratio"] = g.ratio
        return doc


def scan_items(items, process: str, round_index: int, settings: Settings = Settings(),
               side: Role | None = None) -> RoundScan:
    """Scan one round's tensors (`Seen`, in execution order)."""
    items = list(items)
    result = RoundScan(process, round_index, side)
    inputs: dict[str, list[int]] = {}   # op path -> its input rows
    layers: dict[str, list[int]] = {}   # layer-level op -> its rows
    bad = [False] * len(items)          # rows holding NaN/Inf that counts (masks aside)
    made_bad: set[tuple] = set()        # signatures of outputs in `bad`
    mask_ops: set[str] = set()
    grown: dict[str, Growth] = {}
    for i, seen in enumerate(items):
        result.tensors += 1
        if seen.stats is None:
            result.unchecked += 1
        op = seen.op_path
        layers.setdefault(_layer(op), []).append(i)
        kind = non_finite(seen.stats) if seen.stats is not None else None
        if seen.io == Side.INPUT:
            inputs.setdefault(op, []).append(i)
            # -inf alone is a mask unless an op made it from finite values (`log(0)`).
            bad[i] = kind is not None and (kind != NonFiniteKind.NEG_INF or
                                           signature(seen) in made_bad)
            continue
        if kind is None:
            if seen.stats is not None:
                g = _growth(seen, [items[j] for j in inputs.get(op, [])], settings)
                if g is not None and (op not in grown or g.ratio > grown[op].ratio):
                    grown[op] = g
            continue
        ins = inputs.get(op, [])
        if kind == NonFiniteKind.NEG_INF and _builds_mask(items, bad, ins):
            mask_ops.add(op)
            continue
        bad[i] = True
        made_bad.add(signature(seen))
    bad_ops: set[str] = set()
    for layer, rows in layers.items():
        first, counted, contained = _judge_layer(items, bad, inputs, layer, rows)
        bad_ops |= counted
        # After the finding's layer, NaN/Inf anywhere may come from it: none is contained.
        if contained is not None and result.first is None:
            result.contained.append(contained)
        if first is not None and result.first is None:
            result.first = first
    result.non_finite_ops = len(bad_ops)
    result.mask_ops = len(mask_ops - bad_ops)
    result.growth = list(grown.values())
    return result


def _judge_layer(items: list, bad: list[bool], inputs: dict, layer: str, rows: list[int]):
    """The NaN/Inf of one layer-level op execution (`rows`: its rows in `items`): (the finding
    or None, the ops whose NaN/Inf counts, a `Contained` or None).

    A layer whose outputs are finite contains every NaN/Inf below it. One whose outputs are
    not has its finding where the trail back from them starts (trail.py); NaN/Inf off the
    trail and before that start is contained too. Where the outputs are not known (not
    dumped), or the trail cannot be followed, every NaN/Inf counts and the first is the
    finding."""
    outputs = [i for i in rows if items[i].op_path == layer and items[i].io == Side.OUTPUT]
    made = [i for i in rows if bad[i] and items[i].io == Side.OUTPUT]
    if not made:
        return None, set(), None
    known = bool(outputs) and all(items[i].stats is not None for i in outputs)
    start, held = made[0], []
    if known and not any(bad[i] for i in outputs):
        held = made
        start = None
    elif known:
        trail = follow([items[i] for i in rows], [bad[i] for i in rows], layer)
        if trail is not None and trail.starts:
            start = rows[trail.starts[0]]
            held = [i for i in made if i < start and items[i].op_path not in trail.ops]
    held_ops = {items[i].op_path for i in held}
    counted = {items[i].op_path for i in made} - held_ops
    contained = None
    if held:
        seen = items[held[0]]
        contained = Contained(layer, seen.op_path, seen.name, non_finite(seen.stats),
                              len(held_ops))
    if start is None:
        return None, counted, contained
    seen = items[start]
    return _non_finite(seen, non_finite(seen.stats), items, bad,
                       inputs.get(seen.op_path, [])), counted, contained


def _layer(op_path: str) -> str:
    return op_path.split("/", 1)[0]


def non_finite(stats: Stats) -> NonFiniteKind | None:
    """None for finite data, else what it holds."""
    if math.isfinite(stats.max) and math.isfinite(stats.min):
        return None
    if math.isnan(stats.max) or math.isnan(stats.min):
        return NonFiniteKind.NAN
    return NonFiniteKind.NEG_INF if stats.max != math.inf else NonFiniteKind.INF


def _builds_mask(items: list, bad: list[bool], ins: list[int]) -> bool:
    """Whether an op that output -inf made a mask: from no float input, or from a mask (an
    input holding -inf that no op made from finite values), and no input NaN/Inf that
    counts."""
    floats = [i for i in ins if items[i].dtype in FLOAT_DTYPES and items[i].stats is not None]
    if any(bad[i] for i in floats):
        return False
    return not floats or any(non_finite(items[i].stats) == NonFiniteKind.NEG_INF
                             for i in floats)


def _non_finite(seen: Seen, kind: NonFiniteKind, items: list, bad: list[bool],
                ins: list[int]) -> NonFinite:
    bad_inputs = [items[i].name for i in ins if bad[i]]
    if bad_inputs:
        clean = False
    elif any(items[i].stats is None for i in ins):
        clean = None
    else:
        clean = True
    return NonFinite(seen.op_path, _layer(seen.op_path), seen.name, kind, clean, bad_inputs)


def _growth(seen: Seen, ins: list[Seen], settings: Settings) -> Growth | None:
    out = max_abs(seen.stats)
    if out < settings.floor:
        return None
    sizes = [max_abs(x.stats) for x in ins if x.dtype in FLOAT_DTYPES and x.stats is not None]
    sizes = [s for s in sizes if math.isfinite(s)]
    if not sizes or max(sizes) == 0:
        return None  # nothing to grow from: a creation op, or all-zero inputs
    largest = max(sizes)
    if out < settings.growth * largest:
        return None
    return Growth(seen.op_path, _layer(seen.op_path), seen.name, out, largest)


def scan_round(rnd: Round, settings: Settings = Settings()) -> RoundScan:
    """Scan a round of a dump: statistics from its csv, else from its data."""
    items = []
    for t in rnd.tensors:
        if t.uninitialized:
            continue
        stats = t.stats
        if stats is None:
            stats = _stats_from_data(t.path, t.dtype, t.shape)
        items.append(Seen(t.data_name, t.io, t.dtype, stats))
    return scan_items(items, rnd.process.name, rnd.index, settings)


_NOTHING_TO_READ = Stats(0.0, 0.0, math.nan, math.nan)   # finite, as far as the scan looks


def _stats_from_data(path: str | None, dtype: str, shape: str) -> Stats | None:
    """The max and min of a tensor's data (mean and norm NaN): all the scan needs; finite
    values for integer and empty tensors without reading them."""
    if dtype not in FLOAT_DTYPES or is_empty_shape(shape):
        return _NOTHING_TO_READ if dtype != "?" else None
    try:
        array = load_values(path)
    except NoData:
        return None
    if array.size == 0:
        return _NOTHING_TO_READ
    if np.iscomplexobj(array):
        array = np.abs(array)
    with np.errstate(invalid="ignore"):
        return Stats(float(array.max()), float(array.min()), math.nan, math.nan)


def _scan_round_at(process_path: str, round_path: str, settings: Settings) -> RoundScan:
    """Scan one round folder (run in a worker process)."""
    return scan_round(Process(process_path, [round_path]).rounds[0], settings)


def scan_dump(path: str, settings: Settings = Settings(), jobs: int = 1,
              progress=None) -> list[RoundScan]:
    """Scan every round of a dump, `jobs` rounds at a time; `DumpError` for a bad path."""
    dump = open_dump(path)
    rounds = [(r.process.path, r.path) for r in dump.rounds]
    advance = progress(len(rounds)) if progress else None
    results = []
    if jobs <= 1 or len(rounds) <= 1:
        for rnd in dump.rounds:
            results.append(scan_round(rnd, settings))
            if advance:
                advance(1)
        return results
    with worker_pool(min(jobs, len(rounds))) as pool:
        for done in pool.map(_scan_round_at, *zip(*rounds), [settings] * len(rounds)):
            results.append(done)
            if advance:
                advance(1)
    return results


def scan_compared(rows) -> list[RoundScan]:
    """The scan of the tensors a comparison read, per side and round (compare.PairResult rows,
    statistics taken from the data where it was read)."""
    out = []
    for side in Role:
        rounds: dict[tuple[str, int], list] = {}
        for r in rows:
            ref = r.ref(side)
            rounds.setdefault((ref.process, ref.round_index), []).append(
                (ref.order, Seen(ref.data_name, ref.io, ref.dtype, r.stats(side))))
        for (process, index), items in rounds.items():
            items.sort(key=lambda item: item[0])
            scanned = scan_items([s for _, s in items], process, index, side=side)
            if scanned.first is not None or scanned.growth:
                out.append(scanned)
    return out


# -- command line --------------------------------------------------------------------------------

def register(sub) -> None:
    p = sub.add_parser(
        "scan", help="find the first op that made a NaN/Inf, and likely overflow sites",
        description="Read one dump in execution order and name, per process and round, the "
                    "first op whose NaN or Inf reaches a layer-level op's output (and whether "
                    "its inputs were finite), and ops whose outputs grow far above their "
                    "inputs. NaN/Inf dropped on the way (a where, a masked_fill, a softmax over "
                    "a -inf mask) is listed apart as contained. Uses statistic.csv where it "
                    "has statistics, else the .bin data. Exit status: 1 when a NaN/Inf reached "
                    "a layer-level op's output, 0 when not, 2 on bad input.",
        epilog="example: atb-probe scan out/atb_dump_data --json scan.json")
    p.add_argument("dump", help="the dump (any level: root, <dev>_<pid> or round folder)")
    p.add_argument("--json", metavar="FILE", help="also write the findings to FILE as JSON "
                                                  "('-' for stdout, instead of the table)")
    p.add_argument("--growth", type=float, default=GROWTH, metavar="X",
                   help="warn when an op's output max |x| is X times its inputs' "
                        f"(default {GROWTH:g})")
    p.add_argument("--floor", type=float, default=FLOOR, metavar="V",
                   help=f"... and at least V (default {FLOOR:g}; 0 warns on any growth)")
    p.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                   help=f"rounds scanned at once (default: the cores available, here "
                        f"{default_jobs()})")
    p.set_defaults(func=_scan)


def _scan(args) -> int:
    if not extras.require("scan", "rich"):
        return 2
    from rich.console import Console
    if args.growth <= 0 or args.floor < 0 or (args.jobs is not None and args.jobs < 1):
        print("atb-probe scan: --growth must be > 0, --floor >= 0 and --jobs >= 1",
              file=sys.stderr)
        return 2
    settings = Settings(args.growth, args.floor)
    err = Console(stderr=True)
    try:
        with progress_bar(err, "scanning") as progress:
            results = scan_dump(args.dump, settings, args.jobs or default_jobs(), progress)
    except DumpError as exc:
        print(f"atb-probe scan: {exc}", file=sys.stderr)
        return 2
    found = any(r.first is not None for r in results)
    if args.json:
        doc = {"dump": os.path.abspath(args.dump), "growth": settings.growth,
               "floor": settings.floor, "non_finite": found,
               "contained": sum(len(r.contained) for r in results),
               "rounds": [r.to_json() for r in results]}
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
            return 1 if found else 0
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    _print(Console(highlight=False, soft_wrap=True), results, settings)
    if args.json:
        print(f"wrote {args.json}")
    return 1 if found else 0


def _print(out, results: list[RoundScan], settings: Settings) -> None:
    from rich.markup import escape
    from rich.table import Table
    table = Table(title="NaN/Inf per process and round", title_justify="left")
    for column in ("process", "round", "tensors", "first NaN/Inf (op that made it)", "layer",
                   "inputs finite", "growth warnings"):
        table.add_column(column, overflow="fold")
    for r in results:
        f = r.first
        finite = "" if f is None else {True: "yes", False: "no", None: "?"}[f.inputs_finite]
        checked = f"{r.tensors - r.unchecked}" + (f" ({r.unchecked} unknown)" if r.unchecked
                                                    else "")
        table.add_row(r.process, str(r.round_index), checked,
                      "[green]none[/]" if f is None else f"[bold red]{escape(f.op_path)}[/] "
                                                         f"({f.kind})",
                      "" if f is None else escape(f.layer), finite, str(len(r.growth)))
    masks = sum(r.mask_ops for r in results)
    out.print(table)
    warnings = [(r, g) for r in results for g in r.growth]
    if warnings:
        out.print(f"growth warnings (output max |x| >= {settings.growth:g} x inputs' and >= "
                  f"{settings.floor:g}):")
        for r, g in warnings[:20]:
            out.print(f"  {r.process} round {r.round_index}: {escape(g.summary())}",
                      style="yellow")
        if len(warnings) > 20:
            out.print(f"  ... and {len(warnings) - 20} more (see --json)")
    if masks:
        out.print(f"{masks} op(s) build or pass on -inf attention masks: not counted as NaN/Inf")
    contained = [(r, c) for r in results for c in r.contained]
    if contained:
        out.print("contained NaN/Inf (dropped before the layer-level op's output; not counted):")
        for r, c in contained[:20]:
            out.print(f"  {r.process} round {r.round_index}: {escape(c.summary())}")
        if len(contained) > 20:
            out.print(f"  ... and {len(contained) - 20} more (see --json)")
    first = next((r for r in results if r.first is not None), None)
    if first is None:
        out.print("no NaN/Inf in any output", style="green")
    else:
        out.print(f"{first.process}: {first.first.summary(first)}", style="bold red")
