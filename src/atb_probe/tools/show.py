"""`atb-probe show DUMP [--depth N] [--csv [-o FILE]]`: what a dump holds.

The tree goes processes → rounds → layer-level ops → their child ops (down to `--depth`), each
with its tensor count and the bytes of its `.bin` files (a statistics dump, which writes no
`.bin` file, gives its statistic.csv rows instead); every round says its model and phase (from
the model files' `rounds`) and which task it was dumped with (read from its statistic.csv:
`tensor`, `statistics` or `all`). `--csv` instead
merges every round's statistic.csv into one table (same columns; Device and PID and Execution
Count tell the rows apart).
"""
from __future__ import annotations

import csv
import os
import sys

from .. import layout
from ..statcsv import COLUMNS
from .align import OpNode, build_tree as op_tree
from . import extras, size_text
from .dumpreader import DumpError, Round, RoundModules, open_dump


def register(sub) -> None:
    p = sub.add_parser(
        "show", help="show a dump as a tree (processes, rounds, layers, ops) or one table",
        description="Print the processes, rounds, layer-level ops and child ops of a dump with "
                    "tensor counts, bytes and each round's task; or, with --csv, merge every "
                    "statistic.csv into one table.",
        epilog="example: atb-probe show out/atb_dump_data --depth 2")
    p.add_argument("dump", help="the dump (any level: root, <dev>_<pid> or round folder)")
    p.add_argument("--depth", type=int, default=2,
                   help="op levels to show: 1 = layer-level ops only (default 2)")
    p.add_argument("--csv", action="store_true",
                   help="print every statistic.csv merged into one table instead")
    p.add_argument("-o", "--output", help="with --csv: write the table to this file")
    p.set_defaults(func=_show)


def file_bytes(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def merge_csv(dump, out) -> int:
    """Write every round's rows to `out` under one header; returns the number of rows."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    count = 0
    for rnd in dump.rounds:
        for t in rnd.tensors:
            writer.writerow([t.row.get(c, "N/A") for c in COLUMNS])
            count += 1
    return count


def build_tree(dump, depth: int):
    """The rich Tree of a dump."""
    from rich.markup import escape
    from rich.tree import Tree
    total_rounds = len(dump.rounds)
    tree = Tree(f"[bold]{escape(dump.path)}[/]  ({len(dump.processes)} process(es), "
                f"{total_rounds} round(s))")
    models = dump.info_files("model")
    for proc in dump.processes:
        label = (f"[bold]{proc.name}[/]  {len(proc.rounds)} round(s), "
                 f"{_amount(t for r in proc.rounds for t in r.tensors)}")
        phases = [layout.parse_info_file(os.path.basename(p))
                  for p in models.get(proc.name, [])]
        if phases:
            label += f"  model: {', '.join(phases)}"
        pnode = tree.add(label)
        for rnd in proc.rounds:
            _add_round(pnode, rnd, depth, rnd.modules)
    return tree


def _add_round(parent, rnd: Round, depth: int, modules: RoundModules) -> None:
    from rich.markup import escape
    source = "statistic.csv" if os.path.isfile(rnd.csv_path) else "no statistic.csv: folders"
    label = f"round [bold]{rnd.index}[/]"
    if modules.model:
        label += f"  model={escape(modules.model)}"
    if modules.phase:
        label += f"  phase={escape(modules.phase)}"
    rnode = parent.add(f"{label}  task={rnd.task or 'unknown'}  {_amount(rnd.tensors)}  "
                       f"({source})")
    for child in op_tree(rnd).children:
        _add_op(rnode, child, 1, depth, modules.paths)


def _add_op(parent, node: OpNode, level: int, depth: int, paths: dict[str, str]) -> None:
    """One op with the totals of its subtree and its module path; its children while
    `level < depth`."""
    from rich.markup import escape
    label = escape(layout.op_folder(node.own_id, node.name))
    if node.op_id in paths:
        label += f" [dim]({escape(paths[node.op_id] or '<root>')})[/]"
    label += f"  {_amount(_subtree_tensors(node))}"
    below = node.count() - (node.op is not None)
    if below and level >= depth:
        label += f", {below} op(s) below"
    branch = parent.add(label)
    if level < depth:
        for child in node.children:
            _add_op(branch, child, level + 1, depth, paths)


def _subtree_tensors(node: OpNode):
    if node.op is not None:
        yield from node.op.tensors
    for child in node.children:
        yield from _subtree_tensors(child)


def _amount(tensors) -> str:
    """What was written for `tensors`: their count and the bytes of their `.bin` files, or,
    when none has a file (a statistics dump), their count as statistic.csv rows."""
    count = size = files = 0
    for t in tensors:
        count += 1
        if t.path:
            files += 1
            size += file_bytes(t.path)
    if count and not files:
        return f"{count} rows"
    return f"{count} tensors, {size_text(size)}"


def _show(args) -> int:
    if not extras.require("show", "rich"):
        return 2
    try:
        dump = open_dump(args.dump)
    except DumpError as exc:
        print(f"atb-probe show: {exc}", file=sys.stderr)
        return 2
    if args.csv:
        if args.output:
            with open(args.output, "w", newline="", encoding="utf-8") as f:
                count = merge_csv(dump, f)
            print(f"wrote {count} rows to {args.output}", file=sys.stderr)
        else:
            merge_csv(dump, sys.stdout)
        return 0
    if args.output:
        print("atb-probe show: -o goes with --csv", file=sys.stderr)
        return 2
    from rich.console import Console
    Console(highlight=False).print(build_tree(dump, max(1, args.depth)))
    return 0
