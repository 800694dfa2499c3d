"""`atb-probe scan DUMP [--json FILE]`: where the first NaN/Inf comes from, from one dump alone.

No golden run is needed. For every process and round the tensors are read in execution order
(statistic.csv's order: an op's inputs when it starts, its outputs when it ends, so a child op's
outputs come before its parent's), and the first op whose output holds a NaN or an Inf is
named, with whether its inputs were finite: when they were, that op made the bad value; when
they were not, the value came from before the first dumped op (the model's inputs, or an op that
was not dumped). With `save_child` this is the deepest op that was dumped, a kernel inside a
child inside a layer; its layer-level op is named too.

Whether a tensor is finite is read from its statistics when the csv has them (`task:
statistics` or `all`: a NaN makes max and min NaN, an Inf makes one of them infinite), so a live
service dumped cheaply with `task: statistics` can be scanned; otherwise from the `.bin` data.
Integer and bool tensors are always finite and never read.

-inf is what attention masks are made of: PyTorch's scaled-dot-product attention turns a bool
mask into a float one with `scalar_tensor(-inf)` and `where`. So an output whose only non-finite
values are -inf is a *mask*, not a finding, when the op made it from no floating-point input at
all (a constant) or passed on the -inf of an input (`where`, an add of the mask); such ops are
counted apart. -inf made from finite inputs (an overflow, `log(0)`) is a finding, and NaN and
+inf always are. When judging whether a finding's inputs were finite, mask inputs count as
finite.

Growth warnings point at likely overflow sites before an Inf appears: ops whose largest output
magnitude is at least `growth` times the largest magnitude of their floating-point inputs *and*
at least `floor` in absolute terms. The floor keeps a healthy model's ordinary kernels off the
list: an `rsqrt` of a small variance in an RMSNorm turns 1e-4 into 100, a ×1e6 growth that is
no overflow risk at all. Warnings never change the exit status: 1 when a NaN/Inf was found, 0
when none was, 2 on bad input.
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
class RoundScan:
    """What the scan found in one round of one process."""

    process: str
    round_index: int
    side: Role | None = None     # the side of the dumps compare ran the scan on
    tensors: int = 0
    unchecked: int = 0           # tensors with neither statistics nor data
    non_finite_ops: int = 0      # ops with a NaN/Inf output (masks aside)
    mask_ops: int = 0            # ops that build or pass on -inf masks
    first: NonFinite | None = None
    growth: list[Growth] = field(default_factory=list)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["side"] = self.side or ""
        for g, raw in zip(self.growth, doc["growth"]):
            raw["ratio"] = g.ratio
        return doc


def scan_items(items, process: str, round_index: int, settings: Settings = Settings(),
               side: Role | None = None) -> RoundScan:
    """Scan one round's tensors (`Seen`, in execution order)."""
    result = RoundScan(process, round_index, side)
    inputs: dict[str, list[Seen]] = {}
    bad_ops: set[str] = set()
    mask_ops: set[str] = set()
    grown: dict[str, Growth] = {}
    for seen in items:
        result.tensors += 1
        if seen.stats is None:
            result.unchecked += 1
        op = seen.op_path
        if seen.io == Side.INPUT:
            inputs.setdefault(op, []).append(seen)
            continue
        if seen.stats is None:
            continue
        kind = non_finite(seen.stats)
        if kind is not None:
            ins = inputs.get(op, [])
            if kind == NonFiniteKind.NEG_INF and _builds_mask(ins):
                mask_ops.add(op)
            elif op not in bad_ops:
                bad_ops.add(op)
                if result.first is None:
                    result.first = _non_finite(seen, kind, ins)
            continue
        g = _growth(seen, inputs.get(op, []), settings)
        if g is not None and (op not in grown or g.ratio > grown[op].ratio):
            grown[op] = g
    result.non_finite_ops = len(bad_ops)
    result.mask_ops = len(mask_ops - bad_ops)
    result.growth = list(grown.values())
    return result


def _layer(op_path: str) -> str:
    return op_path.split("/", 1)[0]


def non_finite(stats: Stats) -> NonFiniteKind | None:
    """None for finite data, else what it holds."""
    if math.isfinite(stats.max) and math.isfinite(stats.min):
        return None
    if math.isnan(stats.max) or math.isnan(stats.min):
        return NonFiniteKind.NAN
    return NonFiniteKind.NEG_INF if stats.max != math.inf else NonFiniteKind.INF


def _builds_mask(ins: list[Seen]) -> bool:
    """Whether an op that output -inf made a mask: from no float input, or from a mask."""
    floats = [x for x in ins if x.dtype in FLOAT_DTYPES and x.stats is not None]
    return not floats or any(non_finite(x.stats) == NonFiniteKind.NEG_INF for x in floats)


def _non_finite(seen: Seen, kind: NonFiniteKind, ins: list[Seen]) -> NonFinite:
    bad = [x.name for x in ins if x.stats is not None
           and non_finite(x.stats) not in (None, NonFiniteKind.NEG_INF)]
    if bad:
        clean = False
    elif any(x.stats is None for x in ins):
        clean = None
    else:
        clean = True
    return NonFinite(seen.op_path, _layer(seen.op_path), seen.name, kind, clean, bad)


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
                    "first op whose output holds NaN or Inf (and whether its inputs were "
                    "finite), and ops whose outputs grow far above their inputs. Uses "
                    "statistic.csv where it has statistics, else the .bin data. Exit status: "
                    "1 when a NaN/Inf was found, 0 when not, 2 on bad input.",
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
    first = next((r for r in results if r.first is not None), None)
    if first is None:
        out.print("no NaN/Inf in any output", style="green")
    else:
        out.print(f"{first.process}: {first.first.summary(first)}", style="bold red")
