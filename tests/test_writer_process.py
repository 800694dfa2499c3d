"""The writer process (record/sidecar.py): statistics-mode files written by another process.

Each test uses the real thing: a `Writer(process=True)` starts `python -I` with the sidecar's
`serve`, jobs cross a real pipe, and the tests kill, stop, interrupt and fork real processes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import atb_probe
from atb_probe.record import sidecar
from atb_probe.record.jobs import JsonJob, RowsJob, TensorFileJob
from atb_probe.record.safefs import SafeTree
from atb_probe.record.writer import Writer
from atb_probe.statcsv import HEADER, tensor_path_cell

from conftest import check_dump, generate, probe_lines, tiny_llama
from harness import config, wait_until

pytestmark = pytest.mark.skipif(not sidecar.available(), reason="needs Linux memfd_create")


def side_row(op: str, index: int, path=None) -> tuple:
    return ("0_1", str(index), op, op, "0", "output", "0", "float", "4", None, path)


def jobs(rounds: int = 6) -> list:
    """What a statistics dump hands the writer: documents and rows, several rounds."""
    out = []
    for r in range(rounds):
        folder = f"data/0_1/{r}"
        out.append(JsonJob(folder, "tokens.json", {"round": r, "tokens": list(range(r + 3))}))
        for layer in range(4):
            out.append(RowsJob(folder, "statistic.csv",
                               [side_row(f"Layer{layer}", layer * 2 + k) for k in range(2)],
                               HEADER, 2 * 192))
            out.append(JsonJob(f"{folder}/Layer{layer}", "op_param.json", {"layer": layer}))
    return out


def tree_of(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def new_writer(tmp_path, name: str = "out", **kw) -> Writer:
    return Writer(SafeTree(str(tmp_path / name / "atb_dump_data")), min_free=0, process=True,
                  **kw)


def helper_of(writer: Writer) -> subprocess.Popen:
    assert writer._sidecar is not None, "the jobs did not go to a writer process"
    return writer._sidecar._proc


def test_statistics_files_from_the_writer_process_are_those_the_thread_writes(tmp_path):
    by_process = new_writer(tmp_path, "process")
    by_thread = Writer(SafeTree(str(tmp_path / "thread" / "atb_dump_data")), min_free=0)
    for job in jobs():
        by_process.put(job)
        by_thread.put(job)
    helper = helper_of(by_process)
    assert helper.pid != os.getpid() and helper.poll() is None
    assert by_process.flush(60) and by_thread.flush(60)
    stats = by_process.stats
    assert (stats.files_written, stats.bytes_queued, stats.last_error) == \
        (by_thread.stats.files_written, 0, None)
    assert stats.bytes_written == by_thread.stats.bytes_written
    assert by_process.close(60) and by_thread.close(60)
    assert helper.wait(30) == 0  # the process ends once the writer closes
    by_process.put(jobs(1)[0])  # a job after the close is dropped, as the thread drops it
    assert by_process._sidecar is None and by_process.pending() == 0
    written = tree_of(tmp_path / "process")
    assert written == tree_of(tmp_path / "thread") and len(written) == 6 * 6


def test_a_document_pickle_refuses_is_written_as_the_thread_writes_it(tmp_path):
    """A module's configuration may hold anything (a lambda): JSON writes it as its `str`,
    and so does the writer process."""
    def doc():
        return {"param": {"act": activation, "eps": 1e-5, 3: (1, 2)}, "nan": float("nan")}

    activation = lambda x: x  # noqa: E731 - what pickle refuses
    by_process = new_writer(tmp_path, "process")
    by_thread = Writer(SafeTree(str(tmp_path / "thread" / "atb_dump_data")), min_free=0)
    for writer in (by_process, by_thread):
        writer.put(JsonJob("data", "op_param.json", doc()))
    assert helper_of(by_process) and by_process.close(30) and by_thread.close(30)
    assert not by_process.failed
    written = tree_of(tmp_path / "process")
    assert written == tree_of(tmp_path / "thread") and len(written) == 1
    assert b"<function" in next(iter(written.values()))


def test_the_thread_writer_is_kept_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("ATB_PROBE_WRITER", "thread")
    writer = new_writer(tmp_path)
    writer.put(jobs(1)[0])
    assert writer._sidecar is None
    assert writer.close(30)


def nice_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])


@pytest.mark.parametrize("setting, expected", [(None, 19), ("7", 7), ("0", None)])
def test_the_writer_process_runs_at_the_writer_nice_value(tmp_path, monkeypatch, setting,
                                                          expected):
    if setting is not None:
        monkeypatch.setenv("ATB_PROBE_WRITER_NICE", setting)
    writer = new_writer(tmp_path)
    writer.put(jobs(1)[0])
    assert writer.flush(60)  # it runs, and has set its priority
    assert nice_of(helper_of(writer).pid) == (nice_of(os.getpid()) if expected is None
                                              else max(expected, nice_of(os.getpid())))
    assert writer.close(30)


def test_an_application_embedding_python_keeps_the_thread_writer(tmp_path, monkeypatch):
    """`sys.executable` is another program there (a server embedding Python): starting it
    with `-I -c` would run that program, so the thread writes."""
    monkeypatch.setattr(sys, "executable", "/usr/sbin/uwsgi")
    writer = new_writer(tmp_path)
    for job in jobs(1):
        writer.put(job)
    assert writer._sidecar is None and writer.close(30)
    assert len(tree_of(tmp_path / "out")) == 6


def test_a_tensor_file_waits_for_the_process_and_keeps_everything_after_it_on_the_thread(
        tmp_path):
    writer = new_writer(tmp_path)
    folder = "data/0_1/0"
    writer.put(RowsJob(folder, "statistic.csv", [side_row("Early", 0)], HEADER, 192))
    helper = helper_of(writer)
    cell = tensor_path_cell("Late/output_0.bin")
    writer.put(TensorFileJob(f"{folder}/Late", "output_0.bin", [b"\x00" * 64], 64 + 256,
                             row_path=cell))
    assert writer._sidecar is None and helper.wait(30) == 0  # it was done before the file
    writer.put(RowsJob(folder, "statistic.csv", [side_row("Late", 1, cell)], HEADER, 192))
    writer.put(JsonJob(folder, "tokens.json", {"after": True}))  # stays on the thread too
    assert writer._sidecar is None
    assert writer.close(60)
    root = tmp_path / "out" / "atb_dump_data"
    lines = (root / folder / "statistic.csv").read_text().splitlines()
    assert [line.split(",")[2] for line in lines[1:]] == ["Early", "Late"]
    assert "output_0.bin" in lines[2]
    assert writer.stats.files_written == 2  # the .bin and tokens.json (csv appends: bytes)


def test_a_killed_writer_process_is_said_once_and_this_process_writes_the_rest(tmp_path,
                                                                                capfd):
    writer = new_writer(tmp_path)
    before = jobs(2)
    for job in before:
        writer.put(job)
    assert writer.flush(60)
    helper = helper_of(writer)
    helper.kill()
    helper.wait(30)
    after = jobs(4)[len(before):]
    for job in after:
        writer.put(job)
    assert writer._sidecar is None
    assert writer.flush(60) and not writer.failed
    errors = probe_lines(capfd.readouterr().err, "ERROR")
    assert len(errors) == 1 and "killed by signal 9" in errors[0] and \
        "writes the rest itself" in errors[0], errors
    assert writer.stats.files_written == 4 * 5  # JSON files; the process's counts are kept
    assert "killed by signal 9" in writer.stats.last_error
    assert writer.close(30)
    check_dump(tmp_path / "out" / "atb_dump_data")


def thread_wrote_everything(tmp_path, capfd) -> str:
    """Two rounds' jobs put to a writer whose process never says it runs: the thread writes
    them all, nothing lost, and warns once; returns that warning."""
    writer = new_writer(tmp_path)
    for job in jobs(2):
        writer.put(job)
    assert writer.close(60)
    assert writer._sidecar is None and not writer.failed
    assert len(tree_of(tmp_path / "out")) == 2 * 6  # nothing lost
    warnings = probe_lines(capfd.readouterr().err, "WARNING")
    assert len(warnings) == 1, warnings
    return warnings[0]


def test_a_writer_process_that_cannot_start_leaves_the_writing_to_this_process(
        tmp_path, monkeypatch, capfd):
    """It ends before it says it runs: the jobs sent to it meanwhile are written by the
    thread, with one warning, and nothing is lost."""
    monkeypatch.setattr(sidecar, "_BOOT", "import sys; sys.exit(3)")
    assert "could not import the probe" in thread_wrote_everything(tmp_path, capfd)


def test_a_writer_process_that_cannot_be_started_leaves_the_writing_to_this_process(
        tmp_path, monkeypatch, capfd):
    """`Popen` fails (the interpreter is gone): the jobs that waited in the pipe meanwhile are
    written by the thread, with one warning that says why, and nothing is lost."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "gone" / "python3"))
    warning = thread_wrote_everything(tmp_path, capfd)
    assert "could not be started" in warning and "No such file" in warning, warning


