"""`atb_compare_summary.json`: the verdict of a comparison for scripts and CI, beside the CSV.

One JSON object (keys in docs/analysis.md): the first divergence with both sides' round,
process, op path, op name and tensor, the metric that crosses and its value, and what its
inputs say (clean, unknown, crossing); the counts; the thresholds; the rounds paired; the ops
that could not be judged; what could not be aligned, grouped by side, kind and place, with the
reason; the ranks joined into one side (shards.py); the verdict as the console prints it; and,
with `compare --replay` only, what replay found of the kernels from the first divergence on
(culprit.py). Strict JSON: a number that is not finite is written as the string `inf`, `-inf`
or `nan`.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict

from .comparison import PairMode, PairResult, Role, TensorRef, Unmatched
from .divergence import Finding, Unjudged, crossing
from .result import CompareResult

SUMMARY_JSON = "atb_compare_summary.json"
SUMMARY_VERSION = 1
MAX_WHAT = 20                # names listed per group of unmatched entries


def summary_doc(result: CompareResult) -> dict:
    """The summary as a JSON-ready dict."""
    c = result.counts()
    doc = {
        "version": SUMMARY_VERSION,
        "golden": result.golden,
        "target": result.target,
        "mode": str(result.mode),
        "diverged": result.finding is not None,
        "verdict": result.verdict_text(),
        "first_divergence": _finding(result.finding, result),
        "counts": {"tensor_pairs": len(result.rows), "tensor": c.tensor,
                   "statistics": c.statistics, "no_data": c.no_data, "crossing": c.crossing,
                   "ops_paired_by_name_map_or_order": result.name_matched_ops,
                   "unjudged_ops": len(result.unjudged),
                   "unmatched_entries": sum(1 for u in result.unmatched if not u.expected),
                   "no_counterpart_by_convention": sum(1 for u in result.unmatched
                                                       if u.expected)},
        "thresholds": asdict(result.thresholds),
        "rounds": [{"golden": r.golden, "target": r.target} for r in result.rounds],
        "rounds_paired": result.pairing,
        "unjudged": [_unjudged(u) for u in result.unjudged],
        "unmatched": _unmatched_groups(result.unmatched),
        "triage": None if result.triage is None else asdict(result.triage),
        "ranks_joined": None if result.ranks is None else {
            "side": str(result.ranks.role), "ranks": result.ranks.ranks,
            "not_joined": [{"tensor": u.name, "why": u.reason}
                           for u in result.ranks.undecided]},
    }
    if result.replay is not None:    # only with `compare --replay`
        doc["replay"] = result.replay.as_dict()
    return doc


def write_summary(result: CompareResult, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(summary_doc(result)), f, indent=2, ensure_ascii=False,
                  allow_nan=False)
        f.write("\n")


def _finding(f: Finding | None, result: CompareResult) -> dict | None:
    if f is None:
        return None
    row = f.row
    crossed = crossing(row, result.thresholds)
    return {
        "inputs": str(f.inputs),
        "golden": _side(row, Role.GOLDEN),
        "target": _side(row, Role.TARGET),
        "request": f.request or None,    # rounds paired by number do not say
        "token": None if f.positions is None else
        {"first": f.positions.start, "last": f.positions.stop - 1},
        "compare_mode": str(row.mode),
        "match": str(row.match),
        "metric": None if crossed is None else str(crossed.metric),
        "value": None if crossed is None else crossed.value,
        "metrics": asdict(row.metrics) if row.mode == PairMode.TENSOR else
        {"norm_rel_pct": row.diffs.norm_rel_pct,
         "golden_norm": row.golden_stats.norm if row.golden_stats else None,
         "target_norm": row.target_stats.norm if row.target_stats else None},
        "first_inside": f.first_inside or None,
        "unknown_input": None if f.unknown_input is None else
        {"tensor": f.unknown_input.name, "why": f.unknown_input.note or None},
        "unjudged_before": None if f.unjudged is None else _unjudged(f.unjudged),
        "unjudged_ops_before": f.unjudged_before,
        "first_clean_after": None if f.then_clean is None else
        {"round": f.then_clean.round_index, "target_op_path": f.then_clean.op_path,
         "golden_op_path": f.then_clean.golden_op_path},
    }


def _side(row: PairResult, role: Role) -> dict:
    ref: TensorRef = row.ref(role)
    op_path = ref.data_name.rsplit("/", 1)[0]
    return {"process": ref.process, "round": ref.round_index, "op_path": op_path,
            "op_name": op_path.rsplit("/", 1)[-1].partition("_")[2],
            "tensor": ref.data_name, "dtype": ref.dtype, "shape": ref.shape}


def _unjudged(u: Unjudged) -> dict:
    return {"round": u.round_index, "target_op_path": u.op_path,
            "golden_op_path": u.golden_op_path or None, "why": u.why}


def _unmatched_groups(unmatched: list[Unmatched]) -> list[dict]:
    """The entries grouped by (side, kind, where), in the order they were found."""
    groups: dict[tuple, dict] = {}
    for u in unmatched:
        key = (u.side, u.kind, u.where, u.expected)
        group = groups.get(key)
        if group is None:
            why = "no counterpart by convention (the op map says so)" if u.expected \
                else u.kind.reason
            group = groups[key] = {"only_in": str(u.side), "kind": str(u.kind),
                                   "where": u.where, "why": why, "expected": u.expected,
                                   "entries": 0,
                                   "count": 0, "what": []}
        group["entries"] += 1
        group["count"] += u.count
        if len(group["what"]) < MAX_WHAT:
            group["what"].append(u.what)
    return list(groups.values())


def _finite(value):
    """`value` with every non-finite float as its name (strict JSON has no NaN/Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
