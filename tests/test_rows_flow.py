"""statistic.csv rows of a round reach the writer while the round runs, in execution order.

The recorder gathers the rows of a thread's round and hands them to the writer in one piece at
the end of the round, or sooner once they have waited `MAX_WAITING_SECONDS`: a long round
(a prefill of a large model, a server's long request) keeps its rows flowing to disk.
"""
from __future__ import annotations

import gc
import time

import torch
from torch import nn

from atb_probe.capture import recorder
from conftest import dump, only_proc, read_csv
from harness import config, wait_until


class Layer(nn.Module):
    def __init__(self, work=None):
        super().__init__()
        self.work = work

    def forward(self, x):
        if self.work is not None:
            self.work()
        return x + 1.0


class Net(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _written_op_ids(root) -> set:
    """Op IDs in the first round's statistic.csv so far (empty while it does not exist)."""
    data = root / "atb_dump_data" / "data"
    for proc in data.iterdir() if data.exists() else ():
        csv = proc / "0" / "statistic.csv"
        if csv.exists():
            return {r["Op Id"] for r in read_csv(csv)}
    return set()


def test_rows_of_a_long_round_are_written_before_the_round_ends(tmp_path):
    seen = {}

    def slow():  # longer than rows may wait in the recorder
        end = time.monotonic() + 2 * recorder.MAX_WAITING_SECONDS
        while time.monotonic() < end:
            pass

    def wait_for_earlier_rows():
        wait_until(lambda: _written_op_ids(tmp_path) >= {"0", "1"}, 30,
                   "the rows of the first two layers in statistic.csv")
        seen["ids"] = _written_op_ids(tmp_path)

    net = Net([Layer(), Layer(slow), Layer(wait_for_earlier_rows)])
    dump(tmp_path, config(task="statistics"), lambda: net(torch.randn(2, 4)))
    assert seen["ids"] >= {"0", "1"}


def test_rows_keep_execution_order_across_hand_overs(tmp_path, monkeypatch):
    """Rows handed over every few sides (`MAX_WAITING_SIDES`) are on disk before the round
    ends, and the round's statistic.csv lists them in execution order."""
    monkeypatch.setattr(recorder, "MAX_WAITING_SIDES", 3)  # hand over every few sides

    def wait_for_earlier_rows():
        wait_until(lambda: _written_op_ids(tmp_path) >= {"0", "1", "2"}, 30,
                   "rows handed over before the round ends")

    net = Net([Layer() for _ in range(6)] + [Layer(wait_for_earlier_rows)])
    root = only_proc(dump(tmp_path, config(task="statistics"), lambda: net(torch.randn(2, 4))))
    rows = read_csv(root / "0" / "statistic.csv")
    assert [(r["Op Id"], r["Input/Output"]) for r in rows] == \
        [(str(i), side) for i in range(7) for side in ("input", "output")]


def test_rows_waiting_for_the_writer_are_left_alone_by_the_garbage_collector(tmp_path,
                                                                            monkeypatch):
    """Rows wait for the writer for a round and more: as objects the garbage collector tracks,
    they would get promoted to its oldest generation and make Python collect every object of
    the user's process (stats_cell.py). Each side record is a flat tuple of strings and cells,
    which a collection stops tracking."""
    from atb_probe.record.jobs import RowsJob
    from atb_probe.record.writer import Writer
    from atb_probe.stats_cell import NO_VALUES, READY
    from conftest import tiny_llama

    handed = []
    put = Writer.put

    def keep(self, job):
        if type(job) is RowsJob:
            handed.extend(job.sides)
        put(self, job)

    monkeypatch.setattr(Writer, "put", keep)
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dump(tmp_path, config(task="statistics", save_child=True), lambda: model(ids))
    assert len(handed) > 100
    gc.collect()
    assert not any(gc.is_tracked(side) for side in handed)
    cells = [c for side in handed for c in side if type(c) is bytearray]
    assert cells and all(c[-1] in (READY, NO_VALUES) for c in cells)  # an empty tensor: none
    # A statistics dump names no file: its Tensor Path cells are None.
    assert all(type(c) in (str, bytearray, type(None)) for side in handed for c in side)
