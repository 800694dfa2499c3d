"""Statistics of a tensor that a kernel writes in place behind the version counter (SPEC §5, §8).

A collective such as gloo's or NCCL's `c10d::allreduce_` writes into its argument without bumping
the tensor's version counter, the way a row-parallel linear reduces its partial sum in place. The
op registered here writes the same way (through `.data`); the output of the module around it must
have the statistics of its values after the write, not those remembered from before.
"""
from __future__ import annotations

import torch
from torch import nn

from conftest import Root, dump, only_proc, read_csv
from harness import config

_LIB = torch.library.Library("atbprobe_unbumped", "DEF")
_LIB.define("double_into(Tensor(a!) x) -> ()")


def _double_into(x):
    x.data.mul_(2.0)    # no version bump, as a collective's in-place write


_LIB.impl("double_into", _double_into, "CPU")


class ReducesInPlace(nn.Module):
    """A partial result made by a kernel, then written in place by a 'collective'."""

    def forward(self, x):
        partial = x * 3.0
        torch.ops.atbprobe_unbumped.double_into(partial)
        return partial


X = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def test_an_output_written_behind_the_version_counter_has_its_statistics_after_the_write(
        tmp_path):
    def run():
        with torch.no_grad():
            assert torch.equal(Root(ReducesInPlace())(X), X * 6)

    root = dump(tmp_path, config(task="statistics", save_child=True), run)
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    by_op = {(r["Op Type"], r["Input/Output"], r["Index"]): float(r["Max"]) for r in rows}
    assert by_op["MulTensorKernel", "output", "0"] == 15.0      # before the write
    assert by_op["ReducesInPlace", "output", "0"] == 30.0       # after it