# Jobs of both kinds of route: rows, documents and a tensor file (run by `exec`, here and in
# a process of its own).
ROUTE_JOBS = textwrap.dedent("""
    from atb_probe.record.jobs import JsonJob, RowsJob, TensorFileJob
    from atb_probe.statcsv import HEADER
    def row(op, i):
        return ("0_1", str(i), op, op, "0", "output", "0", "float", "4", None, None)
    route_jobs = [JsonJob("data/0_1/0", "tokens.json", {"late": True})]
    for layer in range(3):
        route_jobs.append(RowsJob("data/0_1/0", "statistic.csv",
                                  [row(f"Layer{layer}", layer)], HEADER, 192))
        route_jobs.append(JsonJob(f"data/0_1/0/Layer{layer}", "op_param.json", {"l": layer}))
    route_jobs.append(TensorFileJob("data/0_1/0/Layer0/output", "outtensor0.bin",
                                    [b"header", b"data"], 10))
""")


@pytest.mark.parametrize("process", [True, False], ids=["process", "thread"])
def test_jobs_are_written_where_no_new_thread_can_start(tmp_path, process):
    """Where no thread can start (no memory for its stack here; at interpreter exit on
    Python 3.12, for one), nothing is lost and nothing is said: the writer process is started
    by the caller instead of a thread of its own, and the writer thread's jobs are written by
    the thread that queues them. The files are those a writer with its threads writes."""
    script = tmp_path / "no_threads.py"
    script.write_text(textwrap.dedent("""
        import resource, sys, threading
        from atb_probe.record.safefs import SafeTree
        from atb_probe.record.writer import Writer
        vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20),) * 2)
        threading.stack_size(1 << 30)  # no thread gets a stack from now on
        try:
            threading.Thread(target=lambda: None).start()
            sys.exit("a thread started")
        except RuntimeError:
            pass
        exec(sys.argv[3])
        writer = Writer(SafeTree(sys.argv[1]), min_free=0, process=sys.argv[2] == "True")
        for job in route_jobs:
            writer.put(job)
        assert writer.close(60) and writer.stats.files_written == 5, writer.stats
    """))
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), str(process),
                             ROUTE_JOBS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr and "ERROR" not in result.stderr, result.stderr
    space = {}
    exec(ROUTE_JOBS, space)
    threaded = Writer(SafeTree(str(tmp_path / "threaded")), min_free=0)
    for job in space["route_jobs"]:
        threaded.put(job)
    assert threaded.close(60)
    written = tree_of(tmp_path / "out")
    assert len(written) == 6 and written == tree_of(tmp_path / "threaded")


