"""The writer wakes for small files a few times a second, not once per file (record/writer.py):
JSON documents and csv rows wait in the queue up to `ROWS_DELAY` and go to disk together; a
tensor file goes at once, with everything queued before it; `flush` writes everything now.

What can be told from outside without a clock race is when a file was *not yet* written: a
small file's modification time is never before `ROWS_DELAY` after it was queued (unless a
tensor file or a flush came), whatever the load; how soon after that it comes depends on the
machine, so the tests wait for it.
"""
from __future__ import annotations

import json
import os
import time

from atb_probe.record.jobs import JsonJob, RowsJob, TensorFileJob
from atb_probe.record.safefs import SafeTree
from atb_probe.record.writer import ROWS_DELAY, Writer
from atb_probe.statcsv import HEADER, tensor_path_cell

from harness import wait_until

# The modification time comes from the kernel's coarse clock (a tick behind at most).
CLOCK_SLACK = 0.05


def new_writer(tmp_path) -> tuple[Writer, str]:
    tree = SafeTree(str(tmp_path / "atb_dump_data"))
    return Writer(tree, min_free=0), tree.root


def written_at(path: str) -> float:
    return os.stat(path).st_mtime


def test_small_files_wait_for_the_queue_delay_and_go_to_disk_together(tmp_path):
    writer, root = new_writer(tmp_path)
    queued_at = time.time()
    for i in range(3):
        writer.put(JsonJob("data/0_1/0", f"doc{i}.json", {"i": i}))
    paths = [os.path.join(root, "data", "0_1", "0", f"doc{i}.json") for i in range(3)]
    wait_until(lambda: all(os.path.exists(p) for p in paths), 30, "the documents on disk")
    for i, path in enumerate(paths):
        assert written_at(path) >= queued_at + ROWS_DELAY - CLOCK_SLACK
        assert json.loads(open(path).read()) == {"i": i}
    assert writer.close(30)


def test_flush_writes_waiting_small_files_at_once(tmp_path):
    writer, root = new_writer(tmp_path)
    writer.put(JsonJob("info", "model.json", {"name": "M"}))
    writer.put(RowsJob("data/0_1/0", "statistic.csv", [("0_1", "0", "Op", "Op", "0", "output",
                                                        "0", "float", "4", None, None)],
                       HEADER, 192))
    assert writer.flush(30)
    assert json.loads(open(os.path.join(root, "info", "model.json")).read()) == {"name": "M"}
    table = open(os.path.join(root, "data", "0_1", "0", "statistic.csv")).read()
    assert table.splitlines() == [HEADER.rstrip("\n"),
                                  "0_1,0,Op,Op,0,output,0,float,nd,4,N/A,N/A,N/A,N/A,N/A"]
    assert writer.close(30)


def test_a_tensor_file_takes_what_waits_before_it_along_and_rows_still_follow_their_files(
        tmp_path):
    """Order is kept: a document queued before a tensor file is on disk once the tensor file
    is, and the row naming the tensor file comes after it."""
    writer, root = new_writer(tmp_path)
    writer.put(JsonJob("data/0_1/0", "tokens.json", {"tokens": 1}))
    cell = tensor_path_cell("0_Op/after/outtensor0.bin")
    writer.put(TensorFileJob("data/0_1/0/0_Op/after", "outtensor0.bin", [bytes(64)], 64,
                             row_path=cell))
    writer.put(RowsJob("data/0_1/0", "statistic.csv", [("0_1", "0", "Op", "Op", "0", "output",
                                                        "0", "float", "16", None, cell)],
                       HEADER, 192))
    tensor = os.path.join(root, "data", "0_1", "0", "0_Op", "after", "outtensor0.bin")
    document = os.path.join(root, "data", "0_1", "0", "tokens.json")
    table = os.path.join(root, "data", "0_1", "0", "statistic.csv")
    wait_until(lambda: os.path.exists(tensor), 30, "the tensor file")
    assert os.path.exists(document)  # written before it, in order
    wait_until(lambda: os.path.exists(table), 30, "statistic.csv")
    assert written_at(table) >= written_at(tensor) - CLOCK_SLACK
    assert open(table).read().splitlines()[1].endswith(tensor)
    assert writer.close(30)
