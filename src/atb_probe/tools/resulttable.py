"""The result table of a comparison as files: `atb_compare_result.csv` and `.xlsx`.

One row per compared pair (a comparison.PairResult). The first columns are those of msprobe's
ATB compare, under its names, in its order (tensor metrics, then statistics differences, then
the statistics of each side); our own columns come after them. This is the one place where the
records' fields meet the columns' display titles.
"""
from __future__ import annotations

import csv

from ..statcsv import NA
from .comparison import PairResult, Role
from .result import CompareResult

RESULT_CSV = "atb_compare_result.csv"
RESULT_XLSX = "atb_compare_result.xlsx"
XLSX_MAX_ROWS = 1_048_576  # Excel's sheet limit, header included


def _stat(side: Role, name: str):
    """The getter of one statistic (max, min, mean, norm) of one side."""
    def get(r: PairResult):
        stats = r.stats(side)
        return None if stats is None else getattr(stats, name)
    return get


def _verdict(r: PairResult) -> str:
    return "" if r.diverged is None else ("yes" if r.diverged else "no")


# (title, value of a row), in the file's order.
FIELDS = (
    ("Target Data Name", lambda r: r.target.data_name),
    ("Golden Data Name", lambda r: r.golden.data_name),
    ("Target Device and PID", lambda r: r.target.process),
    ("Golden Device and PID", lambda r: r.golden.process),
    ("Target Execution Count", lambda r: r.round_cell(Role.TARGET)),
    ("Golden Execution Count", lambda r: r.round_cell(Role.GOLDEN)),
    ("Target Data Type", lambda r: r.target.dtype),
    ("Golden Data Type", lambda r: r.golden.dtype),
    ("Target Data Shape", lambda r: r.target.shape),
    ("Golden Data Shape", lambda r: r.golden.shape),
    ("Cosine", lambda r: r.metrics.cosine),
    ("Euc Distance", lambda r: r.metrics.euc_distance),
    ("Max Absolute Err", lambda r: r.metrics.max_abs_err),
    ("Max Relative Err", lambda r: r.metrics.max_rel_err),
    ("One Thousandth Err Ratio", lambda r: r.metrics.one_thousandth_ratio),
    ("Five Thousandth Err Ratio", lambda r: r.metrics.five_thousandth_ratio),
    ("Max Diff", lambda r: r.diffs.max_diff),
    ("Min Diff", lambda r: r.diffs.min_diff),
    ("Mean Diff", lambda r: r.diffs.mean_diff),
    ("Norm Diff", lambda r: r.diffs.norm_diff),
    ("Relative Err of Max(%)", lambda r: r.diffs.max_rel_pct),
    ("Relative Err of Min(%)", lambda r: r.diffs.min_rel_pct),
    ("Relative Err of Mean(%)", lambda r: r.diffs.mean_rel_pct),
    ("Relative Err of Norm(%)", lambda r: r.diffs.norm_rel_pct),
    ("Target Max", _stat(Role.TARGET, "max")), ("Golden Max", _stat(Role.GOLDEN, "max")),
    ("Target Min", _stat(Role.TARGET, "min")), ("Golden Min", _stat(Role.GOLDEN, "min")),
    ("Target Mean", _stat(Role.TARGET, "mean")), ("Golden Mean", _stat(Role.GOLDEN, "mean")),
    ("Target Norm", _stat(Role.TARGET, "norm")), ("Golden Norm", _stat(Role.GOLDEN, "norm")),
    ("Order", lambda r: r.order),
    ("Layer", lambda r: r.layer),
    ("Input/Output", lambda r: str(r.io)),     # closed sets as their text
    ("Compare Mode", lambda r: str(r.mode)),
    ("Match", lambda r: str(r.match)),
    ("Diverged", _verdict),
    ("Note", lambda r: r.note),
    ("Golden Tensor Path", lambda r: r.golden.path or NA),
    ("Target Tensor Path", lambda r: r.target.path or NA),
)
COLUMNS = tuple(title for title, _ in FIELDS)
_GETTERS = tuple(get for _, get in FIELDS)


def values(row: PairResult) -> list:
    """A row's values in column order (numbers as numbers, absent ones as None)."""
    return [get(row) for get in _GETTERS]


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
            w.writerow([cell(v) for v in values(row)])


def write_xlsx(result: CompareResult, path: str) -> None:
    """The table on a first sheet (numbers as numbers, `N/A` as text, as msprobe writes), the
    unmatched ops/tensors and a summary on their own sheets."""
    import pandas as pd
    table = pd.DataFrame([[NA if v is None else v for v in values(row)] for row in result.rows],
                         columns=list(COLUMNS))
    unmatched = pd.DataFrame([(str(u.side), str(u.kind), u.where, u.what, u.count,
                               "no counterpart by convention" if u.expected else "")
                              for u in result.unmatched],
                             columns=["Only In", "Kind", "Where", "What", "Count", "Why"])
    summary = pd.DataFrame(result.summary_lines(), columns=["Item", "Value"])
    with pd.ExcelWriter(path, engine="openpyxl") as xl:
        table.to_excel(xl, sheet_name="compare", index=False)
        unmatched.to_excel(xl, sheet_name="unmatched", index=False)
        summary.to_excel(xl, sheet_name="summary", index=False)
