"""Disk trouble (issue #6, SPEC §6) on real file systems this test mounts itself: a disk that
fills up, the free-space rule, and write errors (ENOSPC, EIO, EROFS, EACCES) at any point of a
dump. Each time the model finishes its run, the probe stops (or skips) with one clear message,
and no partial `.bin` is left behind.

Mounting needs root (CI runs as root); where it is not allowed the tests skip with the reason.
EACCES cannot be provoked as root (root ignores permissions), so that test runs the dumping
process as `nobody` through `setpriv`.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import atb_probe
from atb_probe.record.jobs import JsonJob, RowsJob, TensorFileJob
from atb_probe.record.safefs import SafeTree
from atb_probe.record.writer import Writer
from atb_probe.statcsv import HEADER, tensor_path_cell

from conftest import bins, check_dump, generate, probe_lines, tiny_llama
from harness import Running, clean_env, config, status_of, wait_until

FS_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32): every later access fails with EIO


def dump_while(out: Path, fault=None, min_bins: int = 30, new_tokens: int = 3):
    """Generate with a tiny Llama while dumping everything under `out`; call `fault()` once at
    least `min_bins` files are on disk. Returns (whether the output is right, whether `fault`
    ran)."""
    model = tiny_llama()
    expected = generate(model, new_tokens=new_tokens)
    fired = threading.Event()
    stop = threading.Event()

    def watch():
        wait_until(lambda: stop.is_set() or len(bins(out)) >= min_bins, 300,
                   f"{min_bins} tensor files", interval=0.005)
        if not stop.is_set():
            fault()
            fired.set()

    watcher = threading.Thread(target=watch, daemon=True)
    atb_probe.enable(str(out), config(save_child=True))
    if fault is not None:
        watcher.start()
    try:
        got = generate(model, new_tokens=new_tokens)
    finally:
        atb_probe.disable(timeout=60)
        stop.set()
        if fault is not None:
            watcher.join(10)
    return torch.equal(got, expected), fired.is_set()


# -- disk full ------------------------------------------------------------------------------


def test_disk_full_stops_the_dump_with_one_error_and_the_model_finishes(mount_fs, monkeypatch,
                                                                       capfd):
    """ENOSPC for real: the tmpfs runs out of inodes long before the dump is done."""
    monkeypatch.setenv("ATB_PROBE_MIN_FREE_BYTES", "0")
    fs = mount_fs("tmpfs", "size=64m,nr_inodes=300")
    same, _ = dump_while(fs.path)
    assert same
    err = capfd.readouterr().err
    errors = probe_lines(err, "ERROR")
    assert len(errors) == 1 and "disk full" in errors[0] and "dumping stopped" in errors[0], err
    assert "Traceback" not in err
    root = fs.path / "atb_dump_data"
    assert bins(root)  # it did dump until the disk was full
    check_dump(root)


def test_disk_filled_by_another_writer_at_any_point_is_handled(mount_fs, monkeypatch, capfd):
    """Another process fills the disk while the probe writes: the probe either skips files by
    the free-space rule or stops on ENOSPC, with one message either way."""
    monkeypatch.setenv("ATB_PROBE_MIN_FREE_BYTES", "0")
    fs = mount_fs("tmpfs", "size=16m")

    def fill():  # until the disk is full (the probe may have filled it already: no file then)
        block = b"\xff" * 65536
        try:
            with open(fs.path / "ballast", "wb") as f:
                while True:
                    f.write(block)
                    f.flush()
        except OSError:
            pass

    same, fired = dump_while(fs.path, fill)
    assert same and fired
    err = capfd.readouterr().err
    messages = probe_lines(err, "ERROR") + [w for w in probe_lines(err, "WARNING")
                                            if "free" in w]
    assert 1 <= len(messages) <= 2, err  # a skip warning, and perhaps ENOSPC on a later file
    assert len(probe_lines(err, "ERROR")) <= 1
    (fs.path / "ballast").unlink()
    check_dump(fs.path / "atb_dump_data")


def tensor_file_and_row(rel_dir: str, name: str, chunks: list, index: int = 0):
    """The jobs of an op output written to `rel_dir/name`, and the statistic.csv row naming it
    (a side record, statcsv.py), in a round folder `rel_dir`'s grandparent."""
    in_round = f"{rel_dir.split('/', 3)[-1]}/{name}"
    cell = tensor_path_cell(in_round)
    size = sum(len(c) for c in chunks)
    side = ("0_1", "0", "Op", "Op", "0", "output", str(index), "float", "4", None, cell)
    return TensorFileJob(rel_dir, name, chunks, size, None, cell), side


def rows_job(rel_dir: str, sides: list) -> RowsJob:
    return RowsJob(rel_dir, "statistic.csv", sides, HEADER, 192 * len(sides))


