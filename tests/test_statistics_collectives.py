"""Statistics of a tensor that a kernel writes in place behind the version counter (SPEC §5, §8).

A collective such as gloo's or NCCL's `c10d::allreduce_` writes into its argument without bumping
the tensor's version counter, the way a row-parallel linear reduces its partial sum in place. The
op registered here writes the same way (through `.data`); the output of the module around it must
have the statistics of its values after the write, not those remembered from before. Between
rounds a collective writes weights so (a trainer broadcasting new weights to its inference
ranks): real gloo ranks under torchrun, and the next round has the new weight's statistics.
"""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

import atb_probe
from conftest import Root, dump, only_proc, read_csv
from harness import config, torchrun_loaded

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


BROADCASTS_A_WEIGHT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from pathlib import Path
    from torch import nn

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    weight = net[0].weight
    maxima = []
    with torch.no_grad():
        net(torch.ones(2, 4))            # round 0: this rank's own weight
        maxima.append(weight.max().item())
        dist.broadcast(weight, src=0)    # rank 0's weight, behind the version counter
        net(torch.ones(2, 4))            # round 1
        maxima.append(weight.max().item())
    Path(sys.argv[1], f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "pid": os.getpid(), "maxima": maxima}))
    dist.destroy_process_group()
""")


def test_a_weight_broadcast_between_rounds_has_its_new_statistics_in_the_next_round(tmp_path):
    script = tmp_path / "broadcast_weight.py"
    script.write_text(BROADCASTS_A_WEIGHT)
    torchrun_loaded(tmp_path, config(task="statistics", save_child=True, exec_range="0,1"),
                    script, str(tmp_path))
    runs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for r in runs:
        folder = tmp_path / "atb_dump_data" / "data" / f"{r['rank']}_{r['pid']}"
        recorded = []
        for round_ in ("0", "1"):
            rows = read_csv(folder / round_ / "statistic.csv")
            (weight_row,) = [row for row in rows if row["Op Type"] == "TKernel" and
                             row["Input/Output"] == "input"]   # aten.t of the weight
            recorded.append(float(weight_row["Max"]))
        assert recorded == r["maxima"], r
    rank1 = next(r for r in runs if r["rank"] == 1)
    assert rank1["maxima"][0] != rank1["maxima"][1]   # the broadcast changed its weight


def test_collectives_are_wrapped_only_while_the_probe_is_awake(tmp_path):
    """Awake, the collectives are wrapped, each wrapper with its function's name and
    signature (`functools.wraps`); once the probe is gone, torch.distributed's own functions
    are back."""
    own = {name: getattr(dist, name) for name in ("broadcast", "all_reduce", "batch_isend_irecv")}
    awake = {}
    atb_probe.enable(str(tmp_path / "out"), config(task="statistics"))
    try:
        awake = {name: getattr(dist, name) for name in own}
    finally:
        assert atb_probe.disable(timeout=60)
    for name, fn in own.items():
        assert awake[name] is not fn and awake[name].__wrapped__ is fn
        assert awake[name].__name__ == fn.__name__
        assert getattr(dist, name) is fn
        assert getattr(dist.distributed_c10d, name) is fn


def test_a_collective_that_refuses_its_arguments_raises_its_own_error_while_awake(tmp_path):
    """What a wrapped collective raises for arguments it refuses is torch's own error, not
    one from looking for what it wrote."""
    atb_probe.enable(str(tmp_path / "out"), config(task="statistics"))
    try:
        assert dist.batch_isend_irecv.__wrapped__ is not None
        with pytest.raises(ValueError, match="p2p_op_list"):
            dist.batch_isend_irecv(5)
    finally:
        assert atb_probe.disable(timeout=60)


def test_code_compiled_while_awake_calling_a_collective_keeps_its_whole_graph(tmp_path):
    """Code that `torch.compile` traces while the probe is awake and that calls a wrapped
    collective compiles to one graph (`fullgraph`), and gets the collective's result."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def doubled_and_reduced(x):
            y = x * 2.0
            dist.all_reduce(y)
            return y + 1.0

        atb_probe.enable(str(tmp_path / "out"), config(task="statistics"))
        try:
            assert dist.all_reduce.__wrapped__ is not None
            compiled = torch.compile(doubled_and_reduced, backend="eager", fullgraph=True)
            assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
        finally:
            assert atb_probe.disable(timeout=60)
    finally:
        dist.destroy_process_group()
