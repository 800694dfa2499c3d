"""Statistics that wait for the end of a layer execution, or are found again, still describe the
values of the moment the tensor was seen."""
from __future__ import annotations

import json

import torch
from torch import nn

import atb_probe
from conftest import dump, only_proc, read_csv
from harness import config


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _weight_rows(round_dir):
    """The rows of the first Linear's weight as its kernel input (`aten.t`'s input)."""
    return [r for r in read_csv(round_dir / "statistic.csv")
            if r["Op Id"] == "0_0_0" and r["Input/Output"] == "input"]


def test_a_weight_whose_data_is_replaced_between_rounds_gets_new_statistics(tmp_path):
    """`param.data = new` keeps the parameter object and its version counter: the statistics
    must still follow the new values."""
    net = Net()
    x = torch.randn(2, 4)

    def run():
        with torch.no_grad():
            net(x)
            net.blocks[0].lin.weight.data = torch.full((4, 4), 3.0)
            net(x)

    root = only_proc(dump(tmp_path, config(task="statistics", save_child=True), run))
    first, second = _weight_rows(root / "0"), _weight_rows(root / "1")
    assert first and second
    assert [float(second[0][k]) for k in ("Max", "Min", "Mean", "Norm")] == [3.0, 3.0, 3.0, 12.0]
    assert first[0]["Max"] != second[0]["Max"]


def _weight_stats(round_dir) -> list[float]:
    row = _weight_rows(round_dir)[0]
    return [float(row[k]) for k in ("Max", "Min", "Mean", "Norm")]


def test_a_weight_written_through_its_data_alias_between_rounds_gets_new_statistics(tmp_path):
    """`w.data` is an alias with a version counter of its own: writing through it leaves
    `w._version` as it was, and the statistics must still follow the new values. Every way
    a weight is written like that: the whole alias, a narrowed piece of it, and the alias of a
    slice (the last two are how vLLM's weight loaders copy a shard in)."""
    net = Net()
    x = torch.randn(2, 4)
    weight = net.blocks[0].lin.weight

    def run():
        with torch.no_grad():
            weight.copy_(torch.full((4, 4), 1.0))
            net(x)
            net(x)   # found again: unchanged
            weight.data.mul_(2.0)
            net(x)
            weight.data.narrow(0, 0, 1).copy_(torch.full((1, 4), 7.0))
            net(x)
            weight[2:].data.fill_(5.0)
            net(x)

    root = only_proc(dump(tmp_path, config(task="statistics", save_child=True), run))
    assert [_weight_stats(root / str(i)) for i in range(5)] == [
        [1.0, 1.0, 1.0, 4.0], [1.0, 1.0, 1.0, 4.0], [2.0, 2.0, 2.0, 8.0],
        [7.0, 2.0, 3.25, (4 * 49 + 12 * 4) ** 0.5],
        [7.0, 2.0, 4.75, (4 * 49 + 4 * 4 + 8 * 25) ** 0.5]]
    assert "data" not in torch.Tensor.__dict__  # nothing of the probe's left on Tensor


def test_a_weight_written_through_its_data_alias_while_the_probe_sleeps(tmp_path):
    """While the probe sleeps nothing of it is installed, so such a write goes unseen then; the
    probe measures anew when it wakes."""
    config_path = tmp_path / "config.json"

    def save(**overrides):
        fresh = tmp_path / "config.json.new"
        fresh.write_text(json.dumps(config(task="statistics", save_child=True, **overrides)))
        fresh.replace(config_path)  # a new file: its change is seen at the next poll
        probe.poll_config()

    net = Net()
    x = torch.randn(2, 4)
    weight = net.blocks[0].lin.weight
    config_path.write_text(json.dumps(config(task="statistics", save_child=True)))
    probe = atb_probe.enable(str(tmp_path / "out"), str(config_path))
    try:
        with torch.no_grad():
            weight.copy_(torch.full((4, 4), 1.0))
            net(x)
            save(dump_enable=False)
            assert not probe.engine.awake and "data" not in torch.Tensor.__dict__
            weight.data.mul_(3.0)
            save(dump_enable=True)
            assert probe.engine.awake
            net(x)
    finally:
        assert atb_probe.disable(timeout=60)
    root = only_proc(tmp_path / "out" / "atb_dump_data")
    assert [_weight_stats(root / str(i)) for i in range(2)] == [[1.0, 1.0, 1.0, 4.0],
                                                                [3.0, 3.0, 3.0, 12.0]]