def test_write_that_hits_a_full_disk_leaves_no_partial_file(mount_fs, capfd):
    """A file system that says it has room and then has none (quotas, thin provisioning, a
    shared disk): the file write fails half-way, and nothing of it stays."""
    fs = mount_fs("tmpfs", "size=4m")
    tree = SafeTree(str(fs.path / "atb_dump_data"))
    writer = Writer(tree, min_free=-(1 << 50))  # trust the disk blindly, as such systems lie
    payload = bytes(3 * 1024 * 1024)
    for i in range(3):
        job, side = tensor_file_and_row("data/0_1/0/0_Op/after", f"outtensor{i}.bin",
                                        [b"header\n", payload], i)
        writer.put(job)
        writer.put(rows_job("data/0_1/0", [side]))
    assert writer.close(timeout=30)
    errors = probe_lines(capfd.readouterr().err, "ERROR")
    assert len(errors) == 1 and "disk full while writing" in errors[0]
    assert writer.failed and writer.pending() == 0
    names = sorted(os.listdir(fs.path / "atb_dump_data/data/0_1/0/0_Op/after"))
    assert names == ["outtensor0.bin"]  # the second did not fit; no temporary file remains
    assert (fs.path / "atb_dump_data/data/0_1/0/0_Op/after/outtensor0.bin").stat().st_size == \
        len(payload) + 7
    csv_text = (fs.path / "atb_dump_data/data/0_1/0/statistic.csv").read_text()
    assert csv_text.splitlines() == [
        HEADER.rstrip("\n"),
        f"0_1,0,Op,Op,0,output,0,float,nd,4,N/A,N/A,N/A,N/A,{tree.root}/data/0_1/0/0_Op/after/"
        "outtensor0.bin"]


def test_back_pressure_after_a_long_idle_time_is_not_taken_for_a_stuck_disk(tmp_path, capfd):
    tree = SafeTree(str(tmp_path / "atb_dump_data"))
    writer = Writer(tree, queue_bytes=1 << 20, min_free=0, stall_seconds=0.3)
    writer.put(JsonJob("info", "first.json", {}))
    assert writer.flush(10)
    # Idle for longer than the stall timeout: only time passing is under test here, and
    # nothing shows that it has, so this sleep stays.
    time.sleep(0.6)
    for i in range(40):  # 8 MB through a 1 MB queue: producers wait for the disk
        writer.put(TensorFileJob("d", f"{i}.bin", [bytes(200_000)], 200_000))
    assert writer.close(30)
    assert not writer.failed and len(os.listdir(tmp_path / "atb_dump_data" / "d")) == 40
    assert probe_lines(capfd.readouterr().err, "ERROR") == []


def test_csv_rows_do_not_wait_for_a_busy_writer_to_run_dry(mount_fs):
    """statistic.csv must not fall behind the files it lists while files keep coming (after a
    kill, rows that were never written are lost)."""
    fs = mount_fs("tmpfs", "size=256m")
    tree = SafeTree(str(fs.path / "atb_dump_data"))
    writer = Writer(tree, queue_bytes=1 << 30, min_free=0)
    job, side = tensor_file_and_row("r/0", "first.bin", [b"x"])
    writer.put(job)
    writer.put(rows_job("r", [side]))
    payload = bytes(4096)
    for i in range(20000):
        writer.put(TensorFileJob(f"r/{i % 100}", f"{i}.bin", [payload], len(payload)))
    table = fs.path / "atb_dump_data" / "r" / "statistic.csv"

    def csv_or_dry():  # what came first, and the bytes still queued then
        if table.exists():
            return "csv", writer.pending()
        return None if writer.pending() else ("queue ran dry", 0)

    first, queued = wait_until(csv_or_dry, 60, "the csv, or the queue to run dry",
                               interval=0.002)
    assert first == "csv", "the csv was written only after the queue ran dry"
    assert queued > 1_000_000  # most of the queue was still waiting
    assert writer.close(60)


def test_free_space_rule_with_the_default_reserve_skips_every_file_with_one_warning(
        mount_fs, monkeypatch, capfd):
    """SPEC §6: 2 GiB must stay free; an 8 MiB disk never has that."""
    monkeypatch.delenv("ATB_PROBE_MIN_FREE_BYTES", raising=False)
    fs = mount_fs("tmpfs", "size=8m")
    same, _ = dump_while(fs.path)
    assert same
    err = capfd.readouterr().err
    warnings = [w for w in probe_lines(err, "WARNING") if "free" in w]
    assert len(warnings) == 1 and "2.00 GiB" in warnings[0], err
    assert probe_lines(err, "ERROR") == []
    root = fs.path / "atb_dump_data"
    assert bins(root) == []
    rows = check_dump(root)
    assert rows and all(r["Tensor Path"] == "N/A" for r in rows)  # no row names a missing file
    assert "free" in json.dumps(status_of(root))  # the status file tells why