def test_what_a_killed_model_process_handed_over_is_still_written(tmp_path):
    """The model's process dies at once (SIGKILL) after queueing: the writer process reads to
    the end of its pipe and writes it all."""
    root = tmp_path / "atb_dump_data"
    script = textwrap.dedent(f"""
        import os, signal
        from atb_probe.record.jobs import JsonJob
        from atb_probe.record.safefs import SafeTree
        from atb_probe.record.writer import Writer
        w = Writer(SafeTree({str(root)!r}), min_free=0, process=True)
        for i in range(300):
            w.put(JsonJob("data/0_1/%d" % (i % 30), "doc%d.json" % i, {{"i": i}}))
        print(w._sidecar._proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    helper = int(done.stdout.split()[0])
    wait_until(lambda: not os.path.exists(f"/proc/{helper}") or
               open(f"/proc/{helper}/stat").read().split()[2] == "Z", 60,
               "the writer process to end")
    files = sorted(root.rglob("doc*.json"))
    assert len(files) == 300
    assert {json.loads(p.read_text())["i"] for p in files} == set(range(300))
    assert not list(root.rglob(".*.tmp"))


def test_a_stopped_writer_process_holds_the_producer_back_then_stops_the_dump(tmp_path,
                                                                                capfd):
    """Back-pressure across the pipe: what is sent and not written stays within the queue's
    bytes; a process that takes nothing for the stall timeout stops the dump, and the
    producer goes on."""
    writer = new_writer(tmp_path, queue_bytes=8 * 4096, stall_seconds=1.0)
    writer.put(JsonJob("data", "first.json", {}))
    assert writer.flush(60)
    helper = helper_of(writer)
    os.kill(helper.pid, signal.SIGSTOP)
    try:
        most = 0
        for i in range(40):  # 40 documents of 4096 accounted bytes each: 5 queues' worth
            writer.put(JsonJob("data", f"doc{i}.json", {"i": i}))
            most = max(most, writer.pending())
        assert writer.failed
        assert most <= 8 * 4096
        assert "took nothing for" in writer.stats.last_error
        errors = probe_lines(capfd.readouterr().err, "ERROR")
        assert len(errors) == 1 and "dumping stopped so the model can go on" in errors[0]
    finally:
        os.kill(helper.pid, signal.SIGCONT)
    writer.close(30)
    assert helper.wait(30) is not None


def test_back_pressure_after_a_long_idle_time_is_not_taken_for_a_stuck_writer_process(
        tmp_path, capfd):
    writer = new_writer(tmp_path, queue_bytes=4 * 4096, stall_seconds=0.3)
    writer.put(JsonJob("data", "first.json", {}))
    assert writer.flush(30)
    # Idle for longer than the stall timeout: only time passing is under test here, and
    # nothing shows that it has, so this sleep stays.
    time.sleep(0.6)
    for i in range(40):  # 40 documents through a queue of 4: the producer waits
        writer.put(JsonJob("data", f"doc{i}.json", {"i": i}))
    assert writer.close(30)
    assert not writer.failed and len(os.listdir(tmp_path / "out" / "atb_dump_data" / "data")) == 41
    assert probe_lines(capfd.readouterr().err, "ERROR") == []


def test_a_refused_path_in_the_writer_process_is_skipped_with_one_warning(tmp_path, capfd):
    root = tmp_path / "out" / "atb_dump_data"
    (root / "data").mkdir(parents=True)
    os.symlink(tmp_path, root / "data" / "planted")
    writer = new_writer(tmp_path)
    writer.put(JsonJob("data/planted", "a.json", {}))
    writer.put(JsonJob("data/planted", "b.json", {}))
    writer.put(JsonJob("data/fine", "c.json", {}))
    assert writer.flush(60)
    stats = writer.stats
    assert (stats.files_written, stats.files_skipped) == (1, 2)
    assert "symbolic link" in stats.last_error
    warnings = probe_lines(capfd.readouterr().err, "WARNING")
    assert len(warnings) == 1 and "symbolic link" in warnings[0]
    assert not writer.failed and writer.close(30)
    assert not (tmp_path / "a.json").exists()


def test_an_interrupt_sent_to_the_writer_process_does_not_stop_it(tmp_path):
    """Ctrl-C reaches the whole process group: the model's process decides what happens,
    and its writer process keeps writing until it is closed."""
    writer = new_writer(tmp_path)
    writer.put(JsonJob("data", "before.json", {}))
    assert writer.flush(60)  # it runs, and has set what it does with signals
    helper = helper_of(writer)
    assert os.getpgid(helper.pid) == helper.pid  # not in the terminal's foreground group
    os.kill(helper.pid, signal.SIGINT)
    os.kill(helper.pid, signal.SIGTERM)
    writer.put(JsonJob("data", "after.json", {}))
    assert writer.flush(60) and helper.poll() is None
    assert writer.close(30)
    assert {p.name for p in (tmp_path / "out" / "atb_dump_data" / "data").iterdir()} == \
        {"before.json", "after.json"}


def test_a_forked_child_writes_through_a_writer_process_of_its_own(tmp_path):
    writer = new_writer(tmp_path)
    writer.put(JsonJob("data", "parent-before.json", {}))
    assert writer.flush(60)
    parent_helper = helper_of(writer).pid
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its own process wrote its file
        code = 1
        try:
            writer.reset_after_fork()
            writer.put(JsonJob("data", "child.json", {"pid": os.getpid()}))
            own = writer._sidecar._proc.pid
            code = 0 if writer.close(60) and own != parent_helper else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    writer.put(JsonJob("data", "parent-after.json", {}))
    assert helper_of(writer).pid == parent_helper
    assert writer.close(60)
    assert {p.name for p in (tmp_path / "out" / "atb_dump_data" / "data").iterdir()} == \
        {"parent-before.json", "child.json", "parent-after.json"}


def test_a_full_disk_under_a_statistics_dump_stops_it_with_one_error(mount_fs, monkeypatch,
                                                                     capfd):
    """ENOSPC for real in the writer process (the tmpfs runs out of inodes): one message,
    the model's output unchanged, only whole files and lines on disk."""
    monkeypatch.setenv("ATB_PROBE_WRITER", "process")
    fs = mount_fs("tmpfs", "size=16m,nr_inodes=25")  # 6 new tokens need 35
    model = tiny_llama()
    expected = generate(model, new_tokens=10)
    atb_probe.enable(str(fs.path), config(task="statistics", save_child=True))
    try:
        got = generate(model, new_tokens=10)
        probe = atb_probe._probe
        assert probe.writer._sidecar is not None, "statistics went to the thread"
        wait_until(lambda: probe.writer.failed, 60, "the writer process to fail")
    finally:
        atb_probe.disable(timeout=60)
    assert torch.equal(got, expected)
    err = capfd.readouterr().err
    errors = probe_lines(err, "ERROR")
    assert len(errors) == 1 and "disk full" in errors[0] and "dumping stopped" in errors[0], err
    assert "Traceback" not in err
    check_dump(fs.path / "atb_dump_data")


def test_a_probe_dumping_statistics_uses_the_writer_process_and_tensors_do_not(
        tmp_path, monkeypatch):
    monkeypatch.setenv("ATB_PROBE_WRITER", "process")
    model = tiny_llama()
    for task, process in (("statistics", True), ("tensor", False)):
        with atb_probe.enabled(str(tmp_path / task), config(task=task)):
            generate(model)
            writer = atb_probe._probe.writer
            assert (writer._sidecar is not None) == process
            assert writer._threaded is not process
        check_dump(tmp_path / task / "atb_dump_data")


def test_several_producers_share_the_writer_process(tmp_path):
    writer = new_writer(tmp_path)

    def produce(k: int) -> None:
        for i in range(100):
            writer.put(RowsJob("data/0_1/0", "statistic.csv", [side_row(f"T{k}", i)],
                               HEADER, 192))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writer.close(60)
    lines = (tmp_path / "out" / "atb_dump_data" / "data" / "0_1" / "0" /
             "statistic.csv").read_text().splitlines()
    assert len(lines) == 1 + 400
    for k in range(4):  # each producer's rows in its own order
        mine = [int(line.split(",")[1]) for line in lines[1:] if line.split(",")[2] == f"T{k}"]
        assert mine == list(range(100))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_by_default_the_probe_uses_a_writer_process_only_where_the_model_leaves_a_core(
        tmp_path, monkeypatch):
    """`auto`: a process at the lowest priority only writes while a core is idle; where the
    model's threads take them all it would write after the generation, slower than the
    thread."""
    monkeypatch.delenv("ATB_PROBE_WRITER", raising=False)
    model = tiny_llama()
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        for n, process in ((cores, False), (cores - 1, True)):
            torch.set_num_threads(n)
            with atb_probe.enabled(str(tmp_path / str(n)), config(task="statistics")):
                generate(model)
                writer = atb_probe._probe.writer
                assert (writer._sidecar is not None) == process, n
            check_dump(tmp_path / str(n) / "atb_dump_data")
    finally:
        torch.set_num_threads(threads)
