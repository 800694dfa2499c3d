"""`atb-probe status [OUTPUT]`: is every process's dump on disk yet?

Reads the status files the probes keep under `atb_dump_data/status/` (SPEC §4) and prints one
line per process and a verdict. Exit status: 0 when no live process has data queued, 1 while
data is still on its way (so `until atb-probe status; do sleep 1; done` waits for it).
"""
from __future__ import annotations

import json
import os
import sys
import time


def register(sub) -> None:
    p = sub.add_parser("status", help="show each process's dump progress; exit 0 when complete",
                       description="Show the progress of every process dumping into OUTPUT and "
                                   "say whether all queued data is on disk.",
                       epilog="example: atb-probe status --wait 60 $PWD")
    p.add_argument("output", nargs="?", default=".",
                   help="the --output folder (or its atb_dump_data); default: current directory")
    p.add_argument("--wait", type=float, metavar="SECONDS", default=0,
                   help="wait up to SECONDS for the data still queued to reach the disk")
    p.add_argument("--json", action="store_true", help="print the status documents as JSON")
    p.set_defaults(func=_status)


def status_dir(output: str) -> str:
    output = os.path.abspath(output)
    if os.path.basename(output) != "atb_dump_data":
        output = os.path.join(output, "atb_dump_data")
    return os.path.join(output, "status")


def read_statuses(output: str) -> list[dict]:
    """Every process's status document, each with an `alive` field added."""
    folder = status_dir(output)
    docs = []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        doc["name"] = name[:-5]
        doc["alive"] = not doc.get("exited") and _alive(doc.get("pid"))
        docs.append(doc)
    return docs


def verdict(docs: list[dict]) -> tuple[bool, str]:
    """(complete, message): complete when no live process has anything queued."""
    if not docs:
        return True, "no process has loaded the probe with this output yet"
    busy = [d for d in docs if d["alive"] and d.get("bytes_queued", 0) > 0]
    lost = [d for d in docs if not d["alive"] and d.get("bytes_queued", 0) > 0]
    died = [d for d in docs if not d["alive"] and not d.get("exited")]
    if busy:
        left = sum(d["bytes_queued"] for d in busy)
        return False, f"NOT COMPLETE: {_size(left)} still queued in {len(busy)} process(es)"
    parts = ["COMPLETE: all queued data is on disk"]
    if lost:
        parts.append(f"but {len(lost)} process(es) ended with data never written")
    if died:
        parts.append(f"{len(died)} process(es) ended without a clean exit "
                     f"({', '.join(d['name'] for d in died)}); their last round may be partial")
    errors = [d for d in docs if d.get("last_error")]
    if errors:
        parts.append(f"{len(errors)} process(es) reported an error")
    return True, "; ".join(parts)


def _status(args) -> int:
    deadline = time.monotonic() + max(0.0, args.wait)
    while True:
        docs = read_statuses(args.output)
        complete, message = verdict(docs)
        if complete or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if args.json:
        json.dump({"complete": complete, "message": message, "processes": docs}, sys.stdout,
                  indent=2)
        print()
        return 0 if complete else 1
    for d in docs:
        state = d.get("state", "?") if d["alive"] else ("exited" if d.get("exited") else "gone")
        print(f"{d['name']:>16}  {state:<8}  rounds {d.get('rounds_dumped', 0):>4}  "
              f"files {d.get('files_written', 0):>7}  written {_size(d.get('bytes_written', 0)):>9}"
              f"  queued {_size(d.get('bytes_queued', 0)):>9}  updated {d.get('updated_at', '?')}")
        if d.get("last_error"):
            print(f"{'':>16}  last error: {d['last_error']}")
    print(message)
    return 0 if complete else 1


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is not alive.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _size(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