def test_free_space_reserve_can_be_lowered_for_small_disks(mount_fs, monkeypatch, capfd):
    monkeypatch.setenv("ATB_PROBE_MIN_FREE_BYTES", str(1024 * 1024))
    fs = mount_fs("tmpfs", "size=32m")
    same, _ = dump_while(fs.path, new_tokens=1)
    assert same
    err = capfd.readouterr().err
    assert probe_lines(err, "WARNING") == [] and probe_lines(err, "ERROR") == [], err
    rows = check_dump(fs.path / "atb_dump_data")
    assert rows and all(r["Tensor Path"] != "N/A" for r in rows)


# -- write errors at any point --------------------------------------------------------------


def test_io_error_mid_dump_stops_it_with_one_error(mount_fs, monkeypatch, capfd):
    """EIO for real: the ext4 file system is shut down (as a failing disk would be) while the
    writer is busy."""
    monkeypatch.setenv("ATB_PROBE_MIN_FREE_BYTES", "0")
    fs = mount_fs("ext4", size_mb=96)

    def shutdown():
        fd = os.open(fs.path, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, FS_IOC_SHUTDOWN, struct.pack("I", 0))  # flush, then fail everything
        except OSError as exc:
            pytest.skip(f"cannot shut down an ext4 file system here: {exc}")
        finally:
            os.close(fd)

    same, fired = dump_while(fs.path, shutdown)
    assert same and fired
    err = capfd.readouterr().err
    errors = probe_lines(err, "ERROR")
    assert len(errors) == 1 and "I/O error" in errors[0], err
    assert "Traceback" not in err
    fs.remount()  # what was on disk before the failure, as the next reader sees it
    root = fs.path / "atb_dump_data"
    assert bins(root)
    check_dump(root, temp_files_allowed=True)  # a dead disk cannot unlink its temporary files


def test_file_system_turning_read_only_mid_dump_stops_it_with_one_error(mount_fs, monkeypatch,
                                                                       capfd):
    monkeypatch.setenv("ATB_PROBE_MIN_FREE_BYTES", "0")
    fs = mount_fs("tmpfs", "size=64m")
    same, fired = dump_while(fs.path, fs.read_only)
    assert same and fired
    err = capfd.readouterr().err
    errors = probe_lines(err, "ERROR")
    assert len(errors) == 1 and "read-only file system" in errors[0], err
    check_dump(fs.path / "atb_dump_data", temp_files_allowed=True)


EACCES_SCRIPT = """
import os, sys, time
import torch
import atb_probe
out, stop = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
atb_probe.enable(out, {"task": "all", "dump_enable": True, "exec_range": "all", "ids": "",
                       "op_name": "", "save_child": True, "device": "", "filter_level": 0})
x = torch.ones(8, 64)
rounds = 0
with torch.no_grad():
    while not os.path.exists(stop) and rounds < 2000:
        y = model(x)
        rounds += 1
print("OK", rounds, float(y.sum()), flush=True)
"""


def test_permission_denied_mid_dump_stops_it_with_one_error():
    """EACCES for real: the dumping process runs as `nobody`, and its round folders lose their
    write permission while it dumps."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the dump as an unprivileged user")
    base = Path(tempfile.mkdtemp(prefix="atb-eacces-"))  # traversable by nobody
    try:
        base.chmod(0o755)
        out = base / "out"
        out.mkdir()
        os.chown(out, 65534, 65534)
        script = base / "script.py"
        script.write_text(textwrap.dedent(EACCES_SCRIPT))
        stop = base / "stop"
        src = str(Path(atb_probe.__file__).parents[1])
        env = clean_env(PYTHONPATH=src, HOME=str(base), ATB_PROBE_MIN_FREE_BYTES="0")
        proc = Running([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, script, out, stop], env=env)
        try:
            wait_until(lambda: proc.check_running("the dump") or len(bins(out)) >= 30, 60,
                       "30 tensor files")
            data = out / "atb_dump_data" / "data"
            for d, dirs, _ in os.walk(data):
                os.chmod(d, 0o555)
            status = out / "atb_dump_data" / "status"
            wait_until(lambda: proc.check_running("the dump") or "permission denied" in "".join(
                p.read_text() for p in status.iterdir() if not p.name.startswith(".")), 120,
                "the probe's status to report the error")
            stop.touch()
            assert proc.wait(timeout=60) == 0, proc.stderr
        finally:
            proc.kill()
        stdout, stderr = proc.stdout, proc.stderr
        assert stdout.startswith("OK"), stderr
        errors = probe_lines(stderr, "ERROR")
        assert len(errors) == 1 and "permission denied" in errors[0], stderr
        assert "Traceback" not in stderr
        check_dump(out / "atb_dump_data", temp_files_allowed=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
