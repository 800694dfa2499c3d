"""Other processes, as the tests start them and wait for them: a program run through the load
script, through torchrun or as the CLI; a long-lived one whose stderr is read as it comes; its
status file; and `wait_until`, the one way a test waits (on something it can see, with a
deadline, never a fixed sleep). `config` builds the config documents the tests write.

Every process starts from an environment without the probe's variables (a shell that has not
sourced the load script nor set the probe's options, whatever shell started the suite) and,
where its signal handling matters, with SIGINT and SIGTERM at their defaults (`terminal`).
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import shlex
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from atb_probe.tools.where import scripts_dir

SCRIPTS = Path(scripts_dir())

# Prefix for the command of a program whose signal handling a test checks: it starts with SIGINT
# and SIGTERM at their defaults, as a program started from a terminal does, however the suite
# was started. A background job (`pytest ... &` in a script), `nohup` or a CI runner may start the
# suite with SIGINT ignored, and every child inherits that: Python installs its KeyboardInterrupt
# handler only when SIGINT is not ignored at start, and the probe its SIGTERM handler only when
# SIGTERM is at its default. (`preexec_fn` would do the same, but is unsafe with threads.)
DEFAULT_SIGNALS = "env --default-signal=INT,TERM"

FULL_CONFIG = {
    "task": "tensor",
    "dump_enable": True,
    "exec_range": "all",
    "ids": "",
    "op_name": "",
    "save_child": False,
    "device": "",
    "filter_level": 1,
}


def config(**overrides) -> dict:
    """A complete config document (no missing-key warnings) with `overrides` applied."""
    doc = dict(FULL_CONFIG)
    doc.update(overrides)
    return doc


# -- waiting ---------------------------------------------------------------------------------

def wait_until(condition, timeout: float, what: str, interval: float = 0.01):
    """Poll `condition` until it returns something truthy, and return that; fail the test after
    `timeout` seconds, naming `what` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class FileReads:
    """Reads of the files of one folder by any process, as Linux inotify reports them (a file
    opened and closed again without writing): `wait` returns once a given file has been read,
    so a test can act right after another process has looked. Use as a context manager."""

    _IN_CLOSE_NOWRITE = 0x10
    _EVENT = struct.Struct("iIII")  # struct inotify_event, before its name

    def __init__(self, folder: Path):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            pytest.skip(f"inotify is not available: errno {ctypes.get_errno()}")
        if self._libc.inotify_add_watch(self._fd, os.fsencode(folder),
                                        self._IN_CLOSE_NOWRITE) < 0:
            os.close(self._fd)
            pytest.fail(f"cannot watch {folder}: errno {ctypes.get_errno()}")

    def wait(self, name: str, timeout: float) -> None:
        """Wait until file `name` of the folder has been read since this watch began; fail
        after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"timed out after {timeout} s waiting for {name} to be read")
            if not select.select([self._fd], [], [], left)[0]:
                continue
            data, offset = os.read(self._fd, 65536), 0
            while offset < len(data):
                length = self._EVENT.unpack_from(data, offset)[3]
                start = offset + self._EVENT.size
                if data[start:start + length].rstrip(b"\0").decode() == name:
                    return
                offset = start + length

    def __enter__(self) -> FileReads:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self._fd)


# -- environments and command lines ----------------------------------------------------------

def clean_env(**extra: str) -> dict:
    """This process's environment without the probe's variables (those of the load script and
    the ATB_PROBE_* settings: every ATB_ name), with `extra` set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATB_")}
    env.update(extra)
    return env


def terminal(*argv) -> str:
    """The shell command that becomes `argv` the way a terminal starts it (see
    DEFAULT_SIGNALS)."""
    return f"exec {DEFAULT_SIGNALS} {shlex.join(str(a) for a in argv)}"


def loaded(command: str, output: Path, config_path: Path, load_args: str | None = None) -> str:
    """`command` in a shell that sourced the load script with `--output=output
    --config=config_path` (or `load_args`, as typed)."""
    if load_args is None:
        load_args = f"--output={shlex.quote(str(output))} --config={shlex.quote(str(config_path))}"
    return f'source "{SCRIPTS}/load_atb_probe.sh" {load_args} && {command}'


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A user script's start, run with the probe loaded (`loaded`): one round of a tiny model,
# dumped and on disk. Tests append what they then read of the process.
ONE_ROUND_SCRIPT = """
import json, os, threading, time
import torch
import atb_probe
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with torch.no_grad():
    model(torch.randn(3, 8))
assert atb_probe.active().writer.flush(60)
"""


# -- processes run to their end --------------------------------------------------------------

