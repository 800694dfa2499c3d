"""`atb-probe compare GOLDEN TARGET [-o OUT]`: compare two dumps tensor by tensor.

GOLDEN and TARGET are dumps opened at the same level (roots, `<dev>_<pid>` folders or round
folders; see dumpreader). Tensors are paired by align.py, compared by metrics.py, judged by
divergence.py; this module runs that pipeline and writes the results:

* `atb_compare_result.csv` and `.xlsx` — one row per tensor pair. The first columns are those of
  msprobe's ATB compare, under its names, in its order (tensor metrics, then statistics
  differences, then the statistics of each side); our own columns come after them.
* `atb_compare_report.html` — self-contained: the first divergence, an error plot per round, a
  per-layer summary, what could not be matched, and the table.

Compare mode per tensor (`--mode auto`, the default): tensor metrics when both sides have the
bytes, else statistics differences from the csv (or from the bytes of the side that has them),
else `no data`.
"""
from __future__ import annotations

import csv
import os
import sys
from dataclasses import dataclass, field

from ..statcsv import NA
from . import extras
from .align import Alignment, Unmatched, align_dumps
from .divergence import Finding, Thresholds, crosses, first_divergence
from .dumpreader import DumpError, NoData, TensorRecord, open_dump
from .metrics import STAT_DIFFS, STAT_NAMES, STAT_RELATIVE, TENSOR_METRICS, array_stats, \
    stats_metrics, tensor_metrics

MSPROBE_COMMON = ("Target Data Name", "Golden Data Name", "Target Device and PID",
                  "Golden Device and PID", "Target Execution Count", "Golden Execution Count",
                  "Target Data Type", "Golden Data Type", "Target Data Shape", "Golden Data Shape")
SIDE_STATS = tuple(f"{side} {s}" for s in STAT_NAMES for side in ("Target", "Golden"))
OWN_COLUMNS = ("Order", "Layer", "Input/Output", "Compare Mode", "Match", "Diverged", "Note",
               "Golden Tensor Path", "Target Tensor Path")
COLUMNS = MSPROBE_COMMON + TENSOR_METRICS + STAT_DIFFS + STAT_RELATIVE + SIDE_STATS + OWN_COLUMNS

RESULT_CSV = "atb_compare_result.csv"
RESULT_XLSX = "atb_compare_result.xlsx"
REPORT_HTML = "atb_compare_report.html"
MODES = ("auto", "tensor", "statistics")
XLSX_MAX_ROWS = 1_048_576  # Excel's sheet limit, header included


class CompareError(Exception):
    """A user error: the message says what to give instead."""


@dataclass
class CompareResult:
    golden: str
    target: str
    mode: str
    thresholds: Thresholds
    rows: list[dict]                          # in execution order: round, then target order
    unmatched: list[Unmatched]
    finding: Finding | None
    rounds: list[tuple[int, int]] = field(default_factory=list)   # (golden, target) round ids
    name_matched_ops: int = 0

    def counts(self) -> dict[str, int]:
        out = {"tensor": 0, "statistics": 0, "no data": 0, "crossing": 0}
        for r in self.rows:
            out[r["Compare Mode"]] += 1
            out["crossing"] += r["Diverged"] == "yes"
        return out


