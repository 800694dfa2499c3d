"""Per-op cost of the probe's own code, without a model's arithmetic around it.

`run.py` measures whole generations; this measures what one op costs the probe on the model's
thread, on tiny modules whose own work is a few microseconds, so that a change to the probe's
Python shows up clearly (and steadily: the best of several repeats, the garbage collector
paused). Each timed call is one round of many ops, and the writer is flushed between calls,
outside the timing: what the writer's thread costs the model (it competes for the GIL and the
cores) is `run.py`'s business.

    python bench/micro.py            # every case
    python bench/micro.py --gc       # with the garbage collector running, as in real use
    python bench/micro.py --clock cpu   # the model thread's CPU time (a shared machine)
    python bench/micro.py --cold 8   # each layer first reads 8 MiB, as a real layer's weights do

`--cold`: a real model's layers read megabytes of weights between two of the probe's steps,
which pushes the probe's code and data out of the CPU's caches; every step then costs several
times what it costs in a tight loop (a tiny tensor's statistics about 50 us against 7 on the
Intel VM of docs/performance.md). With `--cold MIB` each layer reads a buffer of MIB MiB
before its op, un-probed and probed alike, so the difference is the probe's cost in that state.

Cases: `layer-stat` (statistics of layer-level ops whose inputs look like a decoder
layer's: hidden state, two position embeddings, two index tensors, a cache object),
`kernel-track` (every kernel tracked, nothing written) and `kernel-stat` (statistics of every
kernel: views, a matmul and element-wise ops, as in a Linear). Each prints the un-probed and
probed time per op and their difference.

Then the writer's side of a statistics dump: microseconds per statistic.csv row
(`statcsv.format_sides`) and per request_statistic.csv row (`format_request_sides`), on side
records shaped like a `save_child` dump's (most sides one row, every other row's statistics
shared with the row before, as a view's are; 8 requests per row, each with its own). The
writer formats rows on its own thread, but holding the GIL the model thread needs.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time

import torch
from torch import nn

import atb_probe

LAYERS = 128
_evicting = None  # with --cold, the buffer each layer reads first


def _evict() -> None:
    if _evicting is not None:
        _evicting.max()


class DecoderLikeLayer(nn.Module):
    """A layer-level op with a decoder layer's kind of arguments and almost no work."""

    def forward(self, hidden, position_ids=None, cache_position=None, position_embeddings=None,
                past_key_values=None, use_cache=False):
        _evict()
        return hidden + 1.0


class KernelLayer(nn.Module):
    """Five rounds of view / t / mm / view / mul / add: 30 kernels per call."""

    KERNELS = 30

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64) / 16)  # keeps values finite

    def forward(self, h):
        _evict()
        for _ in range(5):
            h = torch.mm(h.view(4, 64), self.weight.t()).view(1, 4, 64)
            h = h * 0.5 + 1.0
        return h


class Stack(nn.Module):
    def __init__(self, layer_type):
        super().__init__()
        self.layers = nn.ModuleList([layer_type() for _ in range(LAYERS)])

    def forward(self, hidden, **kwargs):
        for layer in self.layers:
            hidden = layer(hidden, **kwargs)
        return hidden


def _config(**overrides) -> dict:
    base = {"task": "statistics", "dump_enable": True, "exec_range": "all", "ids": "",
            "op_name": "", "save_child": False, "device": "", "filter_level": 1}
    return {**base, **overrides}


def _cases():
    hidden = torch.randn(1, 1, 256)
    cos_sin = (torch.randn(1, 1, 64), torch.randn(1, 1, 64))
    layer_args = ((hidden,), {"position_ids": torch.arange(1)[None],
                              "cache_position": torch.arange(1),
                              "position_embeddings": cos_sin,
                              "past_key_values": object(), "use_cache": True})
    kernel_args = ((torch.randn(1, 4, 64),), {})
    return [
        ("layer-stat", Stack(DecoderLikeLayer), layer_args, _config(), 1),
        ("kernel-track", Stack(KernelLayer), kernel_args,
         _config(save_child=True, op_name="no_such_op"), KernelLayer.KERNELS),
        ("kernel-stat", Stack(KernelLayer), kernel_args, _config(save_child=True),
         KernelLayer.KERNELS),
    ]


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _best_time(model, args, kwargs, repeats: int, clock=time.perf_counter) -> float:
    """The fastest of `repeats` calls (rounds), the writer flushed before each."""
    best = float("inf")
    for _ in range(repeats):
        probe = atb_probe.active()
        if probe is not None:
            probe.writer.flush(60)
        start = clock()
        model(*args, **kwargs)
        best = min(best, clock() - start)
    return best