def test_a_tensor_written_in_place_later_in_the_layer_keeps_the_statistics_of_its_time(tmp_path):
    """A kernel output waits for the end of the layer execution; a later in-place kernel on it
    makes it be computed first."""
    class Scale(nn.Module):
        def forward(self, x):
            y = x * 2.0          # queued: y = 2x
            y.add_(100.0)        # in place: y's statistics must be those of 2x
            return y

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Scale(), Scale()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    x = torch.arange(4.0)
    root = only_proc(dump(tmp_path, config(task="statistics", save_child=True),
                          lambda: Root()(x)))
    rows = read_csv(root / "0" / "statistic.csv")
    mul_out = [r for r in rows if r["Op Id"] == "0_0" and r["Input/Output"] == "output"]
    add_in = [r for r in rows if r["Op Id"] == "0_1" and r["Input/Output"] == "input"]
    add_out = [r for r in rows if r["Op Id"] == "0_1" and r["Input/Output"] == "output"]
    assert float(mul_out[0]["Max"]) == 6.0 and float(add_in[0]["Max"]) == 6.0
    assert float(add_out[0]["Max"]) == 106.0


class Double(nn.Module):
    def forward(self, x):
        return x * 2.0


class AddInPlace(nn.Module):
    """Adds to its input in place, as vLLM's fused residual adds to the previous layer's
    output."""

    def forward(self, x):
        return x.add_(100.0)


def test_a_layer_output_written_in_place_by_the_next_layer_keeps_the_statistics_of_its_time(
        tmp_path):
    """Layer-level ops only (no kernels seen): a small output's statistics are measured with
    the round's rows, from a copy taken at its side, so the next layer adding to it in place
    (vLLM's fused residual does) changes the row of neither side before the write."""
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Double(), AddInPlace(), Double()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    x = torch.arange(4.0)
    root = only_proc(dump(tmp_path, config(task="statistics"), lambda: Root()(x)))
    rows = {(r["Op Name"], r["Op Id"], r["Input/Output"]): float(r["Max"])
            for r in read_csv(root / "0" / "statistic.csv")}
    assert rows == {("Double", "0", "input"): 3.0, ("Double", "0", "output"): 6.0,
                    ("AddInPlace", "1", "input"): 6.0, ("AddInPlace", "1", "output"): 106.0,
                    ("Double", "2", "input"): 106.0, ("Double", "2", "output"): 212.0}, rows


def test_a_requests_slice_written_in_place_by_the_next_layer_keeps_the_statistics_of_its_time(
        tmp_path):
    """The same with a batch of two requests, each a row of one token (a decode round): each
    request's slice is copied with its tensor and measured with the round's rows too, so the
    next layer adding to it in place changes neither the whole rows nor the request rows of
    the sides before the write."""
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Double(), AddInPlace(), Double()])

        def forward(self, input_ids, attention_mask=None):
            x = input_ids.float()[..., None].expand(2, 1, 4).contiguous()
            for layer in self.layers:
                x = layer(x)
            return x

    ids, mask = torch.tensor([[1], [3]]), torch.ones(2, 3, dtype=torch.long)
    root = only_proc(dump(tmp_path, config(task="statistics"), lambda: Root()(ids, mask)))
    rows = {(r["Op Name"], r["Op Id"], r["Input/Output"], r["Request"]): float(r["Max"])
            for r in read_csv(root / "0" / "request_statistic.csv") if r["Index"] == "0"}
    want = {("Double", "0", "output"): (2.0, 6.0), ("AddInPlace", "1", "input"): (2.0, 6.0),
            ("AddInPlace", "1", "output"): (102.0, 106.0),
            ("Double", "2", "input"): (102.0, 106.0), ("Double", "2", "output"): (204.0, 212.0)}
    for (name, op_id, side), (first, second) in want.items():
        assert rows[name, op_id, side, "row0"] == first and \
            rows[name, op_id, side, "row1"] == second, rows
    whole = {(r["Op Name"], r["Op Id"], r["Input/Output"]): float(r["Max"])
             for r in read_csv(root / "0" / "statistic.csv") if r["Index"] == "0"}
    assert whole["AddInPlace", "1", "input"] == 6.0 and whole["Double", "2", "input"] == 106.0