def compare_dumps(golden: str, target: str, mode: str = "auto",
                  thresholds: Thresholds = Thresholds(), progress=None) -> CompareResult:
    """Compare two dumps; `progress(total)` may return a callable advanced once per tensor."""
    if mode not in MODES:
        raise CompareError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    try:
        g_dump, t_dump = open_dump(golden), open_dump(target)
    except DumpError as exc:
        raise CompareError(str(exc)) from None
    if (g_dump.kind == "round") != (t_dump.kind == "round"):
        raise CompareError(
            f"GOLDEN is a {g_dump.kind} folder but TARGET is a {t_dump.kind} folder: give two "
            "round folders (data/<dev>_<pid>/<round>), or two dump roots / process folders")
    alignment: Alignment = align_dumps(g_dump, t_dump)
    total = sum(len(op.tensors) for rp in alignment.rounds for op in rp.ops)
    advance = progress(total) if progress else None
    rows: list[dict] = []
    op_order = []
    for rp in alignment.rounds:
        round_rows = []
        for op in rp.ops:
            in_rows, out_rows = [], []
            for pair in op.tensors:
                row = compare_pair(pair.golden, pair.target, mode)
                row["Match"] = pair.method
                verdict = crosses(row, thresholds)
                row["Diverged"] = "" if verdict is None else ("yes" if verdict else "no")
                (in_rows if pair.target.io == "input" else out_rows).append(row)
                round_rows.append(row)
                if advance:
                    advance()
            done = min((r["Order"] for r in out_rows), default=None)
            if done is None:
                done = max((r["Order"] for r in in_rows), default=0)
            op_order.append(((rp.target.index, done), (rp.target.index, op.target.op_path,
                                                        op.golden.op_path, in_rows, out_rows)))
        round_rows.sort(key=lambda r: r["Order"])
        rows.extend(round_rows)
    op_order.sort(key=lambda item: item[0])
    finding = first_divergence((item for _, item in op_order), thresholds)
    if finding is not None:
        finding.first_inside = _first_inside(rows, finding)
    return CompareResult(g_dump.path, t_dump.path, mode, thresholds, rows, alignment.unmatched,
                         finding, [(rp.golden.index, rp.target.index) for rp in alignment.rounds],
                         alignment.name_matched)


def _first_inside(rows: list[dict], finding: Finding) -> str:
    """The earliest crossing tensor of the found op's children (a weight shows up here)."""
    prefix = finding.op_path + "/"
    for row in rows:
        if (row["Target Execution Count"] == str(finding.round_index) and row["Diverged"] == "yes"
                and row["Target Data Name"].rsplit("/", 1)[0].startswith(prefix)):
            return row["Target Data Name"]
    return ""


def compare_pair(golden: TensorRecord, target: TensorRecord, mode: str = "auto") -> dict:
    """The result row of one pair of tensors (numbers as floats, absent ones as None)."""
    row = dict.fromkeys(COLUMNS)
    row.update({
        "Target Data Name": target.data_name, "Golden Data Name": golden.data_name,
        "Target Device and PID": target.round.process.name,
        "Golden Device and PID": golden.round.process.name,
        "Target Execution Count": str(target.round.index),
        "Golden Execution Count": str(golden.round.index),
        "Target Data Type": target.dtype, "Golden Data Type": golden.dtype,
        "Target Data Shape": target.shape, "Golden Data Shape": golden.shape,
        "Order": target.order, "Layer": target.layer, "Input/Output": target.io,
        "Golden Tensor Path": golden.path or NA, "Target Tensor Path": target.path or NA,
    })
    notes = []
    g_arr = t_arr = None
    if _empty(golden.shape) and _empty(target.shape):
        row.update({"Compare Mode": "no data", "Note": "empty tensor"})
        return row
    if mode != "statistics" or golden.stats is None or target.stats is None:
        g_arr, g_why = _load(golden)
        t_arr, t_why = _load(target)
        for side, why in (("golden", g_why), ("target", t_why)):
            if why:
                notes.append(f"{side}: {why}")
    g_stats = golden.stats
    t_stats = target.stats
    if g_arr is not None and (mode != "statistics" or g_stats is None):
        g_stats = array_stats(g_arr)
    if t_arr is not None and (mode != "statistics" or t_stats is None):
        t_stats = array_stats(t_arr)
    if g_arr is not None and t_arr is not None and mode != "statistics":
        metrics, note = tensor_metrics(g_arr, t_arr)
        row.update(metrics)
        row["Compare Mode"] = "tensor"
        if note:
            notes.insert(0, note)
        elif golden.dtype != target.dtype:
            notes.append(f"dtype differs ({golden.dtype} vs {target.dtype}): compared as float")
    elif g_stats is not None and t_stats is not None and mode != "tensor":
        row["Compare Mode"] = "statistics"
    else:
        row["Compare Mode"] = "no data"
    if g_stats is not None and t_stats is not None:
        row.update(stats_metrics(g_stats, t_stats))
    for side, stats in (("Golden", g_stats), ("Target", t_stats)):
        if stats is not None:
            for name, value in zip(STAT_NAMES, stats):
                row[f"{side} {name}"] = value
    row["Note"] = "; ".join(notes)
    return row