def run(argv: list, cwd: Path | None = None, env: dict | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `argv` to its end, its output captured as text."""
    return subprocess.run([str(a) for a in argv], cwd=cwd,
                          env=clean_env() if env is None else env, capture_output=True,
                          text=True, timeout=timeout)


def run_shell(command: str, cwd: Path, env: dict | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `command` in `bash -c` to its end."""
    return run(["bash", "-c", command], cwd=cwd, env=env, timeout=timeout)


def cli(*args, cwd: Path | None = None, env: dict | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`atb-probe ARGS` (as `python -m atb_probe.cli`) run to its end."""
    return run([sys.executable, "-m", "atb_probe.cli", *args], cwd=cwd, env=env, timeout=timeout)


def run_loaded(tmp: Path, script: str, cfg: dict | None = None, load_args: str | None = None,
               env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python script` in `bash -c` after sourcing the load script, like a user would (with
    tmp/config.json holding `cfg`, when given)."""
    script_path = tmp / "user_script.py"
    script_path.write_text(textwrap.dedent(script))
    if cfg is not None:
        (tmp / "config.json").write_text(json.dumps(cfg))
    command = loaded(shlex.join([sys.executable, str(script_path)]), tmp, tmp / "config.json",
                     load_args)
    return run_shell(command, tmp, clean_env(**(env or {})), timeout)


def torchrun_loaded(tmp: Path, cfg: dict, script: Path, *args: str, ranks: int = 2) -> str:
    """`torchrun --nproc-per-node <ranks> script args` (CPU) from a shell that sourced the load
    script with `cfg` as config.json; its stdout (the run must succeed)."""
    (tmp / "config.json").write_text(json.dumps(cfg))
    torchrun = Path(sys.executable).with_name("torchrun")
    command = loaded(shlex.join([str(torchrun), "--nproc-per-node", str(ranks), "--master-addr",
                                 "127.0.0.1", "--master-port", str(free_port()), str(script),
                                 *args]), tmp, tmp / "config.json")
    env = clean_env(OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    result = run_shell(command, tmp, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cannot dump" not in result.stderr, result.stderr
    return result.stdout


def finished_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


# -- processes that keep running -------------------------------------------------------------

class Running:
    """A process started from `bash -c command` (or from `argv`, a list), its stderr (and,
    unless `interactive`, its stdout) read line by line as it comes. An `interactive` process
    takes lines on its stdin and answers one line on its stdout per line it was sent (`ask`)."""

    def __init__(self, command: str | list, cwd: Path | None = None, env: dict | None = None,
                 interactive: bool = False):
        argv = ["bash", "-c", command] if isinstance(command, str) else [str(a) for a in command]
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=clean_env() if env is None else env, text=True,
            stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=1)
        self._stderr: list[tuple[float, str]] = []
        self._stdout: list[tuple[float, str]] = []
        streams = [(self.proc.stderr, self._stderr)]
        if not interactive:
            streams.append((self.proc.stdout, self._stdout))
        self._readers = [threading.Thread(target=self._read, args=s, daemon=True)
                         for s in streams]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list) -> None:
        for line in stream:
            into.append((time.monotonic(), line.rstrip("\n")))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stderr(self) -> str:
        """What the process wrote to stderr so far."""
        return "\n".join(line for _, line in list(self._stderr))

    @property
    def stdout(self) -> str:
        """What the process wrote to stdout so far (not `interactive`)."""
        return "\n".join(line for _, line in list(self._stdout))

    def lines(self, text: str) -> list[str]:
        """The stderr lines so far that contain `text`."""
        return [line for _, line in list(self._stderr) if text in line]

    def printed_at(self, prefix: str) -> float | None:
        """When the first stdout line starting with `prefix` came (time.monotonic), or None."""
        return next((t for t, line in list(self._stdout) if line.startswith(prefix)), None)

    def check_running(self, what: str = "the process") -> None:
        """Fail the test, with the process's stderr, if it has exited."""
        if self.proc.poll() is not None:
            pytest.fail(f"{what} exited with {self.proc.returncode}:\n{self.stderr[-6000:]}")

    def ask(self, line: str) -> list[str]:
        """Send one line to an `interactive` process; the words of its answer."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        assert answer, f"no answer to {line!r}:\n{self.stderr[-6000:]}"
        return answer

    def stop(self, sig: int | None = None, timeout: float = 60) -> int:
        """Send `sig` (or close an interactive process's stdin) and wait for the end; its exit
        code, with all of its output read."""
        if self.proc.poll() is None:
            if sig is not None:
                self.proc.send_signal(sig)
            elif self.proc.stdin is not None:
                self.proc.stdin.close()
        return self.wait(timeout)

    def wait(self, timeout: float = 60) -> int:
        """Wait for the end; its exit code, with all of its output read."""
        code = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def kill(self) -> None:
        """End it now if it still runs (a test's clean-up)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


# -- status files ----------------------------------------------------------------------------

def status_docs(root: Path) -> list[dict]:
    """Every status document under the dump root `root` (atb_dump_data)."""
    folder = root / "status"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] \
        if folder.is_dir() else []


def status_of(root: Path, pid: int | None = None) -> dict:
    """The status document of process `pid` under the dump root `root`, or of its only
    process."""
    files = sorted((root / "status").glob("*.json" if pid is None else f"*_{pid}.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


class LiveProcess(Running):
    """A long-lived program under the probe, as the live tests share it: its config file and
    its status. Subclasses set `config_path` and `status_file` (or override `status`)."""

    config_path: Path
    status_file: Path

    def status(self) -> dict:
        return json.loads(self.status_file.read_text())

    def write_config(self, **overrides) -> float:
        """Save config.json the way an editor does (truncate, then write); when it was saved."""
        with open(self.config_path, "w") as f:
            f.write(json.dumps(config(**overrides), indent=4))
        return time.monotonic()

    def wait_applied(self, timeout: float = 5, **overrides) -> dict:
        """Wait until the status shows `config(**overrides)` in effect; the status."""
        want = config(**overrides)
        return wait_until(lambda: (lambda s: s if s["config_in_effect"] == want else None)(
            self.status()), timeout, f"config {overrides} in effect")