def _side_records(sides: int, requests: int = 0) -> list:
    """Side records (statcsv.py) of `sides` kernel sides, like a `save_child` statistics dump's:
    one row each but every third (two rows), every other row's statistics shared with the
    row before; with `requests`, each row once per request, each with statistics of its own
    (request_statistic.csv's)."""
    from atb_probe.statcsv import shape_cell
    from atb_probe.stats_cell import fill, new_cell, new_serial
    serial, records, cell = new_serial(), [], None
    for n in range(sides):
        layer, kernel = divmod(n // 2, 60)
        name = f"LlamaForCausalLM/LlamaDecoderLayer_{layer + 2}/MulKernel_{kernel}"
        head = ("0_1234", "3", name, "MulKernel", f"{layer + 2}_{kernel}",
                ("input", "output")[n % 2])
        rows = []
        for i in range(2 if n % 3 == 0 else 1):
            if not requests:
                if cell is None or n % 2:
                    cell = new_cell(serial)
                    fill(cell, (n * 0.37, -n * 0.11, n / 7, n * 1.3))
                rows += (str(i), "float", shape_cell((1, 4, 64)), cell, None)
            for request in range(requests):  # each request's slice: statistics of its own
                cell = new_cell(serial)
                fill(cell, (n * 0.37 + request, -n * 0.11, n / 7 - request, n * 1.3))
                rows += (str(i), "float", shape_cell((1, 64)), cell, f"cmpl-{request}")
        records.append((*head, *rows))
    return records


def _row_costs(repeats: int) -> None:
    """Microseconds per csv row of the writer's two formatters."""
    from atb_probe.statcsv import format_request_sides, format_sides, side_rows
    for name, records, fmt in (
            ("statistic.csv", _side_records(10_000), lambda r: format_sides(r, "/dump/0")),
            ("request_statistic.csv", _side_records(2_000, requests=8), format_request_sides)):
        rows = sum(side_rows(r) for r in records)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fmt(records)
            best = min(best, time.perf_counter() - start)
        print(f"{name:<24}{best / rows * 1e6:>8.2f} us a row ({rows} rows)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gc", action="store_true", help="leave the garbage collector on")
    parser.add_argument("--repeats", type=int, default=15,
                        help="timed rounds per case; the fastest is kept")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time (default); cpu: the model thread's CPU time, "
                             "steadier on a machine shared with other jobs")
    parser.add_argument("--cold", type=int, default=0, metavar="MIB",
                        help="each layer first reads a buffer of MIB MiB (the caches evicted, "
                             "as between a real model's layers)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    if opts.cold:
        import numpy as np
        global _evicting
        _evicting = np.ones(opts.cold << 17, dtype=np.uint64)
    if not opts.gc:
        gc.disable()
    print(f"{'case':<14}{'un-probed us/op':>17}{'probed us/op':>14}{'probe us/op':>13}")
    with torch.no_grad():
        for name, model, (args, kwargs), config, ops_per_layer in _cases():
            ops = LAYERS * ops_per_layer
            _best_time(model, args, kwargs, 3)
            clock = CLOCKS[opts.clock]
            plain = _best_time(model, args, kwargs, opts.repeats, clock) / ops
            with tempfile.TemporaryDirectory() as out:
                atb_probe.enable(out, config)
                try:
                    _best_time(model, args, kwargs, 3)
                    probed = _best_time(model, args, kwargs, opts.repeats, clock) / ops
                finally:
                    atb_probe.disable(timeout=60)
            print(f"{name:<14}{plain * 1e6:>17.1f}{probed * 1e6:>14.1f}"
                  f"{(probed - plain) * 1e6:>13.1f}")
    print("writer, formatting rows:")
    _row_costs(opts.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