def _empty(shape: str) -> bool:
    return "0" in shape.split("x")


def _load(record: TensorRecord):
    try:
        return record.load(), ""
    except NoData as exc:
        return None, str(exc)


# -- writing -------------------------------------------------------------------------------------

def cell(value) -> str:
    """A result value as csv text: msprobe's `N/A` for absent values."""
    if value is None or value == "":
        return NA if value is None else ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_csv(result: CompareResult, path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for row in result.rows:
            w.writerow([cell(row[c]) for c in COLUMNS])


def write_xlsx(result: CompareResult, path: str) -> None:
    """The table on a first sheet (numbers as numbers, `N/A` as text, as msprobe writes), the
    unmatched ops/tensors and a summary on their own sheets."""
    import pandas as pd
    table = pd.DataFrame([[NA if row[c] is None else row[c] for c in COLUMNS]
                          for row in result.rows], columns=list(COLUMNS))
    unmatched = pd.DataFrame([(u.side, u.kind, u.where, u.what, u.count)
                              for u in result.unmatched],
                             columns=["Only In", "Kind", "Where", "What", "Count"])
    summary = pd.DataFrame(summary_lines(result), columns=["Item", "Value"])
    with pd.ExcelWriter(path, engine="openpyxl") as xl:
        table.to_excel(xl, sheet_name="compare", index=False)
        unmatched.to_excel(xl, sheet_name="unmatched", index=False)
        summary.to_excel(xl, sheet_name="summary", index=False)


def summary_lines(result: CompareResult) -> list[tuple[str, str]]:
    c = result.counts()
    lines = [("golden", result.golden), ("target", result.target),
             ("rounds compared", ", ".join(f"{g}~{t}" if g != t else str(g)
                                           for g, t in result.rounds) or "none"),
             ("tensors compared", str(len(result.rows))),
             ("tensor mode", str(c["tensor"])), ("statistics mode", str(c["statistics"])),
             ("no data", str(c["no data"])), ("crossing the thresholds", str(c["crossing"])),
             ("ops paired by name (structures differ)", str(result.name_matched_ops)),
             ("unmatched entries", str(len(result.unmatched))),
             ("thresholds", result.thresholds.describe()),
             ("first divergence", result.finding.summary() if result.finding else "none")]
    return lines


def write_outputs(result: CompareResult, out: str, xlsx: bool = True,
                  html: bool = True) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, RESULT_CSV)]
    write_csv(result, paths[0])
    if xlsx and len(result.rows) >= XLSX_MAX_ROWS:
        print(f"atb-probe compare: {len(result.rows)} rows do not fit in an .xlsx sheet; "
              f"skipped it (the CSV has them all)", file=sys.stderr)
    elif xlsx:
        paths.append(os.path.join(out, RESULT_XLSX))
        write_xlsx(result, paths[-1])
    if html:
        from .report import render_html
        paths.append(os.path.join(out, REPORT_HTML))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.write(render_html(result))
    return paths


# -- command line --------------------------------------------------------------------------------

