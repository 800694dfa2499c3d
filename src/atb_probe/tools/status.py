"""`atb-probe status [OUTPUT]`: is every process's dump on disk yet?

Reads the status files the probes keep under `atb_dump_data/status/` (SPEC §4; the fields are
listed in `Probe.status`) and prints each process's role, state, progress and configuration,
then a verdict. Exit status (`EXIT_CODES`): 0 complete, 1 still writing, 2 no status file found,
3 the folder cannot be read, 4 nothing selected has run yet (so `atb-probe status --wait 60` or
`until atb-probe status; do sleep 1; done` waits for the data of the rounds the config selects).

A process counts as live while its pid runs and is the same process (its start time matches);
one that ended without writing `exited` (killed) is listed as "gone". `--since` leaves out the
processes that started before a time, so earlier launches into the same output do not crowd the
answer.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from dataclasses import dataclass

from .. import layout
from ..config import parse_exec_range
from ..enums import StrEnum
from ..process.role import Role
from . import size_text


class Finding(StrEnum):
    """What `atb-probe status` finds, with its exit status (`EXIT_CODES`)."""

    COMPLETE = "complete"
    WRITING = "writing"
    NOTHING = "nothing found"
    ERROR = "error"
    WAITING = "waiting"

    @property
    def code(self) -> int:
        return _CODES[self]


_CODES = {Finding.COMPLETE: 0, Finding.WRITING: 1, Finding.NOTHING: 2, Finding.ERROR: 3,
          Finding.WAITING: 4}
EXIT_CODES = """exit status:
  0  complete: no live process has data still to come
  1  still writing: data queued, a dumped round running or a model file about to be rewritten
  2  nothing found: no status file (no process loaded the probe with this output, or none
     could write there)
  3  error: OUTPUT is not a folder or cannot be read
  4  waiting: the config selects rounds, but no selected round has run yet in any live
     process (a request not sent yet, a model not started yet)

roles: worker (a model runs in this process: its rounds are the dump), engine (a serving
engine's process that runs no model, such as vLLM's API server and engine core), no model
(no model has run in this process while the probe was awake)

example: atb-probe status --wait 60 --since 10m $PWD"""


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
    p.add_argument("--since", metavar="WHEN", type=since_time,
                   help="only the processes started at or after WHEN: a time (ISO 8601, UTC "
                        "unless it says) or an age such as 90s, 10m, 2h")
    p.set_defaults(func=_status)


def status_dir(output: str) -> str:
    """The folder of the status files of OUTPUT (the --output folder or its atb_dump_data)."""
    return os.path.join(layout.dump_root(output), layout.STATUS_DIR)


def since_time(text: str) -> datetime.datetime:
    """`--since`: an ISO 8601 time (UTC unless it says), or an age (`90s`, `10m`, `2h`, `1d`)
    before now."""
    age = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    now = datetime.datetime.now(datetime.timezone.utc)
    if age:
        seconds = float(age[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[age[2]]
        return now - datetime.timedelta(seconds=seconds)
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a time (2026-01-31T14:05:00) nor an age (90s, 10m, 2h)")
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def started_since(doc: dict, since: datetime.datetime) -> bool:
    """Whether a process's probe started at or after `since` (a document without a readable
    start time is kept)."""
    try:
        started = datetime.datetime.fromisoformat(doc["started_at"])
    except (KeyError, TypeError, ValueError):
        return True
    return started >= since


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
    (SPEC §8) and a selected round has run (or none can any more), and the line that says so."""

    finding: Finding
    message: str

    @property
    def complete(self) -> bool:
        return self.finding is Finding.COMPLETE


def selects_more(doc: dict) -> bool:
    """Whether a live process may still dump: it runs (or may run) a model, its config in
    effect is awake and selects it, and its exec_range holds a round not yet started."""
    cfg = doc.get("config_in_effect")
    if not (doc["alive"] and isinstance(cfg, dict) and cfg.get("dump_enable")):
        return False
    if doc.get("role") not in (Role.WORKER, Role.NO_MODEL) or doc.get("device_selected") is False:
        return False
    spec, _ = parse_exec_range(str(cfg.get("exec_range", "")))
    started = doc.get("rounds_started", 0)
    return spec.everything or any(hi >= started for _, hi in spec.pairs)


def verdict(docs: list[dict]) -> Verdict:
    """The verdict on the processes' status documents."""
    if not docs:
        return Verdict(Finding.NOTHING,
                       "nothing found: no status file, so no process has loaded the probe "
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
        return Verdict(Finding.WRITING,
                       f"NOT COMPLETE: {', '.join(what)} ({len(busy)} process(es))")
    waiting = [d for d in docs if selects_more(d)]
    if waiting and not any(d.get("config_rounds", 0) for d in waiting):
        nexts = ", ".join(f"{d['name']} at round {d.get('rounds_started', 0)}" for d in waiting)
        return Verdict(Finding.WAITING,
                       f"WAITING: no selected round has run yet under the config in effect "
                       f"(next round: {nexts}); the data comes once the model runs them")
    parts = ["COMPLETE: all queued data is on disk"]
    if lost:
        parts.append(f"but {len(lost)} process(es) ended with data never written")
    if cut:
        parts.append(f"{len(cut)} process(es) were killed with data still to come "
                     f"({', '.join(d['name'] for d in cut)}): their last round may be partial")
    if len(died) > len(cut):
        parts.append(f"{len(died) - len(cut)} process(es) were killed between rounds, "
                     "after their data was on disk: nothing of theirs is missing")
    errors = [d for d in docs if d.get("last_error")]
    if errors:
        parts.append(f"{len(errors)} process(es) reported an error")
    return Verdict(Finding.COMPLETE, "; ".join(parts))


def unselected_warning(docs: list[dict]) -> str | None:
    """SPEC §7: a warning when the config's `device` list leaves every live dumping process
    out (a device ID that no rank has), else None."""
    dumping = [d for d in docs if d["alive"] and d.get("state") == "dumping" and
               d.get("role") != Role.ENGINE]
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
        return Finding.ERROR.code
    deadline = time.monotonic() + max(0.0, args.wait)
    while True:
        docs = read_statuses(args.output)
        if args.since is not None:
            docs = [d for d in docs if started_since(d, args.since)]
        found = verdict(docs)
        if found.complete or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    warning = unselected_warning(docs)
    if args.json:
        json.dump({"complete": found.complete, "finding": found.finding,
                   "message": found.message, "warning": warning, "processes": docs},
                  sys.stdout, indent=2)
        print()
        return found.finding.code
    for d in docs:
        state = d.get("state", "?") if d["alive"] else ("exited" if d.get("exited") else "gone")
        print(f"{d['name']:>16}  {_role_text(d):<9}  {state:<8}  rounds "
              f"{d.get('rounds_dumped', 0):>4} dumped of {d.get('rounds_started', 0):>4}  "
              f"files {d.get('files_written', 0):>7}  "
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
    return found.finding.code


def _role_text(doc: dict) -> str:
    """The role column: the status file's role (a file from an older probe has none)."""
    return str(doc.get("role") or "?")


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
