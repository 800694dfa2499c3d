"""Merge the statistic.csv of every rank and say, op by op, whether the ranks agree.

    python compare_ranks.py DUMP [DUMP...]

Each DUMP is an `--output` folder (or its `atb_dump_data`); give one per node to compare ranks
across machines. In a tensor-parallel model every tensor that comes out of an all_reduce must be
the same on all ranks, while the sharded tensors before it differ: a "differs" after an
all_reduce points at the rank whose numbers went wrong.

Needs the task "statistics" or "all" (the Max/Min/Mean/Norm columns).
"""
from __future__ import annotations

import argparse
import glob
import os

import pandas as pd

KEY = ["Execution Count", "Op Id", "Op Name", "Input/Output", "Index"]
STATS = ["Max", "Min", "Mean", "Norm"]


def read_dumps(roots: list[str]) -> pd.DataFrame:
    """Every rank's statistic.csv rows, with a `Rank` column `<node>:<dev>_<pid>`."""
    frames = []
    for node, root in enumerate(roots):
        if os.path.basename(os.path.normpath(root)) != "atb_dump_data":
            root = os.path.join(root, "atb_dump_data")
        for path in sorted(glob.glob(os.path.join(root, "data", "*", "*", "statistic.csv"))):
            frame = pd.read_csv(path, dtype=str, keep_default_na=False)
            frame["Rank"] = f"{node}:" + frame["Device and PID"]
            frames.append(frame)
    if not frames:
        raise SystemExit(f"no statistic.csv under {', '.join(roots)}")
    return pd.concat(frames, ignore_index=True)


def compare(rows: pd.DataFrame, rtol: float = 0.0) -> pd.DataFrame:
    """One line per tensor seen by two or more ranks: how many ranks, and whether they agree."""
    if (rows[STATS] == "N/A").all(axis=None):
        raise SystemExit("these dumps have no statistics: dump with task \"statistics\" or \"all\"")
    stats = rows[STATS].apply(pd.to_numeric, errors="coerce")
    rows = rows.assign(**{c: stats[c] for c in STATS})
    out = []
    for key, group in rows.groupby(KEY, sort=False):
        if group["Rank"].nunique() < 2:
            continue
        same_meta = group["Shape"].nunique() == 1 and group["Dtype"].nunique() == 1
        spread = (group[STATS].max() - group[STATS].min()).abs()
        scale = group[STATS].abs().max().clip(lower=1e-30)
        agree = same_meta and bool((spread <= rtol * scale).all())
        out.append((*key, group["Rank"].nunique(), group["Shape"].iloc[0],
                    "same" if agree else "differs", float((spread / scale).max())))
    return pd.DataFrame(out, columns=[*KEY, "Ranks", "Shape", "Verdict", "Max rel. spread"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dumps", nargs="+", help="--output folders, one per node")
    parser.add_argument("--rtol", type=float, default=0.0,
                        help="relative spread of Max/Min/Mean/Norm still called the same")
    parser.add_argument("--op", default="", help="only ops whose name contains this")
    args = parser.parse_args()
    table = compare(read_dumps(args.dumps), args.rtol)
    if args.op:
        table = table[table["Op Name"].str.contains(args.op, regex=False)]
    if table.empty:
        print("no tensor was dumped by two or more ranks: nothing to compare")
        return
    with pd.option_context("display.max_rows", None, "display.width", 200,
                           "display.max_colwidth", 60):
        print(table.to_string(index=False))


if __name__ == "__main__":
    main()