def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare two dumps and find the first diverging operator",
        description="Compare the tensors of TARGET with those of GOLDEN (dump roots, "
                    "<dev>_<pid> folders or round folders), write a CSV, an .xlsx and an HTML "
                    "report, and name the first operator whose output diverges while its "
                    "inputs do not.",
        epilog="example: atb-probe compare fp32 bf16 -o cmp --min-ratio 0")
    p.add_argument("golden", help="the reference dump")
    p.add_argument("target", help="the dump to check")
    p.add_argument("-o", "--output", default="compare_output",
                   help="folder for the results (default: ./compare_output)")
    p.add_argument("--mode", choices=MODES, default="auto",
                   help="tensor: metrics from the data; statistics: from statistic.csv; auto "
                        "(default): tensor where both sides have data, else statistics")
    d = Thresholds()
    p.add_argument("--min-cosine", type=float, default=d.min_cosine, metavar="C",
                   help=f"an output with cosine below C diverges (default {d.min_cosine})")
    p.add_argument("--min-ratio", type=float, default=d.min_ratio, metavar="R",
                   help="an output whose share of elements within 1‰ relative error is below "
                        f"R diverges (default {d.min_ratio}; 0 turns this test off)")
    p.add_argument("--max-norm-err", type=float, default=d.max_norm_err, metavar="PCT",
                   help="statistics mode: an output whose norm differs by more than PCT "
                        f"percent diverges (default {d.max_norm_err})")
    p.add_argument("--no-xlsx", action="store_true", help="skip the .xlsx file")
    p.add_argument("--no-html", action="store_true", help="skip the HTML report")
    p.set_defaults(func=_compare)


def _compare(args) -> int:
    needed = ("rich",) if args.no_xlsx else ("rich", "pandas", "openpyxl")
    if not extras.require("compare", *needed):
        return 2
    from rich.console import Console
    err = Console(stderr=True)
    thresholds = Thresholds(args.min_cosine, args.min_ratio, args.max_norm_err)
    try:
        with _progress(err) as progress:
            result = compare_dumps(args.golden, args.target, args.mode, thresholds, progress)
    except CompareError as exc:
        print(f"atb-probe compare: {exc}", file=sys.stderr)
        return 2
    out = Console(highlight=False, soft_wrap=True)
    if not result.rows:
        out.print("no tensor of TARGET could be paired with one of GOLDEN: are they dumps of "
                  "the same model, at the same level?")
        _print_unmatched(out, result.unmatched)
        return 1
    paths = write_outputs(result, args.output, xlsx=not args.no_xlsx, html=not args.no_html)
    c = result.counts()
    out.print(f"compared {len(result.rows)} tensors in {len(result.rounds)} round(s): "
              f"{c['tensor']} by tensor, {c['statistics']} by statistics, "
              f"{c['no data']} without data; {c['crossing']} cross the thresholds")
    if result.name_matched_ops:
        out.print(f"{result.name_matched_ops} op(s) were paired by name because the two runs' "
                  "op structures differ there (column Match)")
    _print_unmatched(out, result.unmatched)
    if result.finding:
        style = "bold red" if result.finding.inputs_clean else "bold yellow"
        out.print(result.finding.summary(), style=style)
    else:
        out.print(f"no divergence: no output crosses {thresholds.describe()}", style="green")
    for path in paths:
        out.print(f"wrote {path}")
    return 0


def _print_unmatched(out, unmatched: list[Unmatched], limit: int = 10) -> None:
    if not unmatched:
        return
    out.print(f"{len(unmatched)} entries could not be matched (sheet 'unmatched'):")
    for u in unmatched[:limit]:
        out.print(f"  only in {u.side}: {u.kind} {u.where}: {u.what}"
                  + (f" ({u.count} ops)" if u.kind == "op" and u.count > 1 else ""))
    if len(unmatched) > limit:
        out.print(f"  ... and {len(unmatched) - limit} more")


class _progress:
    """A rich progress bar on stderr while tensors are compared (silent when not a terminal)."""

    def __init__(self, console):
        self.console = console
        self.bar = None

    def __enter__(self):
        return self.start

    def start(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
        self.bar = Progress("comparing", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            console=self.console, transient=True,
                            disable=not self.console.is_terminal)
        self.bar.start()
        task = self.bar.add_task("compare", total=total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
