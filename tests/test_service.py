"""A live inference service under the probe (SPEC §4): examples/service/server.py, started from a
shell that sourced the load script, driven over real HTTP on 127.0.0.1 while the test edits
config.json and reads the status files, as in the user guide's service walk-through.

The server runs a random-weight Llama (hidden 32, 2 layers): layer-level ops 0 `Embedding`,
1 `LlamaRotaryEmbedding`, 2-3 `LlamaDecoderLayer`, 4 `LlamaRMSNorm`, 5 `Linear` (lm_head). A
request with max_tokens N runs N rounds: the prompt (prefill), then one per further token.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from atb_probe.tools.status import unfinished

from conftest import count_rounds_by_config, read_csv
from harness import (FileReads, LiveProcess, Running, cli, config, finished_pid, free_port, loaded,
                     terminal, wait_until)

SERVER = Path(__file__).resolve().parent.parent / "examples" / "service" / "server.py"
WAKE = "Ready to dump ATB data, the running speed of the model will be affected"


class Service(LiveProcess):
    """The example server, started like the guide says: source the load script, then run it."""

    def __init__(self, tmp: Path):
        self.config_path = tmp / "config.json"
        self.root = tmp / "atb_dump_data"
        port = free_port()
        super().__init__(loaded(terminal(sys.executable, SERVER, "--port", port, "--hidden", 32,
                                         "--layers", 2, "--vocab", 64, "--torch-threads", 1),
                                tmp, self.config_path), tmp)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                 trust_env=False)
        wait_until(self._healthy, 90, "the service to answer /health", interval=0.05)
        self.status_file = self.root / "status" / f"0_{self.pid}.json"

    def _healthy(self) -> bool:
        self.check_running("the service")
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def chat(self, max_tokens: int, text: str = "Hello") -> dict:
        reply = self.http.post("/v1/chat/completions", json={
            "model": "tiny-llama", "max_tokens": max_tokens,
            "messages": [{"role": "system",
                          "content": {"type": "text", "text": "You are a helpful assistant"}},
                         {"role": "user", "content": text}]})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == max_tokens
        return body

    def wait_complete(self, rounds_dumped: int, timeout: float = 10) -> dict:
        """Wait until the status says `rounds_dumped` rounds are dumped and nothing more is to
        come (what `atb-probe status` calls COMPLETE)."""
        return wait_until(
            lambda: (lambda s: s if s["rounds_dumped"] == rounds_dumped and
                     not unfinished(s) else None)(self.status()),
            timeout, f"{rounds_dumped} rounds dumped and nothing more to come")

    def stop(self, sig: int | None = None, timeout: float = 60) -> int:
        code = super().stop(sig, timeout)
        self.http.close()
        return code


@pytest.fixture
def service(tmp_path):
    services = []

    def start(**initial_config) -> Service:
        if initial_config:
            (tmp_path / "config.json").write_text(json.dumps(config(**initial_config)))
        services.append(Service(tmp_path))
        return services[-1]

    yield start
    for svc in services:
        svc.kill()


def atb_probe_status(*args) -> subprocess.CompletedProcess:
    return cli("status", *args, timeout=60)


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_the_guide_walkthrough_dumps_exactly_the_rounds_of_one_request(service, tmp_path):
    # 1-3: load, start the service with no config file: it sleeps and serves at full speed.
    svc = service()
    svc.chat(max_tokens=2)
    status = svc.status()
    assert (status["state"], status["rounds_started"], status["config_in_effect"]) == \
        ("sleeping", 0, None)
    assert not (svc.root / "data").exists()

    # 4: wake with exec_range "none": message and data folder, without waiting for a request.
    saved = svc.write_config(exec_range="none")
    wait_until(lambda: svc.lines(WAKE) and (svc.root / "data").is_dir(), 5, "the wake-up")
    wake_latency = time.monotonic() - saved
    svc.chat(max_tokens=2)  # rounds 0 and 1: counted, not dumped
    wait_until(lambda: svc.status()["rounds_started"] == 2, 2, "2 rounds counted")
    assert list((svc.root / "data").iterdir()) == []

    # 5: select op 2 (the first decoder layer) in every round, then send one request.
    saved = svc.write_config(exec_range="all", ids="2")
    svc.wait_applied(exec_range="all", ids="2")
    reload_latency = time.monotonic() - saved
    body = svc.chat(max_tokens=3)
    answered = time.monotonic()
    svc.wait_complete(rounds_dumped=3)
    complete_latency = time.monotonic() - answered
    print(f"wake {wake_latency:.3f} s, reload {reload_latency:.3f} s, "
          f"status complete {complete_latency:.3f} s after the answer")
    assert wake_latency < 1.0 and reload_latency < 1.0
    shown = atb_probe_status(str(tmp_path))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "COMPLETE" in shown.stdout and "ids=2" in shown.stdout

    # The request's rounds, 2 (prefill: the whole prompt) then 3 and 4 (one new token each),
    # each complete: its csv rows name files that are on disk.
    proc_dir = svc.root / "data" / f"0_{svc.pid}"
    assert sorted(p.name for p in proc_dir.iterdir()) == ["2", "3", "4"]
    prompt = body["usage"]["prompt_tokens"]
    for index, seq in ((2, prompt), (3, 1), (4, 1)):
        rows = read_csv(proc_dir / str(index) / "statistic.csv")
        assert {(r["Execution Count"], r["Op Id"], r["Op Name"]) for r in rows} == \
            {(str(index), "2", "LlamaDecoderLayer")}
        assert [r["Shape"] for r in rows if r["Input/Output"] == "output"][0] == f"1x{seq}x32"
        assert all(os.path.getsize(r["Tensor Path"]) > 0 for r in rows)
        assert sorted(p.name for p in (proc_dir / str(index)).iterdir()) == \
            ["2_LlamaDecoderLayer", "statistic.csv", "tokens.json"]

    # Back to sleep: requests are served, nothing more is counted or written.
    svc.write_config(dump_enable=False, exec_range="all", ids="2")
    svc.wait_applied(dump_enable=False, exec_range="all", ids="2")
    before, counted = tree(svc.root / "data"), svc.status()["rounds_started"]
    svc.chat(max_tokens=2)
    # A new configuration in effect means the status was rewritten after the request.
    svc.write_config(dump_enable=False, exec_range="all", ids="3")
    assert svc.wait_applied(dump_enable=False, exec_range="all", ids="3")["rounds_started"] == \
        counted
    assert tree(svc.root / "data") == before

    # 6: stop the service (Ctrl-C): the probe flushes and says the process exited.
    assert svc.stop(signal.SIGINT) == 0, svc.stderr
    final = svc.status()
    assert final["exited"] is True and final["bytes_queued"] == 0
    assert final["rounds_dumped"] == 3
    shown = atb_probe_status(str(tmp_path))
    assert shown.returncode == 0 and "exited" in shown.stdout
    assert len(svc.lines(WAKE)) == 1
    assert not svc.lines("WARNING") and not svc.lines("ERROR"), svc.stderr


def test_concurrent_requests_during_reloads_dump_each_round_under_one_config(service):
    # Op 0 runs first in a round and op 5 last; tensor files vs statistics: a round that
    # switched config half-way would show.
    configs = [dict(ids="0", task="tensor"), dict(ids="5", task="statistics")]
    svc = service(**configs[0])
    stop = threading.Event()
    errors = []

    def client():
        try:
            with httpx.Client(base_url=svc.http.base_url, timeout=60, trust_env=False) as http:
                while not stop.is_set():
                    reply = http.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
                    assert reply.status_code == 200, reply.text
        except Exception as exc:  # reported by the test thread
            errors.append(exc)

    clients = [threading.Thread(target=client) for _ in range(3)]
    for c in clients:
        c.start()
    try:
        for flip in range(4):
            dumped = svc.status()["rounds_dumped"]
            wait_until(lambda: svc.status()["rounds_dumped"] >= dumped + 6, 20,
                       "rounds dumped under this config")
            svc.write_config(**configs[(flip + 1) % 2])
            svc.wait_applied(**configs[(flip + 1) % 2])
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=60)
    assert not errors, errors
    assert svc.stop(signal.SIGINT) == 0
    # Every round started is selected (exec_range all), and the service has written them all
    # by the time it exits: its last status says so. (A status read while it runs may be a
    # moment old: on a busy machine it lagged the clients' last rounds.)
    status = svc.status()
    assert status["exited"] is True and not status["last_error"], status
    assert status["rounds_dumped"] == status["rounds_started"] and status["bytes_queued"] == 0

    proc_dir = svc.root / "data" / f"0_{svc.pid}"
    rounds = {int(p.name): p for p in proc_dir.iterdir()}
    assert sorted(rounds) == list(range(status["rounds_dumped"]))
    seen = count_rounds_by_config(rounds, "0", "5")
    assert seen["0"] >= 12 and seen["5"] >= 12, seen


def test_a_service_stopped_with_sigterm_mid_request_flushes_and_reports_exited(service):
    svc = service(task="all", exec_range="all")
    result = {}
    request = threading.Thread(target=lambda: result.update(svc.chat(max_tokens=12)))
    request.start()
    wait_until(lambda: svc.status()["rounds_started"] >= 1, 20, "the request's first round")
    code = svc.stop(signal.SIGTERM)
    request.join(timeout=60)
    # uvicorn finishes the request, shuts down, puts the probe's handler back and re-raises
    # SIGTERM: the probe flushes, then the process dies of SIGTERM as it would have.
    assert result["usage"]["completion_tokens"] == 12
    assert code == -signal.SIGTERM, svc.stderr
    final = svc.status()
    assert final["exited"] is True and final["bytes_queued"] == 0 and not final["last_error"]
    assert final["rounds_dumped"] == 12
    proc_dir = svc.root / "data" / f"0_{svc.pid}"
    for index in range(12):
        rows = read_csv(proc_dir / str(index) / "statistic.csv")
        assert {r["Op Id"] for r in rows} == {"0", "1", "2", "3", "4", "5"}
        assert all(os.path.getsize(r["Tensor Path"]) > 0 for r in rows)


def _status_doc(tmp: Path, name: str, **fields) -> None:
    """Write status/<name>.json as a probe does: in one piece (a reader sees all or nothing)."""
    folder = tmp / "atb_dump_data" / "status"
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"state": "dumping", "exited": False, "rounds_started": 1, "rounds_dumped": 1,
           "files_written": 3, "bytes_written": 300, "bytes_queued": 0, "last_error": None,
           "config_in_effect": config(ids="2"), "updated_at": "2026-01-01T00:00:00.000+00:00"}
    doc.update(fields)
    (folder / ".next").write_text(json.dumps(doc))
    os.replace(folder / ".next", folder / f"{name}.json")


def _proc_start(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def test_atb_probe_status_exits_1_while_a_live_process_has_data_queued(tmp_path):
    me = os.getpid()
    _status_doc(tmp_path, f"0_{me}", pid=me, proc_start=_proc_start(me), bytes_queued=4096)
    shown = atb_probe_status(str(tmp_path))
    assert shown.returncode == 1 and "NOT COMPLETE" in shown.stdout
    # --wait returns as soon as the data is on disk: the file changes once the command has
    # read it and found data still queued.
    started = time.monotonic()
    with FileReads(tmp_path / "atb_dump_data" / "status") as reads:
        waiting = Running([sys.executable, "-m", "atb_probe.cli", "status", "--wait", "30",
                           tmp_path / "atb_dump_data"])
        try:
            reads.wait(f"0_{me}.json", 60)
            waiting.check_running("status --wait")
            _status_doc(tmp_path, f"0_{me}", pid=me, proc_start=_proc_start(me), bytes_queued=0)
            assert waiting.wait(60) == 0, waiting.stderr
        finally:
            waiting.kill()
    assert "COMPLETE" in waiting.stdout and "NOT COMPLETE" not in waiting.stdout
    assert time.monotonic() - started < 20


def test_atb_probe_status_does_not_wait_for_dead_or_reused_pids(tmp_path):
    dead = finished_pid()
    me = os.getpid()
    _status_doc(tmp_path, f"0_{dead}", pid=dead, bytes_queued=4096)
    _status_doc(tmp_path, f"1_{me}", pid=me, proc_start=_proc_start(me) + 1, bytes_queued=4096)
    shown = atb_probe_status(str(tmp_path))
    assert shown.returncode == 0, shown.stdout
    assert "2 process(es) were killed with data still to come" in shown.stdout
    assert "last round may be partial" in shown.stdout
    assert shown.stdout.count(" gone ") == 2


def test_atb_probe_status_is_complete_only_when_every_round_and_model_file_is_on_disk(tmp_path):
    me = os.getpid()
    for still_to_come in (dict(model_files_pending=1), dict(round_open=True)):
        _status_doc(tmp_path, f"0_{me}", pid=me, proc_start=_proc_start(me), bytes_queued=0,
                    **still_to_come)
        shown = atb_probe_status(str(tmp_path))
        assert shown.returncode == 1 and "NOT COMPLETE" in shown.stdout, still_to_come
    _status_doc(tmp_path, f"0_{me}", pid=me, proc_start=_proc_start(me), bytes_queued=0)
    assert atb_probe_status(str(tmp_path)).returncode == 0


def test_a_process_killed_between_rounds_is_complete_and_said_so(tmp_path):
    dead = finished_pid()
    _status_doc(tmp_path, f"0_{dead}", pid=dead, bytes_queued=0, model_files_pending=0,
                round_open=False)
    shown = atb_probe_status(str(tmp_path))
    assert shown.returncode == 0, shown.stdout
    assert "1 process(es) were killed between rounds, after their data was on disk" in \
        shown.stdout and "partial" not in shown.stdout


def test_atb_probe_status_exit_codes_tell_complete_writing_nothing_and_error(tmp_path):
    shown = atb_probe_status(str(tmp_path / "no-such-dir"))
    assert shown.returncode == 2 and shown.stdout.startswith("nothing found"), shown.stdout
    (tmp_path / "a-file").write_text("x")
    shown = atb_probe_status(str(tmp_path / "a-file"))
    assert shown.returncode == 3 and "is not a folder" in shown.stderr, shown.stderr
    me = os.getpid()
    _status_doc(tmp_path, f"0_{me}", pid=me, proc_start=_proc_start(me), bytes_queued=10)
    assert atb_probe_status(str(tmp_path)).returncode == 1
    _status_doc(tmp_path, f"0_{me}", pid=me, proc_start=_proc_start(me), bytes_queued=0)
    assert atb_probe_status(str(tmp_path)).returncode == 0
    helped = atb_probe_status("--help")
    assert "2  nothing found" in helped.stdout and "3  error" in helped.stdout
