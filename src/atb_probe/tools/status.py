"""`atb-probe status [OUTPUT]`: is every process's dump on disk yet?

Reads the status files the probes keep under `atb_dump_data/status/` (SPEC §4; the fields are
listed in `Probe.status`) and prints each process's state, progress and configuration, then a
verdict. Exit status (`EXIT_CODES`): 0 complete, 1 still writing, 2 no status file found, 3 the
folder cannot be read (so `atb-probe status --wait 60` or `until atb-probe status; do sleep 1;
done` waits for the data).

A process counts as live while its pid runs and is the same process (its start time matches);
one that ended without writing `exited` (killed) is listed as "gone".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

from .. import layout
from . import size_text


COMPLETE, WRITING, NOTHING, ERROR = 0, 1, 2, 3
EXIT_CODES = """exit status:
  0  complete: no live process has data still to come
  1  still writing: data queued, a dumped round running or a model file about to be rewritten
  2  nothing found: no status file (no process loaded the probe with this output, or none
     could write there)
  3  error: OUTPUT is not a folder or cannot be read

example: atb-probe status --wait 60 $PWD"""


def register(sub) -> None:
    p = sub.add_parser("status", help="show each process's dump progress; exit 0 when complete",
                       description="Show the progress of every process dumping into OUTPUT and "
                                   "say whether all queued data is on disk.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", nargs="?", default=".",
                   help="the --output folder (or its atb_dump_data); default: current directory")
    p.add_argument("--wait", type=float, metavar="SECONDS", default=0,
                   help="wait up to SECONDS for the data still queued to reach the disk")
    p.add_argument("--json", action="store_true", help="print the status documents as JSON")
    p.set_defaults(func=_status)


def status_dir(output: str) -> str:
    """The folder of the status files of OUTPUT (the --output folder or its atb_dump_data)."""
    return os.path.join(layout.dump_root(output), layout.STATUS_DIR)


def read_statuses(output: str) -> list[dict]:
    """Every process's status document, each with an `alive` field added."""
    folder = status_dir(output)
    docs = []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    for name in names:
        devpid = layout.parse_status_file(name)
        if devpid is None:
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        doc["name"] = devpid
        doc["alive"] = not doc.get("exited") and _alive(doc.get("pid"), doc.get("proc_start"))
        docs.append(doc)
    return docs


def unfinished(doc: dict) -> bool:
    """Whether a process's status shows data still to come: bytes queued, a model file waiting
    for its rewrite, or a dumped round running."""
    return doc.get("bytes_queued", 0) > 0 or doc.get("model_files_pending", 0) > 0 or \
        bool(doc.get("round_open"))


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a dump is on disk: complete when no live process has data still to come
    (SPEC §8), and the line that says so."""

    complete: bool
    message: str


def verdict(docs: list[dict]) -> Verdict:
    """The verdict on the processes' status documents."""
    if not docs:
        return Verdict(True, "nothing found: no status file, so no process has loaded the probe "
                             "with this output yet (or none could write there: check that it is "
                             "writable)")
    busy = [d for d in docs if d["alive"] and unfinished(d)]
    died = [d for d in docs if not d["alive"] and not d.get("exited")]
    cut = [d for d in died if unfinished(d)]
    lost = [d for d in docs if not d["alive"] and d.get("exited") and unfinished(d)]
    if busy:
        left = sum(d.get("bytes_queued", 0) for d in busy)
        running = sum(bool(d.get("round_open")) for d in busy)
        what = [f"{size_text(left)} still queued"] if left else []
        if running:
            what.append(f"a dumped round running in {running}")
        if not what:
            what.append("model files about to be rewritten")
        return Verdict(False, f"NOT COMPLETE: {', '.join(what)} ({len(busy)} process(es))")
    parts = ["COMPLETE: all queued data is on disk"]
    if lost:
        parts.append(f"but {len(lost)} process(es) ended with data never written")
    if cut:
        parts.append(f"{len(cut)} process(es) were killed with data still to come "
                     f"({', '.join(d['name'] for d in cut)}): their last round may be partial")
    if len(died) > len(cut):
        parts.append(f"{len(died) - len(cut)} process(es) were killed between rounds, "
                     "after their data was on disk")
    errors = [d for d in docs if d.get("last_error")]
    if errors:
        parts.append(f"{len(errors)} process(es) reported an error")
    return Verdict(True, "; ".join(parts))


