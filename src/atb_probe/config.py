"""config.json: parsing with defaults, type fallbacks and warnings (SPEC §3), and safe reading.

Parsing is pure: `parse_config(text)` returns a `DumpConfig` (or None when the document as a whole
is unusable) and the list of warnings to show. `read_config_file(path)` adds the file-level rules:
the file is only read, never executed; it must be a regular file below `MAX_CONFIG_BYTES` that is
not world-writable. Nothing here raises on bad input.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field

from .enums import StrEnum

MAX_CONFIG_BYTES = 1024 * 1024


class Task(StrEnum):
    """What a dump writes: tensor files, statistics, or both. Its text is its value."""

    TENSOR = "tensor"
    STATISTICS = "statistics"
    ALL = "all"


TASKS = tuple(task.value for task in Task)
# ASCII digits only, and few of them: int() of thousands of digits raises (and is slow), and no
# round, device or op index comes near 10**18.
MAX_NUMBER_DIGITS = 18
_NUMBER_RE = re.compile(r"[0-9]{1,%d}" % MAX_NUMBER_DIGITS)
_ID_RE = re.compile(r"[0-9]{1,%d}(?:_[0-9]{1,%d})*" % (MAX_NUMBER_DIGITS, MAX_NUMBER_DIGITS))
_RANGE_WORDS = ("all", "none")


@dataclass(frozen=True)
class ExecRange:
    """Which rounds are dumped: everything, nothing, or a union of inclusive pairs."""

    spec: str = "0,0"
    pairs: tuple[tuple[int, int], ...] = ((0, 0),)
    everything: bool = False

    def __contains__(self, round_index: int) -> bool:
        if self.everything:
            return True
        return any(lo <= round_index <= hi for lo, hi in self.pairs)


@dataclass(frozen=True)
class DumpConfig:
    """One parsed config.json: every field has its SPEC default."""

    task: Task = Task.TENSOR
    dump_enable: bool = False
    exec_range: ExecRange = field(default_factory=ExecRange)
    ids: tuple[str, ...] = ()
    op_name: tuple[str, ...] = ()   # lower-cased prefixes
    save_child: bool = False
    device: tuple[int, ...] = ()
    filter_level: int = 1

    def __post_init__(self):
        object.__setattr__(self, "task", Task(self.task))  # "tensor" given as text too

    @property
    def wants_tensors(self) -> bool:
        return self.task is not Task.STATISTICS

    @property
    def wants_statistics(self) -> bool:
        return self.task is not Task.TENSOR


DEFAULTS = {
    "task": "tensor",
    "dump_enable": False,
    "exec_range": "0,0",
    "ids": "",
    "op_name": "",
    "save_child": False,
    "device": "",
    "filter_level": 1,
}
_TYPES = {
    "task": str, "dump_enable": bool, "exec_range": str, "ids": str,
    "op_name": str, "save_child": bool, "device": str, "filter_level": int,
}
_TYPE_NAMES = {str: "str", bool: "bool", int: "int"}


def parse_config(text: str) -> tuple[DumpConfig | None, list[str]]:
    """Parse a config document; None means "not usable, keep the last good configuration"."""
    if text.startswith("\ufeff"):  # a BOM left by some Windows editors
        text = text[1:]
    try:
        doc = json.loads(text, parse_int=_parse_int)
    except (ValueError, RecursionError) as exc:
        return None, [f"config is not valid JSON ({_short(exc)}); keeping the last good "
                      "configuration"]
    if not isinstance(doc, dict):
        return None, [f"config must be a JSON object, got {type(doc).__name__}; keeping the last "
                      "good configuration"]
    warnings: list[str] = []
    for key in doc:
        if key not in DEFAULTS:
            warnings.append(f"unknown key {_clip(key)!r} ignored (known keys: "
                            f"{', '.join(DEFAULTS)})")
    values = {}
    missing = [key for key in DEFAULTS if key not in doc]
    if len(missing) == 1:
        key = missing[0]
        warnings.append(f"'{key}' is missing; using the default {json.dumps(DEFAULTS[key])} "
                        f"({_TYPE_NAMES[_TYPES[key]]})")
    elif missing:  # one line, however many: a partial dict is one mistake
        listed = ", ".join(f"'{key}' {json.dumps(DEFAULTS[key])} ({_TYPE_NAMES[_TYPES[key]]})"
                           for key in missing)
        warnings.append(f"{len(missing)} keys are missing; using their defaults: {listed}")
    for key, default in DEFAULTS.items():
        if key not in doc:
            values[key] = default
            continue
        value = doc[key]
        expected = _TYPES[key]
        # bool is an int in Python; JSON true is not a valid filter_level.
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            warnings.append(f"'{key}' must be {_TYPE_NAMES[expected]}, got "
                            f"{_show(value)}; using the default {json.dumps(default)}")
            value = default
        values[key] = value

    task = values["task"]
    if task not in TASKS:
        warnings.append(f"'task' {_clip(task)!r} is not one of {', '.join(TASKS)}; using the "
                        "default \"tensor\"")
        task = "tensor"
    level = values["filter_level"]
    if not 0 <= level <= 2:
        warnings.append(f"'filter_level' {_clip(str(level))} is outside 0-2; using the default 1")
        level = 1
    exec_range, msg = parse_exec_range(values["exec_range"])
    if msg:
        warnings.append(msg)
    ids, msgs = _parse_list(values["ids"], "ids", _ID_RE.fullmatch, "op IDs such as 0 or 2_1")
    warnings.extend(msgs)
    names, msgs = _parse_list(values["op_name"], "op_name", lambda s: True, "")
    warnings.extend(msgs)
    devices, msgs = _parse_list(values["device"], "device", _NUMBER_RE.fullmatch,
                                "device IDs such as 0")
    warnings.extend(msgs)
    config = DumpConfig(
        task=task,
        dump_enable=values["dump_enable"],
        exec_range=exec_range,
        ids=tuple(dict.fromkeys(ids)),
        op_name=tuple(dict.fromkeys(n.lower() for n in names)),
        save_child=values["save_child"],
        device=tuple(dict.fromkeys(int(d) for d in devices)),
        filter_level=level,
    )
    return config, warnings


def parse_exec_range(text: str) -> tuple[ExecRange, str | None]:
    """`"all"`, `"none"` or inclusive pairs `"a,b[,c,d...]"`; a bad value gives the default."""
    word = text.strip().lower()
    if word == "all":
        return ExecRange("all", (), True), None
    if word == "none":
        return ExecRange("none", (), False), None
    parts = [p.strip() for p in text.split(",")]
    problem = None
    if not all(_NUMBER_RE.fullmatch(p) for p in parts):
        problem = "must be \"all\", \"none\" or comma-separated non-negative round numbers " \
                  f"(at most {MAX_NUMBER_DIGITS} digits each)"
    elif len(parts) % 2:
        problem = f"has {len(parts)} numbers; rounds come in start,end pairs"
    else:
        nums = [int(p) for p in parts]
        pairs = tuple(zip(nums[::2], nums[1::2]))
        reversed_pairs = [p for p in pairs if p[0] > p[1]]
        if reversed_pairs:
            problem = f"has a pair whose start is after its end ({reversed_pairs[0][0]}," \
                      f"{reversed_pairs[0][1]})"
        else:
            return ExecRange(text, pairs, False), None
    return ExecRange(), f"'exec_range' {_clip(text)!r} {problem}; using the default \"0,0\""


def _parse_list(text, key, valid, what) -> tuple[list[str], list[str]]:
    items, bad, empty = [], [], 0
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            empty += 1
            continue
        (items if valid(item) else bad).append(item)
    warnings = []
    if bad:
        warnings.append(f"'{key}' items {', '.join(repr(_clip(b)) for b in bad[:5])} are not "
                        f"{what}; ignoring them")
    if empty and text.strip():
        warnings.append(f"'{key}' {_clip(text)!r} has empty items; ignoring them")
    return items, warnings


def _clip(text: str, limit: int = 60) -> str:
    text = "".join(c if c.isprintable() else "?" for c in str(text))
    return text if len(text) <= limit else text[:limit] + "..."


class _HugeNumber:
    """A JSON integer too long to be any setting (int() of it would be slow or refused)."""

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str):
    return int(text) if len(text) <= 64 else _HugeNumber(len(text))


def _show(value) -> str:
    """A JSON value as a short printable snippet for a warning."""
    if isinstance(value, _HugeNumber):
        return f"a number of {value.digits} digits"
    try:
        text = json.dumps(value, default=lambda v: f"<{v.digits}-digit number>")
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return _clip(text)


def _short(exc: Exception) -> str:
    return _clip(str(exc), 120)


class ConfigFileError(OSError):
    """The config file exists but must not be used (wrong kind, too big, unsafe permissions)."""


def read_config_file(path: str) -> str | None:
    """The text of the config file, None when it does not exist; ConfigFileError when unsafe."""
    try:
        # Look before opening: opening a device can have side effects (a tape rewinds).
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigFileError(f"config {path} is {_kind(mode)}, not a regular file")
        # O_NONBLOCK: a FIFO swapped in after the check must not hang us.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
                     | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        raise ConfigFileError(f"config {path} cannot be read (permission denied)") from None
    except ConfigFileError:
        raise
    except OSError as exc:
        raise ConfigFileError(f"config {path} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigFileError(f"config {path} is {_kind(st.st_mode)}, not a regular file")
        if st.st_mode & stat.S_IWOTH:
            raise ConfigFileError(f"config {path} is writable by every user; refusing it "
                                  f"(run: chmod o-w {path})")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigFileError(f"config {path} is {st.st_size} bytes; the limit is "
                                  f"{MAX_CONFIG_BYTES}")
        chunks, total = [], 0
        while total <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > MAX_CONFIG_BYTES:
            raise ConfigFileError(f"config {path} grew past {MAX_CONFIG_BYTES} bytes")
    except ConfigFileError:
        raise
    except OSError as exc:
        raise ConfigFileError(f"config {path} cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"
