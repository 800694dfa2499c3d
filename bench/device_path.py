"""The device statistics path run on CPU tensors: torch operations and the probe's host time per
layer-level side, a side computed at once (`DeviceStatistics.batch`, the path before buffers)
against a side copied into the thread's buffers and reduced once a round (`gather`, `flush`).

No accelerator is needed: the same torch calls are made on CPU tensors, so the count of
operations a device would queue (views excluded) and the Python time around them are what they
would be there. A device would also take, per `batch` call, a pinned buffer, a copy to it and
an event (`landing.to_host`), and per `flush` the same once per buffer; those are not counted.

    python bench/device_path.py            # a stat-layer round of 18 sides, 30 rounds
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from atb_probe.capture.stats_compute import DeviceStatistics
from atb_probe.stats_cell import new_cell, new_serial


class _Count(TorchDispatchMode):
    """Counts the operations that compute something (no views, no allocations)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        if not any(r.alias_info is not None and not r.alias_info.is_write for r in returns) \
                and not str(func).startswith("aten.empty"):
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def _sides(count: int, hidden: int) -> list:
    """A decode round's layer-level sides: a hidden state each, every other one with an
    int64 index tensor too (positions)."""
    return [[torch.randn(1, 1, hidden)] + ([torch.arange(1).view(1, 1)] if i % 2 else [])
            for i in range(count)]


def _round(device: DeviceStatistics, sides: list, how: str) -> None:
    serial = new_serial()
    for side in sides:
        getattr(device, how)(side, [new_cell(serial) for _ in side])
    device.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    opts = parser.parse_args()
    sides = _sides(opts.sides, opts.hidden)
    print(f"{opts.sides} sides a round, hidden {opts.hidden}; median of {opts.rounds} rounds")
    for how, label in (("batch", "computed at once (batch)"),
                       ("gather", "copied, reduced once a round (gather)")):
        device = DeviceStatistics()
        with _Count() as count:
            _round(device, sides, how)
        times = []
        for _ in range(opts.rounds):
            start = time.perf_counter()
            _round(device, sides, how)
            times.append(time.perf_counter() - start)
        ops = sum(count.ops.values())
        host = statistics.median(times) / opts.sides * 1e6
        print(f"{label:40s} {ops:4d} operations a round ({ops / opts.sides:.1f} a side), "
              f"host {host:6.1f} us a side")
        print("    " + ", ".join(f"{k} {v}" for k, v in sorted(count.ops.items())))


if __name__ == "__main__":
    main()