def unselected_warning(docs: list[dict]) -> str | None:
    """SPEC §7: a warning when the config's `device` list leaves every live dumping process
    out (a device ID that no rank has), else None."""
    dumping = [d for d in docs if d["alive"] and d.get("state") == "dumping"]
    if not dumping or any(d.get("device_selected") is not False for d in dumping):
        return None
    wanted = {str((d.get("config_in_effect") or {}).get("device", "")) for d in dumping}
    have = sorted({str(d.get("device")) for d in dumping}, key=lambda x: (len(x), x))
    return (f"WARNING: no live process is selected: the config's device "
            f"{' / '.join(sorted(wanted))} matches none of the devices here "
            f"({', '.join(have)}), so nothing is dumped")


def _unreadable(output: str) -> str | None:
    """Why OUTPUT cannot hold a dump's status files, or None."""
    folder = status_dir(output)
    for path in (output, layout.dump_root(output), folder):
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{path} is not a folder"
    if os.path.isdir(folder) and not os.access(folder, os.R_OK | os.X_OK):
        return f"{folder} cannot be read (permissions)"
    return None


def _status(args) -> int:
    problem = _unreadable(args.output)
    if problem:
        print(f"ERROR: {problem}", file=sys.stderr)
        return ERROR
    deadline = time.monotonic() + max(0.0, args.wait)
    while True:
        docs = read_statuses(args.output)
        found = verdict(docs)
        if (found.complete and docs) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    warning = unselected_warning(docs)
    if args.json:
        json.dump({"complete": found.complete and bool(docs), "message": found.message,
                   "warning": warning, "processes": docs}, sys.stdout, indent=2)
        print()
        return _code(found.complete, docs)
    for d in docs:
        state = d.get("state", "?") if d["alive"] else ("exited" if d.get("exited") else "gone")
        print(f"{d['name']:>16}  {state:<8}  rounds {d.get('rounds_dumped', 0):>4} dumped "
              f"of {d.get('rounds_started', 0):>4}  files {d.get('files_written', 0):>7}  "
              f"written {size_text(d.get('bytes_written', 0)):>9}  "
              f"queued {size_text(d.get('bytes_queued', 0)):>9}  "
              f"updated {d.get('updated_at', '?')}")
        print(f"{'':>16}  {_describe_config(d)}")
        if d.get("device_selected") is False:
            print(f"{'':>16}  not selected: device {d.get('device')} is not in the config's "
                  f"device list{'' if d['alive'] else ', so it dumped nothing'}")
        if d.get("config_problem"):
            print(f"{'':>16}  config file not used: {d['config_problem']}")
        if d.get("last_error"):
            print(f"{'':>16}  last error: {d['last_error']}")
    print(found.message)
    if warning:
        print(warning)
    return _code(found.complete, docs)


def _code(complete: bool, docs: list[dict]) -> int:
    if not docs:
        return NOTHING
    return COMPLETE if complete else WRITING


def _describe_config(doc: dict) -> str:
    cfg = doc.get("config_in_effect")
    if not isinstance(cfg, dict):
        return f"no config yet (watching {doc.get('config') or '?'})"
    if not cfg.get("dump_enable"):
        return "config: dump_enable false"
    parts = [f"task={cfg.get('task')}", f"exec_range={cfg.get('exec_range')}"]
    for key in ("ids", "op_name", "device"):
        if cfg.get(key):
            parts.append(f"{key}={cfg[key]}")
    if cfg.get("save_child"):
        parts.append(f"save_child filter_level={cfg.get('filter_level')}")
    return f"config: {' '.join(parts)} (since {doc.get('config_applied_at', '?')})"


def _alive(pid, proc_start=None) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    # A zombie (exited, not yet reaped) is not alive; nor is another process that got the pid.
    if not fields or fields[0] == "Z":
        return False
    return not isinstance(proc_start, int) or len(fields) < 20 or fields[19] == str(proc_start)
