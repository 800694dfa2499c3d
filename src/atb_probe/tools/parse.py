"""`atb-probe parse PATH [--to npy|pt] [-o OUT]`: `.bin` files to `.npy` or `.pt`.

PATH is one `.bin` file or any folder of a dump; a folder is converted recursively and its layout
kept below OUT (`OUT/data/0_123/0/0_Embedding/before/intensor0.npy`), unlike msprobe's parse,
which reads one folder and writes flat. Reference files (filter_level 1) are converted from the
bytes they point at. Header-only files (filter_level 2 kernels) hold no bytes and are skipped and
counted. `.npy` widens bf16 and the fp8 dtypes to float32, as msprobe does (numpy has no such
dtypes); `.pt` keeps every dtype.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from ..binfile import BinFormatError
from . import extras
from ..binread import HeaderOnlyError, load_numpy, load_tensor


def register(sub) -> None:
    p = sub.add_parser(
        "parse", help="convert .bin tensors (one file or a whole dump) to .npy or .pt",
        description="Convert one .bin file, or every .bin file below a folder (keeping the "
                    "layout), to .npy (bf16/fp8 as float32) or .pt (dtype kept). Reference "
                    "files are resolved to the bytes they point at.",
        epilog="example: atb-probe parse out/atb_dump_data --to npy -o parsed")
    p.add_argument("path", help="a .bin file or a folder of a dump")
    p.add_argument("--to", choices=("npy", "pt"), default="npy",
                   help="output format (default npy)")
    p.add_argument("-o", "--output", default="parse_output",
                   help="output folder (default ./parse_output); for a single file, a path "
                        "ending in .npy/.pt names the file itself")
    p.set_defaults(func=_parse)


def convert(src: str, dst: str, to: str) -> None:
    """Write the tensor of `src` to `dst` as `.npy` or `.pt`."""
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = f"{dst}.part"
    if to == "npy":
        import numpy as np
        with open(tmp, "wb") as f:
            np.save(f, load_numpy(src))
    else:
        import torch
        torch.save(load_tensor(src), tmp)
    os.replace(tmp, dst)


def bin_files(folder: str) -> list[str]:
    """Every `.bin` below `folder`, relative to it, sorted."""
    found = []
    for base, dirs, names in os.walk(folder):
        dirs.sort()
        for n in sorted(names):
            if n.endswith(".bin"):
                found.append(os.path.relpath(os.path.join(base, n), folder))
    return found


@dataclass(slots=True)
class Failure:
    """A file that could not be converted."""

    path: str                    # relative to the folder converted (the file itself for one)
    message: str


@dataclass(slots=True)
class ParseResult:
    """What a conversion wrote."""

    output: str                  # the folder, or the one file, written
    written: int = 0
    header_only: int = 0         # skipped: no bytes to convert (filter_level 2)
    failed: list[Failure] = field(default_factory=list)


def parse_path(path: str, output: str, to: str, progress=None) -> ParseResult:
    """Convert `path` (a .bin file or a folder) to `to` (npy | pt) in `output`."""
    result = ParseResult(output)
    if os.path.isfile(path):
        if output.endswith(f".{to}"):
            dst = output
        else:
            dst = os.path.join(output, os.path.basename(path)[:-4] + f".{to}")
        jobs = [(path, dst)]
        result.output = dst
    else:
        jobs = [(os.path.join(path, rel), os.path.join(output, rel[:-4] + f".{to}"))
                for rel in bin_files(path)]
    advance = progress(len(jobs)) if progress else None
    for src, dst in jobs:
        try:
            convert(src, dst, to)
            result.written += 1
        except HeaderOnlyError:
            result.header_only += 1
        except (BinFormatError, OSError) as exc:
            result.failed.append(Failure(os.path.relpath(src, path) if src != path else src,
                                         str(exc)))
        if advance:
            advance()
    return result


def _parse(args) -> int:
    path = os.path.abspath(args.path)
    if not os.path.exists(path):
        print(f"atb-probe parse: {args.path} does not exist", file=sys.stderr)
        return 2
    if os.path.isfile(path) and not path.endswith(".bin"):
        print(f"atb-probe parse: {args.path} is not a .bin file; give a .bin file or a dump "
              "folder", file=sys.stderr)
        return 2
    if os.path.isdir(path) and not bin_files(path):
        print(f"atb-probe parse: no .bin file below {args.path} (was it dumped with "
              "task=statistics? then statistic.csv holds everything there is)", file=sys.stderr)
        return 2
    if not extras.require("parse", "rich"):
        return 2
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress
    err = Console(stderr=True)
    with Progress("parsing", BarColumn(), MofNCompleteColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as bar:
        def progress(total):
            task = bar.add_task("parse", total=total)
            return lambda: bar.advance(task)
        result = parse_path(path, os.path.abspath(args.output), args.to, progress)
    print(f"wrote {result.written} .{args.to} file(s) to {result.output}")
    if result.header_only:
        print(f"skipped {result.header_only} header-only file(s): dumped with filter_level 2, "
              "their data was never written (statistic.csv has their statistics)")
    for failure in result.failed[:20]:
        print(f"failed: {failure.path}: {failure.message}", file=sys.stderr)
    if len(result.failed) > 20:
        print(f"... and {len(result.failed) - 20} more failures", file=sys.stderr)
    return 1 if result.failed else 0
